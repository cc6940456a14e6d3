"""passes/buffer_aliases.py: buffers a forward reaches through a plain object (a cache object's layers) are read from
their module during the trace, and the objects hold their own tensors again after it."""
from __future__ import annotations

import torch
import torch.nn as nn

from spmd.passes.buffer_aliases import buffer_aliases, buffers_through_aliases
from tests.support import one_device


class _Layer:
    def __init__(self, keys):
        self.keys = keys


class _Cache:
    def __init__(self, tensors):
        self.layers = [_Layer(t) for t in tensors]
        self.by_name = {"first": tensors[0]}


class _Cached(nn.Module):
    """Writes into its buffers through a cache object, as transformers' static cache does."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("k0", torch.zeros(3, 4))
        self.register_buffer("k1", torch.zeros(3, 4))
        self.cache = _Cache([self.k0, self.k1])

    def forward(self, x, pos):
        y = self.fc(x)
        for layer in self.cache.layers:
            layer.keys.index_copy_(0, pos, y)
        return self.cache.layers[0].keys.sum(0) + self.cache.by_name["first"].mean(0)


def test_aliases_are_found_in_objects_lists_and_dicts():
    model = _Cached()
    found = {(type(holder).__name__, key, name) for holder, key, _, name in buffer_aliases(model)}
    assert found == {("_Layer", "keys", "k0"), ("_Layer", "keys", "k1"), ("dict", "first", "k0")}
    with buffers_through_aliases(model):
        model(torch.randn(1, 4), torch.tensor([0]))
    assert model.cache.layers[0].keys is model.k0 and model.cache.by_name["first"] is model.k0


def test_a_forward_writing_buffers_through_an_object_compiles_and_runs_as_eager():
    """Before, torch.export took the object's tensors as constants and the decomposition failed on their writes."""
    torch.manual_seed(0)
    model, reference = _Cached(), _Cached()
    reference.load_state_dict(model.state_dict())
    compiled = one_device(model, (torch.randn(1, 4), torch.tensor([0])))
    with torch.no_grad():
        for i in range(3):
            x, pos = torch.randn(1, 4), torch.tensor([i])
            torch.testing.assert_close(compiled(x, pos), reference(x, pos), rtol=0, atol=1e-6)
    torch.testing.assert_close(compiled.get_buffer("k1"), reference.k1, rtol=0, atol=1e-6)
    assert model.cache.layers[1].keys is model.k1 and type(model.k1) is torch.Tensor


def test_a_frozen_holder_of_buffers_is_left_alone():
    """A review: a rotary cache kept in a frozen dataclass beside its buffers was refused with a trace error (the
    rebinding could not assign); such a holder keeps its tensors, which trace as constants, as before."""
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Rope:
        cos: torch.Tensor

    class Rotary(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.register_buffer("cos", torch.rand(4))
            self.rope = Rope(self.cos)

        def forward(self, x):
            return self.fc(x) * self.rope.cos

    torch.manual_seed(0)
    model = Rotary()
    assert buffer_aliases(model) == []
    x = torch.randn(3, 4)
    torch.testing.assert_close(one_device(model, (x,))(x), model(x), rtol=0, atol=0)
    assert model.rope.cos is model.cos
