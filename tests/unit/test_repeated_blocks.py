"""find_repeated_blocks and the layer tying it enables: exact matches only, and a solve whose size does
not grow with depth."""
import torch

import spmd
from tests.models import GPT, GPTConfig, Llama, LlamaConfig
from spmd.passes.find_repeated_blocks import find_repeated_blocks
from spmd.passes.trace_module import trace_module
from tests.support import LATENCY_LINK, SLOW_DEVICE, compile_graph, lm_loss

MESH = spmd.MeshSpec((2, 2), ("dp", "tp"), (LATENCY_LINK, LATENCY_LINK), SLOW_DEVICE)


def _tokens(batch=4, seq=32, vocab=128):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))


def test_identical_layers_map_to_the_first_and_parameters_follow():
    traced = trace_module(GPT(GPTConfig(layers=3)), (_tokens(),))
    blocks = find_repeated_blocks(traced)
    assert len(blocks.classes) == 1 and blocks.classes[0] == ["blocks.0/fwd", "blocks.1/fwd", "blocks.2/fwd"]
    by_fqn = {i.name: i.placeholder for i in traced.inputs}
    assert blocks.rep(by_fqn["blocks.2.mlp.fc1.weight"]) == by_fqn["blocks.0.mlp.fc1.weight"]
    assert blocks.rep(by_fqn["tok_emb.weight"]) is None
    nodes = {n.name: n for n in traced.graph.nodes}
    for name, rep in blocks.representative.items():  # same op, same shape, every time
        if name in nodes and nodes[name].op == "call_function":
            assert nodes[name].target == nodes[rep].target
            assert traced.tensor_info[name] == traced.tensor_info[rep]


def test_different_layers_do_not_match():
    """A model whose layers differ in width has no repeated blocks (the hash alone would not decide)."""

    class Uneven(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(16, 16), torch.nn.Linear(16, 32)])

        def forward(self, x):
            for layer in self.layers:
                x = torch.relu(layer(x))
            return x

    blocks = find_repeated_blocks(trace_module(Uneven(), (torch.randn(4, 16),)))
    assert blocks.classes == [] and blocks.representative == {}


def test_tied_training_solve_does_not_grow_with_depth():
    sizes, objectives = {}, {}
    for layers in (2, 4):
        cfg = LlamaConfig(layers=layers)
        with torch.device("meta"):
            model = Llama(cfg)
            tokens = torch.randint(0, cfg.vocab, (4, cfg.seq))
        plan = spmd.plan(model, MESH, (tokens, tokens), loss_fn=lm_loss, tie_blocks=True)
        sizes[layers] = (plan.stats["binary"], plan.stats["continuous"])
        objectives[layers] = plan.objective
    assert sizes[2] == sizes[4], sizes
    assert objectives[4] > objectives[2]


def test_tying_costs_little_against_the_untied_optimum():
    cfg = GPTConfig(layers=3)
    torch.manual_seed(0)
    model, tokens = GPT(cfg), _tokens()
    tied = spmd.plan(model, MESH, (tokens,), tie_blocks=True)
    free = spmd.plan(model, MESH, (tokens,), tie_blocks=False)
    assert free.objective <= tied.objective * (1 + 1e-9)  # tying only restricts
    assert tied.objective <= free.objective * 1.05
    assert tied.stats["binary"] < free.stats["binary"]


def test_merged_followers_shrink_the_solve_and_stay_correct():
    """merge_followers (an approximation for large graphs) forced on a small one: fewer variables, a
    plan no cheaper than the exact one, and rank graphs that still compute the single-device model."""
    from spmd.runtime.distribute import local_shard
    from spmd.runtime.simulate import simulate

    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model, tokens = Llama(LlamaConfig(layers=2)), _tokens(batch=2)
        exact = compile_graph(model, (tokens,), MESH, merge_followers=False)
        merged = compile_graph(model, (tokens,), MESH, merge_followers=True)
        assert merged.plan.stats["merged_followers"] > 0
        assert merged.plan.stats["binary"] < exact.plan.stats["binary"]
        assert merged.plan.objective >= exact.plan.objective * (1 - 1e-9)
        want = model(tokens)
        ps = merged.plan.choices["output_0"].inputs[0]
        for rank, out in enumerate(simulate(merged, (tokens,))):
            torch.testing.assert_close(out[0], local_shard(want.detach(), ps, MESH.shape, MESH.coordinate(rank)))
    finally:
        torch.set_default_dtype(torch.float32)


class _Gated(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q = torch.nn.Parameter(torch.randn(8))

    def forward(self, x):
        return x + x * self.q


class _Stack(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Gated() for _ in range(n)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_layers_pinned_otherwise_than_each_other_tie_apart():
    """Found by a probe: 9 identical layers, `layers.1.q` pinned replicated and `layers.2.q` sharded, tied into
    one class whose shared choice no placement could meet: the training solve said "Infeasible" and advised
    pinning more. Each set of pins now ties apart, and every pin holds in the plan."""
    from torch.distributed.tensor import Replicate, Shard

    from spmd.runtime.simulate import simulate
    from tests.support import check_simulated_training, spec

    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model, x, t = _Stack(9), torch.randn(4, 8, 8), torch.randn(4, 8, 8)
        loss_fn = lambda out, target: ((out - target) ** 2).mean()  # noqa: E731
        pins = {"layers.1.q": [Replicate()], "layers.2.q": [Shard(0)]}
        c = compile_graph(model, (x, t), spec((4,), ("tp",)), loss_fn=loss_fn, param_placements=pins)
        classes = [[key.split("/")[0] for key in members] for members in c.blocks.classes]
        assert not any("layers.1" in members and "layers.2" in members for members in classes), classes
        assert any(len(members) == 7 for members in classes), classes  # (the seven unpinned layers tie)
        by_fqn = {i.name: i.placeholder for i in c.traced.inputs}
        for fqn, want in pins.items():
            assert list(c.plan.choices[by_fqn[fqn]].outputs[0]) == want
        outs = simulate(c, (x, t, torch.tensor(1.0)))  # (the loss's tangent last)
        loss = loss_fn(model(x), t)
        loss.backward()
        assert check_simulated_training(c, outs, loss, model) == 1 + 9
    finally:
        torch.set_default_dtype(torch.float32)


class _TiedLayer(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = torch.nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class _OneWeightOverEveryLayer(torch.nn.Module):
    def __init__(self, n=8, d=8):
        super().__init__()
        self.layers = torch.nn.ModuleList(_TiedLayer(d) for _ in range(n))
        for layer in self.layers[1:]:
            layer.fc.weight = self.layers[0].fc.weight

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_one_weight_tied_over_three_or_more_layers_trains_equal_to_one_device():
    """Found by a probe: a weight tied over 3 or more layers (ALBERT-like) failed to compile for training with a
    KeyError from enumerate_strategies (a repeated block's representative came after its copy in the graph)."""
    from tests.support import mse_training_checked, spec

    torch.set_default_dtype(torch.float64)
    try:
        for n in (3, 8):
            torch.manual_seed(0)
            model, x, t = _OneWeightOverEveryLayer(n), torch.randn(4, 8), torch.randn(4, 8)
            assert mse_training_checked(model, x, t, spec((2,), ("dp",)))[1] > 1
    finally:
        torch.set_default_dtype(torch.float32)
