"""Planning on 3-D meshes (dp, fsdp, tp): how long `spmd.plan` takes and what it finds, by axis search
(the default for large 3-axis programs) and, with --exact, by the one exact solve.

    1b    a 1.1B Llama-shaped model (8 layers, dim 2048, ffn 5632, 16 heads, 8 kv heads, vocab 32000),
          training, global batch 32 x 2048 tokens, on (4, 4, 4)
    70b   LLaMA3-70B-shaped (80 layers, dim 8192, ffn 28672, 64 heads, 8 kv heads, vocab 128256),
          training, global batch 128 x 8192 tokens, on (8, 8, 16)

    python bench/bench_3d.py --cases 1b          # ~1 minute here
    python bench/bench_3d.py --cases 1b --exact  # the exact program as well (hits the 60 s limit)

Prints one markdown row per run (the numbers quoted in bench/results_plan.md, "3-D meshes").
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import bench_plan  # noqa: E402  (its run_case, loss and model helpers)
import spmd  # noqa: E402
from examples.models import Llama, LlamaConfig  # noqa: E402

CASES = {
    "1b": (LlamaConfig(vocab=32000, seq=2048, dim=2048, heads=16, kv_heads=8, ffn=5632, layers=8), 32, (4, 4, 4)),
    "70b": (LlamaConfig(vocab=128256, seq=8192, dim=8192, heads=64, kv_heads=8, ffn=28672, layers=80), 128,
            (8, 8, 16)),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="1b,70b")
    ap.add_argument("--exact", action="store_true", help="also solve the whole program exactly")
    args = ap.parse_args()
    print("| case | mesh | search | plan s | solve s | solves | step (ms) | gap | peak GB/rank | collectives |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.cases.split(","):
        cfg, batch, shape = CASES[name]
        for exact in ((False, True) if args.exact else (False,)):
            with torch.device("meta"):
                model = Llama(cfg)
                tokens = torch.randint(0, cfg.vocab, (batch, cfg.seq))
            mesh = spmd.MeshSpec(shape, ("dp", "fsdp", "tp"))
            row, c = bench_plan.run_case(model, (tokens, tokens), mesh, training=True, loss_fn=bench_plan.lm_loss,
                                         pins={"axis_search": not exact})
            if c is None:
                print(f"| {name} | {shape} | {'exact' if exact else 'axes'} | {row['total_s']:.1f} | | | "
                      f"{row['error'][:90]} | | | |")
                continue
            search = c.plan.stats.get("axis_search") or {}
            colls = ", ".join(f"{k} x{n}" for k, n in row["collectives"].items())
            print(f"| {name} | {shape} | {'exact' if exact else 'axes'} | {row['total_s']:.1f} | "
                  f"{row['timings']['solve_placements']:.1f} | {search.get('solves', 1)} | {row['objective'] * 1e3:.1f} | "
                  f"{c.plan.gap_text} | {row['peak'] / 1e9:.1f} | {colls} |", flush=True)


if __name__ == "__main__":
    main()
