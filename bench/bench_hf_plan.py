"""transformers' LlamaForCausalLM at LLaMA3-8B shapes planned on a simulated (8, 8) mesh, as
docs/huggingface.md shows it: built on meta, keyword inputs, its own loss, with and without a memory
budget. No processes, no memory.

    python bench/bench_hf_plan.py        # prints the rows of bench/results_plan.md's transformers section
"""
from __future__ import annotations

import re
import time

import torch

import spmd
from spmd.core.graph_facts import format_bytes


def plan_llama3_8b(memory_budget: float | None) -> tuple[float, object]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                      rope_theta=500000.0, use_cache=False)
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
        ids = torch.zeros(64, 8192, dtype=torch.long)
    plan = spmd.plan(model, spmd.MeshSpec((8, 8), ("dp", "tp")), example_kwargs=dict(input_ids=ids, labels=ids),
                     training=True, memory_budget=memory_budget)
    return time.perf_counter() - t0, plan


def main() -> None:
    print("| budget | plan s | step ms (compute + comm) | memory per rank | q_proj | gate_proj |")
    print("|---|---|---|---|---|---|")
    for budget in (None, 80e9):
        seconds, plan = plan_llama3_8b(budget)
        table = dict(re.findall(r"^\s*(model\.layers\.0\.\S+)\s+(\[[^\]]*\])", plan.table(), re.M))
        print(f"| {'none' if budget is None else f'{budget / 1e9:.0f} GB'} | {seconds:.1f} | "
              f"{plan.objective * 1e3:.0f} ({plan.compute_cost * 1e3:.0f} + {plan.comm_cost * 1e3:.0f}) | "
              f"{format_bytes(plan.predicted_peak_bytes)} | "
              f"{table.get('model.layers.0.self_attn.q_proj.weight')} | {table.get('model.layers.0.mlp.gate_proj.weight')} |",
              flush=True)


if __name__ == "__main__":
    main()
