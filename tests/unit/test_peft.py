"""peft's LoRA adapters on a model built under torch.device("meta"): `init_weights` replays
`get_peft_model(Model(cfg), config)` as it ran on one device, the base model built and initialized first, the
adapters wrapped in after it (runtime/init_weights.py, `peft_init_kwargs`); `load_safetensors` reads the base
model's checkpoint and the adapter's file under their own names (runtime/peft_names.py)."""
from __future__ import annotations

import copy

import pytest
import torch

import spmd
from tests.support import one_device

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def _config():
    return transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, use_cache=False)


def _compiled_on_meta(lora, **replay):
    """(the compiled meta model after init_weights(seed=0), the same model built eagerly after manual_seed(0))."""
    torch.manual_seed(0)
    eager = peft.get_peft_model(transformers.LlamaForCausalLM(_config()), lora)
    with torch.device("meta"):
        meta = peft.get_peft_model(transformers.LlamaForCausalLM(_config()), lora)
    compiled = one_device(meta, (torch.randint(0, 128, (2, 8), device="meta"),))
    compiled.init_weights(seed=0, **replay)
    return compiled, eager


@pytest.mark.parametrize("init", [True, "gaussian"])
def test_lora_adapters_on_a_meta_model_are_initialized_as_on_one_device(init):
    """Found by a probe: the replay ran transformers' post_init over the adapters too (it ran before peft added
    them), so lora_B came out drawn (std 0.02) where one device has zeros, and lora_A not kaiming's: the adapter
    was no longer a no-op at the start, 0.19 off one device after 3 steps, silently. Now every tensor equals
    `torch.manual_seed(0); get_peft_model(LlamaForCausalLM(cfg), config)`, the generator's draws in order."""
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                           init_lora_weights=init, modules_to_save=["lm_head"])  # (the head: copied, not drawn)
    compiled, eager = _compiled_on_meta(lora)
    full = compiled.full_state_dict(persistent_only=True)
    want = eager.state_dict()
    assert set(full) == set(want)
    for name, value in want.items():
        assert torch.equal(full[name], value), name
    b = "base_model.model.model.layers.1.mlp.down_proj.lora_B.default.weight"
    assert not full[b].any()  # (what the test would miss: B starts at zero)


def test_an_adapter_init_the_replay_does_not_redo_is_refused_with_a_way_out_that_works():
    """DoRA's magnitudes read the base weights: refused when replayed, naming the way out, which is followed here:
    the layer's tensors zeroed by `reset_fns`, then the base checkpoint and the adapter's file (whose magnitudes
    peft saves as `...q_proj.lora_magnitude_vector`) loaded: every tensor equals the fine-tuned model's."""
    import tempfile

    from peft.tuners.lora.layer import Linear

    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], use_dora=True)
    with pytest.raises(spmd.SpmdError, match=r"init_weights: peft.tuners.lora.layer.Linear \(adapter 'default', "
                                             r"init_lora_weights=True, DoRA\).*reset_fns=\{Linear: fn\}.*"
                                             r"compiled.load_safetensors\(folder\)"):
        _compiled_on_meta(lora)

    def zeros(layer):
        for p in (*layer.lora_A.parameters(), *layer.lora_B.parameters(), *layer.lora_magnitude_vector.parameters()):
            torch.nn.init.zeros_(p)

    compiled, _ = _compiled_on_meta(lora, reset_fns={Linear: zeros})
    torch.manual_seed(1)
    base = transformers.LlamaForCausalLM(_config())  # (a pretrained model's stand-in)
    trained = peft.get_peft_model(copy.deepcopy(base), lora)
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn_like(p))
    with tempfile.TemporaryDirectory() as folder:
        base.save_pretrained(f"{folder}/base")
        trained.save_pretrained(f"{folder}/adapter")
        compiled.load_safetensors(f"{folder}/base")
        compiled.load_safetensors(f"{folder}/adapter")
    full = compiled.full_state_dict(persistent_only=True)
    for name, value in trained.state_dict().items():
        assert torch.equal(full[name], value), name


def test_the_users_own_reset_of_an_adapter_layer_is_kept():
    """A `reset_fns` entry for the adapter layer's class replaces peft's (here: B drawn too, as a user might to
    test a merge), and the rest of the model is replayed as before."""
    from peft.tuners.lora.layer import Linear

    def drawn(layer):
        for adapter in layer.lora_A.keys():
            torch.nn.init.normal_(layer.lora_A[adapter].weight)
            torch.nn.init.normal_(layer.lora_B[adapter].weight)

    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"])
    compiled, eager = _compiled_on_meta(lora, reset_fns={Linear: drawn})
    full = compiled.full_state_dict()
    assert full["base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"].abs().min() > 0
    base = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    assert torch.equal(full[base], eager.state_dict()[base])


def test_a_meta_peft_model_loads_its_base_checkpoint_and_its_adapters_file():
    """Found by a probe: a compiled peft model could load neither file it is made from, a base model's checkpoint
    (`model.layers.0.self_attn.q_proj.weight`, which peft names `base_model.model.model.layers.0.self_attn.q_proj.
    base_layer.weight`) nor `adapter_model.safetensors` (`...q_proj.lora_A.weight`, peft's `lora_A.default.
    weight`): strict loads were refused with advice that did not apply, and strict=False loaded nothing. Each file
    now loads strictly, the other's tensors left as they were (and reported missing), as peft loads them; a
    `modules_to_save` copy starts from the base checkpoint and takes the adapter's values from its file."""
    import tempfile

    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(_config())
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    trained = peft.get_peft_model(copy.deepcopy(base), lora)
    with torch.no_grad():  # (as after fine-tuning: B no longer zero, the head's copy moved)
        for name, p in trained.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                p.add_(torch.randn_like(p))
    with torch.device("meta"):
        meta = peft.get_peft_model(transformers.LlamaForCausalLM(_config()), lora)
    compiled = one_device(meta, (torch.randint(0, 128, (2, 8), device="meta"),))
    compiled.init_weights(seed=1)
    with tempfile.TemporaryDirectory() as folder:
        base.save_pretrained(f"{folder}/base")
        trained.save_pretrained(f"{folder}/adapter")
        missing, unexpected = compiled.load_safetensors(f"{folder}/base")
        assert missing and all("lora_" in k for k in missing) and not unexpected
        full = compiled.full_state_dict(persistent_only=True)
        for name, value in base.state_dict().items():
            peft_name = next(k for k in full if k.replace(".base_layer", "").replace(".original_module", "")
                             == f"base_model.model.{name}")
            assert torch.equal(full[peft_name], value), name
        assert torch.equal(full["base_model.model.lm_head.modules_to_save.default.weight"], base.lm_head.weight)
        missing, unexpected = compiled.load_safetensors(f"{folder}/adapter/adapter_model.safetensors")
        assert missing and not any("lora_" in k for k in missing) and not unexpected
    full = compiled.full_state_dict(persistent_only=True)
    for name, value in trained.state_dict().items():
        assert torch.equal(full[name], value), name


@pytest.mark.parametrize("saved", [None, ["lm_head"], ["wte"]])
def test_lora_on_a_model_with_tied_weights_is_initialized_as_on_one_device(saved):
    """Found by a review: GPT-2 ties its head to its embedding, and the tie's names were the base model's
    (`lm_head.weight`), not the peft model's: init_weights failed on every GPT-2, and with the head in
    `modules_to_save` the copy came out of uninitialized memory (7e29) and the embedding 0.107 off."""
    config = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=16, use_cache=False)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True,
                           modules_to_save=saved)
    torch.manual_seed(0)
    eager = peft.get_peft_model(transformers.GPT2LMHeadModel(config), lora)
    with torch.device("meta"):
        meta = peft.get_peft_model(transformers.GPT2LMHeadModel(config), lora)
    compiled = one_device(meta, (torch.randint(0, 128, (2, 8), device="meta"),))
    compiled.init_weights(seed=0)
    full = compiled.full_state_dict(persistent_only=True)
    for name, value in eager.state_dict().items():
        assert torch.equal(full[name], value), name


def test_two_adapters_are_refused_by_the_replay_and_not_mixed_by_a_load():
    """Found by a review: peft builds a second adapter over all layers after the first, so the replay's draws
    would come in another order: refused, naming the way out. And an adapter's file names no adapter: with two,
    loading one wrote its values into both; its names are not taken as either's now, and a strict load refuses."""
    import tempfile

    from peft.tuners.lora.layer import Linear

    def build():
        model = peft.get_peft_model(transformers.LlamaForCausalLM(_config()),
                                    peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        model.add_adapter("two", peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
        return model

    with torch.device("meta"):
        meta = build()
    compiled = one_device(meta, (torch.randint(0, 128, (2, 8), device="meta"),))
    with pytest.raises(spmd.SpmdError, match=r"2 peft adapters \('default', 'two'\).*reset_fns=\{Linear: fn\}"):
        compiled.init_weights(seed=0)

    def zeros(layer):
        for p in (*layer.lora_A.parameters(), *layer.lora_B.parameters()):
            torch.nn.init.zeros_(p)

    compiled.init_weights(seed=0, reset_fns={Linear: zeros})
    torch.manual_seed(0)
    trained = peft.get_peft_model(transformers.LlamaForCausalLM(_config()),
                                  peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with tempfile.TemporaryDirectory() as folder:
        trained.save_pretrained(folder)
        with pytest.raises(spmd.SpmdError, match="tensors of the model are not in"):
            compiled.load_safetensors(folder)
    two = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.two.weight"
    assert not compiled.full_state_dict()[two].any()
