"""One GPU: the step spmd predicts (its H100/H200 profile) against the step it measures, with NCCL.

    torchrun --nproc-per-node 1 bench/bench_gpu.py                     # GPT d 2048, 4 layers, bf16
    torchrun --nproc-per-node 1 bench/bench_gpu.py --inductor          # also the compiled rank graphs
    torchrun --nproc-per-node 1 bench/bench_gpu.py --measure           # also a profile measured here
    torchrun --nproc-per-node 1 bench/bench_gpu.py --memory            # also predicted against measured memory
    torchrun --nproc-per-node 2 bench/bench_gpu.py --memory-only --one-gpu  # the same, sharded plans on 2 ranks
    torchrun --nproc-per-node 1 bench/bench_gpu.py --cpu --dim 64 --seq 32 --vocab 128 --layers 1  # dry run

A GPT (examples.models) trains on one GPU, compiled by spmd for a one-rank mesh on NCCL: the plan has
no collectives, so its predicted step is the cost model's compute alone, and the measured step tells how
true the device profile is at these shapes. Rows: the model in eager PyTorch, spmd's rank graphs, and
with --inductor the same graphs through torch.compile (its compile time reported apart). Then each ATen
op's measured time (CUDA-synchronized around every node of the rank graphs) next to what the plan
charged for it. With --measure, the device's rates at this model's shapes (matmul FLOP/s, streaming
bandwidth, the cost of a small kernel, fused attention's share of the matmul rate) are timed, and the
same plan is priced again with them: how far the built-in profile is from this device, and what is left
when the rates are right. With --memory, the bytes a training step adds on the GPU (the caching
allocator's peak over what was allocated before it) against what the plan predicts it adds (its
predicted peak less parameters, buffers and inputs), for no recomputation, selective and whole-layer recomputation, and
a memory budget that leaves the choice to the solver. Results go to bench/results_gpu.md by hand.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import spmd  # noqa: E402
from bench_predict import per_op_table  # noqa: E402
from examples.models import GPT, GPTConfig  # noqa: E402
from spmd.core.mesh import MeshSpec  # noqa: E402


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(step, iters: int, warmup: int = 3) -> float:
    """Median seconds of `step` over `iters` calls, each between two synchronizations."""
    for _ in range(warmup):
        step()
    ts = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def kernel_seconds(fn, reps: int = 20) -> float:
    """Seconds per call of `fn` run back to back `reps` times (the device's time, launches overlapped)."""
    for _ in range(3):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) / reps


def measure_device(cfg, tokens: int, dtype, device, builtin):
    """The built-in profile with the rates measured here at this model's shapes: (profile, notes)."""
    import dataclasses

    from spmd.runtime.measure import fit_alpha_beta

    def randn(*shape):
        return torch.randn(*shape, dtype=dtype, device=device)

    d, f, v = cfg.dim, 4 * cfg.dim, cfg.vocab
    mm_points = []
    for m, k, n, transposed in ((tokens, d, d, False), (tokens, d, f, False), (tokens, f, d, False),
                                (d, tokens, f, True), (tokens, d, v, False), (tokens, v, d, False)):
        a, b = (randn(k, m).t() if transposed else randn(m, k)), randn(k, n)
        mm_points.append((2.0 * m * k * n, kernel_seconds(lambda: torch.mm(a, b))))
    mm_latency, flops = fit_alpha_beta(*zip(*mm_points))
    stream = []
    for numel in (1 << 22, 1 << 24, 1 << 26, 1 << 27):
        a, b = randn(numel), randn(numel)
        stream.append((3.0 * a.element_size() * numel, kernel_seconds(lambda: torch.add(a, b))))
    _, bandwidth = fit_alpha_beta(*zip(*stream))
    tiny = randn(1)
    small_op = kernel_seconds(lambda: torch.add(tiny, tiny), reps=200)
    # fused attention (the kernel eager picks for these shapes), priced by its matmul FLOPs: 2 of s x s x d
    # forward, 5 backward, half of them under a causal mask
    b_, h, s_, hd = tokens // cfg.seq, cfg.heads, cfg.seq, cfg.dim // cfg.heads
    q, k, vv = (randn(b_, h, s_, hd).requires_grad_() for _ in range(3))
    grad = randn(b_, h, s_, hd)
    fwd = kernel_seconds(lambda: F.scaled_dot_product_attention(q, k, vv, is_causal=True))
    both = kernel_seconds(lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, vv, is_causal=True),
                                                      (q, k, vv), grad))
    one_matmul = 2.0 * b_ * h * s_ * s_ * hd * 0.5
    attention = min(1.0, 7 * one_matmul / flops / both)
    profile = dataclasses.replace(builtin, name=f"measured-{builtin.name}", flops=flops, memory_bandwidth=bandwidth,
                                  op_overhead_s=small_op, attention_efficiency=attention,
                                  source=f"bench_gpu.py --measure on {torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}")
    notes = [f"matmul: {flops / 1e12:.0f} TFLOP/s at this model's shapes (fit over {len(mm_points)}, latency "
             f"{mm_latency * 1e6:.1f} us; the built-in {builtin.flops / 1e12:.0f}); each: "
             + ", ".join(f"{fl / t / 1e12:.0f}" for fl, t in mm_points),
             f"streaming add: {bandwidth / 1e12:.2f} TB/s counting reads and writes (the built-in "
             f"{builtin.memory_bandwidth / 1e12:.2f})",
             f"a 1-element add back to back: {small_op * 1e6:.1f} us (the built-in op overhead "
             f"{builtin.op_overhead_s * 1e6:.1f})",
             f"causal attention ({b_}x{h}x{s_}x{hd}): forward {fwd * 1e3:.3f} ms "
             f"({2 * one_matmul / fwd / 1e12:.0f} TFLOP/s), forward + backward {both * 1e3:.3f} ms "
             f"({7 * one_matmul / both / 1e12:.0f} TFLOP/s): {attention:.2f} of the matmul rate (the built-in "
             f"{builtin.attention_efficiency:.2f})"]
    return profile, notes


def step_bytes(forward, params) -> tuple[float, float]:
    """(bytes held after the forward, the caching allocator's peak over the step) above what is allocated
    before one training step of `forward`."""
    sync()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = forward()
    sync()
    held = torch.cuda.memory_allocated() - before
    loss.backward()
    del loss
    for p in params:
        p.grad = None
    sync()
    return held, torch.cuda.max_memory_allocated() - before


def predicted_step_bytes(plan) -> float:
    """What the plan says one training step adds to the memory held before it: its predicted peak less
    what is held all along (parameters, buffers, inputs; optimizer state, which a step without an
    optimizer never makes)."""
    return plan.predicted_peak_bytes - sum(plan.memory.get(k, 0.0)
                                           for k in ("parameters", "optimizer", "buffers", "inputs"))


def memory_rows(model, mesh, spec, tokens, targets, cuda: bool, sharded: bool = False):
    """Predicted against measured step memory for several recompute settings and one budget; on several
    ranks (`sharded`), the free plan and budgets that make the solver shard (this rank's bytes)."""
    gib = 2**30
    nan = float("nan")
    lines = ["| plan | recomputed layers | predicted step ms | saved after the forward, GiB: predicted / measured "
             "| the step's peak over what it starts with, GiB: predicted / measured | measured / predicted |",
             "|---|---|---|---|---|---|"]
    held, peak = step_bytes(lambda: lm_loss(model(tokens), targets), list(model.parameters())) if cuda else (nan, nan)
    lines.append(f"| eager PyTorch | | | {held / gib:.2f} | {peak / gib:.2f} | |")
    settings = [("no recompute", dict(recompute=False)), ("selective, every layer", dict(recompute="selective")),
                ("whole, every layer", dict(recompute=True)),
                ("a budget halfway between no and whole recompute's peaks: the solver's choice", None)]
    if sharded:
        settings = [("free", {}), ("budget 0.75 of the free plan's peak", 0.75), ("budget 0.5", 0.5),
                    ("budget 0.35", 0.35)]
    peaks = []
    for name, kw in settings:
        if kw is None:
            kw = dict(memory_budget=(peaks[0] + peaks[-1]) / 2)
        elif isinstance(kw, float):
            kw = dict(memory_budget=kw * peaks[0])
        try:
            compiled = spmd.compile(model, mesh, (tokens, targets), loss_fn=lm_loss, mesh_spec=spec, **kw)
        except spmd.SpmdError as e:
            lines.append(f"| {name} | {str(e).split(': ', 1)[-1][:90]} | | | | |")
            continue
        plan = compiled.plan
        peaks.append(plan.predicted_peak_bytes)
        local = compiled.shard_inputs(tokens, targets)
        params = list(compiled.parameters())
        training_step(lambda: compiled(*local), params)()  # warm: the first step's workspace is not the plan's
        held, peak = step_bytes(lambda: compiled(*local), params) if cuda else (nan, nan)
        predicted = predicted_step_bytes(plan)
        layers = f"{len(plan.recompute)} whole, {len(plan.recompute_selective)} selective"
        if sharded:  # what the plan keeps of the weights on this rank
            kept = sum(p.numel() * p.element_size() for p in params)
            whole = sum(p.numel() * p.element_size() for p in model.parameters())
            layers += f"; weights {kept / gib:.2f} of {whole / gib:.2f} GiB"
        lines.append(f"| {name} | {layers} | {plan.predicted_step_s * 1e3:.2f} | "
                     f"{plan.memory.get('activations', 0) / gib:.2f} / {held / gib:.2f} | "
                     f"{predicted / gib:.2f} / {peak / gib:.2f} | {peak / predicted:.2f} |")
    return lines


def training_step(fn, params):
    def step():
        fn().backward()
        for p in params:
            p.grad = None
    return step


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--inductor", action="store_true", help="also time the rank graphs through torch.compile")
    ap.add_argument("--cpu", action="store_true", help="a dry run on CPU and gloo (the cpu profile)")
    ap.add_argument("--measure", action="store_true", help="also price the plan with rates measured here")
    ap.add_argument("--memory", action="store_true", help="also predicted against measured memory per step")
    ap.add_argument("--memory-only", action="store_true", help="only the memory rows")
    ap.add_argument("--one-gpu", action="store_true",
                    help="every rank on cuda:0 with gloo (torchrun --nproc-per-node 2): memory rows of sharded plans")
    args = ap.parse_args()

    cuda = not args.cpu
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.one_gpu and cuda:
        torch.cuda.set_device(0)
        dist.init_process_group("gloo")  # (init_mesh keeps a process group that exists)
    mesh = spmd.init_mesh((world,), ("dp",), "cuda" if cuda else "cpu")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = getattr(torch, args.dtype)
    if dtype == torch.float32:
        torch.backends.cuda.matmul.allow_tf32 = True
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, dim=args.dim, heads=args.heads, layers=args.layers)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab, (args.batch, cfg.seq), generator=g).to(device)
    targets = torch.randint(0, cfg.vocab, tokens.shape, generator=g).to(device)
    torch.manual_seed(0)
    model = GPT(cfg).to(device, dtype)
    spec = MeshSpec.from_device_mesh(mesh)
    n_params = sum(p.numel() for p in model.parameters())
    where = f"{torch.cuda.get_device_name()}, NCCL {torch.cuda.nccl.version()}" if cuda else "CPU, gloo"
    print(f"{where}, torch {torch.__version__}, device profile {spec.device.name}; GPT d {cfg.dim}, {cfg.layers} layers, {cfg.heads} heads, "
          f"seq {cfg.seq}, batch {args.batch}, vocab {cfg.vocab}, {n_params / 1e6:.0f}M parameters, {args.dtype}")

    if args.memory or args.memory_only:
        lines = memory_rows(model, mesh, spec, tokens, targets, cuda, sharded=world > 1)
        if dist.get_rank() == 0:
            print("\n" + "\n".join(lines))
        if args.memory_only:
            dist.destroy_process_group()
            return 0

    rows = []
    eager = timed(training_step(lambda: lm_loss(model(tokens), targets), list(model.parameters())), args.iters)
    rows.append(("eager PyTorch", eager, None, None))

    t0 = time.perf_counter()
    compiled = spmd.compile(model, mesh, (tokens, targets), loss_fn=lm_loss, mesh_spec=spec)
    compile_s = time.perf_counter() - t0
    local = compiled.shard_inputs(tokens, targets)
    plan = compiled.plan
    measured = timed(training_step(lambda: compiled(*local), list(compiled.parameters())), args.iters)
    rows.append(("spmd rank graphs", measured, plan.predicted_step_s, compile_s))

    notes = []
    if args.measure:
        profile, notes = measure_device(cfg, tokens.numel(), dtype, device, spec.device)
        measured_spec = MeshSpec(spec.shape, spec.axis_names, spec.links, profile)
        again = spmd.compile(model, mesh, (tokens, targets), loss_fn=lm_loss, mesh_spec=measured_spec)
        rows.append(("spmd rank graphs, priced with the measured profile", measured,
                     again.plan.predicted_step_s, None))
        del again

    if args.inductor:
        t0 = time.perf_counter()
        fast = spmd.compile(model, mesh, (tokens, targets), loss_fn=lm_loss, mesh_spec=spec, compile_graphs=True)
        fast_local = fast.shard_inputs(tokens, targets)
        step = training_step(lambda: fast(*fast_local), list(fast.parameters()))
        step()
        sync()
        first_s = time.perf_counter() - t0
        rows.append(("spmd rank graphs, inductor", timed(step, args.iters), plan.predicted_step_s, first_s))

    print("\n| training step (forward, loss, backward) | measured ms | predicted ms | measured / predicted "
          "| compile s (inductor: to the end of the first step) |\n|---|---|---|---|---|")
    for name, m, p, c in rows:
        print(f"| {name} | {m * 1e3:.2f} | {'' if p is None else f'{p * 1e3:.2f}'} | "
              f"{'' if p is None else f'{m / p:.2f}'} | {'' if c is None else f'{c:.1f}'} |")
    for line in notes:
        print(f"- {line}")
    print(f"\nplan: compute {plan.compute_cost * 1e3:.2f} ms, communication {plan.comm_cost * 1e3:.2f} ms, "
          f"wrapper {plan.wrapper_overhead_s * 1e3:.3f} ms"
          + (f"; peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if cuda else ""))

    print("\nper op, each node between two synchronizations:\n")
    print("\n".join(per_op_table(compiled, local, True, sync=sync, calls=7)))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
