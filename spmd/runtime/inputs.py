"""What a compiled module checks about its inputs before any collective runs: a wrong input must fail
here, on the rank that got it, with the fix, and not as a hang or a size error inside gloo.

    count                       the inputs the model was compiled for, by name
    a tensor                    each input is one
    dtype                       the example's dtype (a float64 batch for a float32 model, int32 tokens)
    device                      the rank's device (a CPU batch on a CUDA rank)
    the full tensor             where the rank takes its shard: compiled.shard_inputs(...) cuts it
    another size                the plan is for the example's shapes: `shard_inputs` compiles for new ones
                                (runtime/shapes.py); pieces of shapes nothing was compiled for are refused
    a batch written since its cut   copies `shard_inputs` cut follow their batch as views do (`CutPieces`):
                                refused where the piece was written too
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


# (found by a probe: an epoch's last, smaller batch, a DataLoader's drop_last=False, had no way out that trains: a
# module compiled for its size holds its own copy of the weights, which the optimizer over the first one's does not
# step, and it is refused once its sibling has stepped)
SMALLER_BATCH = (
    "A smaller last batch of an epoch (a DataLoader's drop_last=False): pad it to the compiled size, with its "
    "targets at the loss's ignore_index (with the loss given as loss_fn, or taken of gathered outputs, a mean "
    "cross-entropy leaves those rows out: the smaller batch's loss and gradients; a loss of each rank's own piece "
    "wants a sum divided by the number of real targets over all ranks, since a piece may be all padding), or drop "
    "it (drop_last=True). A module compiled for its size would hold a copy of the weights of its own, which the "
    "optimizer does not step.")


def check_full(inputs: tuple, specs: list[InputSpec]) -> None:
    """`shard_inputs`' inputs: the full tensors, as the example inputs were."""
    _count(inputs, specs, "shard_inputs takes")
    problems, missing, batches, dtypes = [], [], set(), []
    for t, spec in zip(inputs, specs):
        if not isinstance(t, torch.Tensor):
            problems.append(f"  input {spec.name!r}: expected a tensor, got {type(t).__name__}")
            missing.append(spec.name)
            continue
        if t.is_meta:  # (found by a probe: torch's "not on the expected device meta!")
            problems.append(f"  input {spec.name!r}: on the meta device, which holds no values")
            missing.append(spec.name)
            continue
        if t.dtype != spec.dtype:  # (reported beside a shape: a bool mask at a new batch size was told "recompile"
            problems.append(f"  input {spec.name!r}: expected {spec.dtype}, got {t.dtype}")  # alone; a probe)
            dtypes.append(spec.name)
        if tuple(t.shape) != tuple(spec.shape):
            problems.append(f"  input {spec.name!r}: expected the full shape {list(spec.shape)}, got {list(t.shape)}")
            batches.add(t.ndim == len(spec.shape) and t.ndim > 0 and t.shape[0] < spec.shape[0]
                        and tuple(t.shape[1:]) == tuple(spec.shape[1:]))
    if not problems:
        return
    if dtypes and not missing:
        raise SpmdError(
            "shard_inputs cuts full inputs of the dtypes the model was compiled for:\n" + "\n".join(problems) +
            f"\nWhat to do: pass {', '.join(map(repr, dtypes))} in the compiled dtype (`.to(...)`): the graphs are "
            "traced for it. Inputs of other shapes in the compiled dtypes are compiled for at their first cut.")
    if missing:  # (`attention_mask=None` where the example had a mask: not a matter of shapes; found by a probe)
        what, way_out = "as the model was compiled for them", (
            f"the model was compiled with a tensor for {', '.join(map(repr, missing))}, and its graph reads one: pass a "
            "tensor with values (an all-ones attention mask where none is meant), or compile another module with "
            "example inputs that leave it out.")
    else:
        what, way_out = "of the shapes the model was compiled for", (
            "recompile with example inputs of these shapes (the plan is for the compiled ones), or pass batches of "
            "the compiled size." + (f" {SMALLER_BATCH}" if batches == {True} else ""))
    raise SpmdError(f"shard_inputs cuts full inputs {what}:\n" + "\n".join(problems) + f"\nWhat to do: {way_out}")


class LocalCheck:
    """`check_local` for one compiled module, its expectations worked out once: a call whose inputs
    all match (local shape, dtype, device) costs a comparison per input; any other gets
    `check_local`'s message."""

    def __init__(self, specs: list[InputSpec], mesh, rank: int, device: torch.device | None):
        self.specs, self.mesh, self.rank, self.device = specs, mesh, rank, device
        self.expected = tuple((torch.Size(local_shape(s.shape, s.placements, mesh.shape)), s.dtype) for s in specs)

    def expected_shapes(self) -> list[tuple[int, ...]]:
        return [tuple(shape) for shape, _ in self.expected]

    def accepts(self, inputs: tuple) -> bool:
        return len(inputs) == len(self.expected) and all(
            isinstance(t, torch.Tensor) and t.shape == shape and t.dtype == dtype
            and (t.device == self.device if self.device is not None else not t.is_meta)
            and not hasattr(t, "_local_tensor")
            for t, (shape, dtype) in zip(inputs, self.expected))

    def __call__(self, inputs: tuple) -> None:
        if self.accepts(inputs):
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
        if hasattr(t, "to_local") and hasattr(t, "placements"):  # (a DTensor: torch's tensor parallelism before this)
            problems.append(f"{where}: got a DTensor ({placements_str(tuple(t.placements))}); the compiled model takes "
                            "plain tensors, this rank's piece")
            fix.add("dtensor")
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
        if device is not None and t.device != device or device is None and t.is_meta:
            problems.append(f"{where}: expected it on {device or 'the device it was compiled on'}, got it on "
                            f"{t.device}" + (", which holds no values" if t.is_meta else ""))
            fix.add("device")
    if problems:
        todo = []
        if "shard" in fix or "shape" in fix:
            todo.append("pass this rank's shard (compiled.shard_inputs(*full_inputs) cuts it"
                        + (", and compiles for full inputs of other shapes, over the same weights)" if "shape" in fix
                           else ")"))
        if "shard" in fix:  # (found by a probe: transformers' Trainer feeds each rank its own rows)
            todo.append("where each rank already holds its own slice of a larger batch (a distributed sampler, "
                        "transformers' Trainer), compile for the whole batch (all ranks' rows) with the inputs pinned "
                        "`in_placements={name: [Shard(0)]}`, and pass each rank's slice as it is (a slice of the "
                        "compiled whole batch's shape reads as that batch whole: compile for the batch of all the "
                        "ranks' slices; a probe)")
        if "dtype" in fix:
            todo.append("convert the input to the compiled dtype (or recompile with inputs of this dtype)")
        if "device" in fix:
            todo.append(f"move the input to {device}" if device is not None else "pass a tensor with values")
        if "dtensor" in fix:
            todo.append("pass dtensor.full_tensor() through compiled.shard_inputs(...), or dtensor.to_local() where its "
                        "layout is the one the compiled model takes (use_local_output=True in parallelize_module's plan)")
        raise SpmdError(f"wrong input on rank {rank} (checked before any collective ran):\n" + "\n".join(problems)
                        + "\nWhat to do: " + "; ".join(todo) + ".")


def _count(inputs: tuple, specs: list[InputSpec], what: str) -> None:
    if len(inputs) != len(specs):
        raise SpmdError(f"{what} {len(specs)} inputs ({', '.join(s.name for s in specs)}), got {len(inputs)}. What "
                        "to do: pass them in that order (the model's arguments, then the loss function's targets).")


class CutPieces:
    """Pieces `shard_inputs` cut as copies of their batch follow the batch, as views of it do: a call sees the batch
    as it is at the call, as an eager call given the batch would.

    A piece is a view of its full input where the slice is one (a batch split on its first dim, a replicated
    input), and a copy elsewhere: which, the plan decides. A loop that cuts once and then writes the batch in place
    (a static input buffer refilled at every step, a generation loop writing each new token into a fixed token
    buffer) fed the views the new values and the copies the old ones: a GPT-2 with its tokens split on the
    sequence generated from the prompt alone, 0.53-0.67 off from the second token, and a model whose inputs split
    both ways trained on a mix of two batches (both found by probes). Now a copy whose batch was written since the
    last call is cut again, in place, before the call. A copy the user wrote itself (`labels[labels == 0] = -100`
    on the piece) keeps its values while its batch is not written; where both were written since the last call,
    the call is refused. So a loop that prefetches the next batch into the buffer it cut the current one from
    gets the new batch, from views and copies alike: prefetching needs a second buffer, as for an eager call.

    Writes are found by version counters. Inference tensors have none: a copy cut from one, or that is one,
    keeps a snapshot and is compared at each call (inputs are small beside the model)."""

    def __init__(self, cut):
        self._cut_again = cut  # (full, spec) -> this rank's piece of it, as this module lays it out

    def record(self, full: torch.Tensor, piece: torch.Tensor, spec: InputSpec) -> None:
        if torch.compiler.is_compiling():  # (cut inside a torch.compile'd forward: made afresh at each call, and
            return                         # dynamo would keep its own stand-ins here; found by a probe)
        base = full if full._base is None else full._base
        if piece is full or piece._base is base or _same_memory(piece, full):  # (a view of an inference tensor
            _copies.pop(piece, None)                                           # has no `_base`: a review)
            return
        _copies[piece] = _Copy(weakref.ref(base), (full.size(), full.stride(), full.storage_offset()),
                               _mark(base) if not base.is_inference() else piece.detach().clone(), _mark(piece),
                               self._cut_again, spec)

    def check(self, inputs: tuple, specs: list[InputSpec]) -> None:
        if not _copies or torch.compiler.is_compiling():
            return
        for t, spec in zip(inputs, specs):
            copy = _copies.get(t) if isinstance(t, torch.Tensor) else None
            base = copy.base() if copy is not None else None
            if base is None:
                continue
            fresh = None
            if isinstance(copy.batch, int):
                if base._version == copy.batch:
                    continue
            else:  # (an inference batch: its piece as cut at the last call, compared)
                fresh = _cut_from(base, copy, spec)
                if torch.equal(fresh, copy.batch):
                    continue
            if _written(t, copy.piece):
                raise SpmdError(
                    f"input {spec.name!r} ({placements_str(spec.placements)}): both this rank's piece, a copy "
                    "shard_inputs cut, and the batch it was cut from were written in place since the last call, so "
                    "which values the call should see is unclear (a copy follows its batch, as a view does). What "
                    "to do: call compiled.shard_inputs(...) again after writing the batch, then change the piece.")
            if t.requires_grad:
                raise SpmdError(
                    f"input {spec.name!r}: the batch it was cut from (a tensor that requires grad) was written in "
                    "place since the cut, and the piece, part of the autograd graph of the old values, cannot "
                    "follow it. What to do: call compiled.shard_inputs(...) again after writing the batch.")
            fresh = _cut_from(base, copy, spec) if fresh is None else fresh
            with torch.inference_mode(t.is_inference()), torch.no_grad():
                t.copy_(fresh)
            copy.batch = base._version if isinstance(copy.batch, int) else fresh
            copy.piece = _mark(t)

    def seen(self, inputs: tuple) -> None:
        """What the call wrote into its own inputs (a forward that changes its input in place) is not the user's
        write of the piece."""
        if not _copies or torch.compiler.is_compiling():
            return
        for t in inputs:
            if isinstance(t, torch.Tensor) and (copy := _copies.get(t)) is not None:
                copy.piece = _mark(t)


# piece -> _Copy, for every compiled module (a piece one module cut, passed to another compiled from the same model,
# follows its batch too: a review); views are not recorded (they follow their batch)
_copies = WeakIdKeyDictionary()


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() != 0
    except (RuntimeError, NotImplementedError):  # (meta and fake tensors: no memory)
        return False


def _cut_from(base: torch.Tensor, copy: "_Copy", spec: InputSpec) -> torch.Tensor:
    """The piece `copy` is, cut again from its batch as it is now (laid out as the module that cut it does)."""
    size, stride, offset = copy.where
    try:
        full = base.as_strided(size, stride, offset)
    except RuntimeError as e:  # (the batch resized since the cut)
        raise SpmdError(f"input {spec.name!r}: the batch shard_inputs cut it from no longer holds the cut "
                        f"tensor ({e}). What to do: call compiled.shard_inputs(...) again.") from None
    with torch.inference_mode(base.is_inference()), torch.no_grad():
        return copy.cut(full, copy.spec)


@dataclass
class _Copy:
    base: weakref.ref  # the batch's base tensor (a view passed in, `batch[:]`, shares it)
    where: tuple  # the full input's size, stride and storage offset in its base
    batch: int | torch.Tensor  # the base's version at the last call, or (inference) the piece as cut then
    piece: int | torch.Tensor  # the piece's version after the last call, or (inference) a snapshot of it
    cut: object  # (full, spec) -> the piece, as the module that cut it lays it out
    spec: InputSpec  # the input it was cut for


def _mark(t: torch.Tensor) -> int | torch.Tensor:
    return t.detach().clone() if t.is_inference() else t._version


def _written(t: torch.Tensor, mark: int | torch.Tensor) -> bool:
    return t._version != mark if isinstance(mark, int) else not torch.equal(t, mark)
