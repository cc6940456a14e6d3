"""Forward-only GPT benchmark: spmd's compiled per-rank graph vs DTensor eager vs hand-written Megatron.

Two gloo ranks, one thread each, float32, torch.no_grad. Variants, timed interleaved in one run:

    a1  spmd, the plan its cost model picks with no pins
    a2  spmd pinned to the Megatron plan (q/k/v/fc1 column-, o_proj/fc2 row-parallel; 2 all_reduces per layer)
    a2sp only where the pins alone do not give that plan: spmd's own pick under the same pins (a2 is then
         planned with every collective's latency raised; see megatron_mesh_spec)
    b   DTensor eager: parallelize_module with ColwiseParallel / RowwiseParallel (the same Megatron plan)
    c   hand-written Megatron: plain tensors, local weight slices, explicit dist.all_reduce
    d   one process, one thread, the full model (rank 0 runs it while rank 1 waits)
    ar  context only: one dist.all_reduce of a (batch, seq, dim) activation

Run (see bench/README.md):

    torchrun --nproc-per-node 2 bench/bench_forward.py        # or: python bench/bench_forward.py
    python bench/bench_forward.py --profile tiny,medium      # plus where a2's time goes vs c

Rank 0 writes bench/results_forward.md and prints the same. Gloo all_reduce here is slow and bimodal,
so the variants are interleaved (one call each per round, order rotated every round) and the
ratios are only meaningful within one run; "/ c (paired)" is the median of the per-round ratios.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import math
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
# (rounds, calls per variant per round, warmup calls per variant). One call per round pairs the
# variants closely in time: the machine's load (other processes) moves on a scale of seconds.
SCHEDULE = {"tiny": (300, 1, 20), "medium": (40, 1, 3)}
LOOP_MAX_CALLS = 64  # `time_interleaved(loop_s=)`: at most this many calls back to back per sample


# ---------------------------------------------------------------------------------------------------
# (c) hand-written Megatron


class HandMegatron:
    """Megatron tensor parallelism by hand: rank r holds rows r of q/k/v/fc1 (and their biases), columns
    r of o_proj/fc2 (full biases, added after the all_reduce), heads h*r/w .. h*(r+1)/w; embeddings,
    LayerNorms and the LM head are replicated. Two all_reduces per layer."""

    def __init__(self, model, rank: int, world: int, all_reduce=dist.all_reduce):
        cfg = model.cfg
        self.all_reduce = all_reduce  # the profile swaps in a no-op to time compute alone
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
            self.all_reduce(o)
            x = x + o + L["o"][1]
            y = F.layer_norm(x, (x.shape[-1],), *L["ln2"][:2], L["ln2"][2])
            z = F.linear(F.gelu(F.linear(y, *L["fc1"])), L["fc2"][0])
            self.all_reduce(z)
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


def default_spec(mesh):
    """The MeshSpec `spmd.compile` plans with when given none: the gloo links and this host's device
    (runtime/host.py; collective: every rank calls it)."""
    from spmd.core.mesh import MeshSpec
    from spmd.runtime.host import host_cpu_profile

    return MeshSpec.from_device_mesh(mesh, host_cpu_profile())


def megatron_mesh_spec(mesh):
    """The gloo MeshSpec with every collective's latency raised to PLAN_LATENCY_S: planning only (the
    runtime is unchanged). With latency dominating, the plan with the fewest collectives wins; under the
    Megatron pins that is one all_reduce after o_proj and one after fc2. The per-collective entries of
    the profile (all_gather, reduce_scatter, all_to_all) are raised too: raising only the default
    latency, as this bench once did, now prices all_reduce alone at 10 ms and steers away from it."""
    def slow(link):
        return dataclasses.replace(link, name=link.name + "-slow", latency_s=PLAN_LATENCY_S,
                                   per_collective=tuple((k, PLAN_LATENCY_S, bw) for k, _, bw in link.per_collective))

    spec = default_spec(mesh)
    return dataclasses.replace(spec, links=tuple(slow(l) for l in spec.links))


def repriced(plan, mesh_spec, bucket_bytes: float | None = None) -> tuple[float, float]:
    """(compute, communication) seconds of `plan`'s choices priced with `mesh_spec`'s links: what the
    solver would have thought of that plan with the real profile. `bucket_bytes`: price the parameter
    gradient all_reduces (edges into the graph's outputs, training only) as bucketed, as the solver does."""
    from spmd.cost_model.comm import steps_cost

    comm = 0.0
    for e in plan.edges:
        gradient = bucket_bytes if e.consumer.startswith("output_") else None
        comm += steps_cost(e.steps, mesh_spec, gradient)
    return plan.compute_cost, comm


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


def time_interleaved(fns: dict, rank: int, rounds: int, per_round: int, warmup: int, warm_each: bool = False,
                     loop_s: float | None = None) -> dict:
    """Per variant, per call: the max over ranks of (barrier; t0; fn(); t1). `fns[name]` is None on a
    rank that sits the variant out (it still joins the barriers). `warm_each`: (barrier; fn(); t0; fn(); t1),
    each timed call after an untimed one, as a step follows a step in a training loop: the barrier's
    networking evicts the caches the dispatcher runs from, and on a graph of a few ops the first call
    after it pays for that (MLP(16, 64)'s forward on 2 gloo ranks: 37-51 us right after a barrier, 20-21 us
    as the second call, 18 us in a loop).

    `loop_s`: also, right after each timed call, k calls back to back timed together (a training loop's
    steps: no barrier between them), k the same on every rank and large enough that they last about
    `loop_s` (from the warm-up's calls); returned per variant under `(name, "loop")`, per call."""
    names = list(fns)
    spent = {n: [] for n in names}
    for name in names:
        for _ in range(warmup):
            dist.barrier()
            if fns[name] is not None:
                t0 = time.perf_counter()
                fns[name]()
                spent[name].append(time.perf_counter() - t0)
    calls = {n: 1 for n in names}
    if loop_s is not None:  # (every rank the same k: a variant with collectives makes them on each)
        k = torch.tensor([max(1, min(LOOP_MAX_CALLS, math.ceil(loop_s / max(min(spent[n] or [loop_s]), 1e-9))))
                          for n in names], dtype=torch.int64)
        dist.all_reduce(k, op=dist.ReduceOp.MAX)
        calls = dict(zip(names, k.tolist()))
    times = {n: [] for n in names}
    loops = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            fn = fns[name]
            for _ in range(per_round):
                dist.barrier()
                if warm_each and fn is not None:
                    fn()
                t0 = time.perf_counter()
                if fn is not None:
                    fn()
                times[name].append(time.perf_counter() - t0 if fn is not None else float("nan"))
                if loop_s is not None:
                    t0 = time.perf_counter()
                    for _ in range(calls[name] if fn is not None else 0):
                        fn()
                    loops[name].append((time.perf_counter() - t0) / calls[name] if fn is not None else float("nan"))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (times, loops))
    out = {}
    for n in names:
        per_call = zip(*(g[0][n] for g in gathered))
        out[n] = [max(t for t in ts if t == t) for ts in per_call]  # nan (sat out) never wins
        if loop_s is not None:
            out[(n, "loop")] = [max(t for t in ts if t == t) for ts in zip(*(g[1][n] for g in gathered))]
    return out


# ---------------------------------------------------------------------------------------------------
# one size


def run_size(size: str, mesh, rank: int, world: int, args) -> dict:
    import spmd
    from torch.distributed.tensor import Replicate
    from examples.models import GPT, GPTConfig
    from spmd.core.specs import placements_str

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
    a2_free, a2_note = None, "the pins alone give it, with the default gloo profile (no re-planning needed)"
    if not is_megatron(summary_pinned, layers):
        # The pins fix the weights, not the activations: the solver may shard tokens somewhere (sequence
        # or batch parallel) where it predicts compute savings that beat the extra collectives. Keep that
        # plan as "a2sp" and re-plan with every collective's latency high (fewest collectives wins).

        a2_free = a2
        t0 = time.perf_counter()
        a2 = spmd.compile(model, mesh, example_inputs=(tokens,), mesh_spec=megatron_mesh_spec(mesh), **pins)
        t_a2 = time.perf_counter() - t0
        comp, comm = repriced(a2.plan, default_spec(mesh))
        # What this bench's earlier workaround (only the default latency raised) gives now that the gloo
        # profile has per-collective numbers: all_reduce alone gets expensive.
        real = default_spec(mesh)
        old_spec = dataclasses.replace(real, links=tuple(dataclasses.replace(l, latency_s=PLAN_LATENCY_S)
                                                          for l in real.links))
        old = spmd.plan(model, old_spec, (tokens,), **pins)
        a2_note = (f"with only the pins spmd picks {summary_str(summary_pinned)} (timed as a2sp), estimated "
                   f"{a2_free.plan.objective * 1e3:.2f} ms (compute {a2_free.plan.compute_cost * 1e3:.2f}, communication "
                   f"{a2_free.plan.comm_cost * 1e3:.2f}); the Megatron plan priced with the same gloo profile: "
                   f"{(comp + comm) * 1e3:.2f} ms (compute {comp * 1e3:.2f}, communication {comm * 1e3:.2f}), so the "
                   f"solver's pick is {(comp + comm) / a2_free.plan.objective - 1:.1%} cheaper by its own model. a2 is "
                   f"therefore planned with every collective's latency at {PLAN_LATENCY_S * 1e3:.0f} ms (planning only). "
                   f"The earlier workaround, raising only the default latency, no longer gives Megatron: the profile's "
                   f"per-collective entries keep theirs, so it prices all_reduce alone at {PLAN_LATENCY_S * 1e3:.0f} ms "
                   f"and plans {summary_str(dict(old.collective_summary()))}")
    summary_a1 = dict(a1.plan.collective_summary())
    layout_a1 = (f"tokens {placements_str(a1.input_placements()['tokens'])} -> output "
                 f"{placements_str(a1.plan.choices['output_0'].inputs[0])}")
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

    prof = profile_size(a2, x2, model, tokens, rank, world) if size in args.profile.split(",") else None
    return dict(size=size, cfg=(vocab, seq, dim, heads, layers, batch), times=times, check=check,
                summary_a1=summary_a1, layout_a1=layout_a1, summary_a2=summary_a2, a2_note=a2_note, compile_s=(t_a1, t_a2),
                est_a1=a1.plan.objective, est_a2=a2.plan.objective, fingerprint=(a1.plan.fingerprint(), a2.plan.fingerprint()),
                n_nodes=len([n for n in a2.graph_module.graph.nodes if n.op == "call_function"]), profile=prof)


# ---------------------------------------------------------------------------------------------------
# profile (--profile): where a2's time goes compared with c


def without_collectives(compiled):
    """`compiled`'s rank graph with every all_reduce replaced by its input (wrong numbers, same compute)."""
    import torch.fx as fx
    from spmd.core import collectives as C

    gm, graph, env = compiled.graph_module, fx.Graph(), {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in (C.all_reduce, C.all_reduce_start, C.all_reduce_wait):
            env[node] = env[node.args[0]]
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    return fx.GraphModule(gm, graph)


def timed(fns: dict, n: int, barrier: bool) -> dict:
    """Interleaved medians and p10s (rank-local) of each callable over n calls."""
    ts = {k: [] for k in fns}
    for i in range(n + 5):
        for k, fn in fns.items():
            if barrier:
                dist.barrier()
            t0 = time.perf_counter()
            fn()
            if i >= 5:
                ts[k].append(time.perf_counter() - t0)
    return {k: (statistics.median(v), percentile(v, 0.1)) for k, v in ts.items()}


def count_ops(fn) -> dict:
    """How many times each ATen op is dispatched by one call of fn (views included)."""
    import collections
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.c = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.c[str(func.overloadpacket).replace("aten.", "")] += 1
            return func(*args, **(kwargs or {}))

    m = Count()
    with m:
        fn()
    return m.c


def profile_size(a2, x2, model, tokens, rank: int, world: int) -> str:
    """Where a2's time goes compared with c: compute without collectives, the collective itself, the
    module wrapper, and the ATen ops each compute path dispatches (rank 0's view). Everything is timed
    interleaved: a profiler window on one variant, then one on the other, saw different machine load."""
    from spmd.core.collectives import all_gather as spmd_all_gather
    from spmd.core.collectives import all_reduce as spmd_all_reduce
    from spmd.core.collectives import reduce_scatter as spmd_reduce_scatter

    n = 200 if model.cfg.dim < 256 else 10
    hand_nocomm = HandMegatron(model, rank, world, all_reduce=lambda t: None)
    gm_nocomm = without_collectives(a2)
    args_ = a2._graph_args(x2[:1])
    n_ops = len([nd for nd in a2.graph_module.graph.nodes if nd.op == "call_function"])
    act = torch.randn(tokens.shape[0], tokens.shape[1], model.cfg.dim)
    group = a2.group_names[0]
    lines = []
    with torch.no_grad():
        comp = timed({"a2 rank graph, all_reduces removed": lambda: gm_nocomm(*args_),
                      "c, all_reduce a no-op": lambda: hand_nocomm(tokens),
                      "a2 wrapper only (CompiledModule._shapes.check)": lambda: a2._shapes.check(x2)}, n, False)
        full = timed({"d (full model), rank 0 alone, rank 1 idle": (lambda: model(tokens)) if rank == 0 else (lambda: None),
                      "d (full model) on both ranks at once (2 vCPUs busy)": lambda: model(tokens)},
                     max(n // 4, 5), True)
        comm = timed({"dist.all_reduce, in place (what c runs)": lambda: dist.all_reduce(act),
                      "spmd all_reduce: functional all_reduce (clone) + wait_tensor (what a2 runs)":
                          lambda: spmd_all_reduce(act, "sum", group, world),
                      "spmd reduce_scatter + all_gather on dim 0 (sequence parallelism's pair instead of one all_reduce)":
                          lambda: spmd_all_gather(spmd_reduce_scatter(act, 0, "sum", group, world), 0, group, world)},
                     max(n, 100), True)
        counts = {"a2 rank graph, all_reduces removed": count_ops(lambda: gm_nocomm(*args_)),
                  "c, all_reduce a no-op": count_ops(lambda: hand_nocomm(tokens))}
    if rank != 0:
        return ""
    lines.append(f"Rank 0, {n} interleaved calls each (rank graph: {n_ops} call nodes).\n")
    lines.append("| what | median ms | p10 ms |")
    lines.append("|---|---|---|")
    for k, (med, p10) in {**comp, **full, **comm}.items():
        lines.append(f"| {k} | {fmt_ms(med)} | {fmt_ms(p10)} |")
    lines.append(f"| (all_reduce of a {tuple(act.shape)} fp32 activation; {2 * model.cfg.layers} per forward) | | |")
    lines.append("")
    lines.append("ATen ops dispatched per call (one call, top level):\n")
    for name, c in counts.items():
        lines.append(f"- {name}: {sum(c.values())} ops: " + ", ".join(f"{k} {v}" for k, v in c.most_common()))
    lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# report


def paired_ratio(xs: list, cs: list) -> float:
    """Median over rounds of x/c, where x and c ran back to back (same load); needs 1 call per round."""
    return statistics.median(x / c for x, c in zip(xs, cs))


def fmt_ms(s: float) -> str:
    return f"{s * 1e3:.2f}" if s >= 0.01 else f"{s * 1e3:.3f}"


def summary_str(s: dict) -> str:
    return ", ".join(f"{k} on {a}: {c}" for (k, a), c in sorted(s.items())) or "none"


def git_state() -> str:
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "spmd"], cwd=ROOT, capture_output=True, text=True).stdout
        return f"{head}{' + uncommitted changes in spmd/' if dirty.strip() else ''}"
    except OSError:
        return "unknown"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def report(results: list[dict], world: int, wall: float, load) -> str:
    labels = {"a1": "a1 spmd, default plan", "a2": "a2 spmd, Megatron pins", "b": "b DTensor eager Megatron",
              "c": "c hand-written Megatron", "d": "d single process", "ar": "(ar: one dist.all_reduce of b*s*d fp32)",
              "a2sp": "a2sp spmd, Megatron pins only (its own pick)"}
    out = ["# Forward benchmark: spmd vs DTensor vs hand-written Megatron (GPT, gloo)", ""]
    out.append(f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}")
    out.append(f"- machine: {platform.node()}, {cpu_model()}, nproc {os.cpu_count()}, "
               f"Python {platform.python_version()}, torch {torch.__version__}")
    out.append(f"- spmd: git {git_state()}")
    out.append(f"- setup: gloo, {world} ranks, 1 thread per rank, float32, torch.no_grad, forward only; "
               f"variants interleaved; per call the max over ranks after a dist.barrier(); d runs on rank 0 alone")
    out.append(f"- command: `{' '.join(sys.argv)}`; total wall {wall:.0f} s; load average (1 min) "
               f"{load[0][0]:.2f} at start, {load[1][0]:.2f} at end (the bench itself adds ~2)")
    out.append("")
    for r in results:
        vocab, seq, dim, heads, layers, batch = r["cfg"]
        t = r["times"]
        med = {k: statistics.median(v) for k, v in t.items()}
        out.append(f"## {r['size']}: d_model {dim}, {layers} layers, {heads} heads, seq {seq}, batch {batch}, vocab {vocab}")
        out.append("")
        out.append("| variant | median ms | p10 ms | p90 ms | / c (median) | / c (p10) | / c (paired) | calls |")
        out.append("|---|---|---|---|---|---|---|---|")
        for k in ("a1", "a2", "a2sp", "b", "c", "d", "ar"):
            if k not in t:
                continue
            ratio = f"{med[k] / med['c']:.3f}" if k != "ar" else "-"
            r10 = f"{percentile(t[k], 0.1) / percentile(t['c'], 0.1):.3f}" if k != "ar" else "-"
            paired = f"{paired_ratio(t[k], t['c']):.3f}" if k != "ar" else "-"
            out.append(f"| {labels[k]} | {fmt_ms(med[k])} | {fmt_ms(percentile(t[k], 0.1))} | "
                       f"{fmt_ms(percentile(t[k], 0.9))} | {ratio} | {r10} | {paired} | {len(t[k])} |")
        out.append("")
        out.append(f"ratios of medians: a2/c = {med['a2'] / med['c']:.3f}, a1/c = {med['a1'] / med['c']:.3f}, "
                   f"b/c = {med['b'] / med['c']:.3f}, d/c = {med['d'] / med['c']:.3f}; paired (median over rounds of "
                   f"the per-round ratio): a2/c = {paired_ratio(t['a2'], t['c']):.3f}")
        out.append("")
        out.append(f"- a1 plan (no pins): {r['layout_a1']}, collectives: {summary_str(r['summary_a1'])}; estimated {r['est_a1'] * 1e3:.3f} ms; "
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
    load0 = os.getloadavg()
    results = []
    for size in args.sizes.split(","):
        results.append(run_size(size, mesh, rank, world, args))
        if rank == 0:
            print(f"[bench_forward] {size} done at {time.perf_counter() - t0:.0f} s", flush=True)
    if rank == 0:
        text = report(results, world, time.perf_counter() - t0, (load0, os.getloadavg()))
        with open(args.out, "w") as f:
            f.write(text)
        print(text, flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _spawned(rank: int, world: int, port: int, worker, args) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    worker(args)


def launch(worker, args, nprocs: int = 2) -> None:
    """Run `worker(args)` on every rank: here under torchrun, else in `nprocs` spawned gloo processes."""
    if "RANK" in os.environ:  # under torchrun
        worker(args)
        return
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["OMP_NUM_THREADS"] = "1"
    mp.start_processes(_spawned, args=(nprocs, port, worker, args), nprocs=nprocs, start_method="spawn")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="tiny,medium", help="comma list of: " + ", ".join(SIZES))
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the number of timing rounds")
    ap.add_argument("--profile", default="", help="comma list of sizes to profile: where a2's time goes vs c")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results_forward.md"))
    launch(worker, ap.parse_args())


if __name__ == "__main__":
    main()
