"""Big models: compile wall time and peak memory per rank against model size, built on meta (each rank
allocates and initializes only its shards) or built for real on every rank (rank 0's weights scattered).

    OMP_NUM_THREADS=1 python bench/bench_big.py [--sizes 0.1,0.5,1.5] [--world 4] [--out bench/results_big.md]

Each (size, path) runs in fresh gloo processes (`world` of them, one thread each), the GPT example with
every weight sharded over all ranks on dim 0 (pins: FSDP-style, so each rank keeps 1/world of the model)
and a training compile (loss, joint graph). Per rank: seconds to build the model, to compile, to
initialize (meta: `init_weights`; real: the construction itself) and the peak resident memory growth from
before the build to the end (VmHWM after `clear_refs`), against the full model's bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# GPT shapes per target size (fp32): parameters ~ 12 dim^2 layers + 2 vocab dim
SIZES = {0.1: dict(vocab=8192, seq=16, dim=640, heads=10, layers=3),
         0.5: dict(vocab=16384, seq=16, dim=1280, heads=16, layers=5),
         1.5: dict(vocab=32000, seq=16, dim=2048, heads=16, layers=5)}


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _rank(rank: int, world: int, port: int, cfg: dict, path: str, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import gc

    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor import Replicate, Shard

    import spmd
    from examples.models import GPT, GPTConfig

    torch.set_num_threads(1)
    mesh = spmd.init_mesh((world,), ("dp",))
    tokens = torch.randint(0, cfg["vocab"], (world, cfg["seq"]), generator=torch.Generator().manual_seed(1))
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _rss("VmRSS")
    t0 = time.perf_counter()
    if path == "meta":
        with torch.device("meta"):
            model = GPT(GPTConfig(**cfg))
    else:
        torch.manual_seed(0)
        model = GPT(GPTConfig(**cfg))
    build_s = time.perf_counter() - t0
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    pins = {n: [Shard(0) if p.shape[0] % world == 0 else Replicate()] for n, p in model.named_parameters()}
    t0 = time.perf_counter()
    compiled = spmd.compile(model, mesh, (tokens, tokens), in_placements={"tokens": [Shard(0)]}, param_placements=pins,
                            loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()))
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    if path == "meta":
        compiled.init_weights(seed=0)
    init_s = time.perf_counter() - t0
    if path == "real":
        del model  # the user can drop it now: the shards hold the weights
        gc.collect()
    row = {"rank": rank, "path": path, "full_bytes": full, "build_s": build_s, "compile_s": compile_s, "init_s": init_s,
           "peak_growth": _rss("VmHWM") - base, "after": _rss("VmRSS") - base,
           "local_bytes": sum(p.numel() * p.element_size() for p in compiled.parameters())}
    # save_safetensors: what each rank holds beyond what it held before, while the model is written by rank 0
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _rss("VmRSS")
    t0 = time.perf_counter()
    compiled.save_safetensors(f"{out}.safetensors")
    row.update(save_s=time.perf_counter() - t0, save_growth=_rss("VmHWM") - before,
               largest_bytes=max(p.numel() * p.element_size() for p in compiled._source_model.parameters()))
    torch.distributed.barrier()
    if rank == 0:
        os.remove(f"{out}.safetensors")
    with open(f"{out}.{rank}", "w") as f:
        json.dump(row, f)
    torch.distributed.destroy_process_group()


def run(cfg: dict, path: str, world: int) -> list[dict]:
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mktemp(prefix="bench_big_")
    mp.start_processes(_rank, args=(world, port, cfg, path, out), nprocs=world, start_method="spawn")
    rows = []
    for r in range(world):
        with open(f"{out}.{r}") as f:
            rows.append(json.load(f))
        os.remove(f"{out}.{r}")
    return rows


def _save_growth(rows: list[dict]) -> str:
    first = next(r for r in rows if r["rank"] == 0)
    others = max((r for r in rows if r["rank"] != 0), key=lambda r: r["save_growth"])
    big = first["largest_bytes"]
    return (f"{first['save_growth'] / 2**20:.0f} / {others['save_growth'] / 2**20:.0f} MiB, "
            f"{first['save_growth'] / big:.2f} / {others['save_growth'] / big:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="0.1,0.5,1.5")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results_big.md"))
    args = ap.parse_args()
    lines = ["| model | path | build s | compile s | init s | peak growth per rank (max) | x full | local shards | "
             "save s | save's growth: rank 0 / others (max), x largest tensor |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    raw = []
    for size in (float(s) for s in args.sizes.split(",")):
        cfg = SIZES[size]
        for path in ("meta", "real"):
            rows = run(cfg, path, args.world)
            raw += rows
            worst = max(rows, key=lambda r: r["peak_growth"])
            gb = worst["full_bytes"] / 1e9
            line = (f"| {gb:.2f} GB (dim {cfg['dim']}, {cfg['layers']} layers, vocab {cfg['vocab']}) | {path} | "
                    f"{max(r['build_s'] for r in rows):.1f} | {max(r['compile_s'] for r in rows):.1f} | "
                    f"{max(r['init_s'] for r in rows):.1f} | {worst['peak_growth'] / 2**20:.0f} MiB | "
                    f"{worst['peak_growth'] / worst['full_bytes']:.2f} | {worst['local_bytes'] / 2**20:.0f} MiB | "
                    f"{max(r['save_s'] for r in rows):.1f} | {_save_growth(rows)} |")
            lines.append(line)
            print(line, flush=True)
    with open(args.out, "w") as f:
        f.write(RESULTS_HEAD.format(world=args.world, load=os.getloadavg()[0]) + "\n".join(lines) + "\n\n" +
                "Raw rows (per rank):\n\n```\n" + "\n".join(json.dumps(r) for r in raw) + "\n```\n")


RESULTS_HEAD = """# Big models: the meta path against the full-model path

`python bench/bench_big.py` on this 2-core box, {world} gloo ranks (one thread each; load {load:.1f} at the
end). The GPT example, a training compile, every weight sharded over all ranks on dim 0. Per rank, the
slowest rank's seconds and the largest peak growth of resident memory (from before the model is built).
Then `save_safetensors` of the trained-size model: its seconds and each rank's peak growth of resident
memory from just before it, against the largest tensor (the embedding or LM head).

"""


if __name__ == "__main__":
    main()
