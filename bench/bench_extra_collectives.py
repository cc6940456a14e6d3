"""Collectives a plan runs beyond what a hand-written one does (DDP: the gradients' reductions; Megatron: one
all_reduce per column/row pair), for the layouts session 92's probes found costing more: small models planned
with pinned layouts on a simulated (2,) mesh of latency-bound links, no processes. Prints the rows of
bench/results_plan.md's session 92 section.

    python bench/bench_extra_collectives.py
"""
from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import spmd
from spmd.core.profiles import DeviceProfile, LinkProfile

LINK = LinkProfile("latency-bound", 1e-3, 1e11)  # (every collective costs about the same: counts decide)
DEVICE = DeviceProfile("slow", 1e8, 1e9, 0.0, 1e12, optimizer_bandwidth=1e18)


class ConvThen(nn.Module):
    """A conv, then `op` (a pool, a pad, an upsampling), summed over its features."""

    def __init__(self, op: nn.Module, dims: int = 2):
        super().__init__()
        self.c, self.op = (nn.Conv1d, nn.Conv2d)[dims - 1](4, 8, 3, padding=1), op

    def forward(self, x):
        return self.op(self.c(x)).flatten(1).sum(-1)


class MixFFN(nn.Module):
    """Segformer's: a depthwise conv between an MLP's Linears."""

    def __init__(self, d=16, h=32):
        super().__init__()
        self.fc1, self.dw, self.fc2 = nn.Linear(d, h), nn.Conv2d(h, h, 3, padding=1, groups=h), nn.Linear(h, d)

    def forward(self, x):
        y = self.fc1(x)
        b, n, c = y.shape
        return self.fc2(F.gelu(self.dw(y.transpose(1, 2).reshape(b, c, 8, 8)).flatten(2).transpose(1, 2)))


def extra(model, inputs, in_placements, pins, axis="dp") -> str:
    """The plan's collectives whose consumer is not an output (the gradients' and the loss's reductions are)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = spmd.plan(model, spmd.MeshSpec((2,), (axis,), (LINK,), DEVICE), example_inputs=inputs, training=True,
                         loss_fn=lambda out, target: F.mse_loss(out, target), in_placements=in_placements,
                         param_placements=pins)
    found = [f"{step.kind} into {edge.consumer}" for edge, step in plan.collectives()
             if not edge.consumer.startswith("output")]
    return f"{len(found)}" + (f" ({', '.join(found)})" if found else "")


def main() -> None:
    torch.manual_seed(0)
    print("| model, layout | collectives beyond the hand-written plan's |")
    print("|---|---|")
    batch = {"x": [Shard(0)], "target": [Shard(0)]}
    for name, op, dims in (("AvgPool2d(2)", nn.AvgPool2d(2), 2), ("AdaptiveMaxPool2d(1)", nn.AdaptiveMaxPool2d(1), 2),
                           ("Upsample(nearest)", nn.Upsample(scale_factor=2), 2),
                           ("Upsample(bilinear)", nn.Upsample(scale_factor=2, mode="bilinear"), 2),
                           ("Unfold(2)", nn.Unfold(2), 2), ("ReflectionPad1d(1)", nn.ReflectionPad1d(1), 1),
                           ("ReflectionPad2d(1)", nn.ReflectionPad2d(1), 2)):
        model = ConvThen(op, dims)
        x = torch.randn((4, 4) + (8,) * dims)
        pins = {n: [Replicate()] for n, _ in model.named_parameters()}
        print(f"| conv then {name}, DDP | {extra(model, (x, torch.randn(4)), batch, pins)} |", flush=True)
    model = MixFFN()
    pins = {"fc1.weight": [Shard(0)], "fc1.bias": [Shard(0)], "dw.weight": [Shard(0)], "fc2.weight": [Shard(1)]}
    whole = {"x": [Replicate()], "target": [Replicate()]}
    print(f"| Mix-FFN (Linear, depthwise conv, Linear), Megatron on tp (its forward all_reduce is the pair's) | "
          f"{extra(model, (torch.randn(4, 64, 16), torch.randn(4, 64, 16)), whole, pins, 'tp')} |", flush=True)
    try:
        from transformers import LlamaConfig, LlamaForSequenceClassification
    except ImportError:
        return
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, pad_token_id=0, num_labels=3)

    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = LlamaForSequenceClassification(cfg)

        def forward(self, ids):
            return self.m(input_ids=ids).logits

    model = Classifier().eval()
    ids = torch.randint(1, 64, (4, 8))
    ids[0, 5:] = 0
    pins = {n: [Replicate()] for n, _ in model.named_parameters()}
    print(f"| transformers LlamaForSequenceClassification, DDP | "
          f"{extra(model, (ids, torch.randn(4, 3)), {'ids': [Shard(0)], 'target': [Shard(0)]}, pins)} |", flush=True)


if __name__ == "__main__":
    main()
