"""What a compiled module checks about its inputs before any collective runs: a wrong input must fail
here, on the rank that got it, with the fix, and not as a hang or a size error inside gloo.

    count                       the inputs the model was compiled for, by name
    a tensor                    each input is one
    dtype                       the example's dtype (a float64 batch for a float32 model, int32 tokens)
    device                      the rank's device (a CPU batch on a CUDA rank)
    the full tensor             where the rank takes its shard: compiled.shard_inputs(...) cuts it
    another size                the plan is for the example's shapes: recompile for new ones
    a batch written since its cut   pieces `shard_inputs` cut, views of their batch and copies, whose
                                batches were refilled in place after (`CutPieces`)
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from spmd.core.errors import SpmdError, SpmdInternalError
from spmd.core.specs import Placements, local_shape, placements_str


@dataclass(frozen=True)
class InputSpec:
    name: str
    placements: Placements
    shape: tuple[int, ...]  # global
    dtype: torch.dtype


def check_full(inputs: tuple, specs: list[InputSpec]) -> None:
    """`shard_inputs`' inputs: the full tensors, as the example inputs were."""
    _count(inputs, specs, "shard_inputs takes")
    problems, missing = [], []
    for t, spec in zip(inputs, specs):
        if not isinstance(t, torch.Tensor):
            problems.append(f"  input {spec.name!r}: expected a tensor, got {type(t).__name__}")
            missing.append(spec.name)
        elif tuple(t.shape) != tuple(spec.shape):
            problems.append(f"  input {spec.name!r}: expected the full shape {list(spec.shape)}, got {list(t.shape)}")
    if not problems:
        return
    if missing:  # (`attention_mask=None` where the example had a mask: not a matter of shapes; found by a probe)
        what, way_out = "as the model was compiled for them", (
            f"the model was compiled with a tensor for {', '.join(map(repr, missing))}, and its graph reads one: pass a "
            "tensor (an all-ones attention mask where none is meant), or compile another module with example inputs "
            "that leave it out.")
    else:
        what, way_out = "of the shapes the model was compiled for", (
            "recompile with example inputs of these shapes (the plan is for the compiled ones), or pass batches of "
            "the compiled size.")
    raise SpmdError(f"shard_inputs cuts full inputs {what}:\n" + "\n".join(problems) + f"\nWhat to do: {way_out}")


class LocalCheck:
    """`check_local` for one compiled module, its expectations worked out once: a call whose inputs
    all match (local shape, dtype, device) costs a comparison per input; any other gets
    `check_local`'s message."""

    def __init__(self, specs: list[InputSpec], mesh, rank: int, device: torch.device | None):
        self.specs, self.mesh, self.rank, self.device = specs, mesh, rank, device
        self.expected = tuple((torch.Size(local_shape(s.shape, s.placements, mesh.shape)), s.dtype) for s in specs)

    def __call__(self, inputs: tuple) -> None:
        if len(inputs) == len(self.expected) and all(
                isinstance(t, torch.Tensor) and t.shape == shape and t.dtype == dtype
                and (self.device is None or t.device == self.device)
                for t, (shape, dtype) in zip(inputs, self.expected)):
            return
        check_local(inputs, self.specs, self.mesh, self.rank, self.device)
        raise SpmdInternalError("LocalCheck refused inputs that check_local accepts")


def check_local(inputs: tuple, specs: list[InputSpec], mesh, rank: int, device: torch.device | None) -> None:
    """A compiled module's inputs: this rank's shards, in the compiled dtypes, on its device."""
    _count(inputs, specs, "the compiled model takes")
    problems, fix = [], set()
    for t, spec in zip(inputs, specs):
        where = f"  input {spec.name!r}"
        if not isinstance(t, torch.Tensor):
            problems.append(f"{where}: expected a tensor, got {type(t).__name__}")
            continue
        want = local_shape(spec.shape, spec.placements, mesh.shape)
        layout = f"global {list(spec.shape)} laid out as {placements_str(spec.placements)} on mesh {mesh}"
        if tuple(t.shape) != want:
            if tuple(t.shape) == tuple(spec.shape):
                problems.append(f"{where}: got the full tensor {list(t.shape)}; this rank takes its shard "
                                f"{list(want)} ({layout})")
                fix.add("shard")
            else:
                problems.append(f"{where}: expected local shape {list(want)} ({layout}), got {list(t.shape)}")
                fix.add("shape")
        if t.dtype != spec.dtype:
            problems.append(f"{where}: expected {str(spec.dtype).replace('torch.', '')}, got "
                            f"{str(t.dtype).replace('torch.', '')}")
            fix.add("dtype")
        if device is not None and t.device != device:
            problems.append(f"{where}: expected it on {device}, got it on {t.device}")
            fix.add("device")
    if problems:
        todo = []
        if "shard" in fix or "shape" in fix:
            todo.append("pass this rank's shard (compiled.shard_inputs(*full_inputs) cuts it)"
                        + (", or recompile with example inputs of this size" if "shape" in fix else ""))
        if "dtype" in fix:
            todo.append("convert the input to the compiled dtype (or recompile with inputs of this dtype)")
        if "device" in fix:
            todo.append(f"move the input to {device}")
        raise SpmdError(f"wrong input on rank {rank} (checked before any collective ran):\n" + "\n".join(problems)
                        + "\nWhat to do: " + "; ".join(todo) + ".")


def _count(inputs: tuple, specs: list[InputSpec], what: str) -> None:
    if len(inputs) != len(specs):
        raise SpmdError(f"{what} {len(specs)} inputs ({', '.join(s.name for s in specs)}), got {len(inputs)}. What "
                        "to do: pass them in that order (the model's arguments, then the loss function's targets).")


class CutPieces:
    """The pieces `shard_inputs` cut from full inputs, each with the version of the batch (its base tensor: a view
    passed in, `batch[:]`, shares it) at the cut, and whether the piece is a view of it or a copy.

    A piece is a view of its full input where the slice is one (a batch split on its first dim, a replicated
    input), and a copy elsewhere: which, the plan decides. A loop that cut once and refilled the batch in place
    (a static input buffer) then fed the view pieces the new batch and the copies the old one: a model whose
    inputs split both ways trained on a mix of two batches, silently (found by a probe). A call whose inputs
    mix views and copies of batches written since their cut is refused. Where all of them are copies, or all
    views, the call sees one batch (the one cut, or the one written), as a loop that prefetches into its buffer
    or masks its labels' piece in place (`labels[labels == 0] = -100`) means (both found by reviews); what the
    call itself writes into its inputs is taken as seen (`seen`)."""

    def __init__(self):
        # piece -> (a weak reference to the batch's base, its version at the cut, whether the piece is a view of it)
        self._cut = WeakIdKeyDictionary()

    def record(self, full: torch.Tensor, piece: torch.Tensor) -> None:
        base = full if full._base is None else full._base
        if not base.is_inference():  # (no version counter to read)
            view = piece is full or piece._base is base
            self._cut[piece] = (weakref.ref(base), base._version, view)

    def _written(self, t) -> tuple | None:
        """(its batch's base, whether `t` is a view of it) where `t` is a piece whose batch was written since its
        cut, else None."""
        cut = self._cut.get(t) if isinstance(t, torch.Tensor) else None
        base = cut[0]() if cut is not None else None
        return (base, cut[2]) if base is not None and base._version != cut[1] else None

    def check(self, inputs: tuple, specs: list[InputSpec]) -> None:
        if not self._cut:
            return
        written = {True: [], False: []}  # (views, copies) whose batch was written since the cut
        for t, spec in zip(inputs, specs):
            if (found := self._written(t)) is not None:
                written[found[1]].append(spec)
        if written[True] and written[False]:
            views, copies = (", ".join(f"{s.name!r} ({placements_str(s.placements)})" for s in written[k])
                             for k in (True, False))
            raise SpmdError(
                f"inputs {views} and {copies}: the batches shard_inputs cut them from were written in place since "
                f"(refilled). The first are views of their batch and see the new values, the others copies that "
                "hold the old ones (the plan lays each out), so this call would mix two batches. What to do: call "
                "compiled.shard_inputs(...) again after writing the batch, just before the call (pieces cut once do "
                "not follow a buffer refilled in place).")

    def seen(self, inputs: tuple) -> None:
        """What the call wrote into its own inputs (a forward that changes its input in place) is not a refill."""
        if not self._cut:
            return
        for t in inputs:
            if (found := self._written(t)) is not None:
                base, view = found
                self._cut[t] = (weakref.ref(base), base._version, view)
