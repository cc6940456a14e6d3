"""Forward-only GPT benchmark: spmd's compiled per-rank graph vs DTensor eager vs hand-written Megatron.

Two gloo ranks, one thread each, float32, torch.no_grad. Variants, timed interleaved in one run:

    a1  spmd, the plan its cost model picks with no pins
    a2  spmd pinned to the Megatron plan (q/k/v/fc1 column-, o_proj/fc2 row-parallel; 2 all_reduces per layer)
    b   DTensor eager: parallelize_module with ColwiseParallel / RowwiseParallel (the same Megatron plan)
    c   hand-written Megatron: plain tensors, local weight slices, explicit dist.all_reduce
    d   one process, one thread, the full model (rank 0 runs it while rank 1 waits)
    ar  context only: one dist.all_reduce of a (batch, seq, dim) activation

Run (see bench/README.md):

    torchrun --nproc-per-node 2 bench/bench_forward.py        # or: python bench/bench_forward.py
    python bench/bench_forward.py --sizes tiny --profile      # plus a per-op profile of a2 vs c

Rank 0 writes bench/results_forward.md and prints the same. Gloo all_reduce here is slow and bimodal,
so the variants are interleaved (rounds of a few calls each, order rotated every round) and the
ratios are only meaningful within one run.
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

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

SIZES = {
    #        vocab, seq, dim, heads, layers, batch
    "tiny": (128, 32, 64, 4, 2, 4),
    "medium": (512, 128, 512, 8, 4, 8),
}
# (rounds, calls per variant per round, warmup calls per variant)
SCHEDULE = {"tiny": (10, 30, 20), "medium": (8, 5, 3)}
VARIANTS = ("a1", "a2", "b", "c", "d")


# ---------------------------------------------------------------------------------------------------
# (c) hand-written Megatron


class HandMegatron:
    """Megatron tensor parallelism by hand: rank r holds rows r of q/k/v/fc1 (and their biases), columns
    r of o_proj/fc2 (full biases, added after the all_reduce), heads h*r/w .. h*(r+1)/w; embeddings,
    LayerNorms and the LM head are replicated. Two all_reduces per layer."""

    def __init__(self, model, rank: int, world: int):
        cfg = model.cfg
        self.heads = cfg.heads // world
        self.head_dim = cfg.dim // cfg.heads
        self.tok = model.tok_emb.weight.detach()
        self.pos = model.pos_emb.weight.detach()

        def col(lin):  # Shard(0) of the (out, in) weight: this rank's output features
            return (lin.weight.detach().chunk(world, 0)[rank].contiguous(),
                    lin.bias.detach().chunk(world, 0)[rank].contiguous())

        def row(lin):  # Shard(1): this rank's input features; bias replicated
            return lin.weight.detach().chunk(world, 1)[rank].contiguous(), lin.bias.detach()

        self.layers = []
        for blk in model.blocks:
            a, m = blk.attn, blk.mlp
            self.layers.append(dict(
                ln1=(blk.ln1.weight.detach(), blk.ln1.bias.detach(), blk.ln1.eps),
                q=col(a.q_proj), k=col(a.k_proj), v=col(a.v_proj), o=row(a.o_proj),
                ln2=(blk.ln2.weight.detach(), blk.ln2.bias.detach(), blk.ln2.eps),
                fc1=col(m.fc1), fc2=row(m.fc2)))
        self.ln_f = (model.ln_f.weight.detach(), model.ln_f.bias.detach(), model.ln_f.eps)
        self.head = model.lm_head.weight.detach()

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        b, s = tokens.shape
        h, hd = self.heads, self.head_dim
        x = F.embedding(tokens, self.tok) + self.pos[:s]
        for L in self.layers:
            y = F.layer_norm(x, (x.shape[-1],), *L["ln1"][:2], L["ln1"][2])
            q = F.linear(y, *L["q"]).view(b, s, h, hd).transpose(1, 2)
            k = F.linear(y, *L["k"]).view(b, s, h, hd).transpose(1, 2)
            v = F.linear(y, *L["v"]).view(b, s, h, hd).transpose(1, 2)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h * hd)
            o = F.linear(att, L["o"][0])
            dist.all_reduce(o)
            x = x + o + L["o"][1]
            y = F.layer_norm(x, (x.shape[-1],), *L["ln2"][:2], L["ln2"][2])
            z = F.linear(F.gelu(F.linear(y, *L["fc1"])), L["fc2"][0])
            dist.all_reduce(z)
            x = x + z + L["fc2"][1]
        x = F.layer_norm(x, (x.shape[-1],), *self.ln_f[:2], self.ln_f[2])
        return F.linear(x, self.head)


# ---------------------------------------------------------------------------------------------------
# (a), (b) setup


def megatron_param_pins(layers: int) -> dict:
    from torch.distributed.tensor import Replicate, Shard

    pins = {}
    for i in range(layers):
        for n in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.fc1"):
            pins[f"blocks.{i}.{n}.weight"] = [Shard(0)]
            pins[f"blocks.{i}.{n}.bias"] = [Shard(0)]
        for n in ("attn.o_proj", "mlp.fc2"):
            pins[f"blocks.{i}.{n}.weight"] = [Shard(1)]
            pins[f"blocks.{i}.{n}.bias"] = [Replicate()]
    return pins


PLAN_LATENCY_S = 10e-3


def is_megatron(summary: dict, layers: int) -> bool:
    return summary == {("all_reduce", "tp"): 2 * layers}


def megatron_mesh_spec(mesh):
    """The gloo MeshSpec with a much higher link latency: planning only (runtime is unchanged)."""
    import dataclasses
    from spmd.mesh import MeshSpec

    spec = MeshSpec.from_device_mesh(mesh)
    links = tuple(dataclasses.replace(l, name=l.name + "-slow", latency_s=PLAN_LATENCY_S) for l in spec.links)
    return dataclasses.replace(spec, links=links)


_SDPA_RULE_REGISTERED = False


def register_cpu_sdpa_rule() -> None:
    """DTensor in torch 2.13 has no sharding rule for the CPU flash-attention kernel that
    F.scaled_dot_product_attention dispatches to; give it one (replicate, or shard batch or heads)."""
    global _SDPA_RULE_REGISTERED
    if _SDPA_RULE_REGISTERED:
        return
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    @register_sharding(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
    def _sdpa_cpu(query, key, value, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
        return [([p, p], [p, p, p, None, None]) for p in (Replicate(), Shard(1), Shard(0))]

    _SDPA_RULE_REGISTERED = True


def dtensor_megatron(model, mesh, layers: int):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    register_cpu_sdpa_rule()
    mb = copy.deepcopy(model)
    plan = {}
    for i in range(layers):
        # q/k/v stay DTensors so the model's view(b, s, heads, head_dim) keeps global shapes.
        for n in ("attn.q_proj", "attn.k_proj", "attn.v_proj"):
            plan[f"blocks.{i}.{n}"] = ColwiseParallel(use_local_output=False)
        plan[f"blocks.{i}.mlp.fc1"] = ColwiseParallel()
        plan[f"blocks.{i}.attn.o_proj"] = RowwiseParallel()
        plan[f"blocks.{i}.mlp.fc2"] = RowwiseParallel()
    return parallelize_module(mb, mesh, plan)


# ---------------------------------------------------------------------------------------------------
# timing


def percentile(xs, q):
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def time_interleaved(fns: dict, rank: int, rounds: int, per_round: int, warmup: int) -> dict:
    """Per variant, per call: the max over ranks of (barrier; t0; fn(); t1). `fns[name]` is None on a
    rank that sits the variant out (it still joins the barriers)."""
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            dist.barrier()
            if fns[name] is not None:
                fns[name]()
    times = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            fn = fns[name]
            for _ in range(per_round):
                dist.barrier()
                t0 = time.perf_counter()
                if fn is not None:
                    fn()
                times[name].append(time.perf_counter() - t0 if fn is not None else float("nan"))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, times)
    out = {}
    for n in names:
        per_call = zip(*(g[n] for g in gathered))
        out[n] = [max(t for t in ts if t == t) for ts in per_call]  # nan (sat out) never wins
    return out


# ---------------------------------------------------------------------------------------------------
# one size


def run_size(size: str, mesh, rank: int, world: int, args) -> dict:
    import spmd
    from torch.distributed.tensor import Replicate
    from examples.models import GPT, GPTConfig

    vocab, seq, dim, heads, layers, batch = SIZES[size]
    cfg = GPTConfig(vocab, seq, dim, heads, layers, sdpa=True, bias=True)
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    tokens = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))

    t0 = time.perf_counter()
    a1 = spmd.compile(model, mesh, example_inputs=(tokens,))
    t_a1 = time.perf_counter() - t0
    pins = dict(in_placements={"tokens": [Replicate()]}, param_placements=megatron_param_pins(layers),
                out_placements=[[Replicate()]])
    t0 = time.perf_counter()
    a2 = spmd.compile(model, mesh, example_inputs=(tokens,), **pins)
    t_a2 = time.perf_counter() - t0
    summary_pinned = dict(a2.plan.collective_summary())
    a2_free, a2_note = None, "planned with the default gloo profile"
    if not is_megatron(summary_pinned, layers):
        # The pins fix the weights, not the activations: with gloo's profile the solver may add sequence
        # parallelism (reduce_scatter + all_gather instead of all_reduce). Keep that plan as "a2sp" and
        # re-plan with a link latency high enough that one all_reduce beats two collectives.
        a2_free = a2
        a2_note = (f"with only the pins spmd picks {summary_str(summary_pinned)} (timed as a2sp); a2 is planned "
                   f"with mesh_spec = the gloo profile with link latency {PLAN_LATENCY_S * 1e3:.0f} ms (planning "
                   "only), so that one all_reduce beats reduce_scatter + all_gather")
        t0 = time.perf_counter()
        a2 = spmd.compile(model, mesh, example_inputs=(tokens,), mesh_spec=megatron_mesh_spec(mesh), **pins)
        t_a2 = time.perf_counter() - t0
    summary_a1 = dict(a1.plan.collective_summary())
    summary_a2 = dict(a2.plan.collective_summary())
    if not is_megatron(summary_a2, layers):
        raise RuntimeError(f"{size}: pinned Megatron plan has collectives {summary_a2}, "
                           f"expected exactly {2 * layers} all_reduces on tp")
    mb = dtensor_megatron(model, mesh, layers)
    hand = HandMegatron(model, rank, world)

    x1, x2 = a1.shard_inputs(tokens), a2.shard_inputs(tokens)
    xf = a2_free.shard_inputs(tokens) if a2_free is not None else None
    act = torch.randn(batch, seq, dim)
    fns = {
        "a1": lambda: a1(*x1),
        "a2": lambda: a2(*x2),
        "b": lambda: mb(tokens),
        "c": lambda: hand(tokens),
        "d": (lambda: model(tokens)) if rank == 0 else None,
        **({"a2sp": (lambda: a2_free(*xf))} if a2_free is not None else {}),
        "ar": lambda: dist.all_reduce(act),
    }
    with torch.no_grad():
        ref = model(tokens)
        outs = {"a1": a1.gather_outputs(fns["a1"]()), "a2": a2.gather_outputs(fns["a2"]()),
                "b": fns["b"](), "c": fns["c"]()}
        if a2_free is not None:
            outs["a2sp"] = a2_free.gather_outputs(fns["a2sp"]())
        check = {}
        for k, v in outs.items():
            err = (v - ref).abs().max().item()
            check[k] = err
            if not torch.allclose(v, ref, rtol=1e-4, atol=1e-4):
                raise RuntimeError(f"{size}: variant {k} differs from the single-process model: max |diff| {err:.3g}")
        rounds, per_round, warmup = SCHEDULE[size]
        rounds = max(1, int(rounds * args.scale))
        times = time_interleaved(fns, rank, rounds, per_round, warmup)

    prof = profile_size(a2, x2, hand, tokens, rank, args) if args.profile else None
    return dict(size=size, cfg=(vocab, seq, dim, heads, layers, batch), times=times, check=check,
                summary_a1=summary_a1, summary_a2=summary_a2, a2_note=a2_note, compile_s=(t_a1, t_a2),
                est_a1=a1.plan.objective, est_a2=a2.plan.objective, fingerprint=(a1.plan.fingerprint(), a2.plan.fingerprint()),
                n_nodes=len([n for n in a2.graph_module.graph.nodes if n.op == "call_function"]), profile=prof)


# ---------------------------------------------------------------------------------------------------
# profile (--profile): where a2's time goes compared with c


def profile_size(a2, x2, hand, tokens, rank: int, args) -> str:
    """Per-op self CPU time of a2 and c (rank 0's view), plus the cost of pieces of a2's call path."""
    from torch.profiler import ProfilerActivity, profile

    n = 20
    lines = []
    with torch.no_grad():
        for name, fn in (("a2", lambda: a2(*x2)), ("c", lambda: hand(tokens))):
            for _ in range(3):
                dist.barrier()
                fn()
            with profile(activities=[ProfilerActivity.CPU]) as p:
                for _ in range(n):
                    dist.barrier()
                    fn()
            if rank == 0:
                table = p.key_averages().table(sort_by="self_cpu_time_total", row_limit=14)
                lines.append(f"#### {name}: top ops by self CPU time over {n} calls (rank 0)\n\n```\n{table}\n```\n")
        # The generated graph without the module wrapper, and the per-call wrapper alone.
        gm = a2.graph_module
        args_ = [getattr(a2, attr) if kind == "state" else x2[0] for kind, attr in a2._order]
        res = {}
        for label, fn in (("CompiledModule.__call__", lambda: a2(*x2)), ("graph_module(*args)", lambda: gm(*args_)),
                          ("_check_inputs", lambda: a2._check_inputs(x2))):
            ts = []
            for _ in range(n):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            res[label] = statistics.median(ts)
    if rank == 0:
        lines.append("#### a2 call path, median of %d (rank 0)\n" % n)
        lines += [f"- {k}: {v * 1e3:.3f} ms" for k, v in res.items()]
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# report


def fmt_ms(s: float) -> str:
    return f"{s * 1e3:.2f}" if s >= 0.01 else f"{s * 1e3:.3f}"


def summary_str(s: dict) -> str:
    return ", ".join(f"{k} on {a}: {c}" for (k, a), c in sorted(s.items())) or "none"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def report(results: list[dict], world: int, wall: float) -> str:
    labels = {"a1": "a1 spmd, default plan", "a2": "a2 spmd, Megatron pins", "b": "b DTensor eager Megatron",
              "c": "c hand-written Megatron", "d": "d single process", "ar": "(ar: one dist.all_reduce of b*s*d fp32)",
              "a2sp": "a2sp spmd, Megatron pins only (its own pick)"}
    out = ["# Forward benchmark: spmd vs DTensor vs hand-written Megatron (GPT, gloo)", ""]
    out.append(f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}")
    out.append(f"- machine: {platform.node()}, {cpu_model()}, nproc {os.cpu_count()}, "
               f"Python {platform.python_version()}, torch {torch.__version__}")
    out.append(f"- setup: gloo, {world} ranks, 1 thread per rank, float32, torch.no_grad, forward only; "
               f"variants interleaved; per call the max over ranks after a dist.barrier(); d runs on rank 0 alone")
    out.append(f"- command: `{' '.join(sys.argv)}`; total wall {wall:.0f} s")
    out.append("")
    for r in results:
        vocab, seq, dim, heads, layers, batch = r["cfg"]
        t = r["times"]
        med = {k: statistics.median(v) for k, v in t.items()}
        out.append(f"## {r['size']}: d_model {dim}, {layers} layers, {heads} heads, seq {seq}, batch {batch}, vocab {vocab}")
        out.append("")
        out.append("| variant | median ms | p10 ms | p90 ms | / c (median) | calls |")
        out.append("|---|---|---|---|---|---|")
        for k in ("a1", "a2", "a2sp", "b", "c", "d", "ar"):
            if k not in t:
                continue
            ratio = f"{med[k] / med['c']:.3f}" if k != "ar" else "-"
            out.append(f"| {labels[k]} | {fmt_ms(med[k])} | {fmt_ms(percentile(t[k], 0.1))} | "
                       f"{fmt_ms(percentile(t[k], 0.9))} | {ratio} | {len(t[k])} |")
        out.append("")
        out.append(f"ratios: a2/c = {med['a2'] / med['c']:.3f}, a1/c = {med['a1'] / med['c']:.3f}, "
                   f"b/c = {med['b'] / med['c']:.3f}, d/c = {med['d'] / med['c']:.3f}")
        out.append("")
        out.append(f"- a1 plan (no pins): {summary_str(r['summary_a1'])}; estimated {r['est_a1'] * 1e3:.3f} ms; "
                   f"compile {r['compile_s'][0]:.1f} s; fingerprint {r['fingerprint'][0]}")
        out.append(f"- a2 plan (Megatron pins, output pinned [R]): {summary_str(r['summary_a2'])} "
                   f"(= 2 per layer x {layers}); estimated {r['est_a2'] * 1e3:.3f} ms; compile {r['compile_s'][1]:.1f} s; "
                   f"{r['n_nodes']} call nodes in the rank graph; {r['a2_note']}")
        out.append("- max |out - single process| (rank 0): " +
                   ", ".join(f"{k} {v:.2e}" for k, v in r["check"].items()))
        out.append("")
        if r["profile"]:
            out.append(f"### profile ({r['size']})\n")
            out.append(r["profile"])
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------------
# entry points


def worker(args) -> None:
    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    import spmd

    mesh = spmd.init_mesh((2,), ("tp",))
    rank, world = dist.get_rank(), dist.get_world_size()
    t0 = time.perf_counter()
    results = []
    for size in args.sizes.split(","):
        results.append(run_size(size, mesh, rank, world, args))
        if rank == 0:
            print(f"[bench_forward] {size} done at {time.perf_counter() - t0:.0f} s", flush=True)
    if rank == 0:
        text = report(results, world, time.perf_counter() - t0)
        with open(args.out, "w") as f:
            f.write(text)
        print(text, flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _spawned(rank: int, world: int, port: int, args) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    worker(args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="tiny,medium", help="comma list of: " + ", ".join(SIZES))
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the number of timing rounds")
    ap.add_argument("--profile", action="store_true", help="add a torch.profiler breakdown of a2 vs c")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results_forward.md"))
    args = ap.parse_args()
    if "RANK" in os.environ:  # under torchrun
        worker(args)
        return
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["OMP_NUM_THREADS"] = "1"
    mp.start_processes(_spawned, args=(2, port, args), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
