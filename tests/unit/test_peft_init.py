"""peft's LoRA adapters on a model built under torch.device("meta"): `init_weights` replays
`get_peft_model(Model(cfg), config)` as it ran on one device, the base model built and initialized first, the
adapters wrapped in after it (runtime/init_weights.py, `peft_init_kwargs`)."""
from __future__ import annotations

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
                           init_lora_weights=init)
    compiled, eager = _compiled_on_meta(lora)
    full = compiled.full_state_dict(persistent_only=True)
    want = eager.state_dict()
    assert set(full) == set(want)
    for name, value in want.items():
        assert torch.equal(full[name], value), name
    b = "base_model.model.model.layers.1.mlp.down_proj.lora_B.default.weight"
    assert not full[b].any()  # (what the test would miss: B starts at zero)


def test_an_adapter_init_the_replay_does_not_redo_is_refused_with_the_way_out():
    """DoRA's magnitudes read the base weights: refused when replayed, naming the ways out."""
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], use_dora=True)
    with pytest.raises(spmd.SpmdError, match=r"init_weights: peft.tuners.lora.layer.Linear \(adapter 'default', "
                                             r"init_lora_weights=True, DoRA\).*load_state_dict\(adapter_state, "
                                             r"strict=False\).*reset_fns=\{Linear: fn\}"):
        _compiled_on_meta(lora)


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
