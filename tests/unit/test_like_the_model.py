"""A compiled module used as the model is: its load_state_dict pre-hooks (key renames of old checkpoints) run on a
copy of the state dict, post hooks (which would set the model's own tensors) are named in a warning, a batch norm
checkpoint older than `num_batches_tracked` loads; its parts are indexed as the model's; DDP's `no_sync()` runs."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

from tests.support import one_device


class _Renamed(nn.Module):
    """Reads checkpoints from before its `proj` was called `fc` (as transformers' Mamba reads `embedding.`)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self._register_load_state_dict_pre_hook(self._rename)

    @staticmethod
    def _rename(state_dict, prefix, *args):
        for k in [k for k in state_dict if k.startswith(prefix + "proj.")]:
            state_dict[k.replace(prefix + "proj.", prefix + "fc.")] = state_dict.pop(k)

    def forward(self, x):
        return self.fc(x)


class _Derived(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("w_norm", self.fc.weight.norm(dim=1), persistent=False)
        self.register_load_state_dict_post_hook(lambda m, keys: m.w_norm.copy_(m.fc.weight.norm(dim=1)))

    def forward(self, x):
        return self.fc(x) / self.w_norm


@pytest.mark.parametrize("strict", [True, False])
def test_a_pre_hook_renaming_old_keys_runs(strict):
    """Found by a probe: the renames were skipped, so an old checkpoint was refused as unexpected keys, or (strict=False)
    left out silently: 4.11 off."""
    torch.manual_seed(0)
    model, x = _Renamed(), torch.randn(4, 8)
    old = {k.replace("fc.", "proj."): torch.randn_like(v) for k, v in model.state_dict().items()}
    reference = copy.deepcopy(model)
    compiled = one_device(model.eval(), (x,))
    got = compiled.load_state_dict(dict(old), strict=strict)
    want = reference.load_state_dict(dict(old), strict=strict)
    assert list(got.missing_keys) == list(want.missing_keys) == [] and list(got.unexpected_keys) == []
    assert sorted(old) == ["proj.bias", "proj.weight"]  # (the caller's dict is not renamed)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), reference(x), rtol=0, atol=0)


def test_a_post_hook_is_named_in_a_warning():
    """Found by a probe: a post hook recomputing a buffer from the loaded weights was not run, 9.78 off, silently."""
    torch.manual_seed(0)
    model, x = _Derived(), torch.randn(4, 8)
    compiled = one_device(model.eval(), (x,))
    with pytest.warns(UserWarning, match=r"`_Derived` \(_Derived\) of the model registered load_state_dict post hooks"):
        compiled.load_state_dict({k: torch.randn_like(v) for k, v in model.state_dict().items()})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        one_device(nn.Linear(8, 8).eval(), (x,)).load_state_dict(nn.Linear(8, 8).state_dict())  # (none: no warning)


def test_a_batch_norm_checkpoint_from_before_num_batches_tracked_loads():
    """Found by a probe: refused as "1 entries missing", where torch's batch norm takes it (a plain dict has no
    version metadata)."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).eval(), torch.randn(4, 8)
    old = {k: torch.rand_like(v) + 0.5 for k, v in model.state_dict().items() if not k.endswith("num_batches_tracked")}
    reference = copy.deepcopy(model)
    compiled = one_device(model, (x,))
    got, want = compiled.load_state_dict(dict(old)), reference.load_state_dict(dict(old))
    assert list(got.missing_keys) == list(want.missing_keys) == []
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), reference(x), rtol=0, atol=0)
    versioned = reference.state_dict()  # (with metadata of version 2, an entry missing is missing)
    del versioned["1.num_batches_tracked"]
    with pytest.raises(Exception, match="num_batches_tracked"):
        compiled.load_state_dict(versioned)


class _Holding(nn.Module):
    def __init__(self, head):
        super().__init__()
        self.head = head

    def forward(self, x):
        return self.head(x)


def test_parts_are_indexed_as_the_model_s_module_list():
    """Found by a probe: `compiled.blocks[1]` raised TypeError ('_Pieces' object is not subscriptable); a review then
    found a first version counting only the parts that hold weights (`classifier[-1]` of `Sequential(Dropout,
    Linear)` was the Dropout's holder, with no parameters, silently)."""
    from tests.models import GPT, GPTConfig

    compiled = one_device(GPT(GPTConfig(layers=2)).eval(), (torch.randint(0, 128, (2, 16)),))
    assert compiled.blocks[1] is compiled.get_submodule("blocks.1") and compiled.blocks[-1] is compiled.blocks[1]
    assert sorted(compiled.blocks[1].state_dict()) == sorted(k[len("blocks.1."):] for k in compiled.state_dict()
                                                            if k.startswith("blocks.1."))
    with pytest.raises(IndexError, match=r"`blocks` of the model has parts \['0', '1'\]: no 5"):
        compiled.blocks[5]
    head = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Dropout(0.0), nn.Linear(8, 4)))
    compiled = one_device(_Holding(head).eval(), (torch.randn(2, 8),))
    assert compiled.head[1][-1] is compiled.get_submodule("head.1.1") and compiled.head[1][1].weight.shape == (4, 8)
    assert compiled.head[1][0] is compiled.get_submodule("head.1.0") and not list(compiled.head[1][0].parameters())
    assert len(compiled.head[1]) == 2 and list(compiled.head[1]) == compiled.head[1][:] == [compiled.head[1][0],
                                                                                         compiled.head[1][1]]
    assert compiled.head[1][-1:] == [compiled.head[1][1]] and compiled.head[1][1] in compiled.head[1]


def test_a_container_root_is_indexed_as_the_model():
    """`compiled[0]` of an `nn.Sequential` said "'CompiledModule' object is not subscriptable" (known since session
    84). A review then found iteration stopping at a ReLU, a ModuleDict iterated over parts instead of keys (`"a" in
    compiled` False), and `__iter__` on every compiled module. A part with no state is the model's own module; only a
    container's compiled module is one."""
    from collections.abc import Iterable

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    compiled = one_device(model, (torch.randn(3, 4),))
    assert compiled[0] is compiled.get_submodule("0") and compiled[-1] is compiled.get_submodule("2")
    assert compiled[0].weight.shape == (8, 4) and isinstance(compiled[-1], nn.Linear)
    assert compiled[1] is model[1] and list(compiled) == [compiled[0], model[1], compiled[2]]
    assert len(compiled) == 3 and compiled[::2] == [compiled[0], compiled[2]] and bool(compiled)
    assert compiled[2] in compiled and model[2] not in compiled
    with pytest.raises(IndexError, match=r"the model has parts \['0', '1', '2'\]: no 3"):
        compiled[3]
    heads = nn.ModuleDict({"a": nn.Linear(4, 2), "b": nn.Linear(4, 2)})

    class Both(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads = heads

        def forward(self, x):
            return self.heads["a"](x) + self.heads["b"](x)

    compiled = one_device(Both(), (torch.randn(3, 4),))
    assert list(compiled.heads) == ["a", "b"] and "a" in compiled.heads and "c" not in compiled.heads
    assert compiled.heads["b"] is compiled.get_submodule("heads.b") and len(compiled.heads) == 2
    assert [k for k, _ in compiled.heads.items()] == ["a", "b"] and compiled.heads.values()[0] is compiled.heads["a"]
    with pytest.raises(KeyError):
        compiled.heads["c"]
    linear = one_device(nn.Linear(4, 2), (torch.randn(3, 4),))
    assert not isinstance(linear, Iterable) and not hasattr(type(linear), "__len__") and bool(linear)
    with pytest.raises(TypeError, match="not subscriptable"):
        linear[0]


def test_no_sync_runs_a_ddp_accumulation_loop_as_it_is():
    """Found by a probe: `compiled.no_sync()` (DDP's habit for gradient accumulation) raised AttributeError."""
    torch.manual_seed(0)
    model, x = nn.Linear(8, 8), torch.randn(4, 8)
    reference = copy.deepcopy(model)
    compiled = one_device(model, (x, x), loss_fn=nn.functional.mse_loss)
    with compiled.no_sync():
        compiled(x, x).backward()
    compiled(x, x).backward()
    for _ in range(2):
        nn.functional.mse_loss(reference(x), x).backward()
    torch.testing.assert_close(compiled.get_parameter("weight").grad, reference.weight.grad, rtol=1e-6, atol=1e-7)


def test_a_graph_the_backend_fails_to_compile_runs_uncompiled_with_a_warning(monkeypatch):
    """Found by a probe: inductor's C++ vectorizer failed on a batch-split transformers Llama graph, and the user
    got torch's raw InductorError at the first call."""
    import torch._dynamo.exc

    import spmd.runtime.compiled as compiled_module

    def failing(gm, backend):
        def run(*args):
            raise torch._dynamo.exc.BackendCompilerFailed(lambda *a: None, AssertionError("CppCSEVariable"), None)
        return run

    torch.manual_seed(0)
    model, x = nn.Linear(8, 8).eval(), torch.randn(4, 8)
    compiled = one_device(model, (x,))
    want = compiled(x)
    monkeypatch.setattr(compiled_module, "_runner", failing)
    compiled.compile_backend = "inductor"
    with pytest.warns(UserWarning, match=r"could not compile this rank's 'graph' graph .*it runs uncompiled"):
        got = compiled(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (once)
        torch.testing.assert_close(compiled(x), want, rtol=0, atol=0)
