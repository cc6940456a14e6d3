"""The end-to-end table: (model, mesh, options) rows, and what every rank runs for each row.

Every rank builds the same model from the same seed, compiles it, runs its local shard, gathers the
output and compares it with the single-device model in float64.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.distributed.tensor import Replicate, Shard

from tests.models import GPT, MLP, GPTConfig, gpt2
from tests.support import spec


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], torch.nn.Module]
    inputs: Callable[[], tuple]
    mesh: tuple[int, ...]
    names: tuple[str, ...]
    profile: str = "default"  # default: the gloo profile of the real mesh; "compute": SLOW_DEVICE + FAST_LINK
    in_placements: dict = field(default_factory=dict)
    param_placements: dict = field(default_factory=dict)
    out_placements: dict = field(default_factory=dict)
    logits: bool = False  # output is a transformers ModelOutput: compare .logits
    sharded_params: bool = False  # the batch cannot be split evenly, so the plan must shard weights

    @property
    def world(self) -> int:
        return math.prod(self.mesh)


def _tokens(b, s, vocab=128):
    return lambda: (torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(1)),)


def _x(*shape):
    return lambda: (torch.randn(*shape, generator=torch.Generator().manual_seed(1)),)


_gpt = lambda **kw: (lambda: GPT(GPTConfig(**kw)))  # noqa: E731
_frozen = lambda build: (lambda: build().requires_grad_(False))  # noqa: E731
R, S0, S1 = Replicate(), Shard(0), Shard(1)

CASES = {c.name: c for c in [
    # MLP, with and without bias
    Case("mlp-1d2-default", lambda: MLP(16, 64), _x(8, 16), (2,), ("tp",)),
    Case("mlp-1d2-tp", lambda: MLP(16, 64), _x(3, 16), (2,), ("tp",), "compute", sharded_params=True),
    Case("mlp-nobias-1d4-tp", lambda: MLP(16, 64, bias=False), _x(3, 16), (4,), ("tp",), "compute",
         out_placements={0: [R]}, sharded_params=True),
    Case("mlp-2d-compute", lambda: MLP(16, 64), _x(8, 16), (2, 2), ("dp", "tp"), "compute"),
    Case("mlp-2d-fsdp-pins", lambda: MLP(16, 64), _x(8, 16), (2, 2), ("dp", "tp"), "default",
         in_placements={"x": [S0, R]},
         param_placements={"fc1.weight": [S0, S0], "fc2.weight": [S1, S0], "fc1.bias": [S0, R]}),
    # GPT decoder: SDPA and explicit softmax attention
    Case("gpt-1d2-default", _gpt(), _tokens(4, 32), (2,), ("tp",)),
    Case("gpt-1d2-tp", _gpt(), _tokens(1, 31), (2,), ("tp",), "compute", sharded_params=True),
    Case("gpt-softmax-1d2-tp", _gpt(sdpa=False), _tokens(1, 31), (2,), ("tp",), "compute", sharded_params=True),
    Case("gpt-1d4-compute", _gpt(), _tokens(4, 32), (4,), ("tp",), "compute"),
    Case("gpt-1d4-tp", _gpt(), _tokens(1, 31), (4,), ("tp",), "compute", sharded_params=True),
    Case("gpt-2d-default", _gpt(), _tokens(4, 32), (2, 2), ("dp", "tp"), in_placements={"tokens": [S0, R]}),
    Case("gpt-2d-compute", _gpt(), _tokens(2, 32), (2, 2), ("dp", "tp"), "compute"),
    Case("gpt-softmax-2d-compute", _gpt(sdpa=False), _tokens(2, 32), (2, 2), ("dp", "tp"), "compute"),
    # FlexAttention (inference: torch has no CPU backward): head-parallel under a causal block mask; with a
    # score_mod that reads the head index (ALiBi) heads stay whole and the batch splits
    Case("gpt-flex-1d2-tp", _frozen(_gpt(flex="mask")), _tokens(1, 31), (2,), ("tp",), "compute", sharded_params=True),
    Case("gpt-flex-alibi-2d-compute", _frozen(_gpt(flex="alibi")), _tokens(2, 32), (2, 2), ("dp", "tp"), "compute"),
    # A real-world model from a popular library, built from a config with random weights
    Case("gpt2-hf-1d2-compute", gpt2, _tokens(2, 32), (2,), ("tp",), "compute", logits=True),
    Case("gpt2-hf-1d2-tp", gpt2, _tokens(1, 31), (2,), ("tp",), "compute", logits=True, sharded_params=True),
    Case("gpt2-hf-2d-compute", gpt2, _tokens(2, 32), (2, 2), ("dp", "tp"), "compute", logits=True),
]}


def run_case(rank: int, world: int, name: str) -> dict:
    """Executed on every rank: compile, run the local shard, gather, compare with one device."""
    import spmd

    case = CASES[name]
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = case.build()
        inputs = case.inputs()
        with torch.no_grad():
            expected = model(*inputs)
        mesh = spmd.init_mesh(case.mesh, case.names)
        mesh_spec = spec(case.mesh, case.names) if case.profile == "compute" else None
        compiled = spmd.compile(model, mesh, example_inputs=inputs, in_placements=case.in_placements,
                                param_placements=case.param_placements, out_placements=case.out_placements,
                                mesh_spec=mesh_spec)
        with torch.no_grad():
            out = compiled(*compiled.shard_inputs(*inputs))
            full = compiled.gather_outputs(out)
        if case.logits:
            full, expected = full.logits, expected.logits
        local_bytes = sum(p.numel() * p.element_size() for p in compiled.parameters())
        full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        return {
            "max_err": float((full - expected).abs().max()),
            "scale": float(expected.abs().max()),
            "fingerprint": compiled.plan.fingerprint(),
            "collectives": dict(compiled.plan.collective_summary()),
            "param_bytes": local_bytes,
            "full_param_bytes": full_bytes,
        }
    finally:
        torch.set_default_dtype(torch.float32)
