"""Pooling, padding and pixel-shuffle rules (spmd/passes/rules/pool.py) and the index_put past whole slices that
upsampling's backward puts its gradient with (rules/indexing.py), checked like every rule
(tests/property/rule_check.py): every strategy, on every mesh, on random inputs split as it claims, against the
unsharded op."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from tests.property.rule_check import Case, check_case, strategies_of, traced_of

aten = torch.ops.aten
X2, X3 = (4, 8, 6, 6), (4, 8, 4, 4, 4)


def _max2(x):
    return aten.max_pool2d_with_indices(x, [2, 2], [2, 2])


def _max3(x):
    return aten.max_pool3d_with_indices(x, [2, 2, 2], [2, 2, 2])


CASES = {
    "avg_pool2d_backward": ((X2, (4, 8, 3, 3)), lambda x, g: aten.avg_pool2d_backward(
        g, x, [2, 2], [2, 2], [0, 0], False, True, None)),
    "avg_pool3d_backward": ((X3, (4, 8, 2, 2, 2)), lambda x, g: aten.avg_pool3d_backward(
        g, x, [2, 2, 2], [2, 2, 2], [0, 0, 0], False, True, None)),
    "_adaptive_avg_pool3d_backward": ((X3, (4, 8, 2, 2, 2)), lambda x, g: aten._adaptive_avg_pool3d_backward(
        g, x)),
    "adaptive_max_pool2d": ((X2,), lambda x: aten.adaptive_max_pool2d(x, [2, 2])),
    "adaptive_max_pool2d_backward": ((X2, (4, 8, 2, 2)), lambda x, g: aten.adaptive_max_pool2d_backward(
        g, x, aten.adaptive_max_pool2d(x, [2, 2])[1])),
    "adaptive_max_pool3d_backward": ((X3, (4, 8, 2, 2, 2)), lambda x, g: aten.adaptive_max_pool3d_backward(
        g, x, aten.adaptive_max_pool3d(x, [2, 2, 2])[1])),
    "max_pool2d_with_indices": ((X2,), _max2),
    "max_pool2d_with_indices_backward": ((X2, (4, 8, 3, 3)), lambda x, g: aten.max_pool2d_with_indices_backward(
        g, x, [2, 2], [2, 2], [0, 0], [1, 1], False, _max2(x)[1])),
    "max_pool3d_with_indices_backward": ((X3, (4, 8, 2, 2, 2)), lambda x, g: aten.max_pool3d_with_indices_backward(
        g, x, [2, 2, 2], [2, 2, 2], [0, 0, 0], [1, 1, 1], False, _max3(x)[1])),
    "reflection_pad2d": ((X2,), lambda x: aten.reflection_pad2d(x, [1, 1, 2, 0])),
    "reflection_pad2d_backward": ((X2, (4, 8, 8, 8)), lambda x, g: aten.reflection_pad2d_backward(
        g, x, [1, 1, 1, 1])),
    "replication_pad1d_backward": (((4, 8, 6), (4, 8, 8)), lambda x, g: aten.replication_pad1d_backward(
        g, x, [1, 1])),
    "pixel_shuffle": ((X2,), lambda x: aten.pixel_shuffle(x, 2)),
    "pixel_unshuffle": ((X2,), lambda x: aten.pixel_unshuffle(x, 2)),
    # upsampling's backward: the gradient put back past the batch and channel slices
    "index_put": ((X2, (4, 8, 12, 12)), lambda x, g: aten.index_put(
        x, [None, None, torch.arange(12).div(2, rounding_mode="floor")[:, None],
            torch.arange(12).div(2, rounding_mode="floor")], g, True)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_strategy_matches_the_unsharded_op(name):
    shapes, fn = CASES[name]
    op = getattr(aten, name).default
    check_case(Case((name,), shapes, frozenset({op}), fn, "make_fx"), 0)


def _strategies(name: str) -> list:
    shapes, fn = CASES[name]
    case = Case((name,), shapes, frozenset(), fn, "make_fx")
    node = next(n for n in traced_of(case).graph.nodes if n.target is getattr(aten, name).default)
    return strategies_of(case, (2,)).nodes[node.name].strategies


def test_a_pool_splits_on_batch_and_channels_and_a_backward_passes_partial():
    """Batch and channels (the dims before the spatial ones), never a spatial dim; a backward (linear in the incoming
    gradient, the indices given) lets a Partial gradient through, and a max pool itself does not."""
    backward = {(s.outputs, s.inputs) for s in _strategies("max_pool2d_with_indices_backward")}
    for d in (0, 1):
        assert (((Shard(d),),), ((Shard(d),),) * 3) in backward
    assert (((Partial(),),), ((Partial(),), (Replicate(),), (Replicate(),))) in backward
    forward = _strategies("max_pool2d_with_indices")
    assert {p for s in forward for p in s.inputs} == {(Replicate(),), (Shard(0),), (Shard(1),)}
