"""What a batch of another shape costs a compiled module (runtime/shapes.py): transformers' GPT-2 small (124M,
sequence 128, random weights) training on 2 gloo ranks, the mesh's default profile. Times the first compile,
steps at the compiled batch, the first step at a smaller batch (which compiles for it, over the same pieces) and
the steps after it; the difference of the first smaller step and the next ones is the variant's compile.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 bench/bench_shape_variants.py [--batch 4] [--small 2]

Results: bench/results_shape_variants.md.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import spmd  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--small", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(use_cache=False)).train()
    mesh = spmd.init_mesh((2,), ("dp",))
    ids = torch.randint(0, 50257, (args.batch, 128))
    t = time.perf_counter()
    compiled = spmd.compile(model, mesh, example_kwargs=dict(input_ids=ids, labels=ids), training=True)
    first_compile = time.perf_counter() - t
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-4)

    def step(n: int) -> float:
        batch = torch.randint(0, 50257, (n, 128))
        t = time.perf_counter()
        a, k = compiled.shard_inputs(input_ids=batch, labels=batch)
        compiled(*a, **k).loss.backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t

    big = [step(args.batch) for _ in range(args.steps)]
    small = [step(args.small) for _ in range(args.steps)]
    if mesh.get_rank() == 0:
        later = min(small[1:])
        print(f"first compile {first_compile:.1f} s; batch {args.batch} steps "
              f"{', '.join(f'{s:.2f}' for s in big)} s; batch {args.small} steps {', '.join(f'{s:.2f}' for s in small)} s; "
              f"the variant's compile ~{small[0] - later:.1f} s; inputs {compiled.input_placements()}; "
              f"variant inputs {[v.input_specs[0].placements for v in compiled._variants.values()]}")


if __name__ == "__main__":
    main()
