"""Initializing a sharded model from the meta device (runtime/init_weights.py, runtime/init_replay.py):
on every coordinate of a 2x2 mesh the local pieces, put together, equal bit for bit what
`torch.manual_seed(s); Model(cfg)` (then `.apply(init_fn)`) builds on one CPU device, for the test
models, plain-torch corner cases (ties, shared modules, MultiheadAttention, BatchNorm, bf16) and
transformers models; the replay draws the same random ops and leaves the global RNG where construction
leaves it; the largest init group is one module; and the messages for what cannot be replayed."""
from __future__ import annotations

import itertools
import random
import warnings

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

from spmd.core.errors import SpmdError
from spmd.runtime.distribute import local_slices
from spmd.runtime.init_weights import hf_init_kwargs, init_local_shards, plan_init, rng_trace
from tests.models import (GPT, MLP, CausalSelfAttention, GPTConfig, Llama, LlamaConfig, ViT, ViTConfig, nanogpt_init,
                          tied_lm)

R, S0, S1 = Replicate(), Shard(0), Shard(1)
MESH = (2, 2)
COORDS = list(itertools.product(range(2), range(2)))


def all_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}


def _even(ps, shape) -> bool:
    pieces = [1] * len(shape)
    for axis, p in enumerate(ps):
        if isinstance(p, Shard):
            if p.dim >= len(shape):
                return False
            pieces[p.dim] *= MESH[axis]
    return all(n % k == 0 for n, k in zip(shape, pieces))


def make_placements(model, style: str, seed: int = 0) -> dict[str, tuple]:
    """One placement per tensor (Replicate where `style` would cut a dim unevenly); tied names agree."""
    rnd, out, first = random.Random(seed), {}, {}
    for name, t in all_tensors(model).items():
        shape = tuple(t.shape)
        if id(t) in first:
            out[name] = out[first[id(t)]]
            continue
        first[id(t)] = name
        wide = t.dim() >= 2
        ps = {"2d": (S0, S1) if wide else (R, S0), "nested": (S0, S0),
              "transposed": (S1, S0) if wide else (S0, R),
              "mixed": rnd.choice([(R, R), (S0, R), (R, S0), (S0, S0)] + ([(S0, S1), (S1, S0), (S1, S1)] if wide else []))
              }[style]
        out[name] = ps if _even(ps, shape) else (R, R)
    return out


def assemble(pieces: dict[tuple, torch.Tensor], shape, placements) -> torch.Tensor:
    """The full tensor from every coordinate's piece; regions several coordinates hold must agree."""
    full = torch.zeros(shape, dtype=next(iter(pieces.values())).dtype)
    filled = torch.zeros(shape, dtype=torch.bool)
    for coord, piece in pieces.items():
        idx = local_slices(tuple(shape), placements, MESH, coord)
        assert tuple(piece.shape) == tuple(s.stop - s.start for s in idx), (coord, piece.shape, idx)
        seen = filled[idx]
        assert torch.equal(full[idx][seen], piece[seen]), f"coordinates disagree on a replicated region at {coord}"
        full[idx], filled[idx] = piece, True
    assert filled.all(), "the pieces do not cover the tensor"
    return full


def build(factory, seed: int, init_fn=None) -> nn.Module:
    torch.manual_seed(seed)
    m = factory()
    if init_fn is not None:
        m.apply(init_fn)
    return m


def build_meta(factory) -> nn.Module:
    with torch.device("meta"):
        return factory()


def check_equal(factory, style: str, seed: int, init_fn=None, ops=True, meta_build=None, **kw) -> dict:
    """Every coordinate's pieces (one plan, materialized 4 times) against a single-device build: values
    bit for bit, the random ops drawn (by name too, unless not `ops`), the RNG state afterwards, tied names sharing
    one piece, pieces owning their memory (not views pinning a full buffer). `meta_build()` builds the meta model
    where `build_meta(factory)` does not."""
    ref, trace = rng_trace(lambda: build(factory, seed, init_fn))
    after = torch.get_rng_state()
    meta = meta_build() if meta_build is not None else build_meta(factory)
    placements = make_placements(meta, style, seed)
    plan = plan_init(meta, init_fn=init_fn, **kw)
    if ops:
        assert plan.assemble_trace() == trace
    outs = {}
    for c in COORDS:
        torch.manual_seed(seed + 1)                  # somewhere else: materialize must reseed
        outs[c] = plan.materialize(placements, MESH, c, seed=seed)
        assert torch.equal(torch.get_rng_state(), after), "RNG state differs from after construction"
    ref_t = all_tensors(ref)
    assert set(outs[(0, 0)]) == set(ref_t)
    bad = [n for n, t in ref_t.items()
           if not torch.equal(assemble({c: outs[c][n] for c in COORDS}, tuple(t.shape), placements[n]), t.detach())]
    assert not bad, f"{style}: differ from the single-device build: {bad}"
    for c in COORDS:
        for a, b in itertools.combinations(ref_t, 2):
            assert (outs[c][a] is outs[c][b]) == (ref_t[a] is ref_t[b]), (a, b)
        for n, p in outs[c].items():
            assert p.untyped_storage().nbytes() == p.numel() * p.element_size(), n
    return outs


# ---------------------------------------------------------------------------------------------- models

def gpt1() -> GPT:
    return GPT(GPTConfig(layers=1))


MODELS = {"gpt": lambda: GPT(GPTConfig()), "mlp": MLP, "llama": lambda: Llama(LlamaConfig()),
          "vit": lambda: ViT(ViTConfig(classes=8))}


@pytest.mark.parametrize("name,style", [("gpt", "2d"), ("gpt", "nested"), ("gpt", "transposed"), ("mlp", "mixed"),
                                        ("llama", "2d"), ("llama", "mixed"), ("vit", "mixed")])
def test_models_equal_single_device_on_every_coordinate(name, style):
    """Llama's RMSNorm ones and RoPE tables and ViT's zero pos_emb come from their reset_parameters()."""
    check_equal(MODELS[name], style, seed=7)


def test_init_local_shards_per_rank_and_seed_none_goes_on_from_the_global_generator():
    ref = all_tensors(build(gpt1, 11))
    after = torch.get_rng_state()
    meta = build_meta(gpt1)
    pl = make_placements(meta, "2d")
    for c in COORDS:
        torch.manual_seed(11)
        got = init_local_shards(meta, pl, MESH, c, seed=None)
        assert torch.equal(torch.get_rng_state(), after)
        for n, t in ref.items():
            assert torch.equal(got[n], t.detach()[local_slices(tuple(t.shape), pl[n], MESH, c)]), (c, n)


def test_missing_placements_are_named_unless_replicated():
    meta = build_meta(MLP)
    with pytest.raises(SpmdError, match="no placements for 'fc2.bias'"):
        init_local_shards(meta, {n: (R, R) for n in ("fc1.weight", "fc1.bias", "fc2.weight")}, MESH, (0, 0), seed=0)
    got = init_local_shards(meta, {"fc1.weight": (S0, S1)}, MESH, (1, 1), seed=0, replicate_missing=True)
    assert got["fc1.weight"].shape == (32, 8) and got["fc2.weight"].shape == (16, 64)


# ---------------------------------------------------------------------------------------------- init_fn

def test_nanogpt_style_init_fn_equals_model_apply():
    check_equal(lambda: GPT(GPTConfig()), "mixed", 1, init_fn=nanogpt_init)


def test_data_writes_and_a_parent_reading_its_children_join_one_group():
    """Old-style `.data` writes (invisible to a meta tensor's _version) are seen; the attention's init
    scales one child's weight and reads another's, so those join the attention's group, and the
    children's earlier inits are replayed from their saved RNG states."""
    def init_fn(m):
        if isinstance(m, nn.Linear):
            m.weight.data.normal_(0.0, 0.02)
            if m.bias is not None:
                m.bias.data.zero_()
        if isinstance(m, CausalSelfAttention):
            m.o_proj.weight.data.mul_(0.5)
            m.q_proj.bias.data.add_(m.k_proj.weight.data[:, 0])
    plan = plan_init(build_meta(gpt1), init_fn=init_fn)
    names = {plan.infos[k].fqns[0] for k in max(plan.groups, key=lambda g: len(g.keys)).keys}
    assert {"blocks.0.attn.o_proj.weight", "blocks.0.attn.q_proj.bias", "blocks.0.attn.k_proj.weight"} <= names
    assert "blocks.0.attn.v_proj.weight" not in names
    check_equal(gpt1, "mixed", 4, init_fn=init_fn)


# ---------------------------------------------------------------------------------------------- ties, sharing, order

class TiedGPT(GPT):
    """`later.weight = earlier.weight`: the embedding made the tensor; lm_head's own reset drew numbers
    into a tensor the tie dropped."""
    def __init__(self):
        super().__init__(GPTConfig(layers=1))
        self.lm_head.weight = self.tok_emb.weight


class NanoTied(GPT):
    """nanoGPT: `earlier.weight = later.weight` (the later module made the tensor)."""
    def __init__(self):
        super().__init__(GPTConfig(layers=1))
        self.tok_emb.weight = self.lm_head.weight


def test_tie_to_the_earlier_module_is_initialized_once():
    outs = check_equal(TiedGPT, "2d", 6, tied_reset_owner="first")
    assert outs[(1, 1)]["lm_head.weight"] is outs[(1, 1)]["tok_emb.weight"]


def test_a_tie_whose_maker_the_meta_model_cannot_tell_is_refused():
    """The meta model cannot tell which module made a tied tensor, and that decides its values. The default
    used to be the first name's module, silently wrong for nanoGPT's tie (4.01 off): now it is asked for,
    unless an init_fn overwrites the tensor anyway. (spmd.deferred_init records the tie: test_init_tape.py.)"""
    for factory in (TiedGPT, NanoTied):
        with pytest.raises(SpmdError, match=r"tok_emb.weight and lm_head.weight are one tensor, and the "
                                            r"reset_parameters of both Embedding tok_emb and Linear lm_head write it.*"
                                            r"What to do: build the model with spmd.deferred_init.*"
                                            r"tied_reset_owner='first' \(the tie was made as `lm_head.weight = "
                                            r"tok_emb.weight`\) or 'all'"):
            plan_init(build_meta(factory))
    ref = build(NanoTied, 6)
    meta = build_meta(NanoTied)
    first = plan_init(meta, tied_reset_owner="first").materialize(make_placements(meta, "2d"), MESH, (0, 0), seed=6)
    assert not torch.equal(first["lm_head.weight"], ref.lm_head.weight[:64, :32])
    check_equal(NanoTied, "2d", 6, tied_reset_owner="all")
    check_equal(NanoTied, "mixed", 6, init_fn=nanogpt_init)


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.mid = nn.Linear(4, 4)
        self.b = self.a                              # one module under two names


def test_shared_module_is_reset_once_and_init_fn_applied_twice_like_apply():
    def double(m):
        if isinstance(m, nn.Linear):
            with torch.no_grad():
                m.weight.mul_(2.0)                   # Module.apply visits the shared module twice
    check_equal(Shared, "mixed", 2, init_fn=double)


class WithMHA(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.mha = nn.MultiheadAttention(16, 4)
        self.enc = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32)
        self.out = nn.Linear(16, 8)


def test_multihead_attention_and_encoder_layer_replay_in_construction_post_order():
    """MultiheadAttention builds out_proj (a Linear that draws) before its own _reset_parameters():
    named_modules()'s pre-order would draw MHA's numbers first."""
    check_equal(WithMHA, "mixed", 9)
    ref, trace = rng_trace(lambda: build(WithMHA, 9))
    pre = plan_init(build_meta(WithMHA), order="pre")
    assert pre.assemble_trace() != trace
    out = pre.materialize(make_placements(ref, "nested"), MESH, (0, 0), seed=9)
    assert not torch.equal(out["mha.in_proj_weight"], ref.mha.in_proj_weight[:12])


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)


def test_conv_and_batchnorm_buffers_come_from_reset_parameters():
    check_equal(ConvBN, "mixed", 8)


class _Identity(nn.Linear):
    def reset_parameters(self):
        nn.init.eye_(self.weight)  # (writes through `aten.eye.out`)
        nn.init.zeros_(self.bias)


class EyeInit(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = _Identity(8, 8)
        self.out = nn.Linear(8, 4)


def test_an_init_that_writes_through_out_equals_one_device():
    """Found by a probe: `nn.init.eye_` writes its tensor as `torch.eye`'s `out=`, which the replay counted as a read
    of the value it replaces ("read by their init before anything wrote them", a refusal with no way out)."""
    check_equal(EyeInit, "mixed", 8)


def test_bf16_meta_model_equals_a_cast_build_with_init_dtype_and_a_bf16_build_without():
    meta = build_meta(gpt1).to(torch.bfloat16)
    ref = build(gpt1, 4).to(torch.bfloat16)
    pl = make_placements(meta, "2d")
    plan = plan_init(meta)
    outs = {c: plan.materialize(pl, MESH, c, seed=4, init_dtype=torch.float32) for c in COORDS}
    for n, t in all_tensors(ref).items():
        full = assemble({c: outs[c][n] for c in COORDS}, tuple(t.shape), pl[n])
        assert full.dtype == torch.bfloat16 and torch.equal(full, t.detach()), n
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        ref16 = build(gpt1, 4)
    finally:
        torch.set_default_dtype(old)
    outs = {c: plan.materialize(pl, MESH, c, seed=4) for c in COORDS}
    bad = [n for n, t in all_tensors(ref16).items()
           if not torch.equal(assemble({c: outs[c][n] for c in COORDS}, tuple(t.shape), pl[n]), t.detach())]
    assert not bad
    differ = [n for n, t in all_tensors(ref16).items() if not torch.equal(t, all_tensors(ref)[n])]
    assert differ, "the two references agree: the second half checks nothing new"


def test_largest_group_is_one_module_and_the_report_names_it():
    meta = build_meta(lambda: GPT(GPTConfig(vocab=256, dim=32, layers=3)))
    plan = plan_init(meta)
    assert plan.largest_group_bytes == 256 * 32 * 4            # tok_emb or lm_head, not the model
    assert len(plan.groups) == sum(hasattr(m, "reset_parameters") for m in meta.modules())
    first = plan.report().splitlines()
    assert first[0].endswith(f"largest group 0.0 MiB of {sum(t.numel() * 4 for t in meta.parameters()) / 2**20:.1f} MiB")
    assert first[1] == "  largest group: tok_emb.weight"


# ---------------------------------------------------------------------------------------------- what cannot be replayed

class OldNorm(nn.Module):
    """An RMSNorm of before: ones made in __init__, no reset_parameters()."""
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.weight = nn.Parameter(torch.ones(8))


def test_tensor_set_by_nothing_is_named_with_the_way_out():
    meta = build_meta(OldNorm)
    pl = make_placements(meta, "2d")
    with (pytest.warns(UserWarning, match="no reset_parameters.*OldNorm at <root>"),
          pytest.raises(SpmdError, match=r"(?s)1 parameters/buffers are set by no reset_parameters.*: weight\n"
                                         r"What to do: .*reset_fns=\{ModuleClass: fn\}.*strict=False")):
        init_local_shards(meta, pl, MESH, (0, 0), seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = init_local_shards(meta, pl, MESH, (0, 0), seed=0, strict=False)
    assert set(out) == {"lin.weight", "lin.bias"}
    check_equal(OldNorm, "2d", 0, reset_fns={OldNorm: lambda m: nn.init.ones_(m.weight)})


class ScaledByBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 0.5))    # made in __init__: lost on meta


def test_init_reading_a_lost_value_is_reported_and_its_group_left_out():
    def init_fn(m):
        if isinstance(m, ScaledByBuffer):
            with torch.no_grad():
                m.lin.weight.mul_(m.scale)
    meta = build_meta(ScaledByBuffer)
    plan = plan_init(meta, init_fn=init_fn, reset_fns={ScaledByBuffer: None})
    assert plan.uncovered == ["scale"] and plan.read_before_write == ["scale"]
    with pytest.raises(SpmdError, match="read by their init before anything wrote them.*: scale"):
        plan.materialize(make_placements(meta, "2d"), MESH, (0, 0), seed=0)
    assert plan.materialize(make_placements(meta, "2d"), MESH, (0, 0), seed=0, strict=False) == {}
    check_equal(ScaledByBuffer, "2d", 0, init_fn=init_fn, reset_fns={ScaledByBuffer: lambda m: m.scale.fill_(0.5)})


def test_init_that_replaces_a_parameter_is_refused():
    def init_fn(m):
        if isinstance(m, nn.Linear):
            m.weight = nn.Parameter(torch.randn(m.weight.shape))
    with pytest.raises(SpmdError, match=r"init fc1 \(Linear\) replaced 'weight'.*write in place"):
        plan_init(build_meta(MLP), init_fn=init_fn)


def test_data_dependent_init_is_refused_on_meta():
    def init_fn(m):
        if isinstance(m, nn.Linear) and m.weight.abs().max() > 1:
            m.weight.mul_(0.5)
    with pytest.raises(SpmdError, match=r"init fc1 \(Linear\) failed on the meta device.*cannot be planned on meta"):
        plan_init(build_meta(MLP), init_fn=init_fn)


# ---------------------------------------------------------------------------------------------- transformers

def hf_llama(tied: bool):
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(HFLlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                          max_position_embeddings=64, tie_word_embeddings=tied))


HF = {"gpt2": lambda: tied_lm("gpt2"), "bert": lambda: tied_lm("bert"),
      "llama": lambda: hf_llama(False), "llama_tied": lambda: hf_llama(True)}


@pytest.mark.parametrize("name,style", [("gpt2", "2d"), ("gpt2", "mixed"), ("llama", "nested"),
                                        ("llama_tied", "mixed"), ("bert", "mixed")])
def test_transformers_with_hf_init_kwargs_equal_single_device(name, style):
    """post_init (each PreTrainedModel's _init_weights over its subtree), Conv1D's draw in __init__ and
    the tied head's discarded draws, replayed as construction runs them."""
    pytest.importorskip("transformers")
    check_equal(HF[name], style, 13, **hf_init_kwargs(build_meta(HF[name])))


def test_gpt2_without_the_conv1d_reset_fn_warns_and_departs():
    """Conv1D draws in __init__ with no reset_parameters(): left undeclared, every later draw shifts."""
    pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    meta = build_meta(HF["gpt2"])
    kw = hf_init_kwargs(meta)
    del kw["reset_fns"][Conv1D]
    with pytest.warns(UserWarning, match="Conv1D at transformer.h.0.attn.c_attn"):
        out = plan_init(meta, **kw).materialize(make_placements(meta, "nested"), MESH, (0, 0), seed=13)
    ref = build(HF["gpt2"], 13)
    assert not torch.equal(out["transformer.h.1.mlp.c_fc.weight"], ref.transformer.h[1].mlp.c_fc.weight[:16])


# ---------------------------------------------------------------------------------------------- trunc_normal_

class _TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32, bias=False), nn.Linear(32, 16, bias=False)


def _trunc_init(std: float):
    def init_fn(m):
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=std)
    return init_fn


def test_an_init_fn_of_trunc_normal_alone_equals_model_apply():
    """torch's trunc_normal_ returns at once on a meta tensor: an init_fn doing nothing else was seen to touch
    nothing, skipped, and the weights kept their reset values (0.28 off). The dry run now sees it draw."""
    check_equal(_TwoLinears, "2d", 3, init_fn=_trunc_init(0.02))


def test_trunc_normal_with_rejected_draws_equals_model_apply():
    """At std 1 within [-2, 2] about 5% of the draws are rejected and drawn again, as many times as the values
    ask: the number of draws is known only on values, and the real pass makes exactly those."""
    ref = build(_TwoLinears, 4, _trunc_init(1.0))
    plan = plan_init(build_meta(_TwoLinears), init_fn=_trunc_init(1.0))
    out = plan.materialize({}, MESH, (0, 0), seed=4, replicate_missing=True)
    assert torch.equal(out["a.weight"], ref.a.weight) and torch.equal(out["b.weight"], ref.b.weight)
    assert float(ref.a.weight.detach().abs().max()) <= 2.0


# ---------------------------------------------------------------------------------------------- transformers vision

def _vision(name: str):
    import transformers as T

    small = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)
    image = dict(small, image_size=32, patch_size=8)
    return {"vit": lambda: T.ViTForImageClassification(T.ViTConfig(**image, num_labels=5)),
            "dinov2": lambda: T.Dinov2Model(T.Dinov2Config(**image)),
            "clip_vision": lambda: T.CLIPVisionModel(T.CLIPVisionConfig(**image)),
            "clip": lambda: T.CLIPModel(T.CLIPConfig(text_config=dict(small, vocab_size=64), vision_config=image)),
            "siglip": lambda: T.SiglipModel(T.SiglipConfig(text_config=dict(small, vocab_size=64), vision_config=image)),
            "vit_mae": lambda: T.ViTMAEModel(T.ViTMAEConfig(**image)),
            "vit_mae_pretraining": lambda: T.ViTMAEForPreTraining(T.ViTMAEConfig(
                **image, decoder_hidden_size=32, decoder_num_hidden_layers=1, decoder_num_attention_heads=4,
                decoder_intermediate_size=64))}[name]


@pytest.mark.parametrize("name", ["vit", "dinov2", "clip_vision", "clip", "siglip", "vit_mae"])
def test_transformers_vision_models_equal_single_device(name):
    """Modules drawing in `__init__` without a reset_parameters (ViT's cls_token before its patch embedding and
    its position embeddings after, CLIP's class embedding), each redone in place where the source draws it; a
    torch MultiheadAttention inside (SigLIP's pooling head) keeps its own reset; ViTMAE's init reading the
    `_is_hf_initialized` marks of its children; CLIP's `logit_scale` made from its config. ViT, Dinov2 and CLIP
    were refused, CLIP's vision model 0.89 off, SigLIP 1.1 off and ViTMAE 1.0 off."""
    pytest.importorskip("transformers")
    factory = _vision(name)
    check_equal(factory, "mixed", 5, **hf_init_kwargs(build_meta(factory)))


def test_a_transformers_init_helper_that_draws_is_refused_with_the_way_out():
    """ViTMAEDecoder's __init__ calls self.initialize_weights(num_patches), which draws (0.11 off on every later
    weight before): refused, naming the line; the reset_fns it names give the single-device values."""
    pytest.importorskip("transformers")
    from transformers.models.vit_mae.modeling_vit_mae import ViTMAEDecoder

    factory = _vision("vit_mae_pretraining")
    meta = build_meta(factory)
    with pytest.raises(SpmdError, match=r"ViTMAEDecoder.__init__ draws random numbers.*self.initialize_weights\("
                                        r"num_patches\), and ViTMAEDecoder.initialize_weights draws.*reset_fns="
                                        r"\{ViTMAEDecoder: fn\}"):
        plan_init(meta, **hf_init_kwargs(meta))
    kw = hf_init_kwargs(meta)
    kw["reset_fns"][ViTMAEDecoder] = lambda m: m.initialize_weights(16)
    check_equal(factory, "mixed", 5, **kw)


def test_a_draw_under_a_condition_is_refused_with_none_as_a_way_out():
    """Found by a probe: MambaMixer's __init__ calls self.init_mamba_weights() under `if initialize_mixer_weights`,
    which MambaBlock passes False. The refusal said to pass a fn drawing the same numbers; given one, 14 tensors came
    out up to 4.2 off one device, without a word. It now says the draw is conditional and that
    `reset_fns={MambaMixer: None}` says it did not run, which gives the single-device values."""
    pytest.importorskip("transformers")
    import transformers
    from transformers.models.mamba.modeling_mamba import MambaMixer

    cfg = transformers.MambaConfig(vocab_size=32, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2,
                                   conv_kernel=2, use_cache=False)
    factory = lambda: transformers.MambaForCausalLM(cfg)  # noqa: E731
    meta = build_meta(factory)
    with pytest.raises(SpmdError, match=r"MambaMixer.__init__ draws .*init_mamba_weights.*under a condition.*"
                                        r"reset_fns=\{MambaMixer: None\}"):
        plan_init(meta, **hf_init_kwargs(meta))
    assert not hf_init_kwargs(meta)["reset_fns"][MambaMixer].built_after  # (a reset fn may stand in for it)
    kw = hf_init_kwargs(meta)
    kw["reset_fns"][MambaMixer] = None
    check_equal(factory, "mixed", 0, ops=False, **kw)  # (the replay draws torch.rand(n) where the build draws
    # uniform_ into an empty tensor of n: the same numbers; the values and the generator's state after are compared)


class _DrawsBetween(nn.Module):
    """An __init__ that draws between building its children: no reset fn (run after them) can redo its order."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.empty(4))
        self.reset_scale()
        self.act = nn.GELU()
        self.norm = nn.LayerNorm(4)
        self.b = nn.Linear(4, 4)

    def reset_scale(self):
        nn.init.uniform_(self.scale)


def test_a_draw_between_a_modules_children_is_refused_even_with_reset_fns():
    """A draw in __init__ after some children holding tensors and before others: the refusal names those built after
    (not a GELU, which holds none, nor a LayerNorm, whose reset draws none) and gives no reset_fns way out, and the fn it returns carries them, by which
    `init_weights` refuses a user's entry for the class."""
    from spmd.runtime.init_weights import init_draws

    refuse = init_draws(_DrawsBetween, _DrawsBetween())
    assert refuse.built_after == ("b",)
    with pytest.raises(SpmdError, match=r"_DrawsBetween.__init__ draws .*before it builds b, .*no reset_fns entry can"):
        refuse(None)

class _WeightNormed(nn.Module):
    """Wav2Vec2's positional conv: a Conv1d drawn, then weight_norm's g and v computed from its weight."""

    def __init__(self):
        super().__init__()
        self.conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(4, 4, 3), dim=2)
        self.head = nn.Linear(4, 2)


_wn = nn.utils.parametrizations.weight_norm


def _wn_conv(*args, **kwargs):
    """DAC/EnCodec's helper: the parametrization registered under another name, in a function `__init__` calls."""
    return _wn(nn.Conv1d(*args, **kwargs))


class _WeightNormedByHelper(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(3, 4)
        self.conv = _wn_conv(4, 4, 3)
        self.post = nn.Linear(4, 2)


class _Conv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(4, 4, 3)
        self.head = nn.Linear(4, 2)


class _WeightNormedInAList(nn.Module):
    """HiFi-GAN's residual blocks: weight-normed convs built in a ModuleList, the parametrization registered by the
    grandparent's __init__."""

    def __init__(self):
        super().__init__()
        self.convs = nn.ModuleList([nn.utils.parametrizations.weight_norm(nn.Conv1d(4, 4, 3)) for _ in range(2)])
        self.head = nn.Linear(4, 2)


def _weight_normed_after_the_build():
    model = _Conv()
    _wn(model.conv, dim=0)
    return model


class _SpectralNormed(nn.Module):
    """A GAN discriminator's layers: spectral_norm draws its power iteration's u and v when registered."""

    def __init__(self):
        super().__init__()
        self.lin = nn.utils.parametrizations.spectral_norm(nn.Linear(4, 6))
        self.conv = nn.utils.parametrizations.spectral_norm(nn.ConvTranspose1d(4, 4, 3))
        self.head = nn.Linear(4, 2)


class _Flagged(nn.Module):
    """A config flag named like torch's function (`weight_norm=False`), as audio models have: not a registration."""

    def __init__(self, weight_norm: bool = False):
        super().__init__()
        self.conv, self.head, self.weight_norm = nn.Conv1d(4, 4, 3), nn.Linear(4, 2), weight_norm


def _flagged_weight_normed_after_the_build():
    model = _Flagged()
    _wn(model.conv, dim=0)
    return model


class _MaybeNormed(nn.Module):
    """spectral_norm under a flag that is off: no registration when built."""

    def __init__(self, use_sn: bool = False):
        super().__init__()
        self.conv = nn.Conv1d(4, 4, 3)
        if use_sn:
            self.conv = nn.utils.parametrizations.spectral_norm(self.conv)
        self.head = nn.Linear(4, 2)


class _OneChildNormed(nn.Module):
    """weight_norm registered on `a` when built; `conv` is not."""

    def __init__(self):
        super().__init__()
        self.a, self.conv, self.head = _wn(nn.Conv1d(4, 4, 3)), nn.Conv1d(4, 4, 3), nn.Linear(4, 2)


def _spectral_normed_after(cls):
    def build():
        model = cls()
        nn.utils.parametrizations.spectral_norm(model.conv)
        return model
    return build


def _spectral_normed_after_the_build():
    model = _Conv()
    nn.utils.parametrizations.spectral_norm(model.conv)
    return model


@pytest.mark.parametrize("factory", [_WeightNormed, _WeightNormedByHelper, _WeightNormedInAList, _SpectralNormed])
def test_a_parametrization_registered_in_init_gets_its_tensors_from_the_modules_reset(factory):
    """Found by a probe: Wav2Vec2 and HuBERT on meta were refused (weight_norm's g and v set by nothing). The
    module's reset now runs as construction ran it, before the parametrization: it draws a plain weight, and the
    parametrization registered again on it, on the side, sets g and v (spectral_norm: draws u and v and iterates)
    bit for bit as one device's on every coordinate; the draws after it stay in step (the Linear after)."""
    check_equal(factory, "mixed", 3)


@pytest.mark.parametrize("factory", [_weight_normed_after_the_build, _spectral_normed_after_the_build,
                                     _flagged_weight_normed_after_the_build, _spectral_normed_after(_MaybeNormed),
                                     _spectral_normed_after(_OneChildNormed)])
def test_a_parametrization_registered_on_the_built_model_is_refused_with_the_ways_out(factory):
    """Registered after the build (after any init of the model's, which a meta model cannot replay): named. A flag
    named `weight_norm` in the parent's `__init__`, a registration under a branch not taken, or one on another
    child took it as registered there, and the replay drew at the wrong place: other values than one device's
    (reviews)."""
    with pytest.raises(SpmdError, match=r"parametrization on conv: .*not one registered on the built model"
                                        r".*load_safetensors"):
        plan_init(build_meta(factory)).check()


def test_wav2vec2_on_meta_equals_one_device():
    """Wav2Vec2 built on meta (its `torch.Tensor(n)` moved to meta, as the refusal says), with transformers'
    post_init, whose normal_ into the weight-normed conv's computed weight draws and keeps nothing."""
    pytest.importorskip("transformers")
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    def model():
        return Wav2Vec2Model(Wav2Vec2Config(
            hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, conv_dim=(8, 8),
            conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2))

    def meta():
        m = build_meta(model)
        m.masked_spec_embed = nn.Parameter(m.masked_spec_embed.to("meta"))
        return m

    check_equal(model, "mixed", 5, meta_build=meta, **hf_init_kwargs(meta()))


def test_dry_runs_in_threads_leave_nn_init_as_it_was():
    """A review found two overlapping dry runs leaving `trunc_normal_`'s meta stand-in installed for good: the
    first to enter patches nn.init, the last to leave restores it."""
    import threading

    trunc, orthogonal = nn.init._no_grad_trunc_normal_, nn.init.orthogonal_

    def run():
        for _ in range(10):
            plan_init(build_meta(_TwoLinears), init_fn=_trunc_init(0.02))

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert nn.init._no_grad_trunc_normal_ is trunc and nn.init.orthogonal_ is orthogonal
