"""`plan.to_parallelize_plan()` run by DTensor's own `parallelize_module` on gloo ranks: forward and
gradients equal to one device, where the model's code between the styles runs on their local tensors
(an elementwise activation) and where it must not (a softmax or a sum over a column-parallel output, a
view to the whole head count)."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import spmd
from spmd.core.mesh import MeshSpec
from tests.models import GPT, GPTConfig
from tests.support import FAST_LINK, LATENCY_LINK, SLOW_DEVICE, megatron_gpt_plan


class SumNormalized(nn.Module):
    """A column-parallel output divided by its own sum: a reduction over the sharded dim."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        h = self.up(x).exp()
        return self.down(h / h.sum(-1, keepdim=True))


class UpDown(nn.Module):
    """A column-parallel `up` and a row-parallel `down`, joined as `how` says."""

    def __init__(self, how: str):
        super().__init__()
        self.up, self.down, self.how = nn.Linear(16, 64), nn.Linear(64, 16), how

    def forward(self, x):
        h = self.up(x)
        if self.how == "read twice":
            return self.down(h) + h.sum(-1, keepdim=True)
        if self.how == "returned too":
            return self.down(h), h
        return self.down(h / h.shape[-1])  # "a size read from the shape"


class TiedHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.fc, self.head = nn.Embedding(64, 16), nn.Linear(16, 16), nn.Linear(16, 64, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(torch.relu(self.fc(self.emb(x))))


def _run_styles(rank: int, world: int, model, styles: dict, x, mesh_shape: tuple, names: tuple) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    reference = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    parallelize_module(model, mesh["tp"], styles)
    out, ref = model(x), reference(x)
    out, ref = getattr(out, "logits", out), getattr(ref, "logits", ref)
    outs, refs = (out, ref) if isinstance(out, tuple) else ((out,), (ref,))
    sum(o.square().mean() for o in outs).backward()
    sum(r.square().mean() for r in refs).backward()
    grads = {k: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
             for k, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}
    ref_grads = dict(reference.named_parameters(remove_duplicate=False))
    return {"out": max(float((o - r).detach().abs().max()) for o, r in zip(outs, refs)),
            "grads": max(float((g - ref_grads[k].grad).abs().max()) for k, g in grads.items())}


def _export(plan) -> tuple[dict, list[str]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        styles = plan.to_parallelize_plan()
    return dict(styles), list(styles.notes)


def _tp_plan(model, x, pins, link=LATENCY_LINK):
    return spmd.plan(model, MeshSpec((2,), ("tp",), (link,), SLOW_DEVICE), (x,), param_placements=pins)


def test_export_keeps_local_code_local(ranks):
    """An elementwise activation between Colwise and Rowwise runs on the shards, as in the plan: the
    default styles, nothing gathered."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)), torch.randn(8, 16)
    styles, notes = _export(_tp_plan(model, x, {"0.weight": [Shard(0)], "2.weight": [Shard(1)]}))
    assert styles["0"].output_layouts == (Shard(-1),) and styles["2"].input_layouts == (Shard(-1),)
    for r in ranks(2).run(_run_styles, model, styles, x, (2,), ("tp",)):
        assert r["out"] < 1e-5 and r["grads"] < 1e-5, r


def test_export_gathers_where_the_plan_does(ranks):
    """A softmax or a sum over the column-parallel output needs it whole: the plan moves it there, and
    the export gathers it (the default styles normalize each shard alone: 0.023-0.029 off in the output)."""
    torch.manual_seed(0)
    cases = [(nn.Sequential(nn.Linear(16, 64), nn.Softmax(-1), nn.Linear(64, 16)), "0", "2"),
             (SumNormalized(), "up", "down")]
    x = torch.randn(8, 16)
    for model, up, down in cases:
        plan = _tp_plan(model, x, {f"{up}.weight": [Shard(0)], f"{down}.weight": [Shard(1)]})
        styles, notes = _export(plan)
        assert isinstance(styles[up], ColwiseParallel) and styles[up].output_layouts == (Replicate(),), styles
        if down in styles:
            assert isinstance(styles[down], RowwiseParallel) and styles[down].input_layouts == (Replicate(),)
        assert any(f"the export gathers the output of {up} " in n for n in notes), notes
        for r in ranks(2).run(_run_styles, model, styles, x, (2,), ("tp",)):
            assert r["out"] < 1e-5 and r["grads"] < 1e-5, (type(model).__name__, r)


def test_export_of_a_gpt_runs_on_whole_heads_where_the_code_views_them(ranks):
    """The GPT's attention views q/k/v to its whole head count, which the plan makes each rank's; the
    export gathers around attention instead (the default styles crashed there) and says so; its
    logits come back whole. Run on tp of the plan's (dp, tp) mesh, every rank with the whole batch."""
    plan = megatron_gpt_plan()
    styles, notes = _export(plan)
    assert styles["blocks.0.attn.q_proj"].output_layouts == (Replicate(),)
    assert styles["blocks.0.attn.o_proj"].input_layouts == (Replicate(),)
    assert styles["blocks.0.mlp.fc1"].output_layouts == (Shard(-1),)  # the MLP stays Megatron's
    assert styles["lm_head"].output_layouts == (Replicate(),)
    assert any(n.startswith("view") and "whole model's sizes" in n for n in notes), notes
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    x = torch.randint(0, 128, (2, 31))
    for r in ranks(4).run(_run_styles, model, styles, x, (2, 2), ("dp", "tp")):
        assert r["out"] < 1e-4 and r["grads"] < 1e-4, r


def test_export_of_transformers_llama(ranks):
    """transformers' Llama with Megatron's weights: the MLP exports as is, attention runs whole (its
    repeat_kv expands to the whole head count in the traced graph), the embedding's hidden-sharded
    output is gathered (the plan moves it; the default style fed each rank's half to RMSNorm, a shape
    error). Equal to one device."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, use_cache=False)
    model = transformers.LlamaForCausalLM(cfg)
    pins = {}
    for name, p in model.named_parameters():
        leaf = name.split(".")[-2] if name.endswith(".weight") else ""
        if leaf in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            pins[name] = [Shard(0)]
        elif leaf in ("o_proj", "down_proj"):
            pins[name] = [Shard(1)]
    pins.update({f"{path}.{b}": [Replicate()] for path, m in model.named_modules() if "Rotary" in type(m).__name__
                 for b, _ in m.named_buffers() if b.startswith("original")})  # unread: any layout costs the same
    x = torch.randint(0, 128, (2, 16))
    styles, notes = _export(_tp_plan(model, x, pins, link=FAST_LINK))
    assert styles["model.layers.0.mlp.up_proj"].output_layouts == (Shard(-1),)
    assert styles["model.layers.0.self_attn.q_proj"].output_layouts == (Replicate(),)
    assert styles["model.embed_tokens"].output_layouts == (Replicate(),)
    for r in ranks(2).run(_run_styles, model, styles, x, (2,), ("tp",)):
        assert r["out"] < 1e-5 and r["grads"] < 1e-5, r


@pytest.mark.parametrize("how", ["read twice", "returned too", "a size read from the shape", "tied"])
def test_export_of_a_column_parallel_output_read_elsewhere(ranks, how):
    """Found by a review of the export: a column-parallel output read by the row-parallel module and by
    other code crashed (the row-parallel module was not split where the output was gathered); a number read
    from a shard's shape (`h / h.shape[-1]`, a constant 64 in the graph, 32 on each rank) was 0.015 off; a
    tied embedding and head lost half of each gradient (parallelize_module replaces one name's tensor).
    Equal to one device now: gathered and split, or (tied) the embedding left unstyled, with a note."""
    torch.manual_seed(0)
    if how == "tied":
        model, x, pins = TiedHead(), torch.randint(0, 64, (4, 8)), {"emb.weight": [Shard(0)]}
    else:
        model, x, pins = UpDown(how), torch.randn(8, 16), {"up.weight": [Shard(0)], "down.weight": [Shard(1)]}
    styles, notes = _export(_tp_plan(model, x, pins))
    if how == "tied":
        assert "emb" not in styles and any("emb is left unstyled" in n for n in notes), notes
    else:
        assert styles["up"].output_layouts == (Replicate(),) and styles["down"].input_layouts == (Replicate(),)
    for r in ranks(2).run(_run_styles, model, styles, x, (2,), ("tp",)):
        assert r["out"] < 1e-5 and r["grads"] < 1e-5, r
