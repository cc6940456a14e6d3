"""Time to failure of the cases in docs/reliability.md, on 2 gloo ranks of this machine.

    python bench/bench_failures.py            # writes bench/results_failures.md

Each case starts two processes as torchrun does (RANK, WORLD_SIZE, MASTER_*), and measures, on the rank
that has to notice, the seconds from the event (a peer dies, hangs, or compiles something else) to the
SpmdError it raises. Disagreements are measured from the start of `spmd.compile` (the ranks meet before
their first collective); a dead or hung peer from the moment it stops (tests/e2e/scripts/dying_rank.py).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support import launch_ranks  # noqa: E402  (ranks started as torchrun starts them)
DISAGREE = r'''
import os, sys, time
sys.path.insert(0, {root!r})
import torch
from torch.distributed.tensor import Shard
import spmd
from tests.models import GPT, GPTConfig
what = sys.argv[1]
torch.set_num_threads(1)
mesh = spmd.init_mesh((2,), ("dp",))
rank = torch.distributed.get_rank()
torch.manual_seed(0)
model = GPT(GPTConfig(layers=3 if (what == "layers" and rank == 1) else 2))
if what == "dtype" and rank == 1:
    model = model.double()
if what == "weights" and rank == 1:
    torch.manual_seed(1)
    model = GPT(GPTConfig())
tokens = torch.randint(0, 128, (6 if (what == "batch" and rank == 1) else 4, 16))
pins = dict(tokens=[Shard(0)]) if (what == "pins" and rank == 1) else dict()
extra = dict(src_data_rank=None) if what == "weights" else dict()
t0 = time.time()
try:
    spmd.compile(model, mesh, (tokens,), in_placements=pins, **extra)
    print("no error", flush=True)
except spmd.SpmdError as e:
    print(f"failed after {{time.time() - t0:.2f}} s: {{str(e).splitlines()[1].strip()[:90]}}", flush=True)
'''


def disagreement(what: str) -> tuple[float, str]:
    script = ROOT / "bench" / ".disagree.py"
    script.write_text(DISAGREE.format(root=str(ROOT)))
    try:
        procs = launch_ranks([str(script), what])
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        script.unlink()
    lines = [next((ln for ln in o.splitlines() if ln.startswith(("failed", "no error"))), o[-200:]) for o in outs]
    slowest = max(float(ln.split()[2]) for ln in lines if ln.startswith("failed"))
    return slowest, lines[0].split(": ", 1)[-1]


def dead_peer(how: str, timeout_s: float = 10.0) -> float:
    procs = launch_ranks([str(ROOT / "tests" / "e2e" / "scripts" / "dying_rank.py"), how, str(timeout_s)])
    try:
        procs[0].communicate(timeout=300)
        t_end = time.time()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        out1 = procs[1].communicate(timeout=60)[0]
    t_event = float(next(ln for ln in out1.splitlines() if "at step 2" in ln).split(", ")[-1])
    return t_end - t_event


def main() -> None:
    rows = []
    for what in ("layers", "batch", "dtype", "pins", "weights"):
        seconds, message = disagreement(what)
        rows.append(f"| ranks differ in {what} | {seconds:.2f} s from compile start | {message} |")
        print(rows[-1], flush=True)
    for how in ("die", "hang"):
        seconds = dead_peer(how)
        rows.append(f"| a peer {'dies' if how == 'die' else 'hangs (timeout=10 s)'} mid-step | {seconds:.2f} s "
                    "(exit code 1, process gone) | SpmdCollectiveError naming the collective, axis and line |")
        print(rows[-1], flush=True)
    out = ROOT / "bench" / "results_failures.md"
    out.write_text("# Time to failure (2 gloo ranks, this 2-core machine)\n\n`python bench/bench_failures.py`; "
                   "the disagreement times include tracing and the meeting (no solve).\n\n"
                   "| case | time to the error | first line of the message |\n|---|---|---|\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
