"""Random ops (dropout and friends): replicated, so every rank draws exactly the single-device numbers.

Sharding a random op would let each rank draw its own local numbers. On CPU we have no per-shard RNG
offsets (DTensor's Philox offset tracking is CUDA-only), so equal seeds would give every shard the same
mask: correlated, not just different from one device. Replicating costs the full draw on every rank but
is exact: with the same seed on every rank (as for building the model), ranks and the single-device
model consume the generator identically and agree bit for bit. Consumers slice the result for free.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate

from spmd.passes.rules.registry import RuleInput, rule

aten = torch.ops.aten

_RANDOM = [aten.native_dropout.default, aten.rand_like.default, aten.randn_like.default,
           aten.bernoulli.default, aten.bernoulli.p, aten.randint_like.default, aten.normal_functional.default
           if hasattr(aten, "normal_functional") else None, aten.uniform.default if hasattr(aten, "uniform") else None]


@rule(*[op for op in _RANDOM if op is not None])
def replicated_random(inp: RuleInput) -> list[list]:
    return [[Replicate()] * (len(inp.outputs) + len(inp.inputs))]
