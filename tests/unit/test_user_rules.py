"""A user's `@rule` for an op of their own: rows that cannot be used are dropped with a warning naming the first and
why (found by a probe: they were dropped without a word, and where none was left the op ran replicated with no
warning at all), and a well-formed rule is used as given."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

import spmd
from spmd.passes.rules.registry import rule
from tests.support import compile_graph, spec


@torch.library.custom_op("spmd_test::bias_tanh", mutates_args=())
def bias_tanh(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x + b)


@bias_tanh.register_fake
def _(x, b):
    return torch.empty_like(x)


_ROWS: dict[str, list] = {}  # (what the rule below gives this time)


@rule(torch.ops.spmd_test.bias_tanh.default)
def _bias_tanh_rule(r):
    return _ROWS["rows"]


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.b = nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False), nn.Parameter(
            torch.zeros(16))

    def forward(self, x):
        return self.fc2(bias_tanh(self.fc1(x), self.b))


_COLUMN = [Shard(1), Shard(1), Shard(0)]  # (the hidden dim split: x's last dim and the bias with it)


@pytest.mark.parametrize("rows, dropped, left", [
    ([[Shard(1), Shard(1)]], "[Shard(dim=1), Shard(dim=1)] has 2 placement(s), the op 1 output(s) and 2 tensor "
                             "input(s)", False),
    ([[Shard(5), Shard(5), Replicate()], _COLUMN], "holds S(5) for a 2-d tensor", True),
    ([[Shard(-1), Shard(-1), Shard(-1)]], "holds S(-1) for a 2-d tensor", False),
    ([["rows", Shard(1), Shard(0)], _COLUMN], "holds 'rows', not a placement", True),
])
def test_rows_of_a_users_rule_that_cannot_be_used_are_named(rows, dropped, left):
    _ROWS["rows"] = rows
    mesh = spec((2,), ("tp",))
    pins = {"fc1.weight": [Shard(0)], "fc2.weight": [Shard(1)]}
    with pytest.warns(spmd.UnknownOpWarning) as caught:
        c = compile_graph(_Block(), (torch.randn(4, 8),), mesh, param_placements=pins)
    said = [str(w.message) for w in caught if "its rule gave" in str(w.message)]
    assert len(said) == 1 and "spmd_test.bias_tanh.default" in said[0] and dropped in said[0], said
    assert ("runs replicated" in said[0]) == (not left), said[0]
    chosen = next(ch for name, ch in c.plan.choices.items() if name.startswith("bias_tanh"))
    assert chosen.inputs[0] == ((Shard(1),) if left else (Replicate(),)), chosen


def test_a_well_formed_users_rule_is_used_without_a_word():
    _ROWS["rows"] = [_COLUMN]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", spmd.UnknownOpWarning)
        c = compile_graph(_Block(), (torch.randn(4, 8),), spec((2,), ("tp",)),
                          param_placements={"fc1.weight": [Shard(0)], "fc2.weight": [Shard(1)]})
    chosen = next(ch for name, ch in c.plan.choices.items() if name.startswith("bias_tanh"))
    assert chosen.inputs[0] == (Shard(1),), chosen


_LIB = torch.library.Library("spmd_test_nofake", "DEF")
_LIB.define("swish(Tensor x) -> Tensor")
_LIB.impl("swish", lambda x: x * torch.sigmoid(x), "CPU")


@pytest.mark.parametrize("training", [True, False])
def test_an_op_of_the_users_library_without_a_fake_says_to_register_one(training):
    """Found by a probe: torch.export's error names the op alone (`mylib.swish.default`), torch's own reason, no fake
    implementation, deep in the chain, and the way out said to remove data-dependent control flow."""
    import torch.nn.functional as F

    from tests.support import one_device

    class Swished(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return torch.ops.spmd_test_nofake.swish(self.fc(x))

    x, y = torch.randn(3, 4), torch.randn(3, 4)
    with pytest.raises(spmd.SpmdError, match=r"no fake impl or Meta kernel registered(.|\n)*What to do: give the op a "
                                             r"fake implementation.*`@torch.library.register_fake\(\"spmd_test_nofake::"
                                             r"swish\"\)`"):
        if training:
            one_device(Swished(), (x, y), training=True, loss_fn=F.mse_loss)
        else:
            one_device(Swished(), (x,))


@torch.library.custom_op("spmd_test::running_max_", mutates_args=("amax",))
def running_max_(h: torch.Tensor, amax: torch.Tensor) -> None:
    amax.copy_(torch.maximum(amax, h.detach().abs().amax(0)))


@running_max_.register_fake
def _(h, amax):
    return None


def test_an_op_writing_its_inputs_is_named_in_the_warning_for_its_wrapper():
    """Found by a probe: the warning named torch's `auto_functionalized_v2` alone, and a rule given for the user's
    op itself was never asked for, without a word. It names the op now and says where its rule goes."""
    class Tracked(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 16)
            self.register_buffer("amax", torch.zeros(16))

        def forward(self, x):
            h = self.fc(x)
            running_max_(h, self.amax)
            return h / (self.amax + 1.0)

    with pytest.warns(spmd.UnknownOpWarning) as caught:
        compile_graph(Tracked(), (torch.randn(4, 8),), spec((2,), ("tp",)), param_placements={"fc.weight": [Shard(0)]})
    said = [str(w.message) for w in caught if "auto_functionalized" in str(w.message)]
    assert len(said) == 1 and "which runs `spmd_test.running_max_.default`" in said[0], said
    assert "`@rule(torch.ops.higher_order.auto_functionalized_v2)`" in said[0] and "`r.args[0]`" in said[0], said[0]


def test_a_value_smaller_than_its_plan_says_names_the_fake_as_the_likely_cause():
    """Found by a probe: an op's fake stating `[B, H]` where its kernel returns `[B, 1]` crashed one rank with a bare
    `IndexError` (tuple index out of range) where the plan cut the value for that rank."""
    from spmd.core.collectives import shard_local

    assert shard_local(torch.arange(8.0).view(4, 2), 1, 1, 2).tolist() == [[1.0], [3.0], [5.0], [7.0]]
    with pytest.raises(spmd.SpmdError, match=r"a value of shape \(8, 1\) has no piece 1 of 2 on dim 1.*fake "
                                             r"implementation must state the shape its kernel returns"):
        shard_local(torch.zeros(8, 1), 1, 1, 2)
