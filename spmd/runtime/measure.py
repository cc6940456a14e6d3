"""Timing collectives and the device on every rank at once, and fitting the device profile to the timings:
for `spmd calibrate` (tools/calibrate.py) and for the host profile measured at first use (runtime/host.py).

Each point: warmup calls, then `reps` calls, each after a barrier and a little compute (a collective
that follows compute finds gloo asleep more often); per call the max over all ranks; the median, or the
mean less the slowest 10% (gloo here is bimodal, ~0.3 ms or several ms at any size, and a step pays the
average). The device is timed with each call ~20 ms long, so that ranks sharing a core really compete.
"""
from __future__ import annotations

import functools
import math
import os
import statistics
import time

from spmd.core.graph_facts import is_view
from spmd.core.mesh import ranks_on_this_host

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _max_over_ranks(times: list[float]) -> list[float]:
    import torch.distributed as dist

    if not _distributed():
        return list(times)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, times)
    return [max(ts) for ts in zip(*gathered)]


def _trimmed_mean(xs: list[float], drop: float = 0.1) -> float:
    xs = sorted(xs)
    return statistics.fmean(xs[:max(1, len(xs) - int(len(xs) * drop))])


def _timed(fn, warmup: int, reps: int, gap_s: float = 0.0, stat: str = "median") -> float:
    """The slowest rank's time per call, as the median over `reps` calls or (`stat="mean"`) their mean
    without the slowest 10% (preemptions by other processes). Each call comes after a barrier and `gap_s` of
    (untimed) compute: a collective that follows compute, as in a real step, finds gloo's threads asleep
    and costs more than one run back to back (measured here: 4 KiB all_reduce 0.4 ms back to back,
    1.5-2.5 ms after 1-5 ms of matmuls). The deadline is on the shared monotonic clock, so the ranks
    enter the call together."""
    import torch
    import torch.distributed as dist

    a = torch.randn(64, 64)

    def call():
        if _distributed():
            dist.barrier()
        deadline = time.perf_counter() + gap_s
        while time.perf_counter() < deadline:
            torch.mm(a, a)
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    for _ in range(warmup):
        call()
    times = [call() for _ in range(reps)]
    if not reps:
        return 0.0
    worst = _max_over_ranks(times)
    return _trimmed_mean(worst) if stat == "mean" else statistics.median(worst)


def _collective_fn(kind: str, x, group: str, n: int):
    import torch

    from spmd.core import collectives as C

    if kind == "all_reduce":  # in place, as the runtime reduces a value nothing else reads (and buckets);
        y = torch.zeros_like(x)  # zeros, which the repeated sums leave as they are
        return lambda: C.all_reduce(y, "sum", group, n, inplace=True)
    if kind == "all_gather":
        return lambda: C.all_gather(x, 0, group, n)
    if kind == "reduce_scatter":
        return lambda: C.reduce_scatter(x, 0, "sum", group, n)
    return lambda: C.all_to_all(x, 0, 0, group, n)


def measure_links(device_mesh, sizes: list[int], kinds=KINDS, warmup: int = 3, reps: int = 15,
                  log=None, gap_s: float = 0.0, large_sizes: list[int] = ()) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """axis name -> kind -> [(bytes each rank holds, seconds)] on `device_mesh` (every rank calls this).
    `large_sizes`: more sizes after `sizes`, timed with a third of the calls (each takes 10-400 ms)."""
    import torch

    out: dict[str, dict[str, list[tuple[int, float]]]] = {}
    names = device_mesh.mesh_dim_names or tuple(f"axis{i}" for i in range(device_mesh.ndim))
    # Gloo's first ~20 collectives after start-up run in its slow (ms) mode: spend them here, not on the
    # first point.
    for axis in range(device_mesh.ndim):
        n = device_mesh.shape[axis]
        x = torch.randn(max(n, max(sizes) // 4 // n * n))
        for kind in kinds:
            _timed(_collective_fn(kind, x, device_mesh.get_group(axis).group_name, n), 2 * warmup, 0)
    for axis, name in enumerate(names):
        n = device_mesh.shape[axis]
        group = device_mesh.get_group(axis).group_name
        out[name] = {}
        for kind in kinds:
            pts = []
            for nbytes in (*sizes, *large_sizes):
                numel = max(n, (nbytes // 4) // n * n)  # dim 0 divisible by n: even scatters
                x = torch.randn(numel)
                calls = reps if nbytes in sizes else max(3, reps // 3)
                # the mean, not the median: gloo is bimodal (~0.3 ms or several ms at any size) and a step
                # with many collectives pays the average of the two modes
                pts.append((numel * 4, _timed(_collective_fn(kind, x, group, n), warmup, calls, gap_s, "mean")))
            out[name][kind] = pts
            if log:
                log(f"  {name} (n={n}) {kind}: " + ", ".join(f"{b // 1024} KiB {t * 1e3:.2f} ms" for b, t in pts))
    return out


def _small_joint_graph():
    """A forward+backward graph of the ops a transformer runs (layer_norm, linear, gelu, softmax attention,
    mean), traced to ATen by make_fx on tiny tensors, and its inputs: timing it gives the fixed cost per
    node the way a generated rank graph pays it (Python line, dispatcher, kernel start-up)."""
    import torch
    import torch.nn.functional as F
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w1, b1, w2, b2, lw, lb):
        h = F.layer_norm(x, (x.shape[-1],), lw, lb)
        h = F.linear(F.gelu(F.linear(h, w1, b1)), w2, b2)
        y = x + (h @ h.transpose(-1, -2)).softmax(-1) @ h
        return torch.autograd.grad((y * y).mean(), (x, w1, b1, w2, b2, lw, lb))

    g = torch.Generator().manual_seed(0)
    shapes = [(4, 8, 16), (64, 16), (64,), (16, 64), (16,), (16,), (16,)]
    args = [torch.randn(*s, generator=g, requires_grad=True) for s in shapes]
    with torch.enable_grad():
        return make_fx(f)(*args), [a.detach() for a in args]


def _view_graph():
    """A graph of 80 views (permute, reshape, transpose, view) traced to ATen, and its input: what a
    generated graph pays per view node (no kernel runs; Python line and dispatcher only)."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x):
        for _ in range(20):
            x = x.permute(1, 0, 2).reshape(8, 4, 16).transpose(0, 1).view(4, 8, 16)
        return x

    x = torch.randn(4, 8, 16)
    return make_fx(f)(x), x


# A transformer block's joint graph at two sizes: one where the fixed cost per node is most of the time,
# one where the kernels' work is (batch, sequence, width, heads)
BLOCK_SIZES = ((2, 8, 16, 2), (4, 64, 256, 4))


@functools.lru_cache(maxsize=4)  # (traced once per process: timed on every rank, priced again on rank 0)
def _block_graph(batch: int, seq: int, width: int, heads: int, layers: int = 2):
    """The forward+backward graph of `layers` pre-norm transformer blocks (layer norm, q/k/v, causal
    attention, output projection, GELU MLP, residuals) traced to ATen by make_fx, and its inputs: the
    ops a generated rank graph runs, in the order it runs them."""
    import torch
    import torch.nn.functional as F
    from torch.fx.experimental.proxy_tensor import make_fx

    d = width

    def f(x, *ws):
        h = x
        for i in range(layers):
            lw, lb, wqkv, bqkv, wo, bo, lw2, lb2, w1, b1, w2, b2 = ws[12 * i: 12 * i + 12]
            qkv = F.linear(F.layer_norm(h, (d,), lw, lb), wqkv, bqkv)
            q, k, v = qkv.view(batch, seq, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = h + F.linear(o.transpose(1, 2).reshape(batch, seq, d), wo, bo)
            h = h + F.linear(F.gelu(F.linear(F.layer_norm(h, (d,), lw2, lb2), w1, b1)), w2, b2)
        return torch.autograd.grad(h.sum(), (x, *ws))

    g = torch.Generator().manual_seed(0)
    shapes = [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    # weights at nn.Linear's scale (1 / sqrt(fan in)): with unit weights the attention saturates, its
    # gradients underflow to subnormal floats, and those run a matmul 4x slower here
    args = [torch.randn(batch, seq, d, generator=g, requires_grad=True)] + \
        [(torch.randn(*shape, generator=g) / shape[-1] ** 0.5).requires_grad_() for shape in shapes * layers]
    with torch.enable_grad():  # (a caller under no_grad would leave nothing to differentiate)
        return make_fx(f)(*args), [a.detach() for a in args]


WRAPPER_LAYERS = (1, 6)  # Linear layers of the two models whose compiled wrapper is timed


@functools.lru_cache(maxsize=None)
def _wrapped(layers: int, training: bool):
    """(a `CompiledModule` of `layers` Linear(8, 8) + tanh on a mesh of one device, its local inputs, its
    graphs called directly): what `measure_device` times around the graphs. Planned with the built-in
    profile (no process group: a mesh of one device has no collectives)."""
    import torch

    from spmd.compiler.options import PlanOptions, RankBinding
    from spmd.compiler.pipeline import run_pipeline
    from spmd.core.mesh import MeshSpec
    from spmd.runtime.compiled import CompiledModule

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(m for _ in range(layers) for m in (torch.nn.Linear(8, 8), torch.nn.Tanh())))
        inputs = (torch.randn(4, 8), torch.randn(4, 8)) if training else (torch.randn(4, 8),)
    loss = (lambda out, target: torch.nn.functional.mse_loss(out, target)) if training else None
    options = PlanOptions(training=training, loss_fn=loss, stamp_layers=False)
    with torch.enable_grad():
        c = run_pipeline(model, inputs, MeshSpec((1,), ("probe",), device=builtin_cpu()), options,
                         RankBinding(0, ("",)), quiet=True)
    compiled = CompiledModule(c, None, src_data_rank=None)
    return compiled, inputs, graphs_alone(compiled, inputs)


def graphs_alone(compiled, local: tuple):
    """A call of `compiled`'s generated graphs themselves on its local inputs `local`, under no_grad: no
    `CompiledModule.__call__`, no autograd (what a plan's objective prices: its nodes and collectives);
    in training the forward graph, then the backward graph on values saved once and tangents of ones."""
    import torch

    args = [a.detach() for a in compiled._graph_args(local)]
    if compiled.split is None:
        gm = compiled.graph_module

        def forward():
            with torch.no_grad():
                gm(*args)
        return forward
    split = compiled.split
    with torch.no_grad():
        flat = split.forward(*args)
    saved = flat[split.n_outputs + len(split.updates):]
    tangents = [torch.ones_like(o) for o in flat[:split.n_outputs]]

    def step():
        with torch.no_grad():
            split.forward(*args)
            split.backward(*saved, *tangents)
    return step


def measure_wrapper(warmup: int, reps: int, seconds: float) -> list[tuple[float, float, float, float, float]]:
    """[(training, placeholders, parameters, saved values, seconds)]: per call of a compiled module (and
    `.backward()` in training), the time around its graphs, the call less the graphs called directly
    (`Plan.wrapper_overhead_s` prices it from the same counts, `Plan.wrapper_counts`)."""
    import torch

    points = []
    for training in (False, True):
        for layers in WRAPPER_LAYERS:
            compiled, inputs, graphs = _wrapped(layers, training)
            params = list(compiled.parameters())

            def step():
                with torch.enable_grad():
                    compiled(*inputs).backward()
                for p in params:
                    p.grad = None

            def forward():
                with torch.no_grad():
                    compiled(*inputs)
            points.append((float(training), *map(float, compiled.plan.wrapper_counts),
                           _paired_difference(step if training else forward, graphs, warmup, reps, seconds)))
    return points


def _paired_difference(fn, base, warmup: int, reps: int, seconds: float) -> float:
    """Seconds per call of `fn` less `base`'s, each timed as `_timed_per_call` does, the two taken in turn
    and the median of the per-turn differences (never negative): ranks sharing the cores drift in speed
    over a second, and a difference of two medians taken at different times (4 ranks on 2 cores: half a
    second apart) mixed the drift into a few microseconds."""
    k = _agreed_repeats(fn, seconds)
    timed = {f: _repeated(f, k) for f in (fn, base)}
    gaps = []
    for i in range(warmup + reps):
        order = (fn, base) if i % 2 == 0 else (base, fn)  # which goes first alternates: no order bias
        t = {f: _timed(timed[f], 0, 1) for f in order}
        if i >= warmup:
            gaps.append((t[fn] - t[base]) / k)
    return max(statistics.median(gaps), 0.0)


def priced(gm, device) -> tuple[float, float, float]:
    """(fixed, work, bytes) the cost model gives an unsharded make_fx graph on `device`: the seconds of its
    per-node fixed costs (ops and views), the seconds of the rest of `compute.compute_cost` (kernels' work,
    bytes at their cache level, faults), and the bytes its ops that fit in the caches read and write (what
    `compute.cold_seconds` charges)."""
    import torch
    import torch.fx as fx

    from spmd.core.specs import TensorInfo
    from spmd.cost_model.compute import compute_cost, local_call
    from spmd.passes.trace_module import tensor_info_of

    infos = {n.name: tensor_info_of(n) for n in gm.graph.nodes}

    def is_tensor(a) -> bool:
        return isinstance(infos.get(a.name), TensorInfo)

    fixed = work = moved = 0.0
    for n in gm.graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue  # (getitem: the generated code's Python alone)
        if is_view(n.target):
            fixed += device.view_overhead_s
            continue
        ins = [infos[a.name] for a in torch.utils._pytree.tree_leaves((n.args, n.kwargs))
               if isinstance(a, fx.Node) and is_tensor(a)]
        out = infos[n.name]
        outs = [o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, TensorInfo)]
        args, kwargs = local_call(n, is_tensor, ins)
        fixed += device.op_overhead_s
        work += compute_cost(n.target, args, kwargs, ins, outs, device) - device.op_overhead_s
        nbytes = sum(i.nbytes for i in ins) + sum(o.nbytes for o in outs)
        moved += nbytes if nbytes <= device.cache_bytes else 0.0  # (what `compute.cold_seconds` charges per byte)
    return fixed, work, moved


def _repeats(fn, seconds: float) -> int:
    """How many calls of `fn` last about `seconds`. Ranks sharing a core only
    compete if their timed calls overlap; short calls after a barrier get staggered and each sees a whole
    core (4 ranks on 2 cores measured 93 GFLOP/s per rank that way, ~50 with 20 ms calls)."""
    fn()
    t0 = time.perf_counter()
    fn()
    return max(1, round(seconds / max(time.perf_counter() - t0, 1e-7)))


def _agreed_repeats(fn, seconds: float) -> int:
    """`_repeats`, the same on every rank (each must repeat as often as the others): the largest."""
    import torch.distributed as dist

    k = _repeats(fn, seconds)
    if _distributed():
        counts = [None] * dist.get_world_size()
        dist.all_gather_object(counts, k)
        k = max(counts)
    return k


def _repeated(fn, k: int):
    def call():
        for _ in range(k):
            fn()
    return call


def _timed_per_call(fn, warmup: int, reps: int, seconds: float) -> float:
    k = _agreed_repeats(fn, seconds)
    return _timed(_repeated(fn, k), warmup, reps) / k


def measure_device(warmup: int = 2, reps: int = 9, quick: bool = False,
                   seconds: float = 0.02) -> dict[str, list[tuple[float, float]]]:
    """kind -> [(x, seconds)]: "matmul" x = FLOPs of an fp32 mm (transformer shapes; squares when quick);
    "stream", "dram", "fault" x =
    bytes an out-of-place add moves (2 reads + 1 write) in cache, from DRAM, and with a fresh output; "op"
    x = non-view nodes of a small joint graph, t = its time per call (less its views') / x; "view" x = nodes
    of a graph of views alone, t = its time per call / x; "elementwise": op name -> seconds
    per output element (`measure_elementwise`); "block": (batch, seq, width, heads, seconds per call) of
    `_block_graph`s (`in_graph`); "wrapper": `measure_wrapper`'s points. Each timed call repeats the kernel for about `seconds`
    (see `_repeats`)."""
    import torch

    out: dict[str, list[tuple[float, float]]] = {}
    pts = []
    # a transformer layer's matmuls on 512 tokens: up-projection, down-projection, and a weight gradient
    # (a transposed operand), hidden size d; squares in the quick run
    shapes = [(n, n, n, False) for n in (64, 128, 256)] if quick else \
        [s for d in (128, 256, 512, 768) for s in ((512, d, 4 * d, False), (512, 4 * d, d, False), (d, 512, 4 * d, True))]
    for m, k, n, transposed in shapes:
        a, b = (torch.randn(k, m).t() if transposed else torch.randn(m, k)), torch.randn(k, n)
        pts.append((2.0 * m * k * n, _timed_per_call(lambda: torch.mm(a, b), warmup, reps, seconds)))
    out["matmul"] = pts
    # streaming adds: operands that stay in cache, operands from DRAM (outputs below FRESH_PAGE_BYTES,
    # reused by the allocator), and outputs of FRESH_PAGE_BYTES and more, fresh pages each call
    for kind, sizes in (("stream", (1 << 15, 1 << 16) if quick else (1 << 15, 1 << 16, 1 << 17, 1 << 18)),
                        ("dram", (1 << 21,) if quick else (1 << 21, 3 << 20)),
                        ("fault", () if quick else (FRESH_PAGE_BYTES // 4, FRESH_PAGE_BYTES // 2))):
        pts = []
        for numel in sizes:
            a, b = torch.randn(numel), torch.randn(numel)
            pts.append((12.0 * numel, _timed_per_call(lambda: torch.add(a, b), warmup, reps, seconds)))
        out[kind] = pts
    out["elementwise"] = measure_elementwise(warmup, reps, seconds, quick)
    # compute.py charges views `view_overhead_s` and every other node a fixed cost: a graph of views alone
    # gives the first, then (seconds per call of the small joint graph - its views') / its non-view nodes
    vg, vx = _view_graph()
    views = sum(1 for n in vg.graph.nodes if n.op == "call_function")
    out["view"] = [(float(views), _timed_per_call(lambda: vg(vx), warmup, reps, seconds) / views)]
    gm, xs = _small_joint_graph()
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    nonview = sum(1 for n in calls if not is_view(n.target))
    per_call = _timed_per_call(lambda: gm(*xs), warmup, reps, seconds)
    views_s = (len(calls) - nonview) * out["view"][0][1]
    out["op"] = [(float(nonview), max(per_call - views_s, 0.0) / nonview)]
    # the same kernels as a graph runs them, once each among the others (`fit_device` reads the gap)
    out["block"] = []
    for size in BLOCK_SIZES:
        bg, bx = _block_graph(*size)
        out["block"].append((*size, _timed_per_call(lambda: bg(*bx), warmup, reps, seconds)))
    out["wrapper"] = measure_wrapper(warmup, reps + 2, seconds / 2)
    out["optimizer"] = measure_optimizer(warmup, reps)
    return out


# (tensors, elements each) of the AdamW steps timed: the fixed costs (one tiny tensor, 64 of them: per step
# and per tensor); pieces of OPTIMIZER_CACHED_BYTES; of OPTIMIZER_LARGE_BYTES (fp32)
OPTIMIZER_CASES = ((1, 16), (64, 16), (64, 1 << 18), (4, 1 << 22))


def measure_optimizer(warmup: int = 2, reps: int = 9) -> list[tuple[float, float, float]]:
    """[(tensors, elements, seconds)] of one torch.optim.AdamW step (as torch picks its implementation
    for these tensors) over parameters with gradients, `OPTIMIZER_CASES`: one and 64 tiny ones (its fixed
    costs, per step and per tensor), 64 of 1 MB and 4 of 16 MB (each 256 MB with gradients and moments,
    more than the caches hold, as a model's are). Per element the larger pieces cost more: their seven
    passes no longer find the piece in cache (`fit_device`: `optimizer_call_overhead_s`,
    `optimizer_tensor_overhead_s`, `optimizer_cached_bandwidth`, `optimizer_bandwidth`; on a 2-core EPYC
    with 2 ranks stepping at once: 17 us per tensor, 1.6 and 2.8 ns per element)."""
    import torch

    out = []
    for tensors, numel in OPTIMIZER_CASES:
        params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(tensors)]
        for p in params:
            p.grad = torch.randn(numel)
        opt = torch.optim.AdamW(params, lr=1e-3)
        out.append((float(tensors), float(tensors * numel), _timed(opt.step, warmup, reps)))
        del opt, params
    return out


# glibc's malloc serves every block of 32 MiB or more (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit) with a fresh
# mmap and unmaps it on free, so each such output is faulted in page by page when first written
FRESH_PAGE_BYTES = 32 << 20
ELEMENT_ROW = 768  # row length for the row-wise kernels (norm, softmax): a transformer's hidden size


def _elementwise_cases(numel: int) -> dict:
    """ATen op name -> (call, output elements) on fp32 tensors of `numel` elements, rows of ELEMENT_ROW."""
    import torch

    aten = torch.ops.aten
    rows = numel // ELEMENT_ROW
    x, g = torch.randn(rows, ELEMENT_ROW), torch.randn(rows, ELEMENT_ROW)
    w, bias = torch.randn(ELEMENT_ROW), torch.randn(ELEMENT_ROW)
    y, mean, rstd = aten.native_layer_norm.default(x, [ELEMENT_ROW], w, bias, 1e-5)
    soft, logsoft, th, sg = x.softmax(-1), x.log_softmax(-1), x.tanh(), x.sigmoid()
    n, r = x.numel(), rows
    return {
        "gelu": (lambda: aten.gelu.default(x), n),
        "gelu_backward": (lambda: aten.gelu_backward.default(g, x), n),
        "silu": (lambda: aten.silu.default(x), n),
        "silu_backward": (lambda: aten.silu_backward.default(g, x), n),
        "native_layer_norm": (lambda: aten.native_layer_norm.default(x, [ELEMENT_ROW], w, bias, 1e-5), n + 2 * r),
        "native_layer_norm_backward": (lambda: aten.native_layer_norm_backward.default(
            g, x, [ELEMENT_ROW], mean, rstd, w, bias, [True, True, True]), n + 2 * ELEMENT_ROW),
        "_softmax": (lambda: aten._softmax.default(x, -1, False), n),
        "_softmax_backward_data": (lambda: aten._softmax_backward_data.default(g, soft, -1, torch.float32), n),
        "_log_softmax": (lambda: aten._log_softmax.default(x, -1, False), n),
        "_log_softmax_backward_data": (lambda: aten._log_softmax_backward_data.default(g, logsoft, -1,
                                                                                        torch.float32), n),
        "exp": (lambda: aten.exp.default(x), n),
        "log": (lambda: aten.log.default(soft), n),
        "tanh": (lambda: aten.tanh.default(x), n),
        "tanh_backward": (lambda: aten.tanh_backward.default(g, th), n),
        "sigmoid": (lambda: aten.sigmoid.default(x), n),
        "sigmoid_backward": (lambda: aten.sigmoid_backward.default(g, sg), n),
        "erf": (lambda: aten.erf.default(x), n),
        "sqrt": (lambda: aten.sqrt.default(soft), n),
        "rsqrt": (lambda: aten.rsqrt.default(soft), n),
        "cos": (lambda: aten.cos.default(x), n),
        "sin": (lambda: aten.sin.default(x), n),
        "pow": (lambda: aten.pow.Tensor_Scalar(x, 3.0), n),
        "where": (lambda: aten.where.self(y > 0, x, g), n),
        "native_dropout": (lambda: aten.native_dropout.default(x, 0.1, True), 2 * n),
        "bernoulli": (lambda: aten.bernoulli.p(x, 0.9), n),
    }


def measure_elementwise(warmup: int = 2, reps: int = 9, seconds: float = 0.02, quick: bool = False,
                        numel: int = 1 << 18) -> dict[str, float]:
    """ATen op name -> seconds per output element, on tensors that stay in cache (`numel` fp32 elements:
    1 MiB), every rank at once: the work of kernels that are more than a few instructions per element,
    for `DeviceProfile.element_seconds` (the memory traffic of larger tensors is priced separately)."""
    cases = _elementwise_cases(numel)
    names = ("gelu", "exp", "native_dropout", "native_layer_norm") if quick else tuple(cases)
    return {name: _timed_per_call(cases[name][0], warmup, reps, seconds) / cases[name][1] for name in names}


def measure_lockstep(segments: int = 40, warmup: int = 3) -> list[list[float]]:
    """Every rank's seconds (rank -> one per segment, the same lists on every rank) for the same fixed
    work, a barrier before each segment: four rounds of a transformer layer's matmul, GELU, residual add
    and LayerNorm on 512 tokens of width 768 (~40 ms here). A step waits at each collective for the
    slowest rank; `lockstep_slowdown` reads how much that costs on this host."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(512, ELEMENT_ROW, generator=g), torch.randn(ELEMENT_ROW, ELEMENT_ROW, generator=g)
    lw, lb = torch.ones(ELEMENT_ROW), torch.zeros(ELEMENT_ROW)

    def segment():
        h = x
        for _ in range(4):
            h = F.layer_norm(h + F.gelu(h @ w), (ELEMENT_ROW,), lw, lb)

    times = []
    for i in range(warmup + segments):
        dist.barrier()
        t0 = time.perf_counter()
        segment()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    table = torch.zeros(dist.get_world_size(), segments, dtype=torch.float64)
    table[dist.get_rank()] = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(table)
    return table.tolist()


def lockstep_slowdown(per_rank: list[list[float]]) -> float:
    """Sum over segments of the slowest rank's time / of the mean rank's (>= 1; 1 for one rank)."""
    slowest = sum(max(seg) for seg in zip(*per_rank))
    mean = sum(sum(seg) / len(seg) for seg in zip(*per_rank))
    return max(1.0, slowest / mean) if mean > 0 else 1.0


def builtin_cpu():
    """The built-in `cpu` profile scaled by this rank's share of the cores (as MeshSpec.from_device_mesh)."""
    from spmd.core.profiles import device_profile_for

    return device_profile_for("cpu").scaled(min(1.0, (os.cpu_count() or 1) / ranks_on_this_host()))


def fit_alpha_beta(xs, ts, relative: bool = True) -> tuple[float, float]:
    """Least-squares fit of t = alpha + x / beta over points (x units, t seconds): (alpha >= 0, beta > 0).

    `relative`: minimise relative errors (each residual divided by its t). The sizes span three decades;
    plain least squares lets the largest points decide the intercept, so the latency of small messages
    (what most collectives in a step are) comes out wrong or negative. A negative intercept is clamped
    to 0 and the slope refitted through the origin; a non-positive slope (time flat in size, within
    noise) gives the largest bandwidth the points cannot tell from infinite (1e15)."""
    import numpy as np

    x, t = np.asarray(xs, float), np.asarray(ts, float)
    if len(x) == 0 or np.any(t <= 0) or np.any(x < 0):
        raise ValueError("fit_alpha_beta: need points with x >= 0 and t > 0")
    w = 1.0 / t if relative else np.ones_like(t)
    if len(x) >= 2 and np.ptp(x) > 0:
        a = np.stack([w, w * x], 1)
        alpha, slope = np.linalg.lstsq(a, w * t, rcond=None)[0]
    else:
        alpha, slope = 0.0, float(np.sum(w * w * x * t) / max(np.sum(w * w * x * x), 1e-300))
    if alpha < 0:
        alpha = 0.0
        slope = float(np.sum(w * w * x * t) / max(np.sum(w * w * x * x), 1e-300))
    if slope <= 0:
        alpha, slope = float(np.sum(w * w * t) / np.sum(w * w)), 1e-15
    return float(alpha), float(1.0 / slope)


def _line(points) -> tuple[float, float]:
    """Least-squares (intercept, slope) of t = intercept + slope * x over (x, t) points, neither negative
    (a negative one is dropped to 0 and the other refitted alone)."""
    import numpy as np

    x, t = np.array([p[0] for p in points], float), np.array([p[1] for p in points], float)
    if len(x) >= 2 and np.ptp(x) > 0:
        intercept, slope = np.linalg.lstsq(np.stack([np.ones_like(x), x], 1), t, rcond=None)[0]
        if intercept >= 0 and slope >= 0:
            return float(intercept), float(slope)
        if slope < 0:
            return max(float(t.mean()), 0.0), 0.0
        return 0.0, max(float(x @ t / (x @ x)), 0.0) if x @ x > 0 else 0.0
    return max(float(t.mean()), 0.0) if len(t) else 0.0, 0.0


def fit_device(points: dict, source: str, memory_bytes: float):
    """The device profile from `measure_device`'s points; what was not timed (attention's efficiency, in
    quick runs the page-fault rate; the per-call wrapper in timings older than its points) comes from the built-in cpu,
    scaled by this rank's core share. Element-wise kernels a quick run did not time take the built-in's
    seconds per element times the median ratio, measured / built-in, of those it timed."""
    import statistics

    from spmd.core.profiles import DeviceProfile

    cpu = builtin_cpu()
    view = points["view"][0][1] if points.get("view") else cpu.view_overhead_s
    op = max(points["op"][0][1], view)  # (a noisy view timing may leave nothing: an op dispatches at least as a view)
    _, flops = fit_alpha_beta(*zip(*points["matmul"]))
    _, bandwidth = fit_alpha_beta(*zip(*points["stream"]))
    dram = fit_alpha_beta(*zip(*points["dram"]))[1] if points.get("dram") else cpu.dram_bandwidth
    # an add with a fresh output: its DRAM traffic, then the output's pages (a third of what it moves)
    faults = [moved / 3 / (t - moved / dram) for moved, t in points.get("fault", ()) if t > moved / dram]
    fault_bw = statistics.median(faults) if faults else cpu.page_fault_bandwidth
    elementwise = dict(points.get("elementwise") or {})
    builtin = dict(cpu.element_seconds)
    ratios = [s / builtin[k] for k, s in elementwise.items() if builtin.get(k)]
    if ratios:
        scale = statistics.median(ratios)
        elementwise.update({k: s * scale for k, s in builtin.items() if k not in elementwise})
    lockstep = lockstep_slowdown(points["lockstep"]) if points.get("lockstep") else cpu.lockstep_slowdown
    wrapper = points.get("wrapper")
    if wrapper:  # per call + per placeholder; in training, + per parameter and saved value (Plan.wrapper_overhead_s)
        call, per_arg = _line([(args, t) for training, args, _, _, t in wrapper if not training])
        backward, per_tensor = _line([(params + saved, t - call - per_arg * args)
                                      for training, args, params, saved, t in wrapper if training])
    else:
        call, per_arg = cpu.call_overhead_s, cpu.arg_overhead_s
        backward, per_tensor = cpu.backward_overhead_s, cpu.autograd_tensor_overhead_s
    opt_call, opt_tensor, opt_cached, opt_bw = _fit_optimizer(points.get("optimizer"), bandwidth, cpu)
    looped = DeviceProfile("calibrated-cpu", flops, bandwidth, op, memory_bytes, source,
                         attention_efficiency=cpu.attention_efficiency,
                         view_overhead_s=view, call_overhead_s=call, arg_overhead_s=per_arg,
                         backward_overhead_s=backward, autograd_tensor_overhead_s=per_tensor,
                         cache_bytes=_cache_share() or cpu.cache_bytes, dram_bandwidth=dram,
                         fresh_page_bytes=FRESH_PAGE_BYTES, page_fault_bandwidth=fault_bw,
                         element_seconds=tuple(sorted(elementwise.items())) or cpu.element_seconds,
                         lockstep_slowdown=lockstep, optimizer_call_overhead_s=opt_call,
                         optimizer_tensor_overhead_s=opt_tensor,
                         optimizer_cached_bandwidth=opt_cached, optimizer_bandwidth=opt_bw)
    return in_graph(looped, points.get("block") or ())


def _fit_optimizer(points, bandwidth: float, cpu) -> tuple[float, float, float | None, float | None]:
    """(seconds per step, per tensor, cached and large bandwidths of element accesses) from
    `measure_optimizer`'s points: per step and per tensor from the line through the tiny cases (one and 64
    tensors: the step's own cost is what one tensor takes beyond the rest's share; never negative), each
    bandwidth from AdamW's accesses over the rest of its case's time, none above `bandwidth` (an add in
    cache moves bytes no slower than AdamW) and the large pieces' none above the cached ones'. Timings
    that say nothing sane (missing, from before the one-tensor case, or a case no slower than its fixed
    costs) give the built-in's four numbers."""
    from spmd.cost_model.compute import ADAM_ACCESSES

    builtin = (cpu.optimizer_call_overhead_s, cpu.optimizer_tensor_overhead_s, cpu.optimizer_cached_bandwidth,
               cpu.optimizer_bandwidth)
    if not points or len(points) != len(OPTIMIZER_CASES):
        return builtin
    (k1, _, t1), (k0, _, t0), *cases = points
    if t0 > t1:
        per_tensor = (t0 - t1) / (k0 - k1)
        per_step = max(t1 - k1 * per_tensor, 0.0)
    else:  # one tensor no faster than 64: noise, and every tensor pays its share of the 64's time
        per_tensor, per_step = t0 / k0, 0.0
    rates = []
    for tensors, elements, t in cases:
        work = t - per_step - tensors * per_tensor
        if not work > 0.1 * t:  # the elements' time lost in the fixed costs' noise
            return builtin
        rates.append(min(ADAM_ACCESSES * 4 * elements / work, bandwidth))
    cached, large = rates
    return per_step, per_tensor, cached, min(large, cached)


def in_graph(device, blocks):
    """`device` (its numbers timed in loops, one kernel over and over) as a graph runs its kernels, once
    each among the others: their operands and outputs are not in the caches the loop kept them in, and
    their fixed costs are higher (colder instruction caches and predictors). `blocks`: (batch, seq, width,
    heads, seconds per call) of `_block_graph`s. Their times t = a * fixed + work + bytes / B, with
    (fixed, work, bytes) the loop-timed device's price of each (`priced`), fitted by least squares, give
    a (the fixed costs per node, in a graph against in a loop) and B (`DeviceProfile.operand_bandwidth`).
    Without two sizes, or where the fit is not positive, `device` as it is."""
    import dataclasses

    import numpy as np

    if len(blocks) < 2 or not math.isinf(device.operand_bandwidth):
        return device
    rows = [(*priced(_block_graph(*size)[0], device), t) for *size, t in blocks]
    (a, per_byte), *_ = np.linalg.lstsq(np.array([[f, b * 1e-9] for f, _, b, _ in rows]),
                                        np.array([t - w for _, w, _, t in rows]), rcond=None)  # (per GB: scaled)
    per_byte *= 1e-9
    if not per_byte > 0:  # the larger graph's work already over-priced: the fixed costs from the smallest alone
        f, w, _, t = min(rows, key=lambda r: r[1])
        a, per_byte = (t - w) / f, 0.0
    if not a > 0:
        return device
    a = float(a)
    cold = (f"each op that fits in the caches reads and writes its bytes at {1e-9 / float(per_byte):.1f} GB/s "
            "on top of its work") if per_byte > 0 else "no cold bytes (the fit found none)"
    return dataclasses.replace(
        device, op_overhead_s=device.op_overhead_s * a, view_overhead_s=device.view_overhead_s * a,
        operand_bandwidth=1.0 / float(per_byte) if per_byte > 0 else math.inf,
        source=device.source + f"; in a graph: fixed costs per node x{a:.2f} their timings in a loop, {cold} "
        "(a transformer block's joint graph at two sizes, timed whole)")


def _cache_share() -> float | None:
    """Half of this rank's share of the caches (L2 + L3 / ranks on this host, from Linux's sysfs): the bytes
    one op can move at cache speed, leaving room for what else stays resident. None where sysfs says nothing."""
    import glob

    sizes = {}
    for d in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            with open(f"{d}/level") as f:
                level = int(f.read())
            with open(f"{d}/size") as f:
                text = f.read().strip()
        except (OSError, ValueError):
            continue
        digits, unit = text.rstrip("KMG"), text[len(text.rstrip("KMG")):]
        if digits.isdigit() and level in (2, 3):
            sizes[level] = int(digits) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(unit, 1)
    if not sizes.get(2) and not sizes.get(3):
        return None
    ranks = ranks_on_this_host()
    return (sizes.get(2, 0) + sizes.get(3, 0) / ranks) / 2


def memory_per_rank() -> float:
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        total = 16e9
    return float(total) / ranks_on_this_host()
