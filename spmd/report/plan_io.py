"""Plans as files: versioned JSON, with the per-node details so a loaded plan explains itself.

A plan file is JSON with a schema name and version; placements are written as everywhere else in spmd
("S(0)", "R", "P", "P(max)"; `core.specs.placement_str`). A loaded plan explains, prints, diffs and
counts its collectives like the one that was saved (same `fingerprint()`), but holds no graph: it
cannot be run or drawn. A file edited since it was saved is refused: the fingerprint covers the choices and
steps, and the `digest` the rest (a probe loaded a mesh edited to (4, 4) and parameter roles edited to
"replicated", which then explained a plan that was not the one solved).

    {"schema": "spmd-plan", "version": 2, "fingerprint": "3f1c...",
     "mesh": {"shape": [2, 2], "axis_names": ["dp", "tp"], "links": [...], "device": {...}},
     "objective": 0.0398, ..., "choices": {"addmm": {"inputs": [["R", "S(0)"], ...], "outputs": [...]}},
     "edges": [{"value": ["addmm_3", 0], "consumer": "add_1", "steps": [{"kind": "all_reduce", ...}]}],
     "details": {"nodes": [...], "params": [...], "inputs": {...}}}
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

from spmd.core.mesh import MeshSpec
from spmd.core.plan import Edge, Plan
from spmd.core.profiles import device_from_json, device_to_json, link_from_json, link_to_json
from spmd.core.redistribute import Step
from spmd.core.specs import Placements, Strategy, placement_from_text, placement_str
from spmd.report.details import NodeReport, ParamUse, PlanDetails, Split
from spmd.report.tp_regions import StyleRegions

SCHEMA = "spmd-plan"
VERSION = 2  # 2: a file carries its `digest` and `fingerprint`, and one without them is refused
READS = (1, 2)  # (version 1 files, written before the digest, load with the fingerprint check alone)


# ---- placements as text -------------------------------------------------------------------------

def _ps_out(ps: Placements | None):
    return None if ps is None else [placement_str(p) for p in ps]


def _ps_in(texts) -> Placements | None:
    return None if texts is None else tuple(placement_from_text(t) for t in texts)


# ---- save / load --------------------------------------------------------------------------------

def _mesh_json(mesh: MeshSpec) -> dict:
    d = mesh.device
    return {"shape": list(mesh.shape), "axis_names": list(mesh.axis_names),
            "links": [link_to_json(link) for link in mesh.links],
            "device": device_to_json(d)}  # every field: a reloaded plan prices as the saved one


def _mesh_from(d: dict) -> MeshSpec:
    links = tuple(link_from_json(x) for x in d["links"])
    return MeshSpec(tuple(d["shape"]), tuple(d["axis_names"]), links, device_from_json(d["device"]))


def _step_json(s: Step) -> dict:
    return {"kind": s.kind, "axis": s.axis, "src_dim": s.src_dim, "dst_dim": s.dst_dim, "reduce_op": s.reduce_op,
            "local_in_shape": list(s.local_in_shape), "itemsize": s.itemsize}


def _details_json(details: PlanDetails | None) -> dict | None:
    if details is None:
        return None
    regions = None if details.style_regions is None else \
        {axis: asdict(r) for axis, r in details.style_regions.items()}
    return {"nodes": [asdict(r) for r in details.nodes], "params": [asdict(p) for p in details.params],
            "inputs": dict(details.inputs), "style_regions": regions,
            "inputs_gathered": {k: list(v) for k, v in details.inputs_gathered.items()}}


def _details_from(d: dict | None) -> PlanDetails | None:
    if d is None:
        return None
    nodes = []
    for r in d["nodes"]:
        r = dict(r)
        r["cost"] = Split(**r["cost"])
        r["alternative_cost"] = Split(**r["alternative_cost"]) if r["alternative_cost"] else None
        nodes.append(NodeReport(**r))
    params = [ParamUse(**{**p, "roles": tuple(p["roles"]), "tied": tuple(p.get("tied", ()))}) for p in d["params"]]
    regions = d.get("style_regions")
    if regions is not None:
        regions = {axis: StyleRegions(**{k: tuple(v) for k, v in r.items()}) for axis, r in regions.items()}
    gathered = {k: tuple(v) for k, v in d.get("inputs_gathered", {}).items()}  # (absent from older files)
    return PlanDetails(tuple(nodes), tuple(params), dict(d["inputs"]), regions, inputs_gathered=gathered)


def plan_to_json(plan: Plan, details: PlanDetails | None = None) -> dict:
    doc = _content(plan, details)
    return {**doc, "digest": _digest(doc)}


def _digest(doc: dict) -> str:
    """A hash of a plan file's content as this module writes it (so a file written before Partial's one spelling,
    "P(sum)", reads as the same content)."""
    text = json.dumps(_numbers_as_floats({k: v for k, v in doc.items() if k != "digest"}), sort_keys=True,
                      default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _numbers_as_floats(value):
    """`value` with every int a float: profiles read back their numbers as floats (`32 * 2**20` comes back
    33554432.0), which must not read as an edit (a review found every CPU/gloo plan refused so)."""
    if isinstance(value, dict):
        return {k: _numbers_as_floats(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_numbers_as_floats(v) for v in value]
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


def _content(plan: Plan, details: PlanDetails | None) -> dict:
    return {
        "schema": SCHEMA, "version": VERSION, "fingerprint": plan.fingerprint(),
        "mesh": _mesh_json(plan.mesh),
        "objective": plan.objective, "lower_bound": plan.lower_bound, "gap": plan.gap,
        "solve_seconds": plan.solve_seconds, "stats": plan.stats,
        "memory": plan.memory, "memory_budget": plan.memory_budget, "labels": plan.labels,
        "choices": {n: {"inputs": [_ps_out(p) for p in s.inputs], "outputs": [_ps_out(p) for p in s.outputs]}
                    for n, s in plan.choices.items()},
        "node_costs": plan.node_costs,
        "edges": [{"value": list(e.value), "consumer": e.consumer, "slot": e.slot, "src": _ps_out(e.src),
                   "dst": _ps_out(e.dst), "cost": e.cost, "shared": e.shared,
                   "steps": [_step_json(s) for s in e.steps]}
                  for e in plan.edges],
        "wrapper_counts": list(plan.wrapper_counts) if plan.wrapper_counts is not None else None,
        "joint": plan.joint,
        "recompute": list(plan.recompute), "recompute_cost": plan.recompute_cost,
        "recomputed_bytes": plan.recomputed_bytes, "recompute_selective": list(plan.recompute_selective),
        "peak_bytes": plan.peak_bytes,
        "details": _details_json(details),
    }


def plan_from_json(doc: dict, where: str = "plan") -> tuple[Plan, PlanDetails | None]:
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"{where}: not an spmd plan file (schema {doc.get('schema')!r})")
    if doc.get("version") not in READS:
        raise ValueError(f"{where}: plan file version {doc.get('version')}, this spmd reads versions "
                         f"{', '.join(map(str, READS))}. What to do: re-plan with this version (spmd plan ... --json).")
    choices = {n: Strategy(tuple(_ps_in(p) for p in c["outputs"]), tuple(_ps_in(p) for p in c["inputs"]))
               for n, c in doc["choices"].items()}
    edges = [Edge((e["value"][0], e["value"][1]), e["consumer"], e["slot"], _ps_in(e["src"]), _ps_in(e["dst"]),
                  tuple(Step(s["kind"], s["axis"], s["src_dim"], s["dst_dim"], s["reduce_op"],
                             tuple(s["local_in_shape"]), s["itemsize"]) for s in e["steps"]), e["cost"],
                  e.get("shared", False))
             for e in doc["edges"]]
    counts = doc.get("wrapper_counts")
    plan = Plan(_mesh_from(doc["mesh"]), choices, dict(doc["node_costs"]), tuple(edges), doc["objective"],
                doc["lower_bound"], doc["gap"], doc["solve_seconds"], dict(doc.get("stats", {})),
                dict(doc.get("labels", {})), dict(doc.get("memory", {})), doc.get("memory_budget"),
                tuple(counts) if counts is not None else None, bool(doc.get("joint", False)),
                tuple(doc.get("recompute", ())), doc.get("recompute_cost", 0.0), doc.get("recomputed_bytes", 0.0),
                tuple(doc.get("recompute_selective", ())), doc.get("peak_bytes", 0.0))
    # (every file has its fingerprint, version 2's its digest too: a probe took both off a file set to version 1, and
    # the edited plan loaded unchecked; asked after the content, whose keys a cut file lacks)
    needed = ("fingerprint", "digest") if doc["version"] >= 2 else ("fingerprint",)
    if not all(k in doc for k in needed):
        missing = " and ".join(k for k in needed if k not in doc)
        raise ValueError(f"{where}: the plan file has no {missing} (edited since it was saved: every version "
                         f"{doc['version']} file has {' and '.join(needed)}), so nothing shows it describes the plan "
                         "that was solved. "
                         "What to do: re-plan (plan.save(path), or `spmd plan ... --json path`).")
    if plan.fingerprint() != doc["fingerprint"]:
        raise ValueError(f"{where}: the plan does not match its fingerprint (edited by hand, or written by another "
                         "version); re-plan.")
    details = _details_from(doc.get("details"))
    if "digest" in doc:  # (version 1 files, written before the digest, have none)
        # (as written: a version 1 file with its digest, from before version 2, hashed its own version; a review)
        if _digest({**_content(plan, details), "version": doc["version"]}) != doc["digest"]:
            raise ValueError(f"{where}: the plan file was edited since it was saved (its content no longer matches its "
                             "digest), so it would describe a plan other than the one solved. What to do: re-plan "
                             "(plan.save(path), or `spmd plan ... --json path`); keep notes beside the file, not in it.")
    return plan, details


def save_plan(plan: Plan, details: PlanDetails | None, path) -> None:
    Path(path).write_text(json.dumps(plan_to_json(plan, details), indent=1, default=str) + "\n")


def load_plan(path) -> tuple[Plan, PlanDetails | None]:
    """Read a plan written by `save_plan`, with its details."""
    way_out = "What to do: save plans with plan.save(path) or `spmd plan ... --json path`."
    try:
        doc = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a plan file (not JSON: {e}). {way_out}") from None
    except IsADirectoryError:
        raise ValueError(f"{path} is a folder, not a plan file. {way_out}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: not a plan file (a JSON {type(doc).__name__}, not an object). {way_out}")
    try:
        return plan_from_json(doc, str(path))
    except (KeyError, TypeError, IndexError) as e:  # (an entry missing or of another kind: a file cut or edited)
        raise ValueError(f"{path}: not a complete plan file ({type(e).__name__}: {e}). {way_out}") from None
    except ValueError as e:
        if str(e).startswith(str(path)):
            raise
        raise ValueError(f"{path}: not a plan file as written ({e}). {way_out}") from None  # (a placement edited)
