"""Draw the GPT example's plan on a 2x2 (dp, tp) mesh: docs/img/gpt_2x2.svg and docs/img/gpt_2x2_collapsed.svg.

Planning only: no processes, and no memory (the model is built on the meta device and planned through
fake tensors). The mesh uses H100 device numbers with NVLink on tp and InfiniBand on dp (MeshSpec's
defaults); the model has 2 blocks of LLaMA-7B-sized layers (hidden 4096, 32 heads, sequence 2048, a
vocabulary of 8192), so the weights are big enough that tensor parallelism pays on the fast axis.
Without graphviz's `dot` the pictures are written as .dot source.

    python examples/render_gpt.py [out_dir]
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import spmd  # noqa: E402
from examples.models import GPT, GPTConfig  # noqa: E402


def main(out_dir: str = "docs/img") -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=8192, seq=2048, dim=4096, heads=32, layers=2)
    tokens = torch.randint(0, cfg.vocab, (2, cfg.seq))  # batch 2: it splits on dp only
    mesh = spmd.MeshSpec((2, 2), ("dp", "tp"))  # tp: NVLink, dp: InfiniBand, H100 compute
    with torch.device("meta"):  # 400M parameters: planned from shapes alone
        model = GPT(cfg)
    plan = spmd.plan(model, mesh, (tokens,))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    print(plan.explain())
    print(plan.visualize(out / "gpt_2x2.svg", title="GPT (2 blocks)"))
    print(plan.visualize(out / "gpt_2x2_collapsed.svg", collapse=True, title="GPT (2 blocks), collapsed"))


if __name__ == "__main__":
    main(*sys.argv[1:])
