"""transformers' LlamaForCausalLM at LLaMA3-8B shapes planned on a simulated (8, 8) mesh, as
docs/huggingface.md shows it: built on meta, keyword inputs, its own loss, with and without a memory
budget. No processes, no memory.

    python bench/bench_hf_plan.py        # prints the rows of bench/results_plan.md's transformers section
    python bench/bench_hf_plan.py --tiny # the 2-layer, 64-wide one (tests/e2e/test_huggingface.py's) on
                                         # (2, 2), built-in cpu profile, under fractions of its free peak
"""
from __future__ import annotations

import argparse
import re
import time
import warnings

import torch

import spmd
from spmd.core.graph_facts import format_bytes
from spmd.core.profiles import device_profile_for, link_profile_for


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


def tiny_budgets(fractions=(0.8, 0.6, 0.4)) -> None:
    """issue 12's "budgeted solves fast" case: plan s per fraction of the free plan's peak."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
    mesh = spmd.MeshSpec((2, 2), ("dp", "tp"), (link_profile_for("gloo"),) * 2, device_profile_for("cpu"))
    t0 = time.perf_counter()
    free = spmd.plan(model, mesh, example_kwargs=kwargs, training=True)
    print("| budget | plan s | step ms | peak / budget | gap | recomputed (whole, selective) |")
    print("|---|---|---|---|---|---|")
    print(f"| none | {time.perf_counter() - t0:.1f} | {free.objective * 1e3:.4f} | {format_bytes(free.predicted_peak_bytes)} "
          f"| {free.gap_text} | |", flush=True)
    for fraction in fractions:
        budget = fraction * free.predicted_peak_bytes
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                plan = spmd.plan(model, mesh, example_kwargs=kwargs, training=True, memory_budget=budget)
            except spmd.SpmdError as e:
                print(f"| {fraction} | {time.perf_counter() - t0:.1f} | {str(e)[:160]} | | | |", flush=True)
                continue
        over = " (over: the leanest plan found)" if any("memory_budget" in str(w.message) for w in caught) else ""
        print(f"| {fraction} | {time.perf_counter() - t0:.1f} | {plan.objective * 1e3:.4f} | "
              f"{plan.predicted_peak_bytes / budget:.3f}{over} | {plan.gap_text} | "
              f"{len(plan.recompute)}, {len(plan.recompute_selective)} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="the 2-layer model under budgets instead")
    if ap.parse_args().tiny:
        return tiny_budgets()
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
