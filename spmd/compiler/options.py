"""What a plan is asked for (`PlanOptions`) and which rank it is made for (`RankBinding`): frozen, typed,
built in one place. `spmd.plan` and `spmd.compile` take every `PlanOptions` field as a keyword argument
(`PlanOptions.build`), so a new option is one new field here.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from spmd.core.errors import SpmdError
from spmd.core.plan import Plan
from spmd.core.specs import Pins


@dataclass(frozen=True)
class PlanOptions:
    """Constraints and knobs of one plan.

    in_placements / param_placements: pins by input argument name / parameter FQN, each a list with one
    placement per mesh axis; out_placements: pins by output index (a dict, or a list with one entry per
    output). loss_fn: `loss_fn(model(*inputs), *targets)`, the trailing inputs are targets (as many as
    loss_fn has required parameters after the first); `compiled(*inputs, *targets)` returns the loss.
    training: plan the joint forward+backward graph (default: True when there is a loss_fn).
    memory_budget: bytes per rank the predicted peak (parameters, gradients, optimizer state, saved
    activations, inputs, temporaries) must fit in. optimizer_state_factor: optimizer state per parameter
    in parameter sizes (AdamW 2, SGD with momentum 1, plain SGD 0); it also prices the optimizer's step
    on each parameter's piece (cost_model/compute.py `optimizer_cost`).
    tie_blocks: identical layers get identical placements, which keeps the solve one layer deep (None:
    layers that repeat; False: every layer solved on its own). merge_followers:
    single-input ops follow their input's placement (an approximation that shrinks the solve; None: on
    graphs of more than 1500 ops). stamp_layers: trace a stack of 8 or more identical layers 3 layers deep
    and copy the middle one to full depth (None or True: yes, and when compiling only after
    `check_stamping` finds the full-depth forward is the traced layers repeated; False: trace everything).
    recompute: in training, layers whose backward runs their forward again instead of saving its
    activations (None: the solver decides, only when a memory_budget needs it, per layer whole or
    selectively, keeping its matmuls and attention saved; True: every layer of every module list, whole;
    "selective": every layer, selectively; False: none).
    axis_search: on a mesh of three or more axes, solve two axes at a time from a start where the outer
    axes act as one (compiler/axis_search.py: fast, a local optimum, not proven optimal; None: when the
    exact program would be large; False: always solve exactly).
    bucket_bytes: gradient all_reduces are packed into buckets of this size; defer_waits: wait for a
    bucket, and any all_reduce, at its first use, not right after its launch (passes/overlap_collectives.py;
    False: every all_reduce synchronous, where the trace put it).
    solver_time_limit: seconds each placement solve may take (60 by default; the axis search makes a few): where
    it runs out with a plan in hand, that plan is taken with its gap; with none, the solve fails and says so (a
    large model on a slow or loaded host: give it more).
    plan: a plan solved before (by `spmd.plan`, `spmd plan --json`, or a compile), to run instead of solving
    again: its `PlanReport`, `Plan`, or the path of its file (`plan.save(path)`). It must be for this graph
    (the same model, input shapes, training and loss function: checked against the digest of the ops and
    their wiring that the plan keeps) on a mesh of this shape and axis names; the pins given with it must hold
    in it. Costs, memory and explanation are the plan's, priced by the profiles it was solved with (and its
    optimizer_state_factor, where none is given).
    dump_dir: write the annotated graph after every pass there (also SPMD_DUMP=dir); verify: check every
    pass's stated postcondition as it runs (also SPMD_VERIFY=1; the tests turn it on).
    """

    in_placements: dict = field(default_factory=dict)
    param_placements: dict = field(default_factory=dict)
    out_placements: dict | list | tuple = field(default_factory=dict)
    loss_fn: Callable | None = None
    training: bool | None = None
    memory_budget: float | None = None
    optimizer_state_factor: float = 2.0
    tie_blocks: bool | None = None
    merge_followers: bool | None = None
    stamp_layers: bool | None = None
    recompute: bool | str | None = None
    axis_search: bool | None = None
    bucket_bytes: float = 4 * 2**20
    defer_waits: bool = True
    solver_time_limit: float = 60.0
    plan: Any = None  # a core.plan.Plan, or a plan file's path until spmd.api reads it
    dump_dir: str | None = None
    verify: bool = False

    def __post_init__(self):
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise SpmdError(f"loss_fn must be callable, got {type(self.loss_fn).__name__}")
        if self.loss_fn is not None and self.training is False:
            raise SpmdError("a loss_fn only makes sense with training=True (or leave training unset)")
        if self.memory_budget is not None and not self.memory_budget > 0:
            raise SpmdError(f"memory_budget must be a positive number of bytes per rank, got {self.memory_budget!r}")
        if not self.optimizer_state_factor >= 0:
            raise SpmdError(f"optimizer_state_factor must be >= 0, got {self.optimizer_state_factor!r}")
        if self.recompute not in (None, True, False, "selective"):
            raise SpmdError(f"recompute must be None, True, False or 'selective', got {self.recompute!r}")
        if not self.bucket_bytes > 0:
            raise SpmdError(f"bucket_bytes must be > 0, got {self.bucket_bytes!r}")
        if not self.solver_time_limit > 0:
            raise SpmdError(f"solver_time_limit must be a positive number of seconds, got {self.solver_time_limit!r}")
        if self.plan is not None and not isinstance(self.plan, (Plan, str, os.PathLike)):
            raise SpmdError(f"plan must be a solved plan (spmd.plan's result, or spmd.load_plan(path)) or the path of "
                            f"a plan file, got {type(self.plan).__name__}")

    @property
    def joint(self) -> bool:
        """Plan the joint forward+backward graph."""
        return self.training if self.training is not None else self.loss_fn is not None

    @property
    def pins(self) -> Pins:
        outs = self.out_placements
        if isinstance(outs, (list, tuple)):
            outs = dict(enumerate(outs))
        return Pins(self.in_placements or {}, self.param_placements or {}, outs or {})

    @staticmethod
    def build(options: "PlanOptions | None" = None, **overrides: Any) -> "PlanOptions":
        """`options` (or the defaults) with `overrides` applied: what spmd.plan / spmd.compile's keyword
        arguments become. An unknown keyword is an SpmdError naming the closest option."""
        names = [f.name for f in dataclasses.fields(PlanOptions)]
        unknown = [k for k in overrides if k not in names]
        if unknown:
            hints = {k: difflib.get_close_matches(k, names, n=1) for k in unknown}
            said = ", ".join(f"{k!r}" + (f" (did you mean {h[0]!r}?)" if h else "") for k, h in hints.items())
            raise SpmdError(f"unknown option {said}. Options: {', '.join(names)}")
        given = {k: v for k, v in overrides.items() if v is not None}  # None: not given
        return dataclasses.replace(options or PlanOptions(), **given)


@dataclass(frozen=True)
class RankBinding:
    """The rank a compilation emits code for: its coordinate follows from `rank` and the mesh; each mesh
    axis's collectives run on the process group named `group_names[axis]`; `device` is where its
    tensors live (None: wherever the model's are). On a live mesh: `check` makes the ranks agree on
    what they traced before anything else (runtime/agreement.py), only the rank with `plans` builds the
    placement program and solves it, and `share_plan(make)` hands its plan to every rank (ties between
    optimal plans are broken differently in different processes, and the others need not repeat the
    work)."""

    rank: int
    group_names: tuple[str, ...]
    device: torch.device | None = None
    share_plan: Callable | None = None
    check: Callable | None = None
    plans: bool = True
