"""Pooling, padding and pixel-shuffle kernels: those DTensor has no rule for (mostly the backwards of forwards it
has), and its max pools, which it splits on the batch alone.

Each works on every (batch, channel) plane apart, over its trailing spatial dims, so along one mesh axis:

  every tensor S(d) alike, d any dim before the spatial ones    (batch, channels)
  out P <- the first input P, the others R                      where the kernel is linear in its first
                                                                input: an average or a pad, and every
                                                                backward (linear in the incoming gradient,
                                                                the max's indices given)

Without them a batch-split CNN gathered its activations at every `avg_pool2d_backward` (LeNet's pools) and
`adaptive_max_pool2d_backward`, and the convolution's backward before it, and a conv split on its output
channels gathered them before a max pool (found planning small CNNs on dp).
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from spmd.passes.rules.registry import RuleInput, rule

aten = torch.ops.aten

# op name -> (spatial dims, linear in its first input)
_KERNELS = {
    "avg_pool2d_backward": (2, True), "avg_pool3d_backward": (3, True),
    "_adaptive_avg_pool3d_backward": (3, True),
    "adaptive_max_pool2d_backward": (2, True), "adaptive_max_pool3d": (3, False),
    "adaptive_max_pool3d_backward": (3, True),
    "max_pool2d_with_indices": (2, False), "max_pool3d_with_indices": (3, False), "adaptive_max_pool2d": (2, False),
    "max_pool2d_with_indices_backward": (2, True), "max_pool3d_with_indices_backward": (3, True),
    "max_pool1d": (1, False), "max_pool2d": (2, False),
    "reflection_pad1d": (1, True), "reflection_pad2d": (2, True), "reflection_pad3d": (3, True),
    "reflection_pad1d_backward": (1, True), "reflection_pad2d_backward": (2, True),
    "reflection_pad3d_backward": (3, True),
    "replication_pad1d": (1, True), "replication_pad2d": (2, True), "replication_pad3d": (3, True),
    "replication_pad1d_backward": (1, True), "replication_pad2d_backward": (2, True),
    "replication_pad3d_backward": (3, True),
    "pixel_shuffle": (3, True), "pixel_unshuffle": (3, True),  # (channels are mixed with the last two dims)
}


def _per_plane(spatial: int, linear: bool):
    """The rule of a kernel over `spatial` trailing dims: any dim before them splits (an unbatched [C, H, W] input's
    channels too)."""
    def plane_rule(inp: RuleInput) -> list[list]:
        n_out, n_in = len(inp.outputs), len(inp.inputs)
        rows = [[Shard(d)] * (n_out + n_in) for d in range(len(inp.inputs[0].shape) - spatial)]
        if linear:
            rows.append([Partial()] * n_out + [Partial()] + [Replicate()] * (n_in - 1))
        return rows

    return plane_rule


for _name, (_spatial, _linear) in _KERNELS.items():
    _packet = getattr(aten, _name, None)
    if _packet is not None and "default" in _packet.overloads():
        rule(_packet.default)(_per_plane(_spatial, _linear))
