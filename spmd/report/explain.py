"""`plan.explain()` in words (also `compiled.explain()`, `spmd explain plan.json`): three tables.

    modules      how each parameterized module is laid out per mesh axis, in Megatron/FSDP words
                 ("blocks.*.attn.q_proj  Linear  column-parallel on tp; replicated on dp")
    collectives  count, bytes and estimated seconds per (collective kind, mesh axis)
    nodes        every costed node: chosen placements, its compute / communication / memory, the best
                 other strategy with the rest of the plan held fixed, and why that one lost

The rows come from `report/details.py`.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

from spmd.core.graph_facts import any_layer, format_bytes, format_seconds
from spmd.cost_model.comm import bucketed_latency, step_cost
from spmd.report.details import ParamUse, PlanDetails


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [(indent + "  ".join(c.ljust(w) for c, w in zip(r, widths))).rstrip() for r in rows]


def describe_roles(roles: tuple[str, ...], axis_names) -> str:
    """"column-parallel on tp; replicated on dp" (tensor parallelism first)."""
    if all(r == "replicated" for r in roles):
        return "replicated"
    order = sorted(range(len(roles)), key=lambda i: roles[i] == "replicated")
    return "; ".join(f"{roles[i]} on {axis_names[i]}" for i in order)


def module_summary(details: PlanDetails, axis_names) -> list[tuple[str, str, str]]:
    """(module pattern, type, description) per parameterized module; repeated blocks described alike
    fold into one line with `*` for the block index."""
    by_module: dict[str, list[ParamUse]] = {}
    for p in details.params:
        by_module.setdefault(p.module, []).append(p)
    described = {}
    for module, uses in by_module.items():
        main = next((u for u in uses if u.fqn.endswith(".weight")), uses[0])
        text = describe_roles(main.roles, axis_names)
        if len(uses) > 1 and any(u.roles != main.roles for u in uses if u is not main):
            text += "; " + ", ".join(f"{u.fqn.rsplit('.', 1)[-1]} {u.placements}" for u in uses if u is not main)
        if main.tied:  # (a tied head is no row of its own: its weight is this module's)
            text += "; also " + ", ".join(t.rsplit(".", 1)[0] for t in main.tied) + " (tied)"
        described[module] = (main.module_type, text)
    groups: dict[tuple, list[str]] = {}
    for module, (mtype, text) in described.items():
        pattern = any_layer(module, every=True)
        groups.setdefault((pattern, mtype, text), []).append(module)
    counts = defaultdict(int)
    for pattern, _, _ in groups:
        counts[pattern] += 1
    rows = []
    for (pattern, mtype, text), modules in groups.items():
        if counts[pattern] == 1 and len(modules) > 1:
            rows.append((pattern, mtype, text))
        else:
            rows.extend((m, mtype, text) for m in modules)
    return rows


def step_seconds(plan) -> list[tuple[Any, Any, float]]:
    """(edge, step, seconds) for every step the rank graph launches: the plan's edge cost (gradient
    buckets included) shared over its steps in proportion to their own cost. A shared edge reuses an
    earlier consumer's resharding and launches nothing."""
    out = []
    for e in plan.edges:
        if e.shared:
            continue
        raw = [step_cost(s, plan.mesh) for s in e.steps]
        scale = e.cost / sum(raw) if sum(raw) > 0 else 1.0
        out += [(e, s, r * scale) for s, r in zip(e.steps, raw)]
    return out


def collective_totals(plan) -> list[tuple[str, str, int, float, float]]:
    """(kind, axis, launches, bytes, seconds) per collective kind and mesh axis. The gradient all_reduces of a
    training plan count as the buckets the rank graph packs them into (one launch each; a probe found 37 listed
    where the graphs launch one), and their row's time includes the buckets' latency: the share of a launch each
    gradient's edge already pays, plus what the buckets pay beyond the shares (at least one launch: a probe found
    the shares counted twice, the table's total over the headline's communication and buckets' latency)."""
    totals: dict[tuple[str, str], list] = {}
    for _, s, seconds in step_seconds(plan):
        if not s.is_collective:
            continue
        row = totals.setdefault((s.kind, plan.mesh.axis_names[s.axis]), [0, 0.0, 0.0])
        row[0] += 1
        row[1] += s.in_bytes
        row[2] += seconds
    for axis, (count, shares, launches) in plan.stats.get("gradient_all_reduces", {}).items():
        row = totals.get(("all_reduce", axis))
        if row is None:
            continue
        row[0] += launches - count
        latency = plan.mesh.links[plan.mesh.axis_names.index(axis)].alpha_beta("all_reduce")[0]
        row[2] += bucketed_latency(latency, [shares]) - latency * shares
    return [(k, a, c, b, t) for (k, a), (c, b, t) in sorted(totals.items())]


def explain(plan, details: PlanDetails | None, detail: bool = True) -> str:
    """The plan in words. Without `detail`: the screen a person reads first (time, memory, module
    layouts, inputs, collective totals); with it, also every costed node and its best alternative."""
    names = plan.mesh.axis_names
    step = plan.optimizer_cost
    of_it = f" with the optimizer's step {step * 1e3:.3f} ms" if step >= 5e-8 else ""
    # the rest of the objective: recomputation, and the gradient all_reduces' latency, paid per bucket
    # (`_bucket_latency` in the program; their edges carry the bandwidth)
    buckets = plan.objective - plan.compute_cost - plan.comm_cost - plan.recompute_cost
    rest = "".join(f", {what} {t * 1e3:.3f} ms" for what, t in (
        ("recomputation", plan.recompute_cost), ("gradient buckets' latency", buckets)) if t >= 5e-7)
    # (the runtime's own time around the graphs, which no plan changes: a probe read two predictions for one plan)
    wrapper = plan.wrapper_overhead_s
    around = (f"; with the runtime's {wrapper * 1e3:.3f} ms around the graphs, {plan.predicted_step_s * 1e3:.3f} ms "
              f"per {'step' if plan.joint else 'call'} (predicted_step_s)" if wrapper >= 5e-7 else "")
    lines = [f"Plan on mesh {plan.mesh}: estimated {plan.objective * 1e3:.3f} ms per call "
             f"(compute {plan.compute_cost * 1e3:.3f} ms{of_it}, communication {plan.comm_cost * 1e3:.3f} ms{rest}), "
             f"optimality gap {plan.gap_text}{around}"]
    search = plan.stats.get("axis_search")
    if search:
        lines.append(f"solved by axis search ({search['solves']} solves of two mesh axes at a time, "
                     f"{search['seconds']:.1f} s): {search['note']}")
    if plan.memory:
        text = (f"predicted memory per rank: {format_bytes(plan.predicted_peak_bytes)} (" +
                ", ".join(f"{k} {format_bytes(v)}" for k, v in plan.memory.items()) + ")")
        made = plan.stats.get("gradients_at_peak")
        if made is not None and plan.memory.get("gradients"):
            text += (f"; at the worst point ('{plan.stats.get('peak_live_at')}') backward has made "
                     f"{format_bytes(made)} of the gradients")
        total = sum(plan.memory.values())
        if total > plan.predicted_peak_bytes * (1 + 1e-6) + 1:  # (a probe added the terms up and found more)
            after = " (the optimizer step's temporaries come after backward)" if plan.memory.get("optimizer step") \
                else ""
            text += (f"; the terms, each kind's most, add up to {format_bytes(total)}: they are not all alive at the "
                     f"worst point{after}")
        lines.append(text)
    if plan.recompute or plan.recompute_selective:
        parts = [f"{len(keys)} layers {how} ({_layer_span(_as_modules(keys, details))}{note})" for keys, how, note in (
            (plan.recompute, "whole", ""),
            (plan.recompute_selective, "selectively", "; their matmuls and attention stay saved")) if keys]
        lines.append(f"recomputed in backward: {'; '.join(parts)}, +{format_seconds(plan.recompute_cost)} per call, "
                     f"{format_bytes(plan.recomputed_bytes)} fewer activations saved")
    if details is None:
        lines.append("(no per-node details: this plan was saved without them)")
        return "\n".join(lines) + "\n"
    lines += ["", "Modules (layout per mesh axis):"]
    rows = module_summary(details, names)
    lines += _table([[m or "(root)", t, d] for m, t, d in rows]) if rows else ["  (no parameters)"]
    for name, ps in details.inputs.items():
        undone = details.inputs_gathered.get(name, ())
        batch = [names[i] for i, p in enumerate(_parse_list(ps)) if p == "S(0)" and names[i] not in undone]
        notes = [f"batch split on {', '.join(batch)} (data parallel)"] if batch else []
        if undone:
            notes.append(f"its batch split on {', '.join(undone)} undone before any op reads it (gathered, or moved to "
                         f"another axis): no op runs data parallel on {'it' if len(undone) == 1 else 'them'}")
        lines.append(f"  input {name} {ps}{': ' + '; '.join(notes) if notes else ''}")
    lines += ["", "Collectives per call:"]
    totals = collective_totals(plan)
    if totals:
        rows = [["kind", "axis", "count", "bytes", "time"]]
        rows += [[k, a, str(c), format_bytes(b), format_seconds(t)] for k, a, c, b, t in totals]
        rows.append(["total", "", str(sum(r[2] for r in totals)), format_bytes(sum(r[3] for r in totals)),
                     format_seconds(sum(r[4] for r in totals))])
        lines += _table(rows)
        local = plan.comm_cost - sum(r[4] for r in totals)
        if local >= 5e-7:  # (found by a probe: the headline's communication was not this total)
            lines.append(f"  (the headline's communication holds {format_seconds(local)} more: reshardings within a "
                         "rank, a slice or copy of this rank's part, which send nothing)")
        if plan.recompute or plan.recompute_selective:
            lines.append("  (recomputation launches again, in backward, the reshardings inside the recomputed layers: "
                         "they are not counted here; their time is in the headline's recomputation)")
    else:
        lines.append("  none")
    if not detail:
        return "\n".join(lines) + "\n"
    lines += ["", "Nodes (per rank and call: compute (a parameter in training: the optimizer's step on its piece), "
              "resharding of the inputs, memory held; the best alternative is the cheapest other strategy with the "
              "rest of the plan fixed):"]
    rows = [["node", "module", "op", "chosen", "compute", "comm in", "memory", "best alternative",
             "why it lost"]]
    for r in details.nodes:
        where = " ".join(x for x in (r.module, f"({r.phase})" if r.phase else "", f"x{r.count}" if r.count > 1 else "")
                         if x)
        rows.append([r.label, where, r.op, r.chosen, format_seconds(r.cost.compute), format_seconds(r.cost.comm_in),
                     format_bytes(r.cost.memory) if r.cost.memory else "-", r.alternative or "-", r.reason])
    total = {f: sum(getattr(r.cost, f) * r.count for r in details.nodes) for f in ("compute", "comm_in", "memory")}
    rows.append(["total", "", "", "", format_seconds(total["compute"]), format_seconds(total["comm_in"]),
                 format_bytes(total["memory"]), "", ""])
    lines += _table(rows)
    # (what no node's row holds: resharded copies kept for backward (an edge's), the schedule's temporaries, less what
    # recomputation frees; a probe summed the rows and found the plan's activations 35% over them)
    unheld = sum(plan.memory.values()) - total["memory"]
    if plan.memory and unheld >= 1.0:
        lines.append(f"  (the plan's memory also counts {format_bytes(unheld)} that no node's row holds: resharded "
                     "copies kept for backward, the schedule's temporaries, less what recomputation frees)")
    elif plan.memory and unheld <= -1.0:
        lines.append(f"  (the rows hold {format_bytes(-unheld)} more than the plan's memory counts: what recomputation "
                     "frees, less the resharded copies kept for backward and the schedule's temporaries)")
    return "\n".join(lines) + "\n"


def _as_modules(keys: tuple[str, ...], details: PlanDetails | None) -> tuple[str, ...]:
    """Layer keys as the model's module paths: a plan traced with a loss_fn keys them under the loss wrapper's
    `model.` (found by a probe: "model.layers.0-3" for the modules `layers.0`-`layers.3`)."""
    modules = {p.module for p in details.params} if details is not None else set()

    def is_module(path: str) -> bool:
        return any(m == path or m.startswith(path + ".") for m in modules)

    if keys and all(k.startswith("model.") and is_module(k[6:]) and not is_module(k) for k in keys):
        return tuple(k[6:] for k in keys)  # (a transformers model's own `model.` trunk stays: a review)
    return keys


def _layer_span(keys: tuple[str, ...]) -> str:
    """"model.blocks.0-5, model.head_blocks.0": runs of consecutive elements of one list."""
    runs: list[list] = []
    for key in keys:
        stem, _, index = key.rpartition(".")
        if runs and runs[-1][0] == stem and index.isdigit() and runs[-1][2] == int(index) - 1:
            runs[-1][2] = int(index)
        else:
            runs.append([stem, index, int(index) if index.isdigit() else None])
    return ", ".join(f"{stem}.{first}" + (f"-{last}" if last is not None and str(last) != first else "")
                     for stem, first, last in runs)


def _parse_list(ps: str) -> list[str]:
    return [p.strip() for p in ps.strip("[]").split(",")]


