"""Time to first step: transformers' GPT-2-small (124M, seq 128, batch 4) training on (2,) gloo, from
`spmd.compile` to the end of the first optimizer step, split into where the time goes.

    python bench/bench_first_step.py            # spawns the 2 ranks itself (or under torchrun)
    python bench/bench_first_step.py --steps 5  # also time later steps and one process in eager
    python bench/bench_first_step.py --plan /tmp/gpt2.json  # solve and save the plan; run again: compile with it

Phases (rank 0's clock, after a barrier): the model built on every rank (random weights, seed 0, not
counted), `spmd.compile` (its pipeline's passes separately, from `Compilation.timings`), the optimizer
made, then the first step: `shard_inputs`, forward (`compiled(**local)`, which makes the FX code at its
first call), `loss.backward()`, `opt.step()`. Later steps and a single eager process (rank 0 alone,
one thread) give the steady-state speedup. Prints markdown rows for bench/results_first_step.md.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import spmd  # noqa: E402
import spmd.api  # noqa: E402
from bench_forward import launch  # noqa: E402


def gpt2_small():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(use_cache=False))


def _clock(rank: int) -> float:
    dist.barrier()
    return time.perf_counter()


def worker(args) -> None:
    torch.set_num_threads(1)
    mesh = spmd.init_mesh((2,), ("tp",))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = gpt2_small()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=g)
    rows: list[tuple[str, float]] = []

    made = []  # the pipeline's Compilation, for its per-pass timings
    run = spmd.api.run_pipeline
    spmd.api.run_pipeline = lambda *a, **k: made.append(run(*a, **k)) or made[-1]
    t = _clock(rank)
    given = args.plan if args.plan and os.path.exists(args.plan) else None
    compiled = spmd.compile(model, mesh, example_kwargs=dict(input_ids=ids, labels=ids), training=True,
                            compile_graphs=args.compile_graphs, stamp_layers=False if args.whole else None,
                            plan=given)
    t1 = _clock(rank)
    if args.plan and not given and rank == 0:
        compiled.plan.save(args.plan)
    rows.append(("spmd.compile", t1 - t))
    spmd.api.run_pipeline = run
    for name, s in made[0].timings.items():
        rows.append((f"  {name}", s))
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-4)
    t2 = _clock(rank)
    rows.append(("optimizer", t2 - t1))
    _, local = compiled.shard_inputs(input_ids=ids, labels=ids)
    t3 = time.perf_counter()
    rows.append(("first step: shard_inputs", t3 - t2))
    loss = compiled(**local).loss
    t4 = time.perf_counter()
    rows.append(("first step: forward", t4 - t3))
    loss.backward()
    t5 = time.perf_counter()
    rows.append(("first step: backward", t5 - t4))
    opt.step()
    opt.zero_grad()
    t6 = _clock(rank)
    rows.append(("first step: optimizer step", t6 - t5))
    rows.append(("compile to end of first step", t6 - t))

    steady, fb = [], []
    for _ in range(args.steps):
        s0 = _clock(rank)
        compiled(**local).loss.backward()
        fb.append(_clock(rank) - s0)
        opt.step()
        opt.zero_grad()
        steady.append(_clock(rank) - s0)
    eager = []
    if rank == 0 and args.steps:
        torch.manual_seed(0)
        ref = gpt2_small()
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-4)
        for _ in range(args.steps + 1):
            s0 = time.perf_counter()
            ref(input_ids=ids, labels=ids).loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            eager.append(time.perf_counter() - s0)
    dist.barrier()
    if rank == 0:
        print("| phase | s |\n|---|---|")
        for name, s in rows:
            print(f"| {name} | {s:.2f} |")
        if steady:
            med = sorted(steady)[len(steady) // 2]
            emed = sorted(eager[1:])[len(eager[1:]) // 2]
            fmed = sorted(fb)[len(fb) // 2]
            pred = compiled.plan.predicted_step_s
            print(f"\nlater steps (median of {len(steady)}): {med:.2f} s, forward + backward {fmed:.2f} s; one process "
                  f"eager: {emed:.2f} s (first {eager[0]:.2f} s); speedup {emed / med:.2f}x\n"
                  f"plan: predicted step (forward, backward, AdamW's step) {pred:.2f} s (measured / predicted "
                  f"{med / pred:.2f}); collectives {compiled.plan.comm_cost:.2f} s of it")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=0, help="later steps to time, and as many eager ones")
    ap.add_argument("--compile-graphs", action="store_true")
    ap.add_argument("--whole", action="store_true", help="trace all 12 layers (default: 3, stamped to 12)")
    ap.add_argument("--plan", help="a plan file: compiled with it (plan=) where it exists, else solved and saved there")
    launch(worker, ap.parse_args())


if __name__ == "__main__":
    main()
