"""Predicted vs measured step time: `plan.predicted_step_s` (seconds per call: `plan.objective`, the graph's
compute and communication that the solver minimises, plus the wrapper's fixed costs around it) against the
measured median of compiled models on gloo, with the built-in gloo profile and with one
calibrated on this machine by `spmd.tools.calibrate`.

Models (examples.models), each as a forward (`torch.no_grad`) and a training step (forward + loss +
backward + AdamW's step over the rank's pieces, which the plan prices for its default
`optimizer_state_factor` of 2):

    mlp-tiny     MLP(16, 64), x (8, 16)                     mse loss
    mlp-medium   MLP(512, 2048), x (256, 512)               mse loss
    gpt-tiny     GPT d 64, 2 layers, 4 heads, seq 32, batch 4, vocab 128    LM cross-entropy
    gpt-medium   GPT d 256, 2 layers, 4 heads, seq 64, batch 4, vocab 512   LM cross-entropy

on 2 ranks (mesh tp=2) and 4 ranks (mesh dp=2, tp=2; on a 2-core machine, two ranks per core), and on
1 process alone (mesh tp=1, the 2-rank profile) to see the model without other ranks competing for the
cores, with a per-ATen-op breakdown of measured vs predicted.

Run from the repository root (spawns its own ranks; `--worlds 2` for one mesh only):

    python bench/bench_predict.py                       # calibrates first, writes bench/profile_gloo_<W>.json
    python bench/bench_predict.py --profiles bench/profile_gloo_2.json,bench/profile_gloo_4.json

Per round and variant: barrier, an untimed call, one timed call (right after a barrier a graph of a few ops
runs 2-2.5x slower, its caches evicted by the barrier's networking; the second call pays part of that still),
then calls back to back for about 2 ms timed together, per call: a training loop's steps, which no barrier
separates. That loop is `measured`; the single call is reported beside it. Both the max over ranks; the
profiles' compiled models run interleaved (one sample each per round), so load changes hit all. Rank 0
writes bench/results_predict.md.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import platform
import socket
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench_forward import cpu_model, git_state, percentile, summary_str, time_interleaved  # noqa: E402
from spmd.runtime.measure import graphs_alone  # noqa: E402

CASES = {  # name: (kind, config, batch shape); rounds (tiny, medium) set below
    "mlp-tiny": ("mlp", (16, 64), (8, 16)),
    "mlp-medium": ("mlp", (512, 2048), (256, 512)),
    "gpt-tiny": ("gpt", (128, 32, 64, 4, 2), (4, 32)),
    "gpt-medium": ("gpt", (512, 64, 256, 4, 2), (4, 64)),
}
MESHES = {1: ((1,), ("tp",)), 2: ((2,), ("tp",)), 4: ((2, 2), ("dp", "tp"))}
TOLERANCE = 0.25
LOOP_S = 2e-3  # measured: calls back to back for about this long, per call (`time_interleaved(loop_s=)`)


def mse(out, target):
    return F.mse_loss(out, target)


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build(case: str, train: bool):
    from examples.models import GPT, MLP, GPTConfig

    kind, cfg, shape = CASES[case]
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if kind == "mlp":
        model = MLP(*cfg)
        x = torch.randn(*shape, generator=g)
        return model, ((x, torch.randn(*shape, generator=g)) if train else (x,)), mse
    vocab, seq, dim, heads, layers = cfg
    model = GPT(GPTConfig(vocab, seq, dim, heads, layers, sdpa=True, bias=True))
    tokens = torch.randint(0, vocab, shape, generator=g)
    return model, ((tokens, torch.randint(0, vocab, shape, generator=g)) if train else (tokens,)), lm_loss


def call_nodes(compiled) -> int:
    gms = [compiled.split.forward, compiled.split.backward] if compiled.split is not None else [compiled.graph_module]
    return sum(1 for gm in gms for n in gm.graph.nodes if n.op == "call_function")


def step_fn(compiled, local, train: bool):
    params = list(compiled.parameters())
    if not train:
        def fwd():
            with torch.no_grad():
                compiled(*local)
        return fwd

    opt = torch.optim.AdamW(params, lr=1e-4)

    def step():
        compiled(*local).backward()
        opt.step()
        opt.zero_grad()
    return step


def reference(device, seconds: float):
    """A fixed kernel timed with every round: 256^3 matmuls, repeated to last about `seconds` by the
    calibrated device's numbers (the time scale matters: on a shared machine a 0.3 ms burst keeps its
    core, a 10 ms one gets preempted). Measured / predicted is how much slower the machine is now than
    when it was calibrated, to tell load from model error. Returns (fn, predicted seconds)."""
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    one = 2 * 256 ** 3 / device.flops + device.op_overhead_s
    k = max(1, min(400, round(seconds / one)))

    def ref():
        for _ in range(k):
            torch.mm(a, b)
    return ref, k * one


def per_op_table(compiled, local, train: bool, top: int = 16, sync=None, calls: int = 12) -> list[str]:
    """Each ATen op's measured time (an FX Interpreter timing every node, median of `calls` - 2 calls; with
    `sync`, called before and after each node: a GPU's queue drained) next to what the plan charged for it
    (`plan.node_costs`, by node name; a node `fuse_decomposed_ops` fused: its chain's), summed by op:
    where the model is off."""
    import collections

    import torch.fx as fx

    sync = sync or (lambda: None)
    args = [a.detach() for a in compiled._graph_args(local)]
    acc: dict[str, list[float]] = collections.defaultdict(list)
    targets: dict[str, str] = {}
    chains: dict[str, tuple] = {}

    class Timer(fx.Interpreter):
        def run_node(self, n):
            if n.op != "call_function":
                return super().run_node(n)
            targets[n.name] = getattr(n.target, "__name__", str(n.target))
            chains[n.name] = n.meta.get("spmd_fused", (n.name,))
            sync()
            t0 = time.perf_counter()
            r = super().run_node(n)
            sync()
            acc[n.name].append(time.perf_counter() - t0)
            return r

    with torch.no_grad():
        for _ in range(calls):
            if train:
                split = compiled.split
                flat = Timer(split.forward).run(*args)
                saved = flat[split.n_outputs + len(split.updates):]  # (after the outputs and buffers' new values)
                Timer(split.backward).run(*saved, *[torch.ones_like(o) for o in flat[:split.n_outputs]])
            else:
                Timer(compiled.graph_module).run(*args)
    by_op: dict[str, list] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for name, ts in acc.items():
        priced = [compiled.plan.node_costs[m] for m in chains[name] if m in compiled.plan.node_costs]
        op = targets[name] + ("" if priced else " (not a plan node)")
        by_op[op][0] += statistics.median(ts[2:])
        by_op[op][1] += sum(priced)
        by_op[op][2] += 1
    total_m, total_p = sum(v[0] for v in by_op.values()), sum(v[1] for v in by_op.values())
    lines = [f"Sum over nodes: measured {_ms(total_m)} ms (through an FX Interpreter, which adds a few us per node), "
             f"predicted {_ms(total_p)} ms.", "",
             "| ATen op | nodes | measured ms | predicted ms | measured / predicted |", "|---|---|---|---|---|"]
    for op, (m, p, k) in sorted(by_op.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"| {op} | {k} | {_ms(m)} | {_ms(p)} | {m / p:.2f} |" if p else
                     f"| {op} | {k} | {_ms(m)} | 0 | - |")
    return lines


def run_world(world: int, args, rank: int) -> dict:
    import spmd
    from spmd.tools.calibrate import calibrate, geometric_sizes, summary
    from spmd.core.profiles import load_profile, save_profile
    from spmd.core.mesh import MeshSpec
    from spmd.runtime.host import host_cpu_profile

    shape, names = MESHES[world]
    mesh = spmd.init_mesh(shape, names)
    given = {load_profile(p).meta.get("world"): p for p in args.profiles.split(",") if p}
    if world == 1:  # one process alone: the 2-rank profile, and no other rank sharing the cores
        given[1] = given.get(2, os.path.join(ROOT, "bench", "profile_gloo_2.json"))
    t0 = time.perf_counter()
    if world in given:
        prof, prof_path = load_profile(given[world]), given[world]
    else:
        log = (lambda s: print(f"[calibrate w={world}] {s}", flush=True)) if rank == 0 else None
        prof = calibrate(mesh, geometric_sizes(4096, 8 << 20, args.num_sizes), reps=args.cal_reps, log=log)
        prof_path = os.path.join(ROOT, "bench", f"profile_gloo_{world}.json")
        if rank == 0:
            save_profile(prof_path, prof.links, prof.device, prof.points, prof.meta)
    cal_s = time.perf_counter() - t0
    # builtin: the built-in cpu device; default: what `spmd.compile` plans with when given no mesh_spec (this
    # host's device, measured at first use: runtime/host.py); both with the built-in gloo links
    specs = {"builtin": MeshSpec.from_device_mesh(mesh), "default": MeshSpec.from_device_mesh(mesh, host_cpu_profile()),
             "calibrated": MeshSpec.from_profile(prof, shape, names)}
    rows = []
    for case in args.cases.split(","):
        for mode in args.modes.split(","):
            train = mode == "train"
            model, inputs, loss_fn = build(case, train)
            fns, info = {}, {}
            for pname, spec in specs.items():
                t1 = time.perf_counter()
                compiled = spmd.compile(copy.deepcopy(model), mesh, example_inputs=inputs, mesh_spec=spec,
                                        loss_fn=loss_fn if train else None)
                plan = compiled.plan
                local = compiled.shard_inputs(*inputs)
                fns[pname] = step_fn(compiled, local, train)
                if pname == "calibrated":
                    fns["graphs"] = graphs_alone(compiled, local)
                info[pname] = {"objective": plan.objective, "predicted": plan.predicted_step_s,
                               "wrapper": plan.wrapper_overhead_s, "compute": plan.compute_cost, "comm": plan.comm_cost,
                               "collectives": summary_str(plan.collective_summary()), "nodes": call_nodes(compiled),
                               "fingerprint": plan.fingerprint(), "compile_s": time.perf_counter() - t1,
                               "overhead_s": spec.device.op_overhead_s}
            tiny = "tiny" in case
            rounds = max(5, int((60 if tiny else 12) * args.scale))
            fns["ref"], ref_predicted = reference(specs["calibrated"].device, info["calibrated"]["objective"])
            times = time_interleaved(fns, rank, rounds, 1, 10 if tiny else 2, warm_each=True, loop_s=LOOP_S)
            info["ref_predicted"] = ref_predicted
            rows.append({"case": case, "mode": mode, "info": info, "times": times})
            if world == 1 and f"{case}:{mode}" in args.per_op.split(","):
                rows[-1]["per_op"] = per_op_table(compiled, local, train)
            if rank == 0:
                print(f"[w={world}] {case} {mode}: " + ", ".join(
                    f"{p} predicted {info[p]['predicted'] * 1e3:.2f} ms measured "
                    f"{statistics.median(times[p, 'loop']) * 1e3:.2f} ms" for p in specs) +
                      f"; graphs alone {statistics.median(times['graphs', 'loop']) * 1e3:.2f} ms; machine slowdown "
                      f"{statistics.median(times['ref', 'loop']) / ref_predicted:.2f}", flush=True)
    return {"world": world, "mesh": dict(zip(names, shape)), "rows": rows, "profile_path": prof_path,
            "summary": summary(prof), "cal_s": cal_s, "profile": prof,
            "specs": {k: (v.links, v.device) for k, v in specs.items()}}


# ---------------------------------------------------------------------------------------------------
# report


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f}" if s >= 0.01 else f"{s * 1e3:.3f}"


def report(res: dict) -> str:
    out = [f"## {res['world']} rank{'s' if res['world'] > 1 else ''}, mesh {res['mesh']}", ""]
    out.append(f"Profile `{os.path.relpath(res['profile_path'], ROOT)}` ({res['cal_s']:.0f} s to obtain):")
    out.append("")
    out.append(res["summary"])
    out.append("")
    for pname, (links, dev) in res["specs"].items():
        parts = []
        for axis, link in zip(res["mesh"], links):
            per = ", ".join(f"{k} {a * 1e6:.0f} us / {b / 1e9:.2f} GB/s" for k, a, b in link.per_collective)
            parts.append(f"{axis}: `{link.name}` {link.latency_s * 1e6:.0f} us / {link.bandwidth / 1e9:.2f} GB/s"
                         f"{' (' + per + ')' if per else ''}")
        out.append(f"- {pname}: " + "; ".join(parts) + f"; device `{dev.name}` {dev.flops / 1e9:.1f} GFLOP/s, "
                   f"{dev.memory_bandwidth / 1e9:.2f} GB/s, {dev.op_overhead_s * 1e6:.1f} us per op")
    out.append("")
    out.append("Columns: `measured` = per call, calls back to back for about "
               f"{LOOP_S * 1e3:.0f} ms (a training loop's steps), the max over ranks, median over rounds; `one call after "
               "a barrier` = the second of two calls right after a barrier, the max over ranks (each call pays for the "
               "caches the barrier evicted: what this bench measured before session 77), median over rounds, and its "
               "ratio to predicted; `slowdown` = the reference matmuls (as long as the calibrated prediction) measured "
               "now / predicted, i.e. how much slower the machine is than the calibrated profile says; `graphs alone` = "
               "the calibrated plan's generated graphs called directly (no module wrapper, no autograd), compared with "
               "`plan.objective`; `wrapper` = measured - graphs alone, and predicted (`plan.wrapper_overhead_s`).")
    out.append("")
    out.append("| model | mode | profile | plan collectives | call nodes | predicted ms (compute + comm + wrapper) | "
               "measured median ms | p10 / p90 ms | measured / predicted | within 25% | one call after a barrier ms "
               "(/ predicted) | slowdown | graphs alone ms | graphs / objective / slowdown | wrapper ms measured / "
               "predicted |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    hits = {"raw": 0, "normalized": 0, "rows": 0, "cal": 0, "single": 0}
    for r in res["rows"]:
        slow = statistics.median(r["times"]["ref", "loop"]) / r["info"]["ref_predicted"]
        g = statistics.median(r["times"]["graphs", "loop"])
        for p in PROFILES:
            i, t = r["info"][p], r["times"][p, "loop"]
            med, single = statistics.median(t), statistics.median(r["times"][p])
            ratio = med / i["predicted"] if i["predicted"] > 0 else float("inf")
            single_ratio = single / i["predicted"] if i["predicted"] > 0 else float("inf")
            ok = abs(ratio - 1) <= TOLERANCE
            hits["rows"] += 1
            hits["raw"] += ok
            hits["single"] += abs(single_ratio - 1) <= TOLERANCE
            hits[p] = hits.get(p, 0) + ok
            extra = " | | |"
            if p == "calibrated":
                norm = g / i["objective"] / slow
                hits["cal"] += 1
                hits["normalized"] += abs(norm - 1) <= TOLERANCE
                extra = f" {_ms(g)} | {norm:.2f} | {_ms(med - g)} / {_ms(i['wrapper'])} |"
            out.append(f"| {r['case']} | {r['mode']} | {p} | {i['collectives']} | {i['nodes']} | "
                       f"{_ms(i['predicted'])} ({_ms(i['compute'])} + {_ms(i['comm'])} + {_ms(i['wrapper'])}) | {_ms(med)} | "
                       f"{_ms(percentile(t, 0.1))} / {_ms(percentile(t, 0.9))} | {ratio:.2f} | {'yes' if ok else 'no'} | "
                       f"{_ms(single)} ({single_ratio:.2f}) | {slow:.2f} |" + extra)
    out.append("")
    out.append(f"Within +-25%: measured / predicted in {hits['raw']} of {hits['rows']} rows ("
               + ", ".join(f"{p} {hits.get(p, 0)} of {len(res['rows'])}" for p in PROFILES) + "); the calibrated plan's "
               f"graphs alone, load-normalized, in {hits['normalized']} of {hits['cal']}. One call after a barrier / "
               f"predicted: {hits['single']} of {hits['rows']}.")
    out.append("")
    for r in res["rows"]:
        if "per_op" in r:
            out.append(f"Per op, {r['case']} {r['mode']}, calibrated plan:")
            out.append("")
            out.extend(r["per_op"])
            out.append("")
    same = [f"{r['case']} {r['mode']}" for r in res["rows"]
            if len({r["info"][p]["fingerprint"] for p in PROFILES}) == 1]
    out.append(f"Same plan under all three profiles: {', '.join(same) or 'none'} (those pairs time one program twice: "
               "their measured medians differ only by noise).")
    out.append("")
    return "\n".join(out)


PROFILES = ("builtin", "default", "calibrated")
TITLE = "# Predicted vs measured step time (gloo, CPU)\n"


def header(wall: float, load) -> str:
    return "\n".join([
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- machine: {platform.node()}, {cpu_model()}, nproc {os.cpu_count()}, Python {platform.python_version()}, "
        f"torch {torch.__version__}",
        f"- spmd: git {git_state()}",
        f"- command: `{' '.join(sys.argv)}`; wall {wall:.0f} s for this world; load average (1 min) "
        f"{load[0][0]:.2f} at start, {load[1][0]:.2f} at end",
        "- predicted: `plan.predicted_step_s` (`plan.objective`, compute + communication seconds per call, plus "
        "`plan.wrapper_overhead_s`); measured: per call, calls back to back for about "
        f"{LOOP_S * 1e3:.0f} ms after the second of two calls after a barrier, the max over ranks, median over rounds "
        "(that second call is the `one call after a barrier` column); forward under no_grad; train = forward + loss + "
        "backward + AdamW's step (priced by the plan since session 52)", ""])


# ---------------------------------------------------------------------------------------------------
# entry points


def worker(world: int, args) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    t0, load0 = time.perf_counter(), os.getloadavg()
    res = run_world(world, args, rank)
    if rank == 0:
        heading, body = report(res).split("\n", 1)  # the world's heading, then its date and load
        text = TITLE + "\n" + heading + "\n\n" + header(time.perf_counter() - t0, (load0, os.getloadavg())) + body
        path = args.out.replace(".md", f".{world}.part.md")
        with open(path, "w") as f:
            f.write(text)
        print(text, flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _spawned(rank: int, world: int, port: int, args) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    worker(world, args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="2,4,1", help="1: one process alone, with the 2-rank profile")
    ap.add_argument("--per-op", default="gpt-medium:train,gpt-tiny:train",
                    help="CASE:MODE list to break down per ATen op (world 1 only)")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--modes", default="forward,train")
    ap.add_argument("--profiles", default="", help="comma list of profile files to use instead of calibrating "
                    "(matched to a world by the world size they were measured on)")
    ap.add_argument("--num-sizes", type=int, default=7)
    ap.add_argument("--cal-reps", type=int, default=11)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the number of timing rounds")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results_predict.md"))
    args = ap.parse_args()
    import torch.multiprocessing as mp

    parts = []
    for world in (int(w) for w in args.worlds.split(",")):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_spawned, args=(world, port, args), nprocs=world, start_method="spawn")
        part = args.out.replace(".md", f".{world}.part.md")
        with open(part) as f:
            parts.append(f.read())
        os.remove(part)
    with open(args.out, "w") as f:  # one title over the worlds' sections
        f.write(TITLE + "\n" + "\n".join(part.replace(TITLE + "\n", "", 1) for part in parts))


if __name__ == "__main__":
    main()
