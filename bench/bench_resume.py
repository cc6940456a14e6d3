"""Resident memory of a resume in a fresh process, per phase (bench/results_big.md, "Resuming").

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 bench/bench_resume.py --save /tmp/ckpt [--dim 2048]
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 bench/bench_resume.py --resume /tmp/ckpt [--dim 2048]

The GPT of `examples/models.py` built on meta, every weight split on dim 0 over 4 gloo ranks, filled by
`init_weights`, trained one AdamW step and saved with torch.distributed.checkpoint (`--save`); then, in a
new process as a run resumes (`--resume`), a compile of a meta build, a fresh optimizer, `{"model": state_dict(), "optim":
optimizer_state_dict(opt)}`, `dcp.load` into it, `load_state_dict`, `load_optimizer_state_dict`, the dict
dropped, and two steps. Rank 0 prints each phase's growth of its resident memory (VmHWM after clearing
it) and its resident total, in MiB.
"""
from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.tensor import Shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import spmd  # noqa: E402
from examples.models import GPT, GPTConfig  # noqa: E402


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


class Phase:
    def __init__(self, name: str, rank: int):
        self.name, self.rank = name, rank

    def __enter__(self):
        gc.collect()
        dist.barrier()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # (the high-water mark restarts here)
        self.base = _status("VmRSS")

    def __exit__(self, *exc):
        gc.collect()
        if self.rank == 0:
            print(f"| {self.name} | {(_status('VmHWM') - self.base) / 2**20:.0f} | "
                  f"{(_status('VmRSS') - self.base) / 2**20:.0f} | {_status('VmRSS') / 2**20:.0f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=5)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--save", help="train one step and save the checkpoint in this folder")
    where.add_argument("--resume", help="resume from the checkpoint in this folder")
    args = ap.parse_args()
    torch.set_num_threads(1)
    mesh = spmd.init_mesh((4,), ("dp",))
    rank = dist.get_rank()
    cfg = GPTConfig(vocab=32000, seq=16, dim=args.dim, heads=16, layers=args.layers)
    tokens = torch.randint(0, cfg.vocab, (4, cfg.seq), generator=torch.Generator().manual_seed(1))

    def compiled_on_meta():
        with torch.device("meta"):
            model = GPT(cfg)
        return spmd.compile(model, mesh, (tokens, tokens), in_placements={"tokens": [Shard(0)]},
                            param_placements={n: [Shard(0)] for n, _ in model.named_parameters()},
                            loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()))

    if args.save:
        first = compiled_on_meta()
        first.init_weights(seed=0)
        opt = torch.optim.AdamW(first.parameters(), lr=1e-4)
        first(*first.shard_inputs(tokens, tokens)).backward()
        opt.step()
        dcp.save({"model": first.state_dict(), "optim": first.optimizer_state_dict(opt)}, checkpoint_id=args.save)
        dist.destroy_process_group()
        return
    if rank == 0:
        print(f"GPT of dim {args.dim}, {args.layers} layers, on 4 ranks; resident before the compile: "
              f"{_status('VmRSS') / 2**20:.0f} MiB\n\n| phase | peak growth, MiB | after, MiB | resident, MiB |\n"
              "|---|---|---|---|", flush=True)
    with Phase("compile, init_weights, a fresh optimizer", rank):
        resumed = compiled_on_meta()
        resumed.init_weights(seed=0)  # (the rotary and other non-persistent tensors; the checkpoint overwrites)
        opt = torch.optim.AdamW(resumed.parameters(), lr=1e-4)
    with Phase("state_dict + optimizer_state_dict(fresh optimizer)", rank):
        state = {"model": resumed.state_dict(), "optim": resumed.optimizer_state_dict(opt)}
    with Phase("dcp.load", rank):
        dcp.load(state, checkpoint_id=args.resume)
    with Phase("load_state_dict + load_optimizer_state_dict", rank):
        resumed.load_state_dict(state["model"])
        resumed.load_optimizer_state_dict(opt, state["optim"])
    with Phase("del state", rank):
        del state
    x, y = resumed.shard_inputs(tokens, tokens)
    for k in (1, 2):
        with Phase(f"step {k}", rank):
            resumed(x, y).backward()
            opt.step()
            opt.zero_grad()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
