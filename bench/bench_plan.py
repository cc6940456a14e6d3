"""Planning at scale: how long `spmd.plan` takes on big models and simulated 64-GPU meshes, and what it
predicts. No processes, no GPU: models are built on the meta device and traced through fake tensors.

Parts (`--parts`, default all four; run them one or two at a time: together they take longer than 10
minutes on a 2-core machine):

    depth     LLaMA3-8B dims (dim 4096, ffn 14336, 32 heads, 8 kv heads, vocab 128256), batch 16,
              seq 8192, L = 4..96 layers, training (LM cross-entropy) and forward, on
              MeshSpec((8, 8), ("dp", "tp")) with the default H100 / NVLink (tp) / InfiniBand (dp)
              profiles: trace and per-pass seconds, ILP size, HiGHS seconds, objective, bound, gap,
              repeated blocks.
    untied    the same, training, without layer tying (tie_blocks=False) at L = 4, 8, 16: ILP growth and
              the objective tying gives up.
    headline  LLaMA3-8B (32 layers) training on (8, 8): the plan, its collectives, a few placements;
              the same under an 80 GB budget.
    vit       the 2-D parallelism seed in simulation: ViT-60B and ViT-120B (bf16, 16 bytes of parameter
              state per parameter), global batch 512 (ViT-120B also 256), under an 80 GB budget: the
              free plan on (8, 8), the published layout pinned (TP on tp, FSDP on dp), "FSDP-only" pins
              on (8, 8) (inputs and every parameter [S(0), S(0)]) and FSDP on a flat (64,) InfiniBand
              mesh; predicted step, ratio, per-rank memory, "does not fit" with the floor.

    python bench/bench_plan.py --parts headline  # one part (~2-6 minutes each); other parts' sections are kept
    python bench/bench_plan.py                 # all four parts in one go (over 10 minutes here)
    python bench/bench_plan.py --quick         # smoke run: L 2,4, seq 512, untied L 2, ViT with 4 layers (/tmp)

Results go to bench/results_plan.md below a `<!-- generated -->` marker; the hand-written analysis
above the marker survives reruns. Raw rows are kept in bench/results_plan.json (part -> rows) so a run
of one part rewrites only its own section.

Timings are wall seconds on a shared machine: every row records the 1-minute load average.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.tensor import Replicate, Shard  # noqa: E402

import spmd  # noqa: E402
from examples.models import Llama, LlamaConfig, ViT, ViTConfig  # noqa: E402
from spmd.compiler.meta import fake_model  # noqa: E402
from spmd.compiler.options import PlanOptions  # noqa: E402
from spmd.compiler.pipeline import collector_paused, run_pipeline  # noqa: E402
from spmd.core.errors import SpmdError  # noqa: E402
from spmd.report.result import report_of  # noqa: E402

MARKER = "<!-- generated -->"
GB = 1e9
H100_BYTES = 80e9


def lm_loss(logits, targets):  # as tests/training_cases.py
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def cls_loss(logits, labels):
    return F.cross_entropy(logits, labels)


def load() -> float:
    return os.getloadavg()[0]


IB_BANDWIDTH = None  # --ib-gbps: a what-if InfiniBand bus bandwidth (bytes/s) for the ViT meshes


def infiniband():
    from spmd.core.profiles import LinkProfile, link_profile_for

    ib = link_profile_for("infiniband")
    if IB_BANDWIDTH is None:
        return ib
    return LinkProfile(f"infiniband-{IB_BANDWIDTH / 1e9:g}GBps", ib.latency_s, IB_BANDWIDTH, "what-if (--ib-gbps)")


def mesh88() -> spmd.MeshSpec:
    """(dp=8, tp=8): tp the inner axis (NVLink inside a node), dp across nodes (InfiniBand); H100."""
    if IB_BANDWIDTH is None:
        return spmd.MeshSpec((8, 8), ("dp", "tp"))
    from spmd.core.profiles import link_profile_for

    return spmd.MeshSpec((8, 8), ("dp", "tp"), (infiniband(), link_profile_for("nvlink")))


def run_case(model, inputs, mesh, *, training, loss_fn=None, tie_blocks=None, pins=None, memory_budget=None,
             optimizer_state_factor=2.0, stamp_layers=True):
    """The pipeline of `spmd.plan`, run here so the per-pass timings (`c.timings`) are visible."""
    load0 = load()
    options = PlanOptions(**(pins or {}), training=training, loss_fn=loss_fn, memory_budget=memory_budget,
                          optimizer_state_factor=optimizer_state_factor, tie_blocks=tie_blocks,
                          stamp_layers=stamp_layers)
    t0 = time.perf_counter()
    c = error = None
    with collector_paused():  # as in spmd.plan: the meta model's copy and the pipeline
        model, inputs = fake_model(model, inputs)
        fake_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        try:
            c = run_pipeline(model, inputs, mesh, options)
        except SpmdError as e:
            error = e
        wall_pipeline_s = time.perf_counter() - t1
    # (the collector's first collection after the pause, over what the pipeline made, counts too)
    row = {"load": load0, "fake_s": fake_s, "wall_pipeline_s": wall_pipeline_s}
    row["total_s"] = time.perf_counter() - t0
    if c is None:
        row["error"] = str(error)
        return row, None
    row["timings"] = dict(c.timings)
    row["blocks"] = c.blocks.summary() if c.blocks is not None else "not searched (tie_blocks=False)"
    row["stamped"] = c.plan.stats.get("stamped_layers") or "no (traced whole)"
    row["graph_nodes"] = sum(1 for n in c.traced.graph.nodes if n.op == "call_function")
    p = c.plan
    if p is not None:
        row.update(binary=p.stats["binary"], continuous=p.stats["continuous"], rows=p.stats["rows"],
                   status=p.stats["status"], highs_s=p.solve_seconds, objective=p.objective,
                   lower_bound=p.lower_bound, gap=p.gap, compute_s=p.compute_cost, comm_s=p.comm_cost,
                   memory={k: v for k, v in p.memory.items()}, peak=p.predicted_peak_bytes,
                   recompute=len(p.recompute), recompute_selective=len(p.recompute_selective),
                   recompute_s=p.recompute_cost,
                   layers=len(c.recomputable.stacks[0]) if c.recomputable else 0,
                   collectives={f"{k} on {a}": n for (k, a), n in sorted(p.collective_summary().items())},
                   techniques=techniques(c))
    return row, c


VOCAB_MODULES = ("tok_emb", "lm_head", "head", "model.embed_tokens", "transformer.wte")


def techniques(c) -> str:
    """What a plan does on the tensor-parallel axis beyond splitting weights, as people name it:
    sequence parallel (norm outputs split on the sequence dim over tp: how many of the norms) and a
    vocabulary-parallel embedding or head (its weight's dim 0, the vocabulary or classes, split over
    tp). Recomputation has its own columns."""
    from spmd.core.graph_facts import module_stack, phase_of

    plan, out = c.plan, []
    names = plan.mesh.axis_names
    if "tp" in names:
        tp = names.index("tp")
        last: dict[str, object] = {}  # norm module -> its last forward node (the normed output)
        for n in c.traced.graph.nodes:
            stack = module_stack(n)
            if n.op == "call_function" and stack and stack[-1][1].endswith("Norm") and phase_of(n) == "forward":
                last[stack[-1][0]] = n
        split = [m for m, n in last.items() if n.name in plan.choices and len(getattr(
            c.traced.tensor_info.get(n.name), "shape", ())) == 3 and plan.choices[n.name].outputs[0][tp] == Shard(1)]
        if split:
            out.append(f"sequence parallel ({len(split)} of {len(last)} norms)")
        for fqn, ps in placements_by_fqn(plan).items():  # dim 0 of these is the vocabulary (or the classes)
            module = fqn.rsplit(".", 1)[0]
            if fqn.endswith(".weight") and module in VOCAB_MODULES and ps.strip("[]").split(", ")[tp] == "S(0)":
                out.append(f"vocab-parallel {module}")
    return "; ".join(out) or "none"


def fmt_s(x) -> str:
    if x is None:
        return ""
    return f"{x:.2f}" if x < 100 else f"{x:.0f}"


def fmt_ms(x) -> str:
    return "" if x is None else f"{x * 1e3:.1f}"


# ---------------------------------------------------------------------------------------------------
# part 1: depth scaling


def llama(layers: int, seq: int, batch: int, training: bool):
    cfg = LlamaConfig.llama3_8b(layers=layers, seq=seq)
    with torch.device("meta"):
        model = Llama(cfg)
        tokens = torch.randint(0, cfg.vocab, (batch, seq))
    return model, ((tokens, tokens) if training else (tokens,))


def part_depth(args) -> dict:
    rows = []
    for training in (True, False):
        for L in args.layers:
            model, inputs = llama(L, args.seq, args.batch, training)
            row, _ = run_case(model, inputs, mesh88(), training=training, loss_fn=lm_loss if training else None)
            row.update(L=L, mode="train" if training else "forward", tied="auto")
            rows.append(row)
            print(summary_line(row), flush=True)
    # the same plan from a trace of every layer, for comparison
    model, inputs = llama(args.headline_layers, args.seq, args.batch, True)
    row, _ = run_case(model, inputs, mesh88(), training=True, loss_fn=lm_loss, stamp_layers=False)
    row.update(L=args.headline_layers, mode="train", tied="auto")
    rows.append(row)
    print(summary_line(row), flush=True)
    return {"rows": rows, "seq": args.seq, "batch": args.batch}


def part_untied(args) -> dict:
    """LLaMA training with tie_blocks=False at small depths: how the ILP grows when every layer is solved
    on its own, and what tying costs in objective."""
    untied = []
    for L in args.untied_layers:
        if untied and untied[-1]["total_s"] * 2.5 > args.untied_budget_s:
            print(f"untied L={L}: skipped (L={untied[-1]['L']} took {untied[-1]['total_s']:.0f} s; "
                  f"budget {args.untied_budget_s:.0f} s)", flush=True)
            untied.append({"L": L, "mode": "train", "tied": "no", "skipped": True})
            continue
        model, inputs = llama(L, args.seq, args.batch, True)
        row, _ = run_case(model, inputs, mesh88(), training=True, loss_fn=lm_loss, tie_blocks=False)
        row.update(L=L, mode="train", tied="no")
        untied.append(row)
        print(summary_line(row), flush=True)
    return {"rows": untied, "seq": args.seq, "batch": args.batch}


def summary_line(row) -> str:
    t = row.get("timings", {})
    what = row.get("label") or f"L={row.get('L')} {row.get('mode')} tied={row.get('tied')}"
    return (f"{what}: total {row['total_s']:.1f} s "
            f"(trace {t.get('trace_joint', t.get('trace_module', 0)):.1f}, solve_placements "
            f"{t.get('solve_placements', 0):.1f} of which HiGHS {row.get('highs_s', 0):.1f}), ILP "
            f"{row.get('binary')}/{row.get('continuous')}/{row.get('rows')}, objective "
            f"{fmt_ms(row.get('objective'))} ms, gap {row.get('gap', 0):.2%}, load {row['load']:.1f}"
            + (f"  ERROR {row['error'][:200]}" if "error" in row else ""))


PASSES = ("trace", "stamp_layers", "find_repeated_blocks", "enumerate_strategies", "merge_followers", "estimate_costs",
          "solve_placements")


def pass_s(row, name) -> float | None:
    t = row.get("timings", {})
    if name == "trace":
        return t.get("trace_joint", t.get("trace_module"))
    return t.get(name)


def depth_md(d: dict, title: str = "Depth scaling") -> list[str]:
    out = [f"### {title}: LLaMA3-8B dims, batch {d['batch']}, seq {d['seq']}, mesh (dp=8, tp=8)", "",
           "Seconds per pass (`c.timings`); `ILP build` = solve_placements less HiGHS; ILP size = binary / "
           "continuous variables / rows; objective = predicted seconds per step (ms).", "",
           "| L | mode | tied | layers traced | graph nodes | total s | trace | stamp_layers | find_repeated_blocks | "
           "enumerate | merge_followers | estimate | "
           "ILP build | HiGHS | ILP size | objective ms | lower bound ms | gap | "
           "repeated blocks | load |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        if r.get("skipped"):
            out.append(f"| {r['L']} | {r['mode']} | {r['tied']} | | skipped (budget) |" + " |" * 15)
            continue
        stamped = r.get("stamped", "no (traced whole)")
        traced = "all" if stamped.startswith("no") or stamped.startswith("none") else stamped.split(": ")[1].split(" traced")[0]
        sp = pass_s(r, "solve_placements")
        build = sp - r["highs_s"] if sp is not None and r.get("highs_s") is not None else None
        out.append(
            f"| {r['L']} | {r['mode']} | {r['tied']} | {traced} | {r.get('graph_nodes', '')} | {fmt_s(r['total_s'])} | "
            f"{fmt_s(pass_s(r, 'trace'))} | {fmt_s(pass_s(r, 'stamp_layers'))} | {fmt_s(pass_s(r, 'find_repeated_blocks'))} | "
            f"{fmt_s(pass_s(r, 'enumerate_strategies'))} | {fmt_s(pass_s(r, 'merge_followers'))} | "
            f"{fmt_s(pass_s(r, 'estimate_costs'))} | {fmt_s(build)} | "
            f"{fmt_s(r.get('highs_s'))} | "
            f"{r.get('binary')} / {r.get('continuous')} / {r.get('rows')} | {fmt_ms(r.get('objective'))} | "
            f"{fmt_ms(r.get('lower_bound'))} | {r.get('gap', 0):.2%} | {r['blocks']} | {r['load']:.1f} |"
            + (f" error: {r['error'][:300]}" if "error" in r else ""))
    return out


def untied_md(d: dict, depth: dict | None) -> list[str]:
    out = depth_md(d, "Without layer tying (tie_blocks=False), training")
    tied = {r["L"]: r for r in (depth or {}).get("rows", []) if r["mode"] == "train"}
    pairs = [(u, tied[u["L"]]) for u in d["rows"] if not u.get("skipped") and u["L"] in tied
             and u.get("objective") and tied[u["L"]].get("objective")]
    if pairs:
        out += ["", "Tied vs untied: how much the tied plan's objective exceeds the untied one (tying restricts "
                "the choice; an untied solve that hits HiGHS's 60 s limit reports a gap, and its lower bound "
                "is then the fair comparison).", "",
                "| L | tied objective ms | untied objective ms | untied lower bound ms | untied gap | "
                "tied / untied - 1 | tied / untied bound - 1 (the most tying can cost) | ILP size tied | "
                "ILP size untied |", "|---|---|---|---|---|---|---|---|---|"]
        for u, t in pairs:
            out.append(f"| {u['L']} | {fmt_ms(t['objective'])} | {fmt_ms(u['objective'])} | "
                       f"{fmt_ms(u['lower_bound'])} | {u['gap']:.2%} | {t['objective'] / u['objective'] - 1:+.2%} | "
                       f"{t['objective'] / u['lower_bound'] - 1:+.2%} | "
                       f"{t['binary']} / {t['continuous']} / {t['rows']} | "
                       f"{u['binary']} / {u['continuous']} / {u['rows']} |")
    return out


# ---------------------------------------------------------------------------------------------------
# part 2: the headline row


HEADLINE_PARAMS = ("layers.0.attn.q_proj.weight", "layers.0.attn.k_proj.weight", "layers.0.attn.o_proj.weight",
                   "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
                   "layers.0.attn_norm.weight", "tok_emb.weight", "lm_head.weight")


def placements_by_fqn(plan) -> dict[str, str]:
    from spmd.core.specs import placements_str

    return {fqn: placements_str(plan.choices[ph].outputs[0]) for ph, fqn in plan.labels.items() if ph in plan.choices}


def part_headline(args) -> dict:
    model, inputs = llama(args.headline_layers, args.seq, args.batch, True)
    row, c = run_case(model, inputs, mesh88(), training=True, loss_fn=lm_loss)
    row.update(L=args.headline_layers, mode="train", tied="auto")
    print(summary_line(row), flush=True)
    variants = []
    if args.headline_budget:  # the same under an 80 GB budget: the time-optimal plan above ignores memory
        vrow, vc = run_case(model, inputs, mesh88(), training=True, loss_fn=lm_loss, memory_budget=args.budget)
        vrow.update(label=f"memory_budget={args.budget / GB:.0f} GB", placements=_picked(vc))
        variants.append(vrow)
        print(summary_line(vrow), flush=True)
    if c is not None:
        by_fqn = placements_by_fqn(c.plan)
        row["placements"] = {f: by_fqn.get(f, "?") for f in HEADLINE_PARAMS}
        print(json.dumps(row["placements"], indent=1), flush=True)
        t0 = time.perf_counter()
        try:
            text = report_of(c).explain()
            row["explain_s"] = time.perf_counter() - t0
            lines = text.splitlines()
            row["explain_head"] = lines[:40]
        except Exception as e:  # explain is a reader's aid: report, do not fail the bench
            row["explain_error"] = f"{type(e).__name__}: {e}"
    return {"row": row, "variants": variants, "seq": args.seq, "batch": args.batch}


def _picked(c) -> dict:
    if c is None:
        return {}
    by_fqn = placements_by_fqn(c.plan)
    return {f: by_fqn.get(f, "?") for f in HEADLINE_PARAMS}


def headline_md(d: dict) -> list[str]:
    r = d["row"]
    out = [f"### Headline: LLaMA3-8B ({r['L']} layers), training, batch {d['batch']}, seq {d['seq']}, (dp=8, tp=8)",
           "", f"Whole plan {r['total_s']:.1f} s at load {r['load']:.1f} (target: under 2 s).", "",
           "| pass | seconds |", "|---|---|"]
    for name in PASSES:
        s = pass_s(r, name)
        if s is None:
            continue
        if name == "solve_placements" and r.get("highs_s") is not None:
            out.append(f"| solve_placements: building the ILP | {s - r['highs_s']:.2f} |")
            out.append(f"| solve_placements: HiGHS | {r['highs_s']:.2f} |")
        else:
            out.append(f"| {name} | {s:.2f} |")
    out.append(f"| fake_model (meta -> fake tensors) | {r['fake_s']:.2f} |")
    if "error" in r:
        return out + ["", f"error: {r['error']}"]
    mem = ", ".join(f"{k} {v / GB:.1f}" for k, v in r["memory"].items())
    out += ["", f"- graph: {r.get('graph_nodes')} call nodes; repeated blocks: {r['blocks']}",
            f"- ILP: {r['binary']} binary, {r['continuous']} continuous, {r['rows']} rows; {r['status']}",
            f"- predicted step: {fmt_ms(r['objective'])} ms (compute {fmt_ms(r['compute_s'])} + communication "
            f"{fmt_ms(r['comm_s'])}); lower bound {fmt_ms(r['lower_bound'])} ms, gap {r['gap']:.2%}",
            f"- predicted memory per rank: {r['peak'] / GB:.1f} GB ({mem} GB)",
            "- collectives: " + ", ".join(f"{k}: {n}" for k, n in r["collectives"].items()),
            f"- on tp: {r.get('techniques', '?')}; layers recomputed: {r.get('recompute', 0)} whole, "
            f"{r.get('recompute_selective', 0)} selectively", "",
            "| parameter | placements (dp, tp) |", "|---|---|"]
    out += [f"| `{f}` | `{p}` |" for f, p in r.get("placements", {}).items()]
    if d.get("variants"):
        out += ["", "Variants of the same model and mesh:", "",
                "| variant | total s | HiGHS s | predicted step ms (compute + comm) | gap | peak GB | "
                "q / o / gate / down weight | on tp | collectives |", "|---|---|---|---|---|---|---|---|---|"]
        for v in d["variants"]:
            if "error" in v:
                out.append(f"| {v['label']} | {fmt_s(v['total_s'])} | | {v['error'][:300]} | | | | | |")
                continue
            pl = v.get("placements", {})
            w = " / ".join(f"`{pl.get(k, '?')}`" for k in ("layers.0.attn.q_proj.weight", "layers.0.attn.o_proj.weight",
                                                          "layers.0.mlp.gate_proj.weight", "layers.0.mlp.down_proj.weight"))
            out.append(f"| {v['label']} | {fmt_s(v['total_s'])} | {fmt_s(v['highs_s'])} | {fmt_ms(v['objective'])} "
                       f"({fmt_ms(v['compute_s'])} + {fmt_ms(v['comm_s'])}) | {v['gap']:.2%} | {v['peak'] / GB:.1f} | "
                       f"{w} | {v.get('techniques', '?')} | " + ", ".join(f"{k}: {n}" for k, n in v["collectives"].items())
                       + " |")
    if r.get("explain_head"):
        out += ["", f"`plan.explain()` (took {r['explain_s']:.1f} s), first lines:", "", "```",
                *r["explain_head"], "```"]
    elif r.get("explain_error"):
        out += ["", f"`plan.explain()` failed: {r['explain_error']}"]
    return out


# ---------------------------------------------------------------------------------------------------
# part 3: the ViT seed


def vit(cfg: ViTConfig, batch: int, dtype):
    with torch.device("meta"):
        model = ViT(cfg).to(dtype)
        images = torch.empty(batch, cfg.channels, cfg.image, cfg.image, dtype=dtype)
        labels = torch.randint(0, cfg.classes, (batch,))
    return model, (images, labels)


def fsdp_pins(model, mesh) -> tuple[dict, dict[str, str]]:
    """Inputs and every parameter sharded on dim 0 over every mesh axis ([S(0), S(0)]: over all 64 ranks);
    where dim 0 does not split evenly, the first dim that does, else replicated. Returns the pins and
    the exceptions."""
    n, k = mesh.size, mesh.ndim
    params, exceptions = {}, {}
    for fqn, p in model.named_parameters():
        dims = [d for d, s in enumerate(p.shape) if s % n == 0]
        if dims and dims[0] == 0:
            params[fqn] = [Shard(0)] * k
        elif dims:
            params[fqn] = [Shard(dims[0])] * k
            exceptions[fqn] = f"{tuple(p.shape)}: S({dims[0]})"
        else:
            params[fqn] = [Replicate()] * k
            exceptions[fqn] = f"{tuple(p.shape)}: R"
    ins = {"images": [Shard(0)] * k, "labels": [Shard(0)] * k}
    return dict(in_placements=ins, param_placements=params), exceptions


def mesh64() -> spmd.MeshSpec:
    """The 64 ranks as one flat axis on InfiniBand (a ring over 8 nodes is bound by its inter-node hops):
    the mesh of a 1-D FSDP job. On the (8, 8) mesh, pins that store every weight [S(0), S(0)] do not
    force FSDP: that is also the storage of column-parallel on tp + FSDP on dp, and the solver uses it
    that way. On one axis, tensor parallelism would cross InfiniBand 64 ways."""
    return spmd.MeshSpec((64,), ("dp",), (infiniband(),))


def megatron_fsdp_pins(model, mesh) -> dict:
    """The published 2-D layout as pins: Megatron TP on tp (q/k/v/fc1 column-parallel: weight and bias
    S(0); o_proj/fc2 row-parallel: weight S(1)), FSDP on dp (every parameter's dim 0 sharded over dp,
    nested outside the tp sharding); the rest (norms, embeddings, head, row-parallel biases) FSDP on dp
    only, replicated on tp; images and labels split by batch over dp only. As everywhere here, pins fix
    the stored layouts and the inputs; the solver still picks how each op computes."""
    dp = mesh.shape[0]
    params = {}
    for fqn, p in model.named_parameters():
        if fqn.startswith("blocks.") and any(k in fqn for k in ("q_proj", "k_proj", "v_proj", "fc1")):
            params[fqn] = [Shard(0), Shard(0)]
        elif fqn.startswith("blocks.") and fqn.endswith(("o_proj.weight", "fc2.weight")):
            params[fqn] = [Shard(0), Shard(1)]
        else:
            dims = [d for d, s in enumerate(p.shape) if s % dp == 0]
            params[fqn] = [Shard(dims[0]), Replicate()] if dims else [Replicate(), Replicate()]
    return dict(in_placements={"images": [Shard(0), Replicate()], "labels": [Shard(0), Replicate()]},
                param_placements=params)


def part_vit(args) -> dict:
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.vit_dtype]
    out = {"batch": args.vit_batch, "dtype": args.vit_dtype, "ib_gbps": args.ib_gbps, "budget": args.budget,
           "optimizer_state_factor": args.optimizer_state_factor, "models": []}
    sizes = [("vit_60b", ViTConfig.vit_60b, args.vit_batch), ("vit_120b", ViTConfig.vit_120b, args.vit_batch)]
    sizes += [("vit_120b", ViTConfig.vit_120b, b) for b in args.vit_120b_batches if b != args.vit_batch]
    sizes = [s for s in sizes if s[0] in args.vit_models.split(",")]
    for name, make, batch in sizes:
        cfg = make(args.vit_layers) if args.vit_layers else make()
        model, inputs = vit(cfg, batch, dtype)
        entry = {"name": name, "batch": batch, "layers": cfg.layers, "dim": cfg.dim, "heads": cfg.heads,
                 "params": sum(p.numel() for p in model.parameters()), "plans": {}}
        print(f"{name}: {cfg.layers} layers, dim {cfg.dim}, {entry['params'] / 1e9:.2f} B parameters, batch {batch}",
              flush=True)
        pins, exceptions = fsdp_pins(model, mesh88())
        entry["fsdp_exceptions"] = exceptions
        variants = [("2-D (free)", None, mesh88()),
                    ("2-D pinned: TP on tp, FSDP on dp", megatron_fsdp_pins(model, mesh88()), mesh88()),
                    ("FSDP-only", pins, mesh88()),
                    ("FSDP-only, flat (64,) mesh on InfiniBand", fsdp_pins(model, mesh64())[0], mesh64())]
        short = dict(zip(("free", "pinned", "fsdp", "flat"), variants))
        variants = [short[k] for k in args.vit_variants.split(",")]
        budget0 = args.budget or None
        for label, p, mesh in variants:
            for budget in ((budget0, None) if args.also_unbudgeted and budget0 else (budget0,)):
                row, c = run_case(model, inputs, mesh, training=True, loss_fn=cls_loss, pins=p,
                                  memory_budget=budget, optimizer_state_factor=args.optimizer_state_factor)
                row["budget"] = budget
                if c is not None:
                    by_fqn = placements_by_fqn(c.plan)
                    row["placements"] = {f: by_fqn.get(f, "?") for f in (
                        "blocks.0.attn.q_proj.weight", "blocks.0.attn.o_proj.weight", "blocks.0.mlp.fc1.weight",
                        "blocks.0.mlp.fc2.weight", "patch_embed.weight", "head.weight")}
                key = label if budget is not None or not budget0 else label + ", no budget"
                entry["plans"][key] = row
                print(f"  {key}: " + (f"does not fit: {row['error'][:300]}" if "error" in row else
                                      f"{fmt_ms(row['objective'])} ms, peak {row['peak'] / GB:.1f} GB, "
                                      f"{row['collectives']}, total {row['total_s']:.0f} s"), flush=True)
        out["models"].append(entry)
    return out


def _floor_gb(msg: str) -> str:
    import re

    m = re.search(r"needs about ([\d.]+) MiB", msg)
    return f"{float(m.group(1)) * 2**20 / GB:.1f} GB" if m else "?"


def vit_md(d: dict) -> list[str]:
    out = [f"### ViT seed: 64 ranks (dp=8 InfiniBand, tp=8 NVLink), H100 profile, global batch {d['batch']} "
           f"images 224x224 (batch per row), {d['dtype']}, AdamW state factor {d['optimizer_state_factor']:g}, budget "
           + (f"{d['budget'] / GB:.0f} GB per rank" if d["budget"] else "no budget")
           + (f", InfiniBand what-if {d['ib_gbps']:g} GB/s" if d.get("ib_gbps") else ""), "",
           "| model | params | batch | plan | budget | fits? | predicted step ms (compute + comm + "
           "recompute) | predicted peak GB (params / grads / optimizer / activations) | layers recomputed (whole: all "
           "ops; selectively: all but matmuls and attention) | on tp | "
           "collectives | qkv / o / fc1 / fc2 weight | total s (HiGHS) | load |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in d["models"]:
        for key, r in m["plans"].items():
            budget = f"{r['budget'] / GB:.0f} GB" if r.get("budget") else "none"
            if "error" in r:
                fit = f"does not fit (floor {_floor_gb(r['error'])})" if "memory_budget" in r["error"] else "error"
                out.append(f"| {m['name']} | {m['params'] / 1e9:.1f} B | {m.get('batch', d['batch'])} | {key} | "
                           f"{budget} | {fit} | | | | | | | "
                           f"{fmt_s(r['total_s'])} | {r['load']:.1f} |")
                continue
            mem = r["memory"]
            pl = r.get("placements", {})
            w = " / ".join(f"`{pl.get(k, '?')}`" for k in ("blocks.0.attn.q_proj.weight", "blocks.0.attn.o_proj.weight",
                                                          "blocks.0.mlp.fc1.weight", "blocks.0.mlp.fc2.weight"))
            limit = r.get("budget") or H100_BYTES
            fits = "yes" if r["peak"] <= limit else f"no (over {limit / GB:.1f} GB)"
            out.append(
                f"| {m['name']} | {m['params'] / 1e9:.1f} B | {m.get('batch', d['batch'])} | {key} | {budget} | {fits} | {fmt_ms(r['objective'])} "
                f"({fmt_ms(r['compute_s'])} + {fmt_ms(r['comm_s'])} + {fmt_ms(r.get('recompute_s', 0.0))}) | "
                f"{r['peak'] / GB:.1f} "
                f"({mem.get('parameters', 0) / GB:.1f} / {mem.get('gradients', 0) / GB:.1f} / "
                f"{mem.get('optimizer', 0) / GB:.1f} / {mem.get('activations', 0) / GB:.1f}) | "
                f"{r.get('recompute', 0)} whole, {r.get('recompute_selective', 0)} selectively, of {r.get('layers', '?')} | "
                f"{r.get('techniques', '?')} | "
                + ", ".join(f"{k}: {n}" for k, n in r["collectives"].items())
                + f" | {w} | {fmt_s(r['total_s'])} ({fmt_s(r['highs_s'])}) | {r['load']:.1f} |")
    out += ["", "Ratio of predicted step times (same budget):", ""]
    for m in d["models"]:
        ok = lambda r: r is not None and "error" not in r  # noqa: E731
        for fsdp_key, two_key in (("FSDP-only", "2-D (free)"), ("FSDP-only", "2-D pinned: TP on tp, FSDP on dp"),
                                  ("FSDP-only, flat (64,) mesh on InfiniBand", "2-D (free)")):
            fsdp, two = m["plans"].get(fsdp_key), m["plans"].get(two_key)
            if ok(two) and ok(fsdp):
                out.append(f"- {m['name']}, batch {m.get('batch', d['batch'])}, {fsdp_key} / {two_key}: "
                           f"{fsdp['objective'] / two['objective']:.2f}x")
            else:
                out.append(f"- {m['name']}, batch {m.get('batch', d['batch'])}, {fsdp_key} / {two_key}: no ratio "
                           f"({two_key}: {'ok' if ok(two) else 'no plan'}, {fsdp_key}: {'ok' if ok(fsdp) else 'no plan'})")
        if m.get("fsdp_exceptions"):
            out.append("  FSDP-only pins not on dim 0 (not divisible by 64): "
                       + "; ".join(f"`{k}` {v}" for k, v in m["fsdp_exceptions"].items()))
    return out


# ---------------------------------------------------------------------------------------------------


def git_state() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "spmd"], cwd=ROOT, capture_output=True,
                               text=True).stdout.strip()
        return head + (" + uncommitted changes in spmd/" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def environment(args, wall, load0, load1) -> list[str]:
    return [f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
            f"- machine: {platform.node()}, {platform.processor() or platform.machine()}, nproc {os.cpu_count()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}",
            f"- spmd: git {git_state()}",
            f"- command: `{' '.join(['bench/bench_plan.py'] + sys.argv[1:])}`; wall {wall:.0f} s; load average "
            f"(1 min) {load0:.2f} at start, {load1:.2f} at end"]


def write_report(path: str, results: dict) -> None:
    head = "# Planning at scale\n\n(analysis: none yet)\n\n"
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
        if MARKER in text:
            head = text.split(MARKER)[0]
    body = [MARKER, "", "Generated by `bench/bench_plan.py`; everything above the marker is written by hand.", ""]
    depth = results.get("depth", {}).get("data")
    renders = (("headline", headline_md), ("depth", depth_md), ("untied", lambda d: untied_md(d, depth)),
               ("vit", vit_md))
    for part, render in renders:
        if part in results:
            body += render(results[part]["data"]) + ["", "Run:", ""] + results[part]["env"] + [""]
    with open(path, "w") as f:
        f.write(head + "\n".join(body) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="headline,depth,untied,vit",
                    help="comma-separated; run them one or two at a time to stay under 10 minutes a run")
    ap.add_argument("--quick", action="store_true", help="smoke run: L 2,4, seq 512, untied L 2, ViT 4 layers; writes /tmp/results_plan_quick.md")
    ap.add_argument("--layers", default="4,8,16,32,64,96", help="depths for the depth part")
    ap.add_argument("--untied-layers", default="4,8,16", help="depths also planned with tie_blocks=False")
    ap.add_argument("--untied-budget-s", type=float, default=180.0,
                    help="skip the next untied depth if the last one times 2.5 would exceed this")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--headline-layers", type=int, default=32)
    ap.add_argument("--headline-budget", type=int, default=1, help="headline: also plan under --budget (0: no)")
    ap.add_argument("--vit-batch", type=int, default=512, help="global batch for the ViT part (8 images per rank)")
    ap.add_argument("--vit-120b-batches", default="256", help="ViT-120B also at these global batches")
    ap.add_argument("--vit-models", default="vit_60b,vit_120b")
    ap.add_argument("--vit-variants", default="free,pinned,fsdp,flat",
                    help="free: 2-D free plan; pinned: TP on tp + FSDP on dp; fsdp: FSDP pins on (8, 8); flat: (64,) mesh")
    ap.add_argument("--ib-gbps", type=float, default=0.0,
                    help="ViT: InfiniBand bus bandwidth what-if in GB/s (default: the profile's 25)")
    ap.add_argument("--vit-dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--vit-layers", type=int, default=0, help="0: the published depth (72 / 66)")
    ap.add_argument("--budget", type=float, default=H100_BYTES, help="memory budget per rank, bytes (0: none)")
    ap.add_argument("--optimizer-state-factor", type=float, default=6.0,
                    help="optimizer bytes per parameter byte: 6 = AdamW with fp32 master weights, m and v "
                         "(12 bytes) on bf16 parameters")
    ap.add_argument("--also-unbudgeted", action="store_true", help="ViT: plan without a budget too")
    ap.add_argument("--render-only", action="store_true", help="rewrite the markdown from the stored JSON")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results_plan.md"))
    args = ap.parse_args()
    if args.quick:
        args.layers, args.untied_layers, args.seq, args.vit_layers = "2,4", "2", 512, args.vit_layers or 4
        args.headline_layers = 4
        if args.out == os.path.join(ROOT, "bench", "results_plan.md"):
            args.out = os.path.join("/tmp", "results_plan_quick.md")
    args.layers = [int(x) for x in args.layers.split(",") if x]
    args.untied_layers = [int(x) for x in args.untied_layers.split(",") if x]
    args.vit_120b_batches = [int(x) for x in args.vit_120b_batches.split(",") if x]
    if args.ib_gbps:
        global IB_BANDWIDTH
        IB_BANDWIDTH = args.ib_gbps * 1e9
    parts = [p for p in args.parts.split(",") if p]
    store = os.path.splitext(args.out)[0] + ".json"
    results = {}
    if os.path.exists(store):
        with open(store) as f:
            results = json.load(f)
    if args.render_only:
        parts = []
        write_report(args.out, results)
    for part in parts:
        fn = {"depth": part_depth, "untied": part_untied, "headline": part_headline, "vit": part_vit}[part]
        load0, t0 = load(), time.perf_counter()
        data = fn(args)
        results[part] = {"data": data, "env": environment(args, time.perf_counter() - t0, load0, load())}
        with open(store, "w") as f:
            json.dump(results, f, indent=1, default=str)
        write_report(args.out, results)
    print(f"wrote {args.out} and {store}")


if __name__ == "__main__":
    main()
