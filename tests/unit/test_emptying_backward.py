"""The backward graph runs on a list it empties (runtime/compiled.py `_emptying`): each saved activation is let
go of at its last reader, as the plan's schedule walk assumes (tests/e2e/test_memory_truth.py measures it)."""
import weakref

import torch
import torch.fx as fx

from spmd.runtime.compiled import _emptying

seen = {}


def _alive_now() -> None:
    seen["alive"] = seen["ref"]() is not None


def _graph() -> fx.GraphModule:
    """relu(x) is x's last reader; a probe after it looks whether x is still alive."""
    g = fx.Graph()
    x, b = g.placeholder("x"), g.placeholder("b")
    y = g.call_function(torch.relu, (x,))
    g.call_function(_alive_now, ())
    g.output((g.call_function(torch.add, (y, b)),))
    return fx.GraphModule(torch.nn.Module(), g)


def test_an_argument_dies_at_its_last_reader_and_the_values_are_the_same():
    gm = _graph()
    x, b = torch.randn(4), torch.randn(4)
    seen["ref"] = weakref.ref(x)
    expected = gm(x, b)[0]
    args = [x.clone(), b]
    seen["ref"] = weakref.ref(args[0])
    out = _emptying(gm)(args)
    assert args == [] and seen["alive"] is False
    assert torch.equal(out[0], expected)
    # called with the arguments spread (as before), the call's tuple holds x until the graph returns
    args = (x.clone(), b)
    seen["ref"] = weakref.ref(args[0])
    gm(*args)
    assert seen["alive"] is True
