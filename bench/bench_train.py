"""Training-step GPT benchmark: spmd's compiled graphs vs DTensor eager vs hand-written Megatron.

Two gloo ranks, one thread each, float32. One step = forward + cross-entropy LM loss + backward +
AdamW step + zero_grad. Variants, timed interleaved in one run:

    a1  spmd, the plan its cost model picks with no pins
    a2  spmd pinned to Megatron (tokens/targets [R]; q/k/v/fc1 weight+bias [S(0)]; o_proj/fc2 weight
        [S(1)], bias [R]); its forward graph is checked to hold exactly 2 all_reduces per layer
    a1c, a2c  a1 and a2 with their rank graphs through torch.compile (inductor; `compile_graphs=True`);
        their first step pays the compilation (reported apart; --no-inductor leaves them out)
    a2sp only where the pins alone do not give that plan: spmd's own pick under the same pins (a2 is then
        planned with every collective's latency raised; see bench_forward.megatron_mesh_spec)
    b   DTensor eager: parallelize_module with ColwiseParallel / RowwiseParallel (the same Megatron plan)
    c   hand-written Megatron: plain tensors, local weight slices, Megatron's f/g autograd functions
        (f: identity forward, all_reduce backward, before q/k/v and fc1; g: all_reduce forward,
        identity backward, after o_proj and fc2)
    d   one process, one thread, the full model (rank 0 runs it while rank 1 waits)
    ar  context only: one dist.all_reduce of a (batch, seq, dim) activation

Before timing, every variant's loss after one step and its full parameters after that step are checked
against d's (allclose).

Run (see bench/README.md):

    torchrun --nproc-per-node 2 bench/bench_train.py        # or: python bench/bench_train.py
    python bench/bench_train.py --profile tiny,medium      # plus where a2's step goes vs c

Rank 0 writes bench/results_train.md and prints the same. Ratios are only meaningful within one run;
"/ c (paired)" is the median of the per-round ratios (see bench_forward.py).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import platform
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

from bench_forward import (SIZES, count_ops, cpu_model, dtensor_megatron, fmt_ms, git_state,  # noqa: E402
                           default_spec, launch, megatron_mesh_spec, megatron_param_pins, paired_ratio, percentile,
                           register_cpu_sdpa_rule, repriced, summary_str, time_interleaved, timed)

# (rounds, calls per variant per round, warmup calls per variant); see bench_forward.SCHEDULE.
SCHEDULE = {"tiny": (150, 1, 10), "medium": (16, 1, 2)}
LR = 1e-3
# One AdamW step moves an element by about lr * sign(grad); where a gradient is ~1e-7 its sign can flip
# with float32 summation order, so parameters are compared at a fraction of lr, losses tightly.
PARAM_ATOL, LOSS_RTOL = 0.1 * LR, 1e-5


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def adamw(params):
    return torch.optim.AdamW(params, lr=LR)


# ---------------------------------------------------------------------------------------------------
# (c) hand-written Megatron, trainable


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward; backward sums the input gradient over the tensor-parallel ranks."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g)
        return g


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all_reduce forward (in place, on the fresh matmul output); identity backward."""

    @staticmethod
    def forward(ctx, x):
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


class HandMegatronTrain:
    """As bench_forward.HandMegatron, with its own trainable parameters: rank r holds rows r of q/k/v/fc1
    (and their biases), columns r of o_proj/fc2 (their biases whole), heads h*r/w .. h*(r+1)/w;
    embeddings, LayerNorms and the LM head whole on every rank (their gradients come out equal on every
    rank, so they need no communication). 2 all_reduces per layer forward, 2 backward."""

    def __init__(self, model, rank: int, world: int):
        cfg = model.cfg
        self.world, self.heads, self.head_dim = world, cfg.heads // world, cfg.dim // cfg.heads
        self.layout: dict[str, int | None] = {}  # FQN -> dim it is split on (None: whole)
        self.p: dict[str, torch.Tensor] = {}
        for name, t in model.named_parameters():
            dim = None
            if any(k in name for k in ("q_proj", "k_proj", "v_proj", "fc1")):
                dim = 0
            elif name.endswith(("o_proj.weight", "fc2.weight")):
                dim = 1
            local = t.detach().chunk(world, dim)[rank] if dim is not None else t.detach()
            self.p[name] = local.clone().contiguous().requires_grad_(True)
            self.layout[name] = dim
        self.layers = cfg.layers

    def parameters(self):
        return list(self.p.values())

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        P = self.p
        b, s = tokens.shape
        h, hd = self.heads, self.head_dim
        x = F.embedding(tokens, P["tok_emb.weight"]) + P["pos_emb.weight"][:s]
        for i in range(self.layers):
            L = f"blocks.{i}."

            def lin(name, y, bias=True):
                return F.linear(y, P[L + name + ".weight"], P[L + name + ".bias"] if bias else None)

            y = _CopyToTP.apply(F.layer_norm(x, (x.shape[-1],), P[L + "ln1.weight"], P[L + "ln1.bias"]))
            q = lin("attn.q_proj", y).view(b, s, h, hd).transpose(1, 2)
            k = lin("attn.k_proj", y).view(b, s, h, hd).transpose(1, 2)
            v = lin("attn.v_proj", y).view(b, s, h, hd).transpose(1, 2)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h * hd)
            x = x + _ReduceFromTP.apply(lin("attn.o_proj", att, bias=False)) + P[L + "attn.o_proj.bias"]
            y = _CopyToTP.apply(F.layer_norm(x, (x.shape[-1],), P[L + "ln2.weight"], P[L + "ln2.bias"]))
            z = lin("mlp.fc2", F.gelu(lin("mlp.fc1", y)), bias=False)
            x = x + _ReduceFromTP.apply(z) + P[L + "mlp.fc2.bias"]
        x = F.layer_norm(x, (x.shape[-1],), P["ln_f.weight"], P["ln_f.bias"])
        return lm_loss(F.linear(x, P["lm_head.weight"]), targets)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in self.p.items():
            dim = self.layout[name]
            if dim is None:
                out[name] = t.detach()
                continue
            parts = [torch.empty_like(t) for _ in range(self.world)]
            dist.all_gather(parts, t.detach().contiguous())
            out[name] = torch.cat(parts, dim)
        return out


# ---------------------------------------------------------------------------------------------------
# (b) DTensor needs rules for the CPU flash-attention kernels, forward (bench_forward) and backward


_SDPA_BWD_RULE_REGISTERED = False


def register_cpu_sdpa_rules() -> None:
    global _SDPA_BWD_RULE_REGISTERED
    register_cpu_sdpa_rule()
    if _SDPA_BWD_RULE_REGISTERED:
        return
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    @register_sharding(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    def _sdpa_cpu_bwd(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask=None, scale=None):
        # grads of q, k, v <- (grad_out, q, k, v, out, logsumexp): all replicated, or all on batch/heads
        return [([p, p, p], [p, p, p, p, p, p, None, None, None, None]) for p in (Replicate(), Shard(1), Shard(0))]

    _SDPA_BWD_RULE_REGISTERED = True


# ---------------------------------------------------------------------------------------------------
# measurements that are not timings


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (DTensors: their local shard)."""
    seen, total = set(), 0
    for t in tensors:
        st = _local(t).untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def state_bytes(params: list, opt) -> dict[str, int]:
    """This rank's parameters, gradients and optimizer state (tensors with dims; AdamW's step counters
    are 0-d), as sums of storage bytes: measured after backward, before the optimizer step."""
    return {"parameters": storage_bytes(params),
            "gradients": storage_bytes(p.grad for p in params if p.grad is not None),
            "optimizer": storage_bytes(t for st in opt.state.values() for t in st.values()
                                       if isinstance(t, torch.Tensor) and t.dim() > 0)}


def saved_activation_bytes(loss_fn, params: list) -> tuple[int, float]:
    """Bytes autograd saves for backward during one forward (distinct storages, parameters excluded),
    seen through saved-tensor hooks: the same yardstick for every variant (spmd's saves go through its
    autograd.Function's save_for_backward). The backward is run to free them. Also returns the loss."""
    param_ptrs = {_local(p).untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        st = _local(t).untyped_storage()
        if st.data_ptr() not in param_ptrs:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn()
    loss.backward()
    return sum(seen.values()), float(_local(loss).detach())


def graph_collectives(gm) -> dict[str, int]:
    """Collective calls in one generated graph, by function name (a bucket counts once)."""
    from collections import Counter

    names = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "bucket_start", "all_reduce_start"}
    c = Counter(n.target.__name__.removesuffix("_start") if n.target.__name__ == "all_reduce_start" else n.target.__name__
                for n in gm.graph.nodes if n.op == "call_function" and getattr(n.target, "__name__", "") in names)
    return dict(sorted(c.items()))


def counts_str(c: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in c.items()) or "none"


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
    model = GPT(cfg)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    targets = torch.randint(0, vocab, (batch, seq), generator=g)
    example = (tokens, targets)

    compiled, compile_s = {}, {}
    t0 = time.perf_counter()
    compiled["a1"] = spmd.compile(copy.deepcopy(model), mesh, example_inputs=example, loss_fn=lm_loss)
    compile_s["a1"] = time.perf_counter() - t0
    pins = dict(in_placements={"tokens": [Replicate()], "targets": [Replicate()]},
                param_placements=megatron_param_pins(layers))
    t0 = time.perf_counter()
    a2 = spmd.compile(copy.deepcopy(model), mesh, example_inputs=example, loss_fn=lm_loss, **pins)
    compile_s["a2"] = time.perf_counter() - t0
    want = {"all_reduce": 2 * layers}
    a2_note = "the pins alone give it, with the default gloo profile (no re-planning needed)"
    if graph_collectives(a2.split.forward) != want:
        compiled["a2sp"], compile_s["a2sp"] = a2, compile_s["a2"]
        t0 = time.perf_counter()
        a2 = spmd.compile(copy.deepcopy(model), mesh, example_inputs=example, loss_fn=lm_loss,
                          mesh_spec=megatron_mesh_spec(mesh), **pins)
        compile_s["a2"] = time.perf_counter() - t0
        comp, comm = repriced(a2.plan, default_spec(mesh), 4 * 2**20)
        sp = compiled["a2sp"].plan
        a2_note = (f"with only the pins spmd picks forward {counts_str(graph_collectives(compiled['a2sp'].split.forward))}, "
                   f"backward {counts_str(graph_collectives(compiled['a2sp'].split.backward))} (timed as a2sp), estimated "
                   f"{sp.objective * 1e3:.1f} ms (compute {sp.compute_cost * 1e3:.1f}, communication {sp.comm_cost * 1e3:.1f}); "
                   f"the Megatron plan priced with the same gloo profile: {(comp + comm) * 1e3:.1f} ms (compute "
                   f"{comp * 1e3:.1f}, communication {comm * 1e3:.1f}), so the pick is {(comp + comm) / sp.objective - 1:.1%} "
                   "cheaper by spmd's own model. a2 is therefore planned with every collective's latency at 10 ms "
                   "(planning only; bench_forward.megatron_mesh_spec)")
    compiled["a2"] = a2
    if graph_collectives(a2.split.forward) != want:
        raise RuntimeError(f"{size}: the pinned Megatron plan's forward has {graph_collectives(a2.split.forward)}, "
                           f"expected {want}")
    if not args.no_inductor:  # the same two plans, their rank graphs through torch.compile (inductor)
        t0 = time.perf_counter()
        compiled["a1c"] = spmd.compile(copy.deepcopy(model), mesh, example_inputs=example, loss_fn=lm_loss,
                                       compile_graphs=True)
        compile_s["a1c"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiled["a2c"] = spmd.compile(copy.deepcopy(model), mesh, example_inputs=example, loss_fn=lm_loss,
                                       mesh_spec=a2.mesh_spec, compile_graphs=True, **pins)
        compile_s["a2c"] = time.perf_counter() - t0
        for k, base in (("a1c", "a1"), ("a2c", "a2")):
            if compiled[k].plan.fingerprint() != compiled[base].plan.fingerprint():
                raise RuntimeError(f"{size}: {k} was planned differently from {base}")

    # Every variant gets a fresh copy of the model and its own AdamW.
    register_cpu_sdpa_rules()
    mb = dtensor_megatron(model, mesh, layers)
    hand = HandMegatronTrain(model, rank, world)
    md = copy.deepcopy(model)
    opts = {k: adamw(m.parameters()) for k, m in compiled.items()}
    opts.update(b=adamw(mb.parameters()), c=adamw(hand.parameters()), d=adamw(md.parameters()))
    local = {k: m.shard_inputs(tokens, targets) for k, m in compiled.items()}
    loss_fns = {k: (lambda m=m, x=local[k]: m(*x)) for k, m in compiled.items()}
    loss_fns.update(b=lambda: lm_loss(mb(tokens), targets), c=lambda: hand.loss(tokens, targets),
                    d=lambda: lm_loss(md(tokens), targets))
    params = {k: list(m.parameters()) for k, m in compiled.items()}
    params.update(b=list(mb.parameters()), c=hand.parameters(), d=list(md.parameters()))

    def make_step(k):
        loss_fn, opt = loss_fns[k], opts[k]

        def step():
            loss = loss_fn()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return step

    steps = {k: make_step(k) for k in loss_fns}

    # One step each from the same start; loss and updated full parameters must match d's. The first
    # step's time is where torch.compile pays (a1c, a2c).
    losses, first_s = {}, {}
    for k in steps:
        dist.barrier()
        t0 = time.perf_counter()
        losses[k] = float(_local(steps[k]()).detach())
        first_s[k] = time.perf_counter() - t0
    full_d = dict(md.named_parameters())
    fulls = {k: m.full_state_dict() for k, m in compiled.items()}
    fulls["b"] = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p) for n, p in mb.named_parameters()}
    fulls["c"] = hand.full_state_dict()
    check = {}
    for k, full in fulls.items():
        loss_err = abs(losses[k] - losses["d"])
        p_err = max(float((full[n].detach() - v.detach()).abs().max()) for n, v in full_d.items())
        check[k] = (loss_err, p_err)
        if loss_err > LOSS_RTOL * abs(losses["d"]) or p_err > PARAM_ATOL:
            raise RuntimeError(f"{size}: variant {k} differs from the single process after one step: |loss diff| "
                               f"{loss_err:.3g}, max |param diff| {p_err:.3g} (tolerances {LOSS_RTOL} rel, {PARAM_ATOL})")

    # Memory: one more step each, measured after backward (gradients and optimizer state alive). Its
    # loss is the loss after one step: checked against d's too.
    memory, losses1 = {}, {}
    for k in steps:
        saved, losses1[k] = saved_activation_bytes(loss_fns[k], params[k])
        if k in compiled:
            memory[k] = dict(compiled[k].memory_report(opts[k]))
            memory[k]["saved (hooks)"] = saved
        else:
            memory[k] = state_bytes(params[k], opts[k])
            memory[k]["activations"] = saved
        opts[k].step()
        opts[k].zero_grad()

    for k in fulls:
        err = abs(losses1[k] - losses1["d"])
        check[k] += (err,)
        if err > LOSS_RTOL * abs(losses1["d"]):
            raise RuntimeError(f"{size}: variant {k}'s loss after one step differs from the single process's by {err:.3g}")

    act = torch.randn(batch, seq, dim)
    fns = {k: (steps[k] if k != "d" or rank == 0 else None) for k in VARIANTS if k in steps}
    fns["ar"] = lambda: dist.all_reduce(act)
    rounds, per_round, warmup = SCHEDULE[size]
    rounds = max(1, int(rounds * args.scale))
    load_before = os.getloadavg()[0]
    times = time_interleaved(fns, rank, rounds, per_round, warmup)
    load_after = os.getloadavg()[0]

    plans = {}
    for k, m in compiled.items():
        p = m.plan
        plans[k] = dict(
            layout=f"tokens {placements_str(m.input_placements()['tokens'])}, targets "
                   f"{placements_str(m.input_placements()['targets'])}",
            fwd=counts_str(graph_collectives(m.split.forward)), bwd=counts_str(graph_collectives(m.split.backward)),
            summary=summary_str(dict(p.collective_summary())), est=p.objective, compute=p.compute_cost,
            optimizer=p.optimizer_cost, comm=p.comm_cost, memory=dict(p.memory), peak=p.predicted_peak_bytes, fingerprint=p.fingerprint(),
            compile_s=compile_s[k], sharded=sum(1 for s in m._state_placements.values()
                                                if any(type(x).__name__ == "Shard" for x in s)),
            n_params=len(m._state_placements),
            nodes=(len([n for n in m.split.forward.graph.nodes if n.op == "call_function"]),
                   len([n for n in m.split.backward.graph.nodes if n.op == "call_function"])))
    prof = profile_size(a2, local["a2"], opts["a2"], hand, opts["c"], model, tokens, targets, rank, world) \
        if size in args.profile.split(",") else None
    return dict(size=size, cfg=(vocab, seq, dim, heads, layers, batch), times=times, check=check, losses=losses,
                first_s=first_s,
                losses1=losses1, load=(load_before, load_after),
                plans=plans, a2_note=a2_note, memory=memory, profile=prof)


# ---------------------------------------------------------------------------------------------------
# profile (--profile): where a2's step goes compared with c


def _replace_targets(gm, mapping: dict):
    """A copy of `gm` with call targets swapped per `mapping` (same arguments)."""
    import torch.fx as fx

    graph, env = fx.Graph(), {}
    for node in gm.graph.nodes:
        new = graph.node_copy(node, lambda n: env[n])
        if node.op == "call_function" and node.target in mapping:
            new.target = mapping[node.target]
        env[node] = new
    return fx.GraphModule(gm, graph)


def _no_all_reduce(x, reduce_op="sum", group=None, world=1, inplace=False, **_):
    return x


def _no_wait(pending, reduce_op="sum", world=1, **_):
    return pending


def _bucket_start_local(tensors, reduce_op, group, world, **_):
    return torch.cat([t.reshape(-1) for t in tensors])  # the packing copy, no communication


def _bucket_wait_local(flat, tensors, reduce_op, world, **_):
    return [p.view(t.shape) for p, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


def profile_size(a2, x2, opt2, hand, opt_c, model, tokens, targets, rank: int, world: int) -> str:
    """Where a2's step goes, compared with c (rank 0's view, interleaved calls): the generated forward
    and backward graphs called directly (no autograd), the same with collectives removed, the
    autograd.Function boundary, the gradient bucket, the optimizer step, and ATen op counts."""
    from spmd.core import collectives as C
    from spmd.runtime.compiled import _RankStep

    split = a2.split
    no_comm = {C.all_reduce: _no_all_reduce, C.all_reduce_start: _no_all_reduce, C.all_reduce_wait: _no_wait,
               C.bucket_start: _bucket_start_local, C.bucket_wait: _bucket_wait_local}
    fwd_nc, bwd_nc = _replace_targets(split.forward, no_comm), _replace_targets(split.backward, no_comm)
    args_ = a2._graph_args(x2)
    with torch.no_grad():
        flat = split.forward(*[a.detach() for a in args_])
    saved = flat[split.n_outputs + len(split.updates):]  # (after the outputs and buffers' new values)
    tangents = [torch.ones_like(o) for o in flat[:split.n_outputs]]
    n = 100 if model.cfg.dim < 256 else 6

    def graphs(fwd, bwd):
        def run():
            with torch.no_grad():
                fwd(*args_)
                bwd(*saved, *tangents)
        return run

    def via_function():
        out = _RankStep.apply(a2, a2._shapes, *args_)
        out[0].backward()
        for p in a2.parameters():
            p.grad = None

    def c_fwd_bwd():
        hand.loss(tokens, targets).backward()
        for p in hand.parameters():
            p.grad = None

    real_ar = dist.all_reduce

    def c_fwd_bwd_nocomm():
        dist.all_reduce = lambda t, *a, **k: None  # f and g look it up at call time
        try:
            c_fwd_bwd()
        finally:
            dist.all_reduce = real_ar

    def a2_step():
        loss = a2(*x2)
        loss.backward()
        for p in a2.parameters():
            p.grad = None

    grads = [torch.randn_like(p) for p in a2.parameters()]
    grads_c = [torch.randn_like(p) for p in hand.parameters()]

    def opt_step(opt, params, gs):
        def run():
            for p, g_ in zip(params, gs):
                p.grad = g_
            opt.step()
        return run

    from spmd.passes.bucket_gradients import local_bytes

    bucket_sizes = [int(sum(local_bytes(m, a2.mesh_spec.shape) for m in nd.args[0]) // 4)
                    for nd in split.backward.graph.nodes if nd.target is C.bucket_start]
    group = a2.group_names[0]
    bucket = [torch.randn(max(bucket_sizes) if bucket_sizes else 1)]
    act = torch.randn(tokens.shape[0], tokens.shape[1], model.cfg.dim)

    rows = {}
    rows.update(timed({"a2 step without the optimizer: compiled(*x) + loss.backward()": a2_step,
                       "a2 graphs called directly (no autograd): forward + backward": graphs(split.forward, split.backward),
                       "a2 through _RankStep.apply (its autograd.Function) + backward": via_function,
                       "c forward + loss + backward (autograd)": c_fwd_bwd}, n, True))
    real_split = a2.split

    def via_function_nocomm():  # the autograd.Function boundary around the collective-free graphs
        a2.split = nc_split
        try:
            via_function()
        finally:
            a2.split = real_split

    def module_nocomm():  # and CompiledModule.__call__ (input checks, argument list, unflatten) on top
        a2.split = nc_split
        try:
            a2_step()
        finally:
            a2.split = real_split

    import dataclasses

    nc_split = dataclasses.replace(split, forward=fwd_nc, backward=bwd_nc)
    rows.update(timed({"a2 graphs, collectives removed (bucket packing kept)": graphs(fwd_nc, bwd_nc),
                       "the same through _RankStep.apply + backward": via_function_nocomm,
                       "the same through compiled(*x) + loss.backward()": module_nocomm,
                       "c forward + backward, all_reduce a no-op": c_fwd_bwd_nocomm}, n, False))
    rows.update(timed({"AdamW step, a2's parameters": opt_step(opt2, list(a2.parameters()), grads),
                       "AdamW step, c's parameters": opt_step(opt_c, hand.parameters(), grads_c)}, n, False))
    rows.update(timed({"spmd all_reduce of a (b, s, d) activation (functional + wait)":
                       lambda: C.all_reduce(act, "sum", group, world),
                       "dist.all_reduce of the same, in place (what c runs)": lambda: dist.all_reduce(act),
                       f"spmd gradient bucket ({bucket[0].numel()} fp32): bucket_start + bucket_wait":
                       lambda: C.bucket_wait(C.bucket_start(bucket, "sum", group, world), bucket, "sum", world)},
                      max(n, 50), True))
    ops = {"a2 forward + backward graphs": count_ops(graphs(split.forward, split.backward)),
           "c forward + backward (eager autograd)": count_ops(c_fwd_bwd)}
    if rank != 0:
        return ""
    fc, bc = len([x for x in split.forward.graph.nodes if x.op == "call_function"]), \
        len([x for x in split.backward.graph.nodes if x.op == "call_function"])
    lines = [f"Rank 0, {n} interleaved calls per row (a2: {fc} call nodes forward, {bc} backward; "
             f"gradient buckets: {len(bucket_sizes)}, elements per bucket {bucket_sizes}).\n",
             "| what | median ms | p10 ms |", "|---|---|---|"]
    lines += [f"| {k} | {fmt_ms(med)} | {fmt_ms(p10)} |" for k, (med, p10) in rows.items()]
    lines.append("")
    a, c = ops["a2 forward + backward graphs"], ops["c forward + backward (eager autograd)"]
    lines.append("ATen ops dispatched per forward + backward (views included): " +
                 ", ".join(f"{k} {sum(v.values())}" for k, v in ops.items()) + ". Largest differences, a2 - c: " +
                 ", ".join(f"{k} {a[k] - c[k]:+d}" for k in sorted(set(a) | set(c), key=lambda k: -abs(a[k] - c[k]))[:16]))
    lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# report


VARIANTS = ("a1", "a1c", "a2", "a2c", "a2sp", "b", "c", "d")
LABELS = {"a1": "a1 spmd, its own plan", "a1c": "a1c spmd, its own plan, inductor",
          "a2": "a2 spmd, Megatron pins", "a2c": "a2c spmd, Megatron pins, inductor", "a2sp": "a2sp spmd, Megatron pins only (its own pick)",
          "b": "b DTensor eager Megatron", "c": "c hand-written Megatron", "d": "d single process",
          "ar": "(ar: one dist.all_reduce of b*s*d fp32)"}


def mib(x: float) -> str:
    return f"{x / 2**20:.2f}"


def report(results: list[dict], world: int, wall: float, load) -> str:
    out = ["# Training-step benchmark: spmd vs DTensor vs hand-written Megatron (GPT, gloo)", ""]
    out.append(f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}")
    out.append(f"- machine: {platform.node()}, {cpu_model()}, nproc {os.cpu_count()}, "
               f"Python {platform.python_version()}, torch {torch.__version__}")
    out.append(f"- spmd: git {git_state()}")
    out.append(f"- setup: gloo, {world} ranks, 1 thread per rank, float32; one step = forward + cross-entropy LM "
               f"loss + backward + AdamW(lr {LR:g}) step + zero_grad; variants interleaved; per call the max over "
               "ranks after a dist.barrier(); d runs on rank 0 alone")
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
        for k in VARIANTS + ("ar",):
            if k not in t:
                continue
            ratio = f"{med[k] / med['c']:.3f}" if k != "ar" else "-"
            r10 = f"{percentile(t[k], 0.1) / percentile(t['c'], 0.1):.3f}" if k != "ar" else "-"
            paired = f"{paired_ratio(t[k], t['c']):.3f}" if k != "ar" else "-"
            out.append(f"| {LABELS[k]} | {fmt_ms(med[k])} | {fmt_ms(percentile(t[k], 0.1))} | "
                       f"{fmt_ms(percentile(t[k], 0.9))} | {ratio} | {r10} | {paired} | {len(t[k])} |")
        out.append("")
        out.append(f"load average (1 min) {r['load'][0]:.2f} before these timings, {r['load'][1]:.2f} after.")
        out.append("")
        out.append(f"paired ratios (median over rounds of the per-round ratio): a2/c = {paired_ratio(t['a2'], t['c']):.3f}, "
                   f"a1/c = {paired_ratio(t['a1'], t['c']):.3f}, b/a2 = {paired_ratio(t['b'], t['a2']):.3f}, "
                   f"b/a1 = {paired_ratio(t['b'], t['a1']):.3f}")
        out.append("")
        a2c, ba2, a1c = paired_ratio(t['a2'], t['c']), paired_ratio(t['b'], t['a2']), paired_ratio(t['a1'], t['c'])
        if "a1c" in t:
            out.append(f"inductor (paired): a1c/c = {paired_ratio(t['a1c'], t['c']):.3f} (target < 1), a2c/c = "
                       f"{paired_ratio(t['a2c'], t['c']):.3f} (target <= 0.9), a1c/a1 = {paired_ratio(t['a1c'], t['a1']):.3f}, "
                       f"a2c/a2 = {paired_ratio(t['a2c'], t['a2']):.3f}")
            out.append("")
        out.append("first step, s (from a compiled module to its first loss; a1c/a2c include torch.compile of both "
                   "graphs): " + ", ".join(f"{k} {v:.2f}" for k, v in r["first_s"].items()))
        out.append("")
        out.append(f"targets (paired): a2 <= 1.05 x c: {'met' if a2c <= 1.05 else 'missed'} ({a2c:.3f}); a2 >= 2 x faster "
                   f"than b: {'met' if ba2 >= 2 else 'missed'} ({ba2:.3f}); a1 faster than c: "
                   f"{'met' if a1c < 1 else 'missed'} ({a1c:.3f})")
        out.append("")
        for k in ("a1", "a2", "a2sp"):
            if k not in r["plans"]:
                continue
            p = r["plans"][k]
            out.append(f"- {k} plan: {p['layout']}; {p['sharded']} of {p['n_params']} parameters sharded; collectives "
                       f"forward {p['fwd']}, backward {p['bwd']} (plan: {p['summary']}); estimated "
                       f"{p['est'] * 1e3:.2f} ms (compute {p['compute'] * 1e3:.2f} with the optimizer's step "
                       f"{p.get('optimizer', 0.0) * 1e3:.2f}, communication {p['comm'] * 1e3:.2f}); "
                       f"{p['nodes'][0]} + {p['nodes'][1]} call nodes forward + backward; compile {p['compile_s']:.1f} s; "
                       f"fingerprint {p['fingerprint']}")
        out.append(f"- a2: {r['a2_note']}")
        out.append(f"- check vs d (first loss {r['losses']['d']:.6f}, loss after one step {r['losses1']['d']:.6f}): " + ", ".join(
            f"{k} |loss diff| {le:.1e} / {le1:.1e}, max |param diff| {pe:.1e}" for k, (le, pe, le1) in r["check"].items()) +
            f" (tolerances: loss {LOSS_RTOL:g} relative, parameters {PARAM_ATOL:g} absolute)")
        out.append("")
        out.append("Memory per rank, MiB. spmd rows: `predicted` is `plan.memory` (each kind at its most; its sum is at least "
                   "`plan.predicted_peak_bytes`); `measured` is `compiled.memory_report(opt)` after backward, whose "
                   "activations are the storages its forward graph saved (parameters included if saved). Other rows: "
                   "sums of the storages of this rank's parameters, gradients and AdamW state (DTensor: local shards), "
                   "after backward. `saved (hooks)`: distinct storages autograd saved for backward in one forward, "
                   "parameters excluded, seen through saved-tensor hooks (the same yardstick for every variant).")
        out.append("")
        out.append("| variant | what | parameters | gradients | optimizer | activations | inputs | total | saved (hooks) |")
        out.append("|---|---|---|---|---|---|---|---|---|")
        for k in ("a1", "a2", "a2sp", "b", "c", "d"):
            if k not in r["memory"]:
                continue
            m = r["memory"][k]
            if k in r["plans"]:
                p = r["plans"][k]["memory"]
                out.append(f"| {k} | predicted (plan) | {mib(p.get('parameters', 0))} | {mib(p.get('gradients', 0))} | "
                           f"{mib(p.get('optimizer', 0))} | {mib(p.get('activations', 0))} | {mib(p.get('inputs', 0))} | "
                           f"{mib(sum(p.values()))} | |")
                total = sum(m.get(x, 0) for x in ("parameters", "gradients", "optimizer", "activations", "buffers"))
                out.append(f"| {k} | measured (memory_report) | {mib(m['parameters'])} | {mib(m['gradients'])} | "
                           f"{mib(m['optimizer'])} | {mib(m['activations'])} | | {mib(total)} | {mib(m['saved (hooks)'])} |")
            else:
                total = m["parameters"] + m["gradients"] + m["optimizer"]
                out.append(f"| {k} | measured (storages) | {mib(m['parameters'])} | {mib(m['gradients'])} | "
                           f"{mib(m['optimizer'])} | | | {mib(total)} (without activations) | {mib(m['activations'])} |")
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
    warnings.filterwarnings("ignore", category=UserWarning)
    import spmd

    mesh = spmd.init_mesh((2,), ("tp",))
    rank, world = dist.get_rank(), dist.get_world_size()
    t0 = time.perf_counter()
    load0 = os.getloadavg()
    results = []
    for size in args.sizes.split(","):
        results.append(run_size(size, mesh, rank, world, args))
        if rank == 0:
            print(f"[bench_train] {size} done at {time.perf_counter() - t0:.0f} s", flush=True)
    if rank == 0:
        results.sort(key=lambda r: list(SIZES).index(r["size"]))  # run in any order, report smallest first
        text = report(results, world, time.perf_counter() - t0, (load0, os.getloadavg()))
        with open(args.out, "w") as f:
            f.write(text)
        print(text, flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="tiny,medium", help="comma list of: " + ", ".join(SIZES))
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the number of timing rounds")
    ap.add_argument("--profile", default="", help="comma list of sizes to profile: where a2's step goes vs c")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results_train.md"))
    ap.add_argument("--no-inductor", action="store_true", help="leave out a1c/a2c (the rank graphs through inductor)")
    launch(worker, ap.parse_args())


if __name__ == "__main__":
    main()
