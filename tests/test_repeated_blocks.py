"""find_repeated_blocks and the layer tying it enables: exact matches only, and a solve whose size does
not grow with depth."""
import torch

import spmd
from examples.models import GPT, GPTConfig, Llama, LlamaConfig
from spmd.passes.find_repeated_blocks import find_repeated_blocks
from spmd.passes.trace_module import trace_module
from tests.cases import SLOW_DEVICE, LATENCY_LINK
from tests.training_cases import lm_loss

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
