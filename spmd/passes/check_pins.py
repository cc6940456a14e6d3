"""check_pins: the user's pins, validated whole and normalized, before any strategy is enumerated.

Before: `Pins` as the user wrote them (in_placements by input name, param_placements by parameter or
buffer FQN, out_placements by output index), and the traced graph they refer to. After: `Pins` whose
every key names an input, a parameter/buffer (a tied parameter's extra name becomes its canonical one)
or an output, and whose every value is a tuple of one DTensor placement per mesh axis with `Shard(-k)`
made `Shard(ndim - k)`; or one `SpmdError` listing every problem, each with the way out. Whether a pin
divides evenly is checked later, against the strategies (enumerate_strategies).
"""
from __future__ import annotations

import difflib
import re
from collections.abc import Mapping

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from spmd.core.errors import SpmdError
from spmd.core.specs import Pins, TensorInfo, placements_str


def check_pins(pins: Pins, traced, mesh) -> Pins:
    problems: list[str] = []
    inputs = {gi.name: gi for gi in traced.inputs if gi.kind == "input"}
    state = {gi.name: gi for gi in traced.inputs if gi.kind in ("parameter", "buffer", "constant")}
    aliases = {a: c for a, c in traced.aliases.items() if c in state}
    outputs = [k for k, o in enumerate(traced.output_kinds()) if o.kind == "output"]
    known = list(inputs) + list(state) + list(aliases)

    def unknown(name, book: str) -> str:
        if not isinstance(name, str):
            return f"{book} key {name!r} is not a name. What to do: key pins by name (a string)."
        if book == "param_placements" and name in inputs:
            return f"{name!r} is an input, not a parameter. What to do: pin it with in_placements."
        if book == "in_placements" and (name in state or name in aliases):
            return f"{name!r} is a parameter, not an input. What to do: pin it with param_placements."
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
        hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
        shown = ", ".join(known[:12]) + (f", ... ({len(known)} in all)" if len(known) > 12 else "")
        return f"{book} names {name!r}, which is not an input or parameter of the model.{hint} Known names " \
               f"(inputs first): {shown}"

    def placements(value, what: str, info: TensorInfo | None, whole: bool):
        """The pin as a tuple of placements, or None after recording what is wrong with it."""
        if isinstance(value, Placement):
            problems.append(f"the pin for {what} is a single placement {_code(value)}; a pin has one placement per "
                            f"mesh axis. What to do: write a list, e.g. [{_code(value)}]" +
                            (f" + [Replicate()] * {mesh.ndim - 1}" if mesh.ndim > 1 else "") + ".")
            return None
        if isinstance(value, str) or not hasattr(value, "__iter__"):
            problems.append(f"the pin for {what} is {value!r}, not a list of placements. What to do: write one "
                            f"Shard(d) / Replicate() per mesh axis, e.g. [Shard(0)]" +
                            (f" + [Replicate()] * {mesh.ndim - 1}" if mesh.ndim > 1 else "") + ".")
            return None
        ps = list(value)
        if len(ps) != mesh.ndim:
            problems.append(f"the pin for {what} has {len(ps)} placements but the mesh {mesh} has {mesh.ndim} axes. "
                            "What to do: give one placement per mesh axis.")
            return None
        ndim = len(info.shape) if info is not None else None
        for i, p in enumerate(ps):
            if isinstance(p, str):
                meant = _from_text(p)
                problems.append(f"the pin for {what} holds the text {p!r} on axis {mesh.axis_names[i]}, not a "
                                "placement. What to do: use torch.distributed.tensor's " +
                                (f"{meant} there." if meant else "Shard(d), Replicate() or Partial()."))
                return None
            if not isinstance(p, (Shard, Replicate, Partial)):
                problems.append(f"the pin for {what} holds {p!r} on axis {mesh.axis_names[i]}, which is not a "
                                "placement. What to do: use Shard(d), Replicate() or Partial().")
                return None
            if isinstance(p, Partial) and whole:
                problems.append(f"the pin for {what} is Partial on axis {mesh.axis_names[i]}: an input or parameter "
                                "is a whole tensor held by each rank, not a sum still to be reduced. What to do: pin "
                                "Shard(d) or Replicate().")
                return None
            if isinstance(p, Partial) and not whole:
                problems.append(f"the pin for {what} is Partial on axis {mesh.axis_names[i]}: outputs are delivered "
                                "reduced. What to do: pin Shard(d) or Replicate().")
                return None
            if isinstance(p, Shard) and ndim is not None:
                d = p.dim + ndim if p.dim < 0 else p.dim
                if not 0 <= d < ndim:
                    problems.append(f"the pin for {what} is {p} on axis {mesh.axis_names[i]}, but it is a "
                                    f"{ndim}-D tensor of shape {tuple(info.shape)}. What to do: "
                                    + (f"shard a dim in 0..{ndim - 1} (or -{ndim}..-1)." if ndim else
                                       "pin it Replicate() (a scalar has no dim to shard; found by a probe)."))
                    return None
                ps[i] = Shard(d)
        return tuple(ps)

    def book_of(mapping, name: str):
        if mapping is None:
            return {}
        if not isinstance(mapping, Mapping):
            problems.append(f"{name} must be a dict from name to placements, got {type(mapping).__name__}.")
            return {}
        return mapping

    new_inputs, new_params, new_outputs = {}, {}, {}
    info = traced.tensor_info
    for name, value in book_of(pins.inputs, "in_placements").items():
        if name not in inputs:
            problems.append(unknown(name, "in_placements"))
        elif (ps := placements(value, f"input {name!r}", info.get(inputs[name].placeholder), True)) is not None:
            new_inputs[name] = ps
    for name, value in book_of(pins.params, "param_placements").items():
        canonical = aliases.get(name, name) if isinstance(name, str) else name
        if canonical not in state:
            problems.append(unknown(name, "param_placements"))
            continue
        ps = placements(value, f"parameter {name!r}", info.get(state[canonical].placeholder), True)
        if ps is None:
            continue
        if canonical in new_params and new_params[canonical] != ps:
            problems.append(f"{name!r} and {canonical!r} are one tied parameter pinned two ways "
                            f"({placements_str(ps)} and {placements_str(new_params[canonical])}). What to do: pin it once.")
        new_params[canonical] = ps
    flat = list(traced.graph.output_node().args[0]) if isinstance(traced.graph.output_node().args[0], (tuple, list)) \
        else [traced.graph.output_node().args[0]]
    for key, value in book_of(pins.outputs, "out_placements").items():
        if not isinstance(key, int) or isinstance(key, bool) or key not in outputs:
            problems.append(f"out_placements names output {key!r}, but the model's outputs are numbered "
                            f"{outputs} (flattened, in the order the model returns them). What to do: key by that "
                            "index, or pass a list with one entry per output.")
            continue
        node = flat[key]
        ps = placements(value, f"output {key}", info.get(getattr(node, "name", None)), False)
        if ps is not None:
            new_outputs[key] = ps
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise SpmdError(f"{len(problems)} problem{'s' if len(problems) > 1 else ''} with the pins:\n{lines}")
    return Pins(new_inputs, new_params, new_outputs)


def _code(p: Placement) -> str:
    """How the placement is written in code: Shard(0), Replicate(), Partial()."""
    if isinstance(p, Shard):
        return f"Shard({p.dim})"
    if isinstance(p, Partial):
        return "Partial()" if p.reduce_op == "sum" else f"Partial({p.reduce_op!r})"
    return "Replicate()" if isinstance(p, Replicate) else repr(p)


def _from_text(text: str) -> str | None:
    """The code for a placement written as text ("S(0)", "Shard(1)", "R", "P"), or None."""
    m = re.fullmatch(r"\s*(?:S|Shard)\((-?\d+)\)\s*", text)
    if m:
        return f"Shard({m.group(1)})"
    if text.strip() in ("R", "Replicate", "Replicate()"):
        return "Replicate()"
    if text.strip() in ("P", "Partial", "Partial()", "P(sum)"):
        return "Partial()"
    return None
