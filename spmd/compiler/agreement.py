"""What every rank must agree on before the first collective: a summary of what it compiled, and, when
ranks differ, the first difference in words.

    summarize(...)     category -> value: the mesh, the options and pins, the user inputs (names, shapes,
                       dtypes), the parameters and buffers (names, shapes, dtypes), the traced graph (each
                       op with the numbers it takes and its output shapes, in order), the versions of
                       torch and Python (machines set up apart: the same graph may run other kernels)
    digest(summary)    category -> a short hash: what ranks exchange first (a few hundred bytes)
    differences(...)   from every rank's summary of the categories whose hashes differ: one line per
                       category naming the ranks that differ from rank 0 and the first difference
                       ("parameters: rank 1 differs from rank 0; rank 1 has 38, rank 0 has 26; only on
                       rank 1: layers.2.* (12)")

Ranks that compiled different things would otherwise exchange mismatched collectives (a hang, or gloo
aborting the process) or, worse, line up and compute a silently wrong result.
"""
from __future__ import annotations

import hashlib
import platform
import re
from collections import Counter

import torch

from spmd.core.graph_facts import layer_of, op_label
from spmd.core.specs import TensorInfo, placements_str

# PlanOptions fields that change the plan (dump_dir and verify only change what is written or checked)
_PLAN_FIELDS = ("loss_fn", "training", "memory_budget", "optimizer_state_factor", "tie_blocks", "merge_followers",
                "stamp_layers", "bucket_bytes", "defer_waits", "plan")


def _pins_text(pins) -> list[str]:
    out = []
    for book, table in (("input", pins.inputs), ("parameter", pins.params), ("output", pins.outputs)):
        for key in sorted(table, key=str):
            value = table[key]
            text = placements_str(tuple(value)) if isinstance(value, (list, tuple)) else repr(value)
            out.append(f"{book} {key}: {text}")
    return out


def summarize(traced, mesh, options) -> dict[str, list[str]]:
    info = traced.tensor_info
    options_text = []
    for f in _PLAN_FIELDS:
        value = getattr(options, f)
        if f == "loss_fn" and value is not None:
            value = getattr(value, "__qualname__", type(value).__name__)
        elif f == "plan" and value is not None:  # (a given plan: the same one on every rank)
            value = value.fingerprint()
        options_text.append(f"{f}={value}")
    return {
        "mesh": [f"{name}={size}" for name, size in zip(mesh.axis_names, mesh.shape)],
        "options": options_text,
        "pins": _pins_text(options.pins),
        "inputs": [f"{gi.name}: {_shape(info.get(gi.placeholder))}" for gi in traced.inputs if gi.kind == "input"],
        "parameters": [f"{gi.name}: {_shape(info.get(gi.placeholder))}" for gi in traced.inputs
                       if gi.kind in ("parameter", "buffer", "constant")],
        "graph": graph_lines(traced, wiring=True),
        "versions": [f"torch {torch.__version__}", f"python {platform.python_version()}"],
        # (not compared: what explains a graph wired apart, `differences`)
        "_string_hashes": [str(hash("spmd: the order of a set of strings"))],
    }


def graph_lines(traced, wiring: bool = False) -> list[str]:
    """Each op of the traced graph with the numbers it takes and its output shape, in order; `wiring`: and the
    values it reads. (Ranks whose forward iterates a set of strings, in an order each process's hash seed picks,
    traced the same ops wired apart: transformers' Gemma3 and ModernBERT loop over `set(config.layer_types)`. Rank
    0's plan, which names values, then fed another rank's ops other values: ModernBERT trained 0.5 off one
    device, with no error; found by a probe.)"""
    info, graph = traced.tensor_info, []
    for n in traced.graph.nodes:
        if n.op == "call_function":
            i = info.get(n.name)
            text = f"{list(i.shape)} {str(i.dtype).replace('torch.', '')}" if isinstance(i, TensorInfo) else "tuple"
            reads = f" of {', '.join(a.name for a in n.all_input_nodes)}" if wiring and n.all_input_nodes else ""
            graph.append(f"{op_label(n)}{_constants(n)}{reads} -> {text}")
    return graph


def graph_digest(traced, wiring: bool = False) -> str:
    """A short hash of `graph_lines`: two plans of graphs that differ (another number of heads, causal or not)
    have other digests (the plan diff's check; found by a probe). `wiring`: and of the values each op reads
    (`x * 2 + y` against `y * 2 + x`, which a plan given to compile must tell apart) and of each placeholder's
    name, shape and dtype."""
    lines = graph_lines(traced, wiring)
    if wiring:  # (and each input's shape: `x + b` with b of [8] or of [1] makes the same ops of the same outputs)
        lines = [f"{n.name}: {_shape(traced.tensor_info.get(n.name))}" for n in traced.graph.nodes
                 if n.op == "placeholder"] + lines
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def placeholder_shapes(traced) -> dict[str, str]:
    """Each input's, parameter's and buffer's shape and dtype by its name ("tokens": "[4, 8] int64"): what a plan
    given to compile names where this trace's differ (a wider model, another batch)."""
    return {gi.name: _shape(traced.tensor_info.get(gi.placeholder)) for gi in traced.inputs if gi.kind != "tangent"}


def _shape(info) -> str:
    return f"{list(info.shape)} {str(info.dtype).replace('torch.', '')}" if isinstance(info, TensorInfo) else "-"


def _constants(node) -> str:
    """The numbers an op takes, as its arguments list them ("(0.1, -100)"): a constant the forward or the loss
    computed from the rank (`label_smoothing=0.1 * (rank + 1)`) is another graph (found by a probe: each rank
    trained with its own, and their gradients mixed). Devices are left out (each rank names its own)."""
    found = []

    def visit(a):
        if isinstance(a, (list, tuple)):
            for x in a:
                visit(x)
        elif isinstance(a, (bool, int, float)) or a is None:  # (not strings: a profiler's label names its rank)
            found.append(repr(a))
        elif isinstance(a, torch.dtype):
            found.append(str(a).replace("torch.", ""))

    visit(node.args)
    visit([v for k, v in sorted(node.kwargs.items()) if k != "device"])
    return f"({', '.join(found)})" if found else ""


def digest(summary: dict[str, list[str]]) -> dict[str, str]:
    """The compared categories' hashes (not those whose names start with "_": what explains a difference)."""
    return {k: hashlib.sha256("\n".join(v).encode()).hexdigest()[:16] for k, v in summary.items()
            if not k.startswith("_")}


def _names(lines: list[str]) -> dict[str, str]:
    return dict(line.split(": ", 1) for line in lines if ": " in line)


def _grouped(names: list[str]) -> str:
    """"layers.2.* (12)" for names that share a layer, the names themselves otherwise."""
    counts = Counter(f"{layer_of(n)}.*" if layer_of(n) else n for n in names)
    return ", ".join(f"{k} ({c})" if c > 1 else k for k, c in sorted(counts.items()))


def _first_difference(category: str, mine: list[str], theirs: list[str], rank: int) -> str:
    """How rank `rank`'s `mine` differs from rank 0's `theirs`, in one line."""
    if category in ("parameters", "inputs"):
        a, b = _names(mine), _names(theirs)
        only_mine = [n for n in a if n not in b]
        only_theirs = [n for n in b if n not in a]
        parts = []
        if len(a) != len(b):
            parts.append(f"rank {rank} has {len(a)}, rank 0 has {len(b)}")
        if only_mine:
            parts.append(f"only on rank {rank}: {_grouped(only_mine)}")
        if only_theirs:
            parts.append(f"only on rank 0: {_grouped(only_theirs)}")
        changed = [n for n in a if n in b and a[n] != b[n]]
        if changed:
            n = changed[0]
            parts.append(f"{n} is {a[n]} on rank {rank}, {b[n]} on rank 0" +
                         (f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""))
        return "; ".join(parts)
    if category == "graph" and len(mine) != len(theirs):
        prefix = f"rank {rank} traced {len(mine)} ops, rank 0 {len(theirs)}"
    else:
        prefix = ""
    for i, (x, y) in enumerate(zip(mine, theirs)):
        if x != y:
            where = f"op {i}: " if category == "graph" else ""
            return "; ".join(p for p in (prefix, f"{where}{x!r} on rank {rank}, {y!r} on rank 0") if p)
    extra = mine[len(theirs):] or theirs[len(mine):]
    return prefix or f"rank {rank} {'adds' if len(mine) > len(theirs) else 'lacks'} {extra[0]!r}"


def _unwired(lines: list[str]) -> list[str]:
    """`graph_lines(wiring=True)` without the values each op reads."""
    return [re.sub(r" of [\w, ]+(?= -> )", "", line) for line in lines]


def differences(digests: list[dict[str, str]], summaries: dict[int, dict[str, list[str]]]) -> list[str]:
    """One line per category where some rank differs from rank 0 (`summaries`: the full summaries of the
    ranks that differ, and of rank 0)."""
    lines = []
    for category in digests[0]:
        odd = [r for r, d in enumerate(digests) if d.get(category) != digests[0].get(category)]
        if not odd:
            continue
        detail = _first_difference(category, summaries[odd[0]][category], summaries[0][category], odd[0])
        ranks = f"rank {odd[0]} differs" if len(odd) == 1 else f"ranks {odd} differ"
        if category == "graph" and _unwired(summaries[odd[0]][category]) == _unwired(summaries[0][category]):
            hashes = [summaries[r].get("_string_hashes") for r in (0, odd[0])]
            detail += "; the same ops, wired apart"
            if hashes[0] != hashes[1]:
                detail += (f". Rank {odd[0]} hashes strings unlike rank 0 (each process draws its own hash seed, as "
                           "torchrun starts them), so a forward that iterates a set of strings (transformers' "
                           "`set(config.layer_types)` in Gemma3 or ModernBERT) traces its ops in another order. What "
                           "to do: start every rank with the same PYTHONHASHSEED (`PYTHONHASHSEED=0 torchrun ...`)")
        lines.append(f"{category}: {ranks} from rank 0; {detail}")
    return lines


def weights_summary(state: dict) -> list[str]:
    """One checksum line per parameter and buffer of a model every rank built for real: what ranks that
    each use their own copy (src_data_rank=None) must agree on."""
    import torch

    out = []
    chunk = 1 << 22
    for name, t in state.items():
        flat = t.detach().reshape(-1)
        total = weighted = 0.0
        for start in range(0, flat.numel(), chunk):  # a chunk at a time: no float64 copy of a big tensor
            part = flat[start:start + chunk].to(torch.float64)
            # the sum, and a sum weighted by position (so permuted values differ too)
            weights = torch.arange(start, start + part.numel(), dtype=torch.float64).remainder_(97).add_(1)
            total += float(part.sum())
            weighted += float((part * weights).sum())
        out.append(f"{name}: {total:.17g} {weighted:.17g}")
    return out

