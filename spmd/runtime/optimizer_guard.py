"""Catch the optimizer traps, at each optimizer's first step.

- An optimizer built over the original model's parameters after compile. The compiled module holds its
  own parameters (this rank's shards); the original model's parameters never get a gradient from it, so
  `torch.optim.AdamW(model.parameters())` would step nothing and the loss would stay flat without a
  word. `watch(model)` remembers the original parameters (weakly); an optimizer holding any of them
  raises `SpmdError` naming them and the fix.
- An optimizer other than the one the plan assumed. A training plan counts `optimizer_state_factor`
  parameter sizes of optimizer state per parameter (AdamW's 2 by default) in its memory and prices the
  optimizer's step by it. `expect(parameters, factor)` remembers the compiled module's parameters with
  that factor; a torch optimizer over them that keeps another amount (SGD 0, SGD with momentum 1, Adam
  with amsgrad 3, ...: `state_factor`) gets a warning naming both and the option to re-plan with.

- An optimizer whose update of an element reads other elements (Adafactor's factored moments, Muon's
  orthogonalized matrices, LBFGS's dot products over every parameter), over the pieces of a sharded parameter:
  each rank would compute its update from its piece alone, and the result would differ from one device's,
  silently. `watch_pieces(pieces)` remembers the sharded pieces; torch's optimizers of that kind raise, and an
  optimizer from elsewhere (whose update spmd cannot read) warns, naming the pieces and the ways out.

- State saved for other pieces than this rank's: an optimizer's own `state_dict()` saved by rank 0 alone and
  loaded on every rank, or saved under another plan. `place(pieces, ...)` remembers each sharded piece's
  coordinate and layout; the optimizer's `state_dict()` carries them in its param groups (`SAVED_BY`), and a
  load where they differ raises at the load or the first step.

One process-wide optimizer step pre-hook checks each optimizer at its first step, and again after parameters
or step hooks were added to it.
"""
from __future__ import annotations

import sys
import threading
import warnings
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from spmd.core.errors import SpmdError, user_stacklevel
from spmd.runtime.distribute import extremes_over_mesh, same_piece

_lock = threading.Lock()
_watched: dict[int, tuple[weakref.ref, str, str]] = {}  # id(parameter) -> (ref, FQN, model class)
# id(compiled parameter) -> (ref, the plan's state factor, its mesh: (group names per axis, shape, the device of its
# own small collectives))
_expected: dict[int, tuple[weakref.ref, float, tuple]] = {}
# optimizer -> how many parameters and step hooks of its own it had when checked (one added since,
# `add_param_group` as gradual unfreezing does, is checked at the next step)
_checked: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, int]]" = weakref.WeakKeyDictionary()
_loads_watched: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()  # (a load post hook registered)
# optimizers whose plain parameters' gradients were compared over the mesh (once: a check refused and retaken on one
# rank must not enter the collective alone)
_plain_checked: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
# optimizers whose first step took a closure: their plain gradients come inside the step, so are compared after it
_plain_after: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_pieces = WeakIdKeyDictionary()  # this rank's piece of a sharded parameter -> its FQN
# a piece sharded over some mesh axis -> (FQN, this rank's coordinate, the mesh's shape, its placements)
_placed = WeakIdKeyDictionary()
SAVED_BY = "spmd_pieces_of"  # the param group entry `state_dict()` adds: per parameter, whose piece and its layout
_hook = _after_hook = None

# torch's optimizers whose update of each element reads only that element's gradient and state
PER_ELEMENT = frozenset({"SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adadelta", "Adagrad", "ASGD", "RMSprop",
                         "Rprop", "SparseAdam"})
# and those whose update reads more: what it reads, and which parameters it reads so (their least ndim)
WHOLE = {"Adafactor": ("the row and column means of each matrix's squared gradients (its factored second moment) "
                       "and each parameter's and update's root mean square (its step size and clipping)", 0),
         "Muon": ("each matrix whole, to orthogonalize its update", 2),
         "LBFGS": ("dot products over every parameter, and its line search the whole loss", 0)}


def _install() -> None:
    global _hook, _after_hook
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(torch.compiler.disable(_check, recursive=True))
        _after_hook = register_optimizer_step_post_hook(torch.compiler.disable(_after_step, recursive=True))


def watch(model: torch.nn.Module) -> None:
    """Remember `model`'s parameters as ones no optimizer may step once it is compiled."""
    with _lock:
        for fqn, p in model.named_parameters():
            key = id(p)
            _watched[key] = (weakref.ref(p, lambda _, key=key: _watched.pop(key, None)), fqn, type(model).__name__,
                             _grad_key(p))
        _install()


def _grad_key(p: torch.Tensor) -> tuple | None:
    """What `p`'s gradient is now (None: it has none): a gradient that came since is one its users made."""
    return None if p.grad is None else (id(p.grad), p.grad._version)


def _refuse_read_outside(optimizer: torch.optim.Optimizer) -> None:
    """A parameter of a compiled model that got a gradient since it was compiled: code outside the compiled module
    reads the original tensor (an eager head tied to the compiled backbone's embedding, `h @ bb.emb.weight.T`),
    which the compiled module's pieces replaced. Its gradient lands there, where no step of the pieces reaches,
    and it reads weights that never change: the probe's loss was 4.4269 where eager gave 4.4295 after a step,
    the embedding 0.049 off after 3, silently. Looked for at each optimizer's first step."""
    grown = [(fqn, model) for ref, fqn, model, was in list(_watched.values())
             if (p := ref()) is not None and p.grad is not None and _grad_key(p) != was]
    if not grown:
        return
    names = ", ".join(fqn for fqn, _ in grown[:5]) + (f" and {len(grown) - 5} more" if len(grown) > 5 else "")
    raise SpmdError(
        f"{type(optimizer).__name__}.step(): the original {grown[0][1]}'s {names} got a gradient since it was "
        "compiled: code outside the compiled module reads the original tensor (an eager head tied to the compiled "
        "embedding), which the compiled module replaced with its pieces. That code reads weights no step changes, "
        "and its gradient never reaches the pieces. What to do: read the compiled module's parameter there "
        f"(`compiled.get_parameter({grown[0][0]!r})`, whole where its plan replicates it: pin it so with "
        "param_placements), or compile the whole computation that uses it (the head inside the compiled module, "
        "with a loss_fn).")


def expect(parameters, state_factor: float, mesh: tuple = ((), (), None)) -> None:
    """Remember a compiled training module's `parameters` as planned for an optimizer keeping
    `state_factor` parameter sizes of state per parameter, on `mesh` (its group names per axis, its shape, the
    device its own collectives run on: `distribute.collective_device`)."""
    with _lock:
        for p in parameters:
            key = id(p)
            _expected[key] = (weakref.ref(p, lambda _, key=key: _expected.pop(key, None)), float(state_factor),
                              (tuple(mesh[0]), tuple(mesh[1]), mesh[2]))
        _install()


def watch_pieces(pieces: dict[str, torch.Tensor]) -> None:
    """FQN -> this rank's piece of a sharded parameter: an optimizer that is not per element over one of them
    raises or warns at its first step."""
    with _lock:
        for fqn, p in pieces.items():
            _pieces[p] = fqn
        _install()


def place(pieces: dict[str, tuple[torch.Tensor, tuple]], coordinate: tuple, mesh_shape: tuple) -> None:
    """FQN -> (this rank's piece of a parameter sharded over some mesh axis, its placements): an optimizer's
    `state_dict()` over them says whose pieces it holds, and a load on a rank whose pieces differ raises."""
    with _lock:
        for fqn, (p, placements) in pieces.items():
            _placed[p] = (fqn, tuple(coordinate), tuple(mesh_shape), tuple(placements))
        _install()


def _where(p) -> tuple | None:
    """(this rank's coordinate, the mesh's shape, the placements, its name) of a placed piece; None for any other.
    (The name: what a load under another plan that keeps the parameter whole names.)"""
    entry = _placed.get(p)
    return None if entry is None else (entry[1], entry[2], str(entry[3]), entry[0])


def _stamp(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """(A state_dict post hook) each param group that holds placed pieces says, per parameter, whose piece it
    stepped and how it was laid out: torch's `load_state_dict` copies the entry into the loading optimizer's
    groups, where `_refuse_saved_elsewhere` reads it."""
    for group, saved in zip(optimizer.param_groups, state_dict.get("param_groups", ())):
        if any(p in _placed for p in group["params"]):
            saved[SAVED_BY] = tuple(_where(p) for p in group["params"])
    return state_dict


def _refuse_saved_elsewhere(optimizer: torch.optim.Optimizer) -> None:
    """Raise where `optimizer` was loaded with state saved for other pieces than this rank's, of the same
    shapes: by another rank (`torch.save(optimizer.state_dict(), ...)` on rank 0 alone, loaded on every rank:
    each took rank 0's moments for its own pieces, silently), or under another plan (a parameter cut on
    another axis). (A load post hook, and at each optimizer's check.)"""
    for group in optimizer.param_groups:
        for p, saved in zip(group["params"], group.get(SAVED_BY, ())):
            now, entry = _where(p), _placed.get(p)
            if not optimizer.state.get(p) or saved == now:
                continue
            if saved is None or now is None or saved[2] != now[2]:
                name = entry[0] if entry else saved[3] if saved is not None and len(saved) > 3 else "a parameter"
                what = (f"under another plan ({name}: laid out "
                        f"{saved[2] if saved else 'whole'} then, {now[2] if now else 'whole'} now)")
            else:
                (coordinate, shape), (fqn, mine, mesh_shape, placements) = saved[:2], entry
                if same_piece((coordinate, shape), (mine, mesh_shape), placements):
                    continue
                what = (f"by the rank at mesh coordinate {tuple(coordinate)} (of a mesh {tuple(shape)}), and this "
                        f"rank is at {mine}: its pieces of sharded parameters ({fqn}, ...) are other parts of the whole")
            _checked.pop(optimizer, None)  # (its next step asks again: the state stays loaded)
            raise SpmdError(
                f"{type(optimizer).__name__} was loaded with a state_dict() saved {what}, so each rank would step "
                "its pieces with other pieces' moments. A state_dict() saved by one rank (`torch.save(optimizer."
                "state_dict(), ...)` on rank 0) and loaded on every rank, or saved before the plan changed, does "
                "that. What to do: save `compiled.optimizer_state_dict(optimizer)` with torch.distributed.checkpoint "
                "and load it with `compiled.load_optimizer_state_dict(optimizer, state)` (any mesh and plan), or let "
                "each rank save and load its own file (`f'optim_{rank}.pt'`) on the same plan.")


def _torch_kind(optimizer: torch.optim.Optimizer) -> str | None:
    """The name of torch's optimizer whose update `optimizer` runs (itself, or a subclass that keeps its `step`),
    or None: an optimizer from elsewhere, or one with a `step` of its own."""
    import inspect

    step = inspect.unwrap(type(optimizer).step)  # (torch wraps a class's step in its profiling hook)
    for cls in type(optimizer).__mro__:
        if cls.__module__.startswith("torch.optim") and (cls.__name__ in PER_ELEMENT or cls.__name__ in WHOLE):
            return cls.__name__ if inspect.unwrap(cls.step) is step else None
    return None


def _cut(optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """(FQN, piece) of each piece of a sharded parameter `optimizer` steps."""
    return [(fqn, p) for group in optimizer.param_groups for p in group["params"] if (fqn := _pieces.get(p)) is not None]


def _listed(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def step_hooks(optimizer: torch.optim.Optimizer) -> list[dict]:
    """The tables of the optimizer's own step pre- and post-hooks."""
    return [table for table in (getattr(optimizer, "_optimizer_step_pre_hooks", None),
                                getattr(optimizer, "_optimizer_step_post_hooks", None)) if table is not None]


# torch's wrappers that spread what a rank stepped over the other ranks: what they do to pieces, and the way out
_SPREADING = {
    "ZeroRedundancyOptimizer": (
        "it broadcasts each parameter from the rank that steps it, and those pieces differ from rank to rank, so each "
        "would be overwritten with another rank's part",
        "use the optimizer itself (AdamW(compiled.parameters())): spmd's plan already shards the optimizer state "
        "with the parameters it shards (pin more of them sharded to save memory)"),
    "PostLocalSGDOptimizer": (
        "its model averager all_reduces each parameter over the ranks, and those pieces are different parts of the "
        "parameter, so each would become an average of parts",
        "step the inner optimizer itself (its gradients are already reduced over the mesh by the compiled module, "
        "every step)"),
}


def _spreading_wrapper(optimizer: torch.optim.Optimizer) -> str | None:
    """The name of the `_SPREADING` wrapper `optimizer` is, or steps inside (`_stepped_inside`)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return "ZeroRedundancyOptimizer"
    return _stepped_inside(optimizer)


def _stepped_inside(optimizer: torch.optim.Optimizer) -> str | None:
    """The name of the wrapper stepping `optimizer` as its inner one, found on the stack above its step (called from
    the step hook's checks): PostLocalSGDOptimizer's inner optimizer alone reaches the step hooks; ZeRO's inner one
    holds this rank's share of the parameters alone."""
    from torch.distributed.optim import PostLocalSGDOptimizer, ZeroRedundancyOptimizer

    frame = sys._getframe(2)
    for _ in range(16):
        if frame is None:
            return None
        held = frame.f_locals.get("self")
        if isinstance(held, (PostLocalSGDOptimizer, ZeroRedundancyOptimizer)) and held.optim is optimizer:
            return type(held).__name__
        frame = frame.f_back
    return None


def _refuse_spreading(optimizer: torch.optim.Optimizer) -> None:
    """Raise where torch's ZeroRedundancyOptimizer holds pieces of sharded parameters (found by a probe: the loss
    rose, 0.95 -> 1.20, where one device's fell to 0.86, and the parameters ended 0.67 off), or PostLocalSGDOptimizer
    averages them (found by a probe: 0.33 off, silently): what one rank stepped overwrites or is mixed into another
    rank's part of the parameter."""
    cut = [fqn for fqn, _ in _cut(optimizer)]
    if not cut or (wrapper := _spreading_wrapper(optimizer)) is None:
        return
    does, way_out = _SPREADING[wrapper]
    raise SpmdError(
        f"{wrapper} steps pieces of sharded parameters ({_listed(cut)}): {does}. What to do: {way_out}; or compile "
        f'with those parameters replicated (param_placements={{"{cut[0]}": [Replicate()] * mesh.ndim, ...}}).')


def _not_per_element(optimizer: torch.optim.Optimizer) -> None:
    """Raise (torch's optimizers that read more than each element) or warn (one spmd cannot read) where
    `optimizer` steps pieces of sharded parameters."""
    cut = _cut(optimizer)
    if not cut:
        return
    kind, name = _torch_kind(optimizer), type(optimizer).__name__
    if kind in PER_ELEMENT:
        wrapper = _wrapper(optimizer)
        if wrapper is None:
            _hooks_see_pieces(optimizer, name, cut)
            return
        kind, name = None, f"{wrapper} (around {name})"
    if kind in WHOLE:
        reads, least = WHOLE[kind]
        cut = [(fqn, p) for fqn, p in cut if p.ndim >= least]
        if not cut:
            return
    shown = _listed([fqn for fqn, _ in cut])
    pin = f'param_placements={{"{cut[0][0]}": [Replicate()] * mesh.ndim, ...}}'
    if kind in WHOLE:
        raise SpmdError(
            f"{name} steps this rank's pieces of sharded parameters ({shown}), and its update reads {reads}: "
            "each rank would compute it from its piece alone, and the parameters would train otherwise than on "
            f"one device, silently. What to do: compile with those parameters replicated ({pin}: each rank then "
            "holds and steps them whole), or train them with an optimizer whose update is per element (AdamW, SGD, "
            "...), e.g. in a second optimizer over them.")
    warnings.warn(
        f"{name} steps this rank's pieces of sharded parameters ({shown}), and spmd cannot tell whether its "
        "update of an element reads only that element's gradient and state (as AdamW's and SGD's do). One that "
        "reads more (factored moments as Adafactor's, orthogonalization as Muon's or Shampoo's, norms per tensor "
        "as LAMB's or LARS's, a norm over all the gradients as SAM's, state quantized in blocks as 8-bit Adam's) "
        "would compute each rank's update from its piece alone, and train otherwise than on one device. What to "
        f"do: if it does, compile with those parameters replicated ({pin}), or compute what it reads whole (the "
        "gradients' norm is `compiled.grad_norm()`); if its update is per element, nothing (filter this "
        "warning).",
        stacklevel=4)


def _wrapper(optimizer: torch.optim.Optimizer) -> str | None:
    """The name of an optimizer from elsewhere whose code is stepping `optimizer` (a torch optimizer) over the
    same parameters, found on the stack above the step: SAM (davda54/sam) perturbs the weights by the norm of all
    the gradients in its own `first_step` and steps its base optimizer (SGD) in `second_step`, so neither its
    math nor a `step` of its own reaches the step hooks (found by a probe: each rank took the norm of its own
    pieces, 2.21 and 1.81 against one device's 2.76, and the weights ended 0.114 off, without a word)."""
    mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
    frame, found = sys._getframe(3), None
    for _ in range(24):
        if frame is None:
            break
        held = frame.f_locals.get("self")
        if isinstance(held, torch.optim.Optimizer) and held is not optimizer and \
                not type(held).__module__.startswith("torch.") and \
                any(id(p) in mine for group in held.param_groups for p in group["params"]):
            if frame.f_code.co_name == "step":
                # its own step, which passes the step on (accelerate's AcceleratedOptimizer, timm's Lookahead,
                # Lightning's optimizer: named falsely by a review) or is checked itself (SAM's step(closure))
                return None
            found = found or type(held).__name__
        frame = frame.f_back
    return found


def _hooks_see_pieces(optimizer: torch.optim.Optimizer, name: str, cut: list) -> None:
    """Warn where a per-element optimizer stepping pieces has step hooks of its own: they see this rank's pieces
    (found by a probe: a LARS trust ratio, `p.norm() / p.grad.norm()` in a step pre-hook, 1.6e-3 to 7.7e-3 off,
    silently)."""
    hooks = [h for table in step_hooks(optimizer) for h in table.values()]
    if not hooks:
        return
    warnings.warn(
        f"{name} steps this rank's pieces of sharded parameters ({_listed([fqn for fqn, _ in cut])}), and has {len(hooks)} step hook(s) "
        f"({', '.join(getattr(h, '__qualname__', type(h).__name__) for h in hooks[:3])}): they see the pieces, not "
        "the whole parameters. One that reads more than each element (a LARS trust ratio from `p.norm()`, a "
        "norm or clip per tensor) computes it from this rank's piece alone, and the model trains otherwise than on "
        "one device. What to do: if one does, compute it with the compiled module's whole-parameter tools "
        "(`compiled.grad_norm`, `compiled.clip_grad_norm_`) or compile with those parameters replicated "
        f'(param_placements={{"{cut[0][0]}": [Replicate()] * mesh.ndim, ...}}); if none does, nothing (filter '
        "this warning).", stacklevel=5)


def state_factor(optimizer: torch.optim.Optimizer) -> float | None:
    """Parameter sizes of state one of torch's optimizers keeps per parameter, as its first param group's
    options make it (None: an optimizer this does not know, or one whose state is not per element)."""
    g = optimizer.param_groups[0] if optimizer.param_groups else {}
    if type(optimizer).__module__.split(".")[:2] != ["torch", "optim"]:
        return None  # a subclass or wrapper may keep anything (master weights, factored moments)
    name = type(optimizer).__name__
    if name == "SGD":
        return 1.0 if g.get("momentum", 0) else 0.0
    if name in ("Adam", "AdamW"):
        return 3.0 if g.get("amsgrad") else 2.0
    if name in ("Adamax", "NAdam", "RAdam", "Adadelta", "Rprop", "SparseAdam"):
        return 2.0
    if name in ("Adagrad", "ASGD"):
        return 1.0
    if name == "RMSprop":
        return 1.0 + bool(g.get("momentum", 0)) + bool(g.get("centered"))
    return None


def _planned(optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, float]]:
    """The compiled training modules' parameters `optimizer` steps, each with its plan's state factor."""
    return [(p, entry[1]) for p, entry in _planned_entries(optimizer)]


def _plain_gradients_agree(optimizer: torch.optim.Optimizer) -> None:
    """Warn where the plain parameters an optimizer steps beside a compiled module's (an eager head, a learnable
    temperature) have gradients that differ between the module's ranks: they were computed on each rank's piece of
    a split output, so each holds its own piece's part where one device's holds the whole batch's, and the
    replicas drift apart (found by a probe: a head on the output piece 0.083 off one device after 3 steps, its
    replicas 0.23 apart, the backbone 2e-3 off, without a word; a layer between two compiled modules is caught at
    the second's call). Small all_reduces per mesh axis at the first step: of what the plain parameters are (their
    count and shapes, in order), then, where every rank holds the same, of each gradient's sum of squares. A first
    step given a closure (LBFGS's) is checked after it: the closure makes the gradients inside the step.

    Every rank of the mesh takes part where its optimizer holds the same (SPMD code builds it alike); one whose first
    step comes on another iteration (GradScaler skipping it on one rank alone, `add_param_group` on one rank) meets
    its peers apart, as the compiled module's own first-call checks would at its next call."""
    if optimizer in _plain_checked:
        return
    _plain_checked.add(optimizer)
    entries = _planned_entries(optimizer)
    mine = {entry[2] for _, entry in entries}
    if len(mine) != 1:  # (no compiled module, or modules on several meshes: no one set of ranks to compare over)
        return
    group_names, shape, device = mine.pop()
    # (ZeroRedundancyOptimizer's inner optimizer holds this rank's share alone, other on every rank, and the wrapper
    # is checked itself: a review found ranks apart in the collective, a hang)
    if not group_names or all(n == 1 for n in shape) or _stepped_inside(optimizer) == "ZeroRedundancyOptimizer":
        return
    steps = {id(p) for p, _ in entries}
    # (whether to take part depends on what every rank's optimizer holds alike, never on which gradients came)
    plain = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in steps]
    if not plain:
        return
    device = device or torch.device("cpu")
    # the same parameters on every rank, in the same order (a set made into a list orders them per process)
    signature = torch.tensor([len(plain), hash(tuple(tuple(p.shape) for p in plain)) % (1 << 50)],
                             dtype=torch.float64, device=device)
    most, least = extremes_over_mesh(signature, shape, group_names)
    if not torch.equal(most, least):
        return
    zero = torch.zeros((), dtype=torch.float64, device=device)
    # (the norm in the gradient's own dtype, then widened: real for complex gradients, and no float64 copy)
    norms = torch.stack([zero if p.grad is None or p.grad.is_sparse else
                         torch.linalg.vector_norm(p.grad.detach()).double().square().to(device) for p in plain])
    most, least = extremes_over_mesh(norms, shape, group_names)
    apart = [p for p, hi, lo in zip(plain, most.tolist(), least.tolist()) if hi - lo > 1e-6 * hi]
    if apart:
        said = ", ".join(str(tuple(p.shape)) for p in apart[:4]) + (", ..." if len(apart) > 4 else "")
        warnings.warn(
            f"{type(optimizer).__name__}.step(): {len(apart)} plain parameter(s) beside the compiled module's (shapes "
            f"{said}) have gradients that differ between its ranks: they were computed on each rank's piece of a "
            "split output, so each rank's holds its own piece's part alone, where one device's come from the whole "
            "batch, and their replicas drift apart. What to do: run such layers on whole tensors "
            "(`compiled.gather_outputs(out)`), or compile them with the module (a loss_fn). Summing their gradients "
            "over the mesh axes the output is split on (`torch.distributed.all_reduce(p.grad, "
            "group=mesh.get_group(axis))`) equals one device only where each rank's loss is its piece's part of the "
            "batch's (a sum over the piece divided by the whole batch's count, not the piece's mean).",
            stacklevel=user_stacklevel())


def _after_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if optimizer in _plain_after:
        _plain_after.discard(optimizer)
        _plain_gradients_agree(optimizer)


def _planned_entries(optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, tuple]]:
    """The compiled training modules' parameters `optimizer` steps, each with its `expect` entry."""
    return [(p, entry) for group in optimizer.param_groups for p in group["params"]
            if (entry := _expected.get(id(p))) is not None and entry[0]() is p]


def _state_shapes(optimizer: torch.optim.Optimizer) -> bool:
    """Raise where a per-element torch optimizer over compiled pieces holds state of another shape than its piece:
    a single-device optimizer's `state_dict()` (or another plan's) loaded with `optimizer.load_state_dict`, which
    takes it as it is, and the step then fails on a shape that names nothing. Whether it steps compiled pieces."""
    pieces = [p for p, _ in _planned(optimizer)]
    if not pieces or _torch_kind(optimizer) not in PER_ELEMENT:  # (other optimizers' state may be shaped otherwise)
        return bool(pieces)
    for p in pieces:
        for key, value in optimizer.state.get(p, {}).items():
            if hasattr(value, "to_local"):  # (DTensors replicated everywhere failed in torch at the step: "mixed
                _checked.pop(optimizer, None)  # torch.Tensor and DTensor"; a probe)
                raise SpmdError(
                    f"{type(optimizer).__name__} holds DTensors as state (its {key!r}): `compiled.optimizer_state_dict"
                    "(optimizer)`'s form, loaded with `optimizer.load_state_dict` (or torch's "
                    "`set_optimizer_state_dict`), which keeps each value as it is, where the optimizer steps plain "
                    "pieces. What to do: load it with `compiled.load_optimizer_state_dict(optimizer, state)`, which "
                    "gives each rank its pieces.")
            if isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape != p.shape:
                _checked.pop(optimizer, None)  # (its next step asks again: the state stays loaded)
                raise SpmdError(
                    f"{type(optimizer).__name__} holds state of another shape than the compiled module's pieces (its "
                    f"{key!r} is {tuple(value.shape)}, the piece {tuple(p.shape)}): a single-device optimizer's "
                    "state_dict() (or one saved on another mesh or plan), loaded with `optimizer.load_state_dict` (or "
                    "torch's `set_optimizer_state_dict`), which takes each tensor as it is. What to do: load it with `compiled.load_optimizer_state_dict("
                    "optimizer, state)`, which gives each rank its pieces, from the state under the model's names "
                    "(`torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(model, single_device_optimizer)`"
                    ", or `compiled.optimizer_state_dict(optimizer)` as saved).")
    return True


def _count(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """What a step is checked again for: the parameters, and the step hooks of the optimizer's own."""
    return sum(len(group["params"]) for group in optimizer.param_groups), sum(map(len, step_hooks(optimizer)))


# an optimizer with no state -> the state `optimizer_state_dict` made up for it (its tensors and their versions then)
_made_up: "weakref.WeakKeyDictionary[torch.optim.Optimizer, list]" = weakref.WeakKeyDictionary()


def made_up(optimizer: torch.optim.Optimizer, tensors: list[torch.Tensor]) -> None:
    """`compiled.optimizer_state_dict(optimizer)` gave state made up for an optimizer that has none (`tensors`):
    written before the optimizer's first step (torch.distributed.checkpoint loading into it in place) and not
    loaded into the optimizer, its step raises (`_refuse_unloaded`)."""
    with _lock:
        _made_up[optimizer] = [(t, t._version) for t in tensors]
        _install()


def made_up_ids(optimizer: torch.optim.Optimizer) -> frozenset:
    """The ids of the tensors of the state `optimizer_state_dict` made up for `optimizer`, no load having taken
    it yet. (Only its own: another optimizer's made-up state, loaded into this one and kept, would be that
    one's too once loaded there, and both would step the same moments; a review.)"""
    with _lock:
        return frozenset(id(t) for t, _ in _made_up.get(optimizer, ()))


def forget_made_up(optimizer: torch.optim.Optimizer) -> None:
    """`optimizer` was loaded: the state made up for it is no longer watched, nor kept alive here (a memory probe:
    held until the first step, it was a second copy of the optimizer's state beside the loaded one)."""
    with _lock:
        _made_up.pop(optimizer, None)


def refuse_unwritten(named: dict) -> None:
    """Raise where `named` (given to `load_optimizer_state_dict`) is state `optimizer_state_dict` made up for an
    optimizer that had none, and nothing was written into it since: a load before `dcp.load` filled it took
    the made-up state (AdamW's step 1), and the checkpoint's moments reached the optimizer only through the
    memory they share, its steps and rates never (found by a probe: 2.35 where the run resumed at 2.27)."""
    tensors = [getattr(v, "_local_tensor", v) for entries in named.get("state", {}).values()
               if isinstance(entries, dict) for v in entries.values() if isinstance(v, torch.Tensor)]
    with _lock:
        made = {id(t): v for records in _made_up.values() for t, v in records}
    if tensors and all(id(t) in made and t._version == made[id(t)] for t in tensors):
        raise SpmdError(
            "load_optimizer_state_dict: this is the state `compiled.optimizer_state_dict(optimizer)` made up for an "
            "optimizer that had none (a fresh one's: AdamW's step 1, zero moments), and nothing was loaded into it "
            "since: the optimizer would resume from it, not from the checkpoint. What to do: load the checkpoint "
            "into the dict first (`dcp.load({..., 'optim': state}, ...)`), then "
            "`compiled.load_optimizer_state_dict(optimizer, state)`.")


def _refuse_unloaded(optimizer: torch.optim.Optimizer) -> None:
    """FSDP2's way, `dcp.load({"optim": get_optimizer_state_dict(...)})`, fills the optimizer's own state in place;
    spmd's `optimizer_state_dict` of a fresh optimizer is made up beside it (a step at rate 0 would change the
    first real step's), so the same load alone left the optimizer fresh: moments of zero, 0.034 off eager's
    resume after 2 steps, silently (found by a probe)."""
    made = _made_up.pop(optimizer, None)
    if made and not optimizer.state and any(t._version != v for t, v in made):
        _made_up[optimizer] = made  # (refused again at the next step, until loaded)
        raise SpmdError(
            f"{type(optimizer).__name__}.step(): the state `compiled.optimizer_state_dict(optimizer)` gave for this "
            "optimizer, which had none, was written since (torch.distributed.checkpoint loaded a checkpoint into "
            "it), but never loaded into the optimizer, which would start from fresh state instead of the "
            "checkpoint's. What to do: after dcp.load, `compiled.load_optimizer_state_dict(optimizer, state)` with "
            "the loaded dict (`state['optim']`).")


def _check(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if _made_up:
        _refuse_unloaded(optimizer)
    if (before := _checked.get(optimizer)) == _count(optimizer):
        return
    if before is None:
        _refuse_read_outside(optimizer)
    stale = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = _watched.get(id(p))
            if entry is not None and entry[0]() is p:
                stale.append(entry)
    if stale:
        names = ", ".join(fqn for _, fqn, *_ in stale[:5]) + (f" and {len(stale) - 5} more" if len(stale) > 5 else "")
        raise SpmdError(
            f"{type(optimizer).__name__} steps {len(stale)} parameter(s) of the original {stale[0][2]} ({names}), "
            "which the compiled module does not use: they never get a gradient, so training would change "
            "nothing. What to do: build the optimizer over the compiled module's parameters, "
            f"`{type(optimizer).__name__}(compiled.parameters(), ...)` (each rank's shards).")
    _refuse_spreading(optimizer)
    _not_per_element(optimizer)
    if before is None:  # (a closure computes the gradients inside the step: LBFGS's; compared after it)
        closure = kwargs.get("closure", args[0] if args else None)
        if closure is not None:
            _plain_after.add(optimizer)
        else:
            _plain_gradients_agree(optimizer)
    _refuse_saved_elsewhere(optimizer)
    if _state_shapes(optimizer) and optimizer not in _loads_watched:  # (and again after each later load into it)
        optimizer.register_load_state_dict_post_hook(_state_shapes)
        optimizer.register_load_state_dict_post_hook(_refuse_saved_elsewhere)
        optimizer.register_state_dict_post_hook(_stamp)
        _loads_watched.add(optimizer)
    _checked[optimizer] = _count(optimizer)  # (once it passed: a refused step taken again is refused again)
    planned = {factor for _, factor in _planned(optimizer)}
    keeps = state_factor(optimizer) if planned else None
    if before is None and keeps is not None and any(abs(f - keeps) > 1e-9 for f in planned):
        f = max(planned, key=lambda f: abs(f - keeps))
        warnings.warn(
            f"{type(optimizer).__name__} keeps {keeps:g} parameter size(s) of state per parameter, but the compiled "
            f"module was planned for optimizer_state_factor={f:g} (AdamW's 2 by default): its predicted memory "
            "counts the wrong optimizer state, and the optimizer's step is priced as another optimizer's, so the "
            "plan may not be the best for this one. What to do: compile with "
            f"`spmd.compile(..., optimizer_state_factor={keeps:g})`.", stacklevel=user_stacklevel())
