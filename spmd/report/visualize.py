"""The sharded graph as graphviz source (`to_dot`); `report/render.py` turns it into files.

The drawing is the `insert_collectives` graph (what every rank runs, global shapes), in graphviz:

    ┌ blocks.0.attn.q_proj (Linear) ─────────┐     each op: name, compute time, one cell per mesh axis
    │ weight  [dp: R | tp: S(0)]  32x64 of 64x64 │     coloured by placement (Shard blue, Replicate grey,
    │ addmm   [dp: S(0) | tp: S(1)]  ...      │     Partial orange), local shape of global shape
    └────────────────────────────────────────┘
                      │
            ██ all_reduce(sum) on tp ██            each inserted collective: red, with its mesh axis,
            ██ 31.0 KiB · 1000.3 us   ██            bytes per rank and estimated time

Nodes are grouped in boxes by module path (torch.export's `nn_module_stack`; backward nodes of a
training graph by the forward module they differentiate, under a "backward" box). Views and getitem are
drawn through (`views=True` shows them). `collapse` folds runs of identical repeated blocks
(`blocks.1` ... `blocks.95` like `blocks.0`) into one node, so a 96-layer model stays readable.
"""
from __future__ import annotations

import html
from collections import Counter, defaultdict

import graphviz
import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard

from spmd.core.errors import SpmdError
from spmd.core.graph_facts import format_bytes, format_seconds, innermost_layer, is_layout_op, module_paths, \
    op_label, phase_of
from spmd.core.specs import local_shape, placement_str
from spmd.report.explain import step_seconds

COLORS = {"S": "#9ecae1", "R": "#e0e0e0", "P": "#fdae6b"}
COLLECTIVE = "#d62728"


def _placement_text(p) -> tuple[str, str]:
    kind = "S" if isinstance(p, Shard) else "R" if isinstance(p, Replicate) else "P" if isinstance(p, Partial) else None
    return placement_str(p), COLORS.get(kind, "white")


def _esc(text) -> str:
    return html.escape(str(text), quote=True)


def _shape(val) -> tuple[int, ...] | None:
    return tuple(int(s) for s in val.shape) if isinstance(val, torch.Tensor) else None


class _Drawing:
    """Decides what each graph node looks like and where it goes; `build()` returns the Digraph."""

    def __init__(self, plan, src, collapse: bool | None, views: bool, title: str | None):
        self.plan, self.mesh, self.views = plan, plan.mesh, views
        self.gm: fx.GraphModule = src.global_gm
        self.kinds, self.joint = src.kinds, src.joint
        self.title = title
        params = [plan.labels[p] for p, k in src.kinds.items() if k in ("parameter", "buffer")]
        self.where, self.types = module_paths(self.gm.graph, params)
        self.nodes = list(self.gm.graph.nodes)
        self.step_cost = self._step_costs()
        self.module = {n.name: self._module_of(n) for n in self.nodes}
        self.phase = {n.name: self._phase_of(n) for n in self.nodes}
        self.visible = [n for n in self.nodes if self._is_visible(n)]
        self.folded: dict[str, str] = {}  # node name -> fold node id
        self.folds: dict[str, str] = {}  # fold node id -> label
        self.fold_place: dict[str, tuple[str, str]] = {}  # fold node id -> (phase, module path)
        threshold = {True: 2, None: 4, False: 0}[collapse]
        if threshold:
            self._collapse(threshold)

    # ---- facts about nodes ----

    def _step_costs(self) -> dict:
        """(value name, Step) -> estimated seconds (see `explain.step_seconds`)."""
        return {(e.value[0], s): seconds for e, s, seconds in step_seconds(self.plan)}

    def _source(self, n: fx.Node) -> fx.Node:
        while "spmd_step" in n.meta:
            n = n.args[0]
        return n

    def _module_of(self, n: fx.Node) -> str:
        if n.op == "placeholder":
            kind = self.kinds.get(n.name)
            label = self.plan.labels.get(n.name, n.name)
            return label.rsplit(".", 1)[0] if kind in ("parameter", "buffer") and "." in label else ""
        if "spmd_step" in n.meta:  # a collective belongs to the module whose value it moves
            return self._module_of(self._source(n))
        return self.where.get(n.name, "")

    def _phase_of(self, n: fx.Node) -> str:
        if not self.joint:
            return ""
        if n.op == "placeholder":
            return "backward" if self.kinds.get(n.name) == "tangent" else "forward"
        return phase_of(n) or ("backward" if n.op == "output" else "forward")

    def _is_visible(self, n: fx.Node) -> bool:
        if n.op != "call_function" or "spmd_step" in n.meta or self.views:
            return True
        return not is_layout_op(n)

    def _signature(self, n: fx.Node, block: str) -> tuple:
        """What a node looks like, minus names: equal for the same node in two identical blocks."""
        step = n.meta.get("spmd_step")
        ps = n.meta.get("spmd_placements") or ()
        rel = self.module[n.name][len(block):]
        return (n.op, op_label(n) if n.op == "call_function" else self.kinds.get(n.name), rel,
                tuple(str(p) for p in ps), _shape(n.meta.get("val")), repr(step) if step else None,
                self.plan.labels.get(n.name, "").rsplit(".", 1)[-1])

    # ---- folding repeated blocks ----

    def _collapse(self, threshold: int) -> None:
        members: dict[tuple[str, str, int], list[fx.Node]] = defaultdict(list)
        for n in self.visible:
            layer = innermost_layer(self.module[n.name])
            if layer:
                members[(self.phase[n.name], *layer)].append(n)
        by_parent: dict[tuple[str, str], list[int]] = defaultdict(list)
        for phase, parent, idx in sorted(members):
            by_parent[(phase, parent)].append(idx)
        for (phase, parent), idxs in by_parent.items():
            sig = {i: tuple(self._signature(n, f"{parent}{i}") for n in members[(phase, parent, i)]) for i in idxs}
            run = [idxs[0]]
            for i in idxs[1:] + [None]:
                if i is not None and i == run[-1] + 1 and sig[i] == sig[run[0]]:
                    run.append(i)
                    continue
                if len(run) >= threshold:
                    self._fold(phase, parent, run, members)
                if i is not None:
                    run = [i]

    def _fold(self, phase: str, parent: str, run: list[int], members) -> None:
        fid = f"fold_{phase}_{parent}{run[1]}".replace(".", "_")
        first = f"{parent}{run[0]}"
        steps = Counter()
        for n in members[(phase, parent, run[1])]:
            step = n.meta.get("spmd_step")
            if step is not None and step.is_collective:
                steps[(step.kind, self.mesh.axis_names[step.axis])] += 1
        each = ", ".join(f"{c}x {k} on {a}" for (k, a), c in sorted(steps.items())) or "no collectives"
        span = f"{parent}{run[1]}" + (f" … {parent}{run[-1]}" if len(run) > 2 else "")
        more = f"{len(run) - 1} more block{'s' if len(run) > 2 else ''}"
        self.folds[fid] = f"<<b>{_esc(span)}</b><br/>{more} like {_esc(first)}<br/>each: {_esc(each)}>"
        self.fold_place[fid] = (phase, parent.rstrip("."))
        for i in run[1:]:
            for n in members[(phase, parent, i)]:
                self.folded[n.name] = fid

    # ---- labels ----

    def _cells(self, ps) -> str:
        cells = []
        for axis, p in zip(self.mesh.axis_names, ps):
            text, color = _placement_text(p)
            cells.append(f'<td bgcolor="{color}">{_esc(axis)}: {_esc(text)}</td>')
        return "".join(cells)

    def _label(self, n: fx.Node) -> tuple[str, dict]:
        k = self.mesh.ndim
        step = n.meta.get("spmd_step")
        if step is not None:
            axis = self.mesh.axis_names[step.axis]
            detail = f"({step.reduce_op})" if step.reduce_op else ""
            if not step.is_collective:
                what = f"slice dim {step.dst_dim}" if step.kind == "shard_local" else f"to P{detail}"
                return f"<{_esc(what)} on {_esc(axis)} (local)>", {"shape": "box", "style": "dashed,rounded",
                                                                   "fontsize": "9"}
            seconds = self.step_cost.get((self._source(n).name, step), 0.0)
            label = (f'<<table border="0" cellspacing="0" cellpadding="1"><tr><td><b>{_esc(step.kind)}{_esc(detail)}'
                     f'</b></td></tr><tr><td>on {_esc(axis)} · {format_bytes(step.in_bytes)} · {format_seconds(seconds)}</td></tr>'
                     "</table>>")
            return label, {"shape": "box", "style": "filled,bold", "fillcolor": COLLECTIVE, "fontcolor": "white",
                           "color": "#7f0000", "penwidth": "2.5"}
        if n.op == "output":
            return "<<b>outputs</b>>", {"shape": "box", "style": "rounded"}
        ps = (n.meta.get("spmd_placements") or (None,))[0]
        shape = _shape(n.meta.get("val"))
        if shape is None and isinstance(n.meta.get("val"), (tuple, list)):
            shape = _shape(n.meta["val"][0])
        if n.op == "placeholder":
            kind = self.kinds.get(n.name, "input")
            title = f"{_esc(self.plan.labels.get(n.name, n.name).rsplit('.', 1)[-1])} <i>{_esc(kind)}</i>"
            step = self.plan.node_costs.get(n.name, 0.0)  # a parameter in training: the optimizer's step
            if step >= 5e-8:  # (one that rounds to 0.0 us says nothing)
                title += f" <font point-size=\"9\">step {format_seconds(step)}</font>"
            attrs = {"shape": "plain" if ps is None else "none"}
        else:
            cost = self.plan.node_costs.get(n.name, 0.0)
            title = f"<b>{_esc(op_label(n))}</b> <font point-size=\"9\">{format_seconds(cost)}</font>"
            attrs = {"shape": "none"}
        rows = [f'<tr><td colspan="{k}">{title}</td></tr>']
        if ps is not None:
            rows.append(f"<tr>{self._cells(ps)}</tr>")
            if shape is not None:
                local = local_shape(shape, ps, self.mesh.shape)
                rows.append(f'<tr><td colspan="{k}"><font point-size="9">{list(local)} of {list(shape)}'
                            "</font></td></tr>")
        bg = ' bgcolor="#fffbe6"' if n.op == "placeholder" else ' bgcolor="white"'
        return (f'<<table border="0" cellborder="1" cellspacing="0" cellpadding="2"{bg}>{"".join(rows)}</table>>',
                {**attrs, "margin": "0"})

    # ---- the graph ----

    def _display(self, name: str) -> str:
        return self.folded.get(name, name)

    def _sources_of(self, n: fx.Node, memo: dict) -> dict[str, None]:
        """The visible nodes `n` reads from, looking through hidden views, in the order it reads them (a set's
        order changed with each process's hash seed, and with it graphviz's edge ids in the rendered file)."""
        if n.name in memo:
            return memo[n.name]
        out: dict[str, None] = {}
        for a in n.all_input_nodes:
            if a.name in self._visible_names:
                out[a.name] = None
            else:
                out.update(self._sources_of(a, memo))
        memo[n.name] = out
        return out

    def _legend(self, g: graphviz.Digraph) -> None:
        s, r, p = COLORS["S"], COLORS["R"], COLORS["P"]
        label = ('<<table border="0" cellborder="1" cellspacing="0" cellpadding="3">'
                 '<tr><td colspan="2"><b>legend</b></td></tr>'
                 f'<tr><td bgcolor="{s}">S(d)</td><td>Shard: dim d split over the axis</td></tr>'
                 f'<tr><td bgcolor="{r}">R</td><td>Replicate: every rank on the axis holds it all</td></tr>'
                 f'<tr><td bgcolor="{p}">P</td><td>Partial: the sum over the axis is the value</td></tr>'
                 f'<tr><td bgcolor="{COLLECTIVE}"><font color="white"><b>coll.</b></font></td>'
                 '<td>inserted collective: axis, bytes per rank, time</td></tr>'
                 '<tr><td>cells</td><td>one per mesh axis; then local shape of global shape</td></tr>'
                 '<tr><td>boxes</td><td>module paths; a 3-D box folds identical repeated blocks</td></tr>'
                 '</table>>')
        with g.subgraph(name="cluster_legend") as lg:
            lg.attr(label="", style="invis")
            lg.node("legend", label=label, shape="none", margin="0")

    def build(self) -> graphviz.Digraph:
        plan = self.plan
        summary = plan.collective_summary()
        colls = ", ".join(f"{k} on {a} x{c}" for (k, a), c in sorted(summary.items())) or "none"
        title = (f"{self.title + ': ' if self.title else ''}sharded graph on mesh {self.mesh}: estimated "
                 f"{format_seconds(plan.objective)} per call; collectives: {colls}")
        g = graphviz.Digraph("spmd", graph_attr={"rankdir": "TB", "label": title, "labelloc": "t", "fontsize": "16",
                                                 "fontname": "Helvetica", "newrank": "true", "nodesep": "0.2",
                                                 "ranksep": "0.3"},
                             node_attr={"fontname": "Helvetica", "fontsize": "10"},
                             edge_attr={"color": "#555555", "arrowsize": "0.6"})
        shown = [n for n in self.visible if n.name not in self.folded]
        self._visible_names = {n.name for n in self.visible}
        # boxes: module path -> nodes, nested by path prefix, under one box per phase for training
        placed: dict[tuple[str, str], list[tuple[str, str, dict]]] = defaultdict(list)
        for n in shown:
            label, attrs = self._label(n)
            placed[(self.phase[n.name], self.module[n.name])].append((n.name, label, attrs))
        for fid, label in self.folds.items():
            placed[self.fold_place[fid]].append((fid, label, {"shape": "box3d", "style": "filled",
                                                              "fillcolor": "#f2f2f2"}))
        self._draw_boxes(g, placed)
        edges: dict[tuple[str, str], bool] = {}
        memo: dict = {}
        by_name = {n.name: n for n in self.nodes}
        for n in self.visible:
            if n.op == "placeholder":
                continue
            dst = self._display(n.name)
            for s in self._sources_of(n, memo):
                src = self._display(s)
                if src != dst:  # edges into and out of a collective are drawn red
                    hot = "spmd_step" in n.meta or "spmd_step" in by_name[s].meta
                    edges[(src, dst)] = edges.get((src, dst), False) or hot
        for (src, dst), hot in edges.items():
            g.edge(src, dst, **({"color": COLLECTIVE, "penwidth": "1.6"} if hot else {}))
        self._legend(g)
        return g

    def _draw_boxes(self, g: graphviz.Digraph, placed) -> None:
        known = set(self.types) - {""}
        paths = set()
        for _, module in placed:
            parts = module.split(".") if module else []
            for i in range(1, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if prefix in known or i == len(parts):
                    paths.add(prefix)
        children: dict[str, list[str]] = defaultdict(list)
        for p in sorted(paths):
            parent = next((q for q in _ancestors(p) if q in paths), "")
            children[parent].append(p)
        phases = sorted({ph for ph, _ in placed}, key=lambda ph: ("forward", "backward", "").index(ph))

        def emit(sub, phase: str, path: str) -> None:
            for name, label, attrs in placed.get((phase, path), ()):
                sub.node(name, label=label, **attrs)
            for child in children.get(path, ()):
                if not any(m == child or m.startswith(child + ".") for ph, m in placed if ph == phase):
                    continue
                cname = f"cluster_{phase + '_' if phase else ''}{child}"
                with sub.subgraph(name=cname) as c:
                    kind = self.types.get(child, "")
                    c.attr(label=f"{child}" + (f" ({kind})" if kind else ""), style="rounded", color="#888888",
                           fontsize="11", labeljust="l")
                    emit(c, phase, child)

        for phase in phases:
            if phase:
                with g.subgraph(name=f"cluster_{phase}") as sub:
                    sub.attr(label=phase, style="dashed", fontsize="14", labeljust="l")
                    emit(sub, phase, "")
            else:
                emit(g, phase, "")


def _ancestors(path: str):
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        yield ".".join(parts[:i])


def to_dot(plan, sources, collapse: bool | None = None, views: bool = False, title: str | None = None) -> str:
    """The graphviz source of the sharded graph of `plan`, from its `sources` (see the module docstring)."""
    if sources is None or sources.global_gm is None:
        raise SpmdError("visualize: this plan carries no graph (it was loaded from a file). What to do: draw a plan "
                        "from spmd.plan(...) or compiled.visualize(...); `spmd explain plan.json` prints a loaded one.")
    return _Drawing(plan, sources, collapse, views, title).build().source
