"""The names a peft model's tensors have in the checkpoints it is loaded from.

`get_peft_model(base, config)` renames the base model's tensors (`model.layers.0.self_attn.q_proj.weight` becomes
`base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight`) and adds the adapter's under the adapter's
name (`...q_proj.lora_A.default.weight`; a `modules_to_save` module as `original_module` beside
`modules_to_save.default`). On one device the base checkpoint is loaded before the wrapping and the adapter's file
(`adapter_model.safetensors`, whose names keep the prefix and drop the adapter's name) after it, by peft. A
compiled peft model built on meta loads both itself (`CompiledModule.load_safetensors`); neither file had one name
of the model's (found by a probe). `checkpoint_names` gives each tensor its names in those two files.
"""
from __future__ import annotations

import sys

import torch.nn as nn

_PREFIX = "base_model.model."
_WRAPPERS = frozenset({"base_layer", "original_module"})  # (what peft puts the base model's own module under)
_ADAPTER_PARTS = frozenset({"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector",
                            "modules_to_save"})


def is_peft_model(model: nn.Module) -> bool:
    """A peft `PeftModel` (checked without importing peft when it is not loaded)."""
    if "peft" not in sys.modules:
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)


def adapter_names(model: nn.Module) -> frozenset[str]:
    return frozenset(getattr(model, "peft_config", None) or ())


def checkpoint_names(fqn: str, adapters: frozenset[str]) -> tuple[tuple[str, ...], bool]:
    """(the names `fqn` has in the checkpoints a peft model loads, whether it is the adapter's own): a base
    tensor's, in the base model's checkpoint; an adapter's, in the adapter's file; a `modules_to_save` copy's, in
    both (the copy starts as the base module)."""
    parts = fqn.split(".")
    base, saved, own, copied, i = [], [], False, False, 0
    while i < len(parts):
        if parts[i] in _ADAPTER_PARTS and i + 1 < len(parts) and parts[i + 1] in adapters:
            own, copied = True, copied or parts[i] == "modules_to_save"
            if parts[i] != "modules_to_save":  # (lora_A.default.weight: lora_A.weight; modules_to_save.default: -)
                saved.append(parts[i])
            if parts[i] == "lora_magnitude_vector" and parts[i + 2:] == ["weight"]:
                break  # (DoRA's magnitudes: `...q_proj.lora_magnitude_vector`)
            i += 2
            continue
        if parts[i] not in _WRAPPERS:
            base.append(parts[i])
        saved.append(parts[i])
        i += 1
    base_name = ".".join(base).removeprefix(_PREFIX)
    if not own:
        return (base_name,), False
    # (an adapter's file names no adapter: with several, whose it is is not known, and peft loads it into the one
    # named; its tensors are then not the model's, and a strict load refuses them. Found by a review: a second
    # adapter took the first's values)
    saved_name = (".".join(saved),) if len(adapters) == 1 else ()
    return ((base_name,) if copied else ()) + saved_name, True
