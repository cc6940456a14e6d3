"""Module types, hence Megatron roles, for models whose top child is called `model` (transformers'
`*ForCausalLM`, a wrapper around torchtitan's Llama): the traced paths are read against the user's module
tree, so the training wrapper's "model." prefix is removed only where the trace added it."""

import warnings

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import spmd
from spmd.core.graph_facts import module_paths, module_prefix
from spmd.passes.trace_joint import argument_names
from spmd.report.explain import module_summary
from tests.models import GPT, GPTConfig
from tests.support import lm_loss, spec

TP = spec((2,), ("tp",))
COLUMN = ("q_proj", "k_proj", "v_proj", "fc1", "gate_proj", "up_proj")
ROW = ("o_proj", "fc2", "down_proj")


def megatron_pins(model: nn.Module) -> dict:
    """Megatron's weight layouts, pinned by FQN: attention and MLP in-projections split by output
    features (Shard(0)), out-projections by input features (Shard(1))."""
    pins = {}
    for path, m in model.named_modules():
        leaf = path.rsplit(".", 1)[-1]
        if isinstance(m, nn.Linear) and leaf in COLUMN + ROW:
            pins[f"{path}.weight"] = [Shard(0 if leaf in COLUMN else 1)]
    return pins


def styles_of(plan) -> dict[str, str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # biases and embeddings the styles do not express
        return {k: type(v).__name__ for k, v in plan.to_parallelize_plan().items()}


def plan_of(model, tokens, train: bool):
    kw = {"loss_fn": lm_loss} if train else {}
    return spmd.plan(model, TP, (tokens, tokens) if train else (tokens,),
                     param_placements=megatron_and_unused(model), in_placements=whole_tokens(model, train), **kw)


def whole_tokens(model: nn.Module, train: bool) -> dict:
    """Training: the tokens and the targets pinned whole, as the styles assume (on this slow device,
    splitting the loss's element-wise ops and its gather by batch pays as well)."""
    return {argument_names(model, 1)[0]: [Replicate()], "targets": [Replicate()]} if train else {}


def megatron_and_unused(model: nn.Module) -> dict:
    """Megatron's weights, and the rotary tables transformers keeps but the forward never reads
    (`original_inv_freq`, for dynamic RoPE) pinned whole: unread, every layout costs the same, and the
    styles have none for a split one."""
    pins = megatron_pins(model)
    pins.update({f"{path}.{b}": [Replicate()] for path, m in model.named_modules()
                 if "Rotary" in type(m).__name__ for b, _ in m.named_buffers() if b.startswith("original")})
    return pins


class Wrap(nn.Module):
    """A plain wrapper whose only child is called `model`."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.model = inner

    def forward(self, tokens):
        return self.model(tokens)


class Logits(nn.Module):
    """transformers' causal LM (itself `.model` + `.lm_head`) under a child called `model`, returning logits."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.model = inner

    def forward(self, input_ids):
        return self.model(input_ids).logits


# ---- a plain model under a child called `model` ------------------------------------------------------


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_wrapped_gpt_reads_like_gpt(train):
    """Wrap(GPT) explains and exports exactly as GPT does, each path one "model." deeper."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 128, (2, 31))
    bare = plan_of(GPT(GPTConfig()), tokens, train)
    torch.manual_seed(0)
    wrapped = plan_of(Wrap(GPT(GPTConfig())), tokens, train)
    names = wrapped.mesh.axis_names
    assert module_summary(wrapped.details, names) == [
        (f"model.{m}", t, d) for m, t, d in module_summary(bare.details, names)]
    text = wrapped.explain()
    for line in ("model.blocks.*.attn.q_proj  Linear     column-parallel on tp",
                 "model.blocks.*.attn.o_proj  Linear     row-parallel on tp",
                 "model.blocks.*.mlp.fc1      Linear     column-parallel on tp",
                 "model.blocks.*.mlp.fc2      Linear     row-parallel on tp",
                 "model.blocks.*.ln1          LayerNorm"):
        assert line in text, line
    assert "sharded dim" not in text and "model.model." not in text
    styles = styles_of(wrapped)
    assert styles == {f"model.{k}": v for k, v in styles_of(bare).items()}
    assert styles["model.blocks.0.attn.q_proj"] == "ColwiseParallel"
    assert styles["model.blocks.1.mlp.fc2"] == "RowwiseParallel"


def test_loss_module_keeps_its_own_path_and_the_model_loses_the_prefix():
    """A loss_fn that is itself a module puts "loss_fn.*" paths in the trace: the wrapper's prefix still
    comes off the model's paths (it once stayed on every path)."""

    class CE(nn.Module):
        def forward(self, logits, targets):
            return lm_loss(logits, targets)

    torch.manual_seed(0)
    model, tokens = GPT(GPTConfig()), torch.randint(0, 128, (2, 31))
    plan = spmd.plan(model, TP, (tokens, tokens), loss_fn=CE(), param_placements=megatron_pins(model))
    text = plan.explain()
    assert "blocks.*.attn.q_proj  Linear     column-parallel on tp" in text and "model." not in text
    assert styles_of(plan)["blocks.0.attn.o_proj"] == "RowwiseParallel"


# ---- transformers' LlamaForCausalLM (body `.model`, head `.lm_head`) ---------------------------------


def hf_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                   max_position_embeddings=64, use_cache=False)
    return transformers.LlamaForCausalLM(cfg)


def check_llama_roles(plan, prefix: str = ""):
    text = plan.explain()
    m = prefix + "model.layers.*."
    for line in (f"{m}self_attn.q_proj          Linear                column-parallel on tp",
                 f"{m}self_attn.k_proj          Linear                column-parallel on tp",
                 f"{m}self_attn.o_proj          Linear                row-parallel on tp",
                 f"{m}mlp.gate_proj             Linear                column-parallel on tp",
                 f"{m}mlp.down_proj             Linear                row-parallel on tp",
                 f"{m}input_layernorm           LlamaRMSNorm"):
        assert line in text, f"{line!r} not in\n{text}"
    assert "sharded dim" not in text
    styles = plan.to_parallelize_plan()
    m = prefix + "model.layers."
    for i in range(2):
        assert isinstance(styles[f"{m}{i}.self_attn.q_proj"], ColwiseParallel)
        assert isinstance(styles[f"{m}{i}.self_attn.v_proj"], ColwiseParallel)
        assert isinstance(styles[f"{m}{i}.self_attn.o_proj"], RowwiseParallel)
        assert isinstance(styles[f"{m}{i}.mlp.up_proj"], ColwiseParallel)
        assert isinstance(styles[f"{m}{i}.mlp.down_proj"], RowwiseParallel)
    assert styles.axis == "tp"
    # the MLP runs on its shards as in the plan; attention's repeat_kv expands to the whole head count in
    # the traced graph, so the export runs attention whole (tests/e2e/test_parallelize_export.py)
    assert styles[f"{m}0.mlp.up_proj"].output_layouts == (Shard(-1),)
    assert styles[f"{m}0.mlp.down_proj"].input_layouts == (Shard(-1),)
    assert styles[f"{m}0.self_attn.q_proj"].output_layouts == (Replicate(),)
    assert any("the export gathers the output of" in n for n in styles.notes), styles.notes


def test_llama_for_causal_lm_inference():
    model = hf_llama()
    plan = spmd.plan(model, TP, (torch.randint(0, 128, (2, 16)),), param_placements=megatron_and_unused(model))
    check_llama_roles(plan)


def test_llama_for_causal_lm_training():
    """The loss reads the ModelOutput's logits; traced paths are "model.model.layers..." (the wrapper's
    "model." over the user's own child `model`)."""
    model = hf_llama()
    tokens = torch.randint(0, 128, (2, 16))
    plan = spmd.plan(model, TP, (tokens, tokens), param_placements=megatron_and_unused(model),
                     in_placements=whole_tokens(model, True), loss_fn=lambda out, targets: lm_loss(out.logits, targets))
    check_llama_roles(plan)


def test_llama_for_causal_lm_under_a_child_called_model_training():
    """Three `model`s deep once traced (wrapper, the user's wrapper, LlamaForCausalLM's body)."""
    model = Logits(hf_llama())
    tokens = torch.randint(0, 128, (2, 16))
    plan = plan_of(model, tokens, train=True)
    check_llama_roles(plan, prefix="model.")


# ---- the prefix decision itself, on hand-made module stacks ----------------------------------------------


def graph_with(*stacks: list[tuple[str, str]]) -> fx.Graph:
    g = fx.Graph()
    x = g.placeholder("x")
    for stack in stacks:
        x = g.call_function(torch.neg, (x,))
        x.meta["nn_module_stack"] = {f"L__self__{p}": (p, t) for p, t in stack}
    g.output(x)
    return g


def test_prefix_is_read_against_the_module_tree():
    root_child = [("", "Wrap"), ("model", "GPT"), ("model.lm_head", "Linear")]
    wrapped = [("", "WithLoss"), ("model", "Wrap"), ("model.model", "GPT"), ("model.model.lm_head", "Linear")]
    # Wrap(GPT) traced as is: its paths name its own modules
    assert module_prefix(graph_with(root_child), ["model.lm_head.weight"]) == ""
    # Wrap(GPT) under the training wrapper: one "model." too many
    g = graph_with(wrapped, [("", "WithLoss"), ("loss_fn", "CE")])
    assert module_prefix(g, ["model.lm_head.weight"]) == "model."
    where, types = module_paths(g, ["model.lm_head.weight"])
    assert types == {"": "Wrap", "model": "GPT", "model.lm_head": "Linear", "loss_fn": "CE"}
    assert list(where.values()) == ["model.lm_head", "loss_fn"]
    # GPT under the training wrapper
    assert module_prefix(graph_with([("", "WithLoss"), ("model", "GPT"), ("model.lm_head", "Linear")]),
                         ["lm_head.weight"]) == "model."
    # nothing to read against (no parameters): paths as they are
    assert module_prefix(graph_with(wrapped), []) == ""


def test_a_child_called_model_keeps_its_layers_tied_in_training_without_a_loss_fn():
    """find_repeated_blocks and stamp_layers read the wrapper's prefix from the module tree too: a child
    called `model` trained on its own output used to lose 96 of its 495 tied nodes and change the plan."""
    from tests.support import compile_graph

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = GPT(GPTConfig(layers=4))

        def forward(self, tokens):
            return self.model(tokens)

    tokens = torch.randint(0, 128, (2, 31))
    torch.manual_seed(0)
    plain = compile_graph(GPT(GPTConfig(layers=4)), (tokens,), spec((2,), ("tp",)), training=True, tie_blocks=True)
    torch.manual_seed(0)
    wrapped = compile_graph(Wrap(), (tokens,), spec((2,), ("tp",)), training=True, tie_blocks=True)
    assert len(wrapped.blocks.representative) == len(plain.blocks.representative) == 495
    assert wrapped.plan.objective == pytest.approx(plain.plan.objective)


def test_gpt2_conv1d_roles():
    """transformers' Conv1D holds its weight (in, out): Shard(1) is column-parallel, Shard(0) row-parallel.
    DTensor's styles take nn.Linear only, and the export says so (it used to say "sharded dim 1")."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=128, n_positions=32, use_cache=False)
    model = transformers.GPT2LMHeadModel(cfg)
    pins = {"transformer.h.0.mlp.c_fc.weight": [Shard(1)], "transformer.h.0.mlp.c_proj.weight": [Shard(0)]}
    plan = spmd.plan(model, TP, (torch.randint(0, 128, (2, 16)),), param_placements=pins)
    text = plan.explain(detail=False)
    assert "transformer.h.0.mlp.c_fc     Conv1D     column-parallel on tp" in text, text
    assert "transformer.h.0.mlp.c_proj   Conv1D     row-parallel on tp" in text, text
    with pytest.warns(UserWarning, match="nn.Linear and nn.Embedding only"):
        styles = plan.to_parallelize_plan()
    assert "transformer.h.0.mlp.c_fc" not in styles


def test_the_export_notes_sharded_model_inputs_not_loss_targets():
    """The export's styles run the model alone (the loss stays the user's): a note on a target split over tp
    named an input `model(x)` never takes."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    plan = spmd.plan(model, TP, (x, y), loss_fn=F.mse_loss, in_placements={"input": [Shard(0)], "target": [Shard(0)]},
                     param_placements={"0.weight": [Shard(0)], "2.weight": [Shard(1)]})
    assert plan.stats["loss_targets"] == ["target"]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        plan.to_parallelize_plan()
    text = "\n".join(str(w.message) for w in said)
    assert "input 'input' is sharded on tp" in text, text
    assert "'target'" not in text, text


def test_a_weight_gathered_only_in_backward_is_not_called_fsdp():
    """Found by a probe: GPT's fc1 weight stored [R, S(0)], used sharded by its forward matmul (column-parallel)
    and all_gathered on tp only for a backward matmul, was labelled "FSDP on tp". The forward uses decide."""
    from tests.models import GPT, GPTConfig
    from tests.support import lm_loss, spec

    torch.manual_seed(0)
    t = torch.randint(0, 128, (4, 32))
    p = spmd.plan(GPT(GPTConfig()), spec((2, 2), ("dp", "tp")), (t, t), loss_fn=lm_loss)
    ph = {v: k for k, v in p.labels.items()}["blocks.0.mlp.fc1.weight"]
    assert p.choices[ph].outputs[0] == (Replicate(), Shard(0))
    line = next(x for x in p.summary().splitlines() if "mlp.fc1" in x)
    assert "column-parallel on tp" in line and "FSDP" not in line, line


def test_the_export_notes_the_batch_split_on_another_axis():
    """Found by a probe: a plan data parallel on dp and tensor parallel on tp exported its tp styles with no word
    of the dp half (its notes named only parameters sharded on other axes)."""
    from tests.support import megatron_gpt_plan

    plan = megatron_gpt_plan()
    with pytest.warns(UserWarning, match="not expressed as parallel styles"):
        styles = plan.to_parallelize_plan()
    assert styles.axis == "tp"
    assert any(n.startswith("input 'tokens' is split on dp ([S(0), R]): data parallel there") for n in styles.notes), \
        styles.notes
