"""find_layer_stacks + stamp_layers: a deep model traced three layers deep and stamped to full depth
gives the graph a full trace gives (compared as a content hash of every node), plans the same, and runs
the same; models whose layers are not interchangeable or do not chain simply are traced whole."""
import collections
import dataclasses
import hashlib

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Shard
from torch.utils._pytree import tree_leaves

import spmd
from tests.models import GPT, GPTConfig, Llama, LlamaConfig
from spmd.passes.check_stamping import check_stamping
from spmd.passes.find_layer_stacks import TRACED, LayerStack, find_layer_stacks, truncated
from spmd.passes.find_repeated_blocks import find_repeated_blocks
from spmd.passes.stamp_layers import CannotStamp, stamp_layers
from spmd.passes.trace_joint import WithLoss, trace_joint
from spmd.passes.trace_module import flat_outputs, trace_module
from spmd.runtime.distribute import local_shard
from spmd.runtime.simulate import simulate
from tests.support import check_simulated_training, compile_graph, mse_training_checked, spec


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def content(traced) -> tuple:
    """Every node as a hash of its op, shape and (recursively) inputs, placeholders by FQN: equal for
    two graphs that compute the same thing from the same parameters, whatever their node names."""
    labels, h = traced.labels(), {}
    for n in traced.graph.nodes:
        if n.op == "placeholder":
            h[n] = "input:" + labels[n.name]
        elif n.op != "output":
            args = [h[a] if isinstance(a, fx.Node) else repr(a) for a in tree_leaves((n.args, n.kwargs))]
            h[n] = hashlib.sha1(f"{n.target}|{traced.tensor_info.get(n.name)}|{args}".encode()).hexdigest()
    outputs = [h.get(a, repr(a)) for a in flat_outputs(traced.graph.output_node())]
    return collections.Counter(h.values()), outputs


def tiny_llama(layers):
    return Llama(LlamaConfig(layers=layers, vocab=128, dim=64, heads=4, kv_heads=2, ffn=128, seq=32))


@pytest.mark.parametrize("name, build, joint", [
    ("gpt", lambda: GPT(GPTConfig(layers=8)), True),
    ("gpt", lambda: GPT(GPTConfig(layers=8)), False),
    ("llama", lambda: tiny_llama(9), True),
])
def test_stamped_graph_is_the_full_trace(name, build, joint):
    torch.manual_seed(0)
    model = build()
    tokens = torch.randint(0, 128, (2, 32))
    trace = (lambda: trace_joint(model, (tokens, tokens), lm_loss)) if joint else (lambda: trace_module(model, (tokens,)))
    full = trace()
    stacks = find_layer_stacks(model)
    assert [s.fqn for s in stacks] == ["blocks" if name == "gpt" else "layers"]
    with truncated(model, stacks):
        short = trace()
    assert len(short.graph.nodes) < len(full.graph.nodes) / 2
    stamped = stamp_layers(short, stacks, model)
    assert content(stamped) == content(full)
    assert [i.name for i in stamped.inputs] == [i.name for i in full.inputs]
    assert stamped.outputs == full.outputs
    assert set(stamped.state) == set(full.state) and stamped.frozen == full.frozen
    assert len(list(model.get_submodule(stacks[0].fqn))) == stacks[0].depth  # restored after tracing
    # module paths follow the layer each copy stands for
    paths = {str(n.meta.get("nn_module_stack") or n.meta.get("fwd_nn_module_stack")) for n in stamped.graph.nodes}
    assert any(f"{stacks[0].fqn}.6" in p for p in paths)
    # the copies join their source's class unhashed, and the classes are the ones hashing finds
    copies = {k.rsplit("/", 1)[0].split(stacks[0].fqn + ".")[-1]: v.rsplit("/", 1)[0].split(".")[-1]
              for k, v in stamped.stamped.items()}
    assert copies == {str(i): str(TRACED - 2) for i in range(TRACED - 1, stacks[0].depth - 1)}
    hinted = find_repeated_blocks(stamped, 4)
    hashed = find_repeated_blocks(dataclasses.replace(stamped, stamped={}), 4)
    assert hinted.classes and (hinted.classes, hinted.representative) == (hashed.classes, hashed.representative)


def test_plan_with_stamping_equals_plan_without():
    torch.manual_seed(0)
    model, tokens = GPT(GPTConfig(layers=8)), torch.randint(0, 128, (4, 32))
    mesh = spec((2, 2), ("dp", "tp"))
    stamped = spmd.plan(model, mesh, (tokens, tokens), loss_fn=lm_loss)
    whole = spmd.plan(model, mesh, (tokens, tokens), loss_fn=lm_loss, stamp_layers=False)
    assert stamped.stats["stamped_layers"] == f"blocks: {TRACED} traced, 5 stamped"
    assert "stamped_layers" not in whole.stats
    assert stamped.objective == pytest.approx(whole.objective, rel=1e-9)
    assert stamped.collective_summary() == whole.collective_summary()
    by_label = lambda p: {p.labels[n]: s.outputs[0] for n, s in p.choices.items() if n in p.labels}  # noqa: E731
    assert by_label(stamped) == by_label(whole)


def test_stamped_training_graph_computes_the_model():
    """All four rank graphs of a stamped 8-layer GPT training step, stepped together: the loss and every
    gradient equal eager autograd on one device."""
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = GPT(GPTConfig(layers=8, dim=32, heads=4, vocab=64, seq=16))
        tokens = torch.randint(0, 64, (4, 16))
        inputs = (tokens, tokens)
        mesh = spec((2, 2), ("dp", "tp"))
        c = compile_graph(model, inputs, mesh, loss_fn=lm_loss, stamp_layers=True)
        assert c.plan.stats["stamped_layers"].startswith("blocks:")
        outs = simulate(c, inputs + (torch.tensor(1.0),))
        loss = lm_loss(model(tokens), tokens)
        loss.backward()
        assert check_simulated_training(c, outs, loss, model) == 1 + len(list(model.parameters()))
    finally:
        torch.set_default_dtype(torch.float32)


class Layer(nn.Module):
    def __init__(self, dim=16, scale=1.0):
        super().__init__()
        self.fc, self.scale = nn.Linear(dim, dim), scale

    def forward(self, x):
        return torch.relu(self.fc(x)) * self.scale


class Stack(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_layers_must_be_interchangeable():
    assert find_layer_stacks(Stack([Layer() for _ in range(8)])) == (LayerStack("layers", 8),)
    assert find_layer_stacks(Stack([Layer() for _ in range(7)])) == ()  # too shallow to pay
    # the model itself a list of layers: no parent to hold it cut (the plan's note said "KeyError: ''")
    assert find_layer_stacks(nn.Sequential(*[Layer() for _ in range(8)])) == ()
    # an attribute that differs: a stack, whose forward is watched for reads of it (see below)
    assert find_layer_stacks(Stack([Layer(scale=1.0 + (i == 5)) for i in range(8)])) == (
        LayerStack("layers", 8, (("", "scale"),)),)
    no_bias = Stack([Layer() for _ in range(8)])
    no_bias.layers[4].fc = nn.Linear(16, 16, bias=False)  # different parameters
    assert find_layer_stacks(no_bias) == ()
    hooked = Stack([Layer() for _ in range(8)])
    hooked.layers[3].register_forward_hook(lambda m, i, o: o * 2)
    assert find_layer_stacks(hooked) == ()
    shared = Stack([Layer() for _ in range(8)])
    shared.last = shared.layers[-1]  # the same module also used elsewhere
    assert find_layer_stacks(shared) == ()
    frozen = Stack([Layer() for _ in range(8)])
    frozen.layers[2].fc.weight.requires_grad_(False)
    assert find_layer_stacks(frozen) == ()


class IndexedByDepth(Stack):
    """Loops over a configured depth: the truncated model cannot run."""

    def __init__(self, n):
        super().__init__([Layer() for _ in range(n)])
        self.n = n

    def forward(self, x):
        for i in range(self.n):
            x = self.layers[i](x)
        return x


class SkipTwo(Stack):
    """Each layer also adds the activations of two layers back: outside nodes read the middle layer."""

    def forward(self, x):
        prev = x
        for layer in self.layers:
            x, prev = layer(x) + prev, x
        return x


@pytest.mark.parametrize("model_cls, reason", [(IndexedByDepth, "did not trace"), (SkipTwo, "reads")])
def test_models_that_do_not_stamp_are_traced_whole(model_cls, reason):
    torch.manual_seed(0)
    model = model_cls(8) if model_cls is IndexedByDepth else model_cls([Layer() for _ in range(8)])
    x = torch.randn(4, 16)
    c = compile_graph(model, (x,), spec((2,), ("dp",)))
    assert c.plan.stats["stamped_layers"].startswith("none:") and reason in c.plan.stats["stamped_layers"]
    assert sum(1 for i in c.traced.inputs if i.kind == "parameter") == 16  # every layer is in the graph
    outs = simulate(c, (x,))
    want = model(x)
    ps = c.plan.choices["output_0"].inputs[0]
    for rank, out in enumerate(outs):
        torch.testing.assert_close(out[0], local_shard(want.detach(), ps, (2,), (rank,)))


class TitanBlock(Layer):
    """torchtitan's way: a per-layer id and init scale the forward never reads."""

    def __init__(self, layer_id):
        super().__init__()
        self.layer_id, self.weight_init_std = layer_id, 0.02 / (2 * (layer_id + 1)) ** 0.5


class Layers(nn.ModuleDict):
    """A ModuleDict subclass keyed "0", "1", ... whose constructor takes a depth, not the layers."""

    def __init__(self, n):
        super().__init__({str(i): TitanBlock(i) for i in range(n)})


class Titan(nn.Module):
    def __init__(self, n=8):
        super().__init__()
        self.layers = Layers(n)

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x)
        return x


class ReadsItsIndex(TitanBlock):
    def forward(self, x):
        return super().forward(x) * (self.layer_id + 1)


@pytest.mark.parametrize("block, stamped", [(TitanBlock, True), (ReadsItsIndex, False)])
def test_layer_dicts_and_attributes_the_forward_does_not_read_stamp(block, stamped):
    torch.manual_seed(0)
    model = Titan()
    for i in range(8):
        model.layers[str(i)] = block(i)
    assert find_layer_stacks(model) == (LayerStack("layers", 8, (("", "layer_id"), ("", "weight_init_std"))),)
    x = torch.randn(4, 16)
    c = compile_graph(model, (x,), spec((2,), ("dp",)))
    note = c.plan.stats["stamped_layers"]
    assert note.startswith("layers: 3 traced, 5 stamped") if stamped else "layers.*.layer_id, which the forward reads" in note
    assert sum(1 for i in c.traced.inputs if i.kind == "parameter") == 16
    assert type(model.layers) is Layers and len(model.layers) == 8 and type(model.layers["0"]) is block  # restored
    outs, want = simulate(c, (x,)), model(x)
    ps = c.plan.choices["output_0"].inputs[0]
    for rank, out in enumerate(outs):
        torch.testing.assert_close(out[0], local_shard(want.detach(), ps, (2,), (rank,)))


def test_cannot_stamp_names_the_reason():
    model = SkipTwo([Layer() for _ in range(8)])
    x = torch.randn(4, 16)
    stacks = find_layer_stacks(model)
    with truncated(model, stacks):
        short = trace_module(model, (x,))
    with pytest.raises(CannotStamp, match="outside the stack"):
        stamp_layers(short, stacks, model)


def test_stamped_rank_program_matches_the_whole_trace():
    """Through every pass of a training compile for one rank (no process group needed to build it): the
    stamped and the whole traces give rank programs with the same ops and collectives."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=8, dim=32, heads=4, vocab=64, seq=16))
    tokens = torch.randint(0, 64, (4, 16))
    programs = []
    for stamp in (True, False):
        c = compile_graph(model, (tokens, tokens), spec((2, 2), ("dp", "tp")), 0, loss_fn=lm_loss,
                          stamp_layers=stamp)
        programs.append([collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
                         for gm in (c.split.forward, c.split.backward)])
    assert programs[0] == programs[1]


class ReadsDepth(Stack):
    """Forwards that act on their depth in ways a truncated trace cannot see: the parent normalizes
    after the layer whose index is the configured depth - 1, scales by 1 / len(layers), or hands each
    layer its index as an argument."""

    def __init__(self, how, n=8):
        super().__init__([Layer() for _ in range(n)])
        self.how, self.n, self.norm = how, n, nn.LayerNorm(16)

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x, i) if self.how == "index" else layer(x)
            if self.how == "last" and i == self.n - 1:
                x = self.norm(x)
        return x * (1 / len(self.layers)) if self.how == "scale" else x


class TakesIndex(Layer):
    def forward(self, x, i=0):
        return super().forward(x) * (i + 1)


@pytest.mark.parametrize("how, where", [("last", "outside the layers"), ("scale", "outside the layers"),
                                        ("index", "layer 2 of layers")])
def test_compile_traces_whole_a_forward_that_reads_its_depth(how, where):
    """spmd.compile stamps by default: check_stamping compares the forward at full depth with the cut
    one on fake tensors, op by op, and a difference sends it to the whole trace (a plan still stamps)."""
    torch.manual_seed(0)
    model = ReadsDepth(how)
    if how == "index":
        model.layers = nn.ModuleList(TakesIndex() for _ in range(8))
    x = torch.randn(4, 16)
    stacks = find_layer_stacks(model)
    assert len(stacks) == 1
    assert where in check_stamping(model, (x,), model, stacks)
    c = compile_graph(model, (x,), spec((2,), ("dp",)), 0)
    assert c.plan.stats["stamped_layers"].startswith("none:") and where in c.plan.stats["stamped_layers"]
    outs, want = simulate(c, (x,)), model(x)
    ps = c.plan.choices["output_0"].inputs[0]
    for rank, out in enumerate(outs):
        torch.testing.assert_close(out[0], local_shard(want.detach(), ps, (2,), (rank,)))
    planned = compile_graph(model, (x,), spec((2,), ("dp",))).plan.stats["stamped_layers"]
    assert planned.startswith("layers: 3") if how != "index" else "differ in the fwd graph" in planned


def test_compile_stamps_by_default_where_the_depth_is_not_read():
    torch.manual_seed(0)
    model, tokens = GPT(GPTConfig(layers=8, dim=32, heads=4, vocab=64, seq=16)), torch.randint(0, 64, (4, 16))
    assert check_stamping(WithLoss(model, lm_loss, 1), (tokens, tokens), model, find_layer_stacks(model)) is None
    c = compile_graph(model, (tokens, tokens), spec((2,), ("dp",)), 0, loss_fn=lm_loss)
    assert c.plan.stats["stamped_layers"] == "blocks: 3 traced, 5 stamped"
    assert "stamped_layers" not in compile_graph(model, (tokens, tokens), spec((2,), ("dp",)), 0, loss_fn=lm_loss,
                                                 stamp_layers=False).plan.stats


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x, g):
        return x + torch.tanh(self.fc(x)) * (torch.tensor(g) if isinstance(g, float) else g)


class HandsEachLayer(nn.Module):
    """A parent that hands layer i its own tensor, by Python alone: the same ops in every layer, on other
    values (found by a probe: every stamped layer got the middle layer's, 4.31 where eager gave 8.49)."""

    def __init__(self, how):
        super().__init__()
        self.how, self.layers = how, nn.ModuleList(Gated() for _ in range(8))
        self.gates = nn.ParameterList(nn.Parameter(torch.full((16,), 1.0 + 0.2 * i)) for i in range(8))
        self.rows = nn.Parameter(torch.randn(8, 16))
        for i in range(2):
            self.register_buffer(f"mask{i}", torch.full((16,), float(i + 1)))

    def forward(self, x, *extra):
        first, rows = None, self.rows.unbind() if self.how == "rows zipped" else None
        for i, layer in enumerate(self.layers):
            g = {"parameter list": lambda: self.gates[i], "buffer by i % 2": lambda: getattr(self, f"mask{i % 2}"),
                 "rows zipped": lambda: rows[i], "per-layer input": lambda: extra[i],
                 "layer 0's output": lambda: first if first is not None else x,
                 "torch.tensor(scale)": lambda: 1.0 + 0.1 * i}[self.how]()
            x = layer(x, g)
            first = x if first is None else first
        return x


@pytest.mark.parametrize("how", ["parameter list", "buffer by i % 2", "rows zipped", "per-layer input",
                                 "layer 0's output", "torch.tensor(scale)"])
def test_a_parent_handing_each_layer_its_own_tensor_is_traced_whole(how):
    torch.manual_seed(0)
    model, x = HandsEachLayer(how), torch.randn(4, 16)
    inputs = (x, *torch.randn(8, 16).unbind()) if how == "per-layer input" else (x,)
    stacks = find_layer_stacks(model)
    assert len(stacks) == 1
    assert "on other values" in check_stamping(model, inputs, model, stacks)
    c = compile_graph(model, inputs, spec((2,), ("dp",)), 0)
    assert c.plan.stats["stamped_layers"].startswith("none:")
    outs, want = simulate(c, inputs), model(*inputs)
    ps = c.plan.choices["output_0"].inputs[0]
    for rank, out in enumerate(outs):
        torch.testing.assert_close(out[0], local_shard(want.detach(), ps, (2,), (rank,)))


class _ScaleBackward(torch.autograd.Function):
    """The identity, whose backward scales the gradient by a number the forward is given."""

    @staticmethod
    def forward(ctx, x, s):
        ctx.s = s
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.s, None


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x, s=1.0):
        return x + torch.tanh(self.fc(_ScaleBackward.apply(x, s)))


_KEPT: list = []


class AutogradByIndex(nn.Module):
    """A parent that treats layer 5 otherwise for autograd alone: the same ops on the same values in its forward."""

    def __init__(self, how):
        super().__init__()
        self.how, self.layers = how, nn.ModuleList(Scaled() for _ in range(8))
        self.first = nn.Linear(16, 16)  # (so that the layers' input needs a gradient, as a reentrant checkpoint's must)

    def forward(self, x):
        x = self.first(x)
        for i, layer in enumerate(self.layers):
            if self.how == "no_grad" and i == 5:
                with torch.no_grad():
                    x = layer(x)
            elif self.how == "backward only":
                x = layer(x, 0.5 if i == 5 else 1.0)
            elif self.how == "checkpointed closures":  # (the same autograd in every layer: stamps)
                def run(*a, layer=layer):
                    return layer(*a)
                _KEPT.append(run)  # (each run's closures at their own addresses, as a model that keeps them)
                x = torch.utils.checkpoint.checkpoint(run, x, use_reentrant=True)
            else:
                x = layer(x)
                if self.how == "hook" and i == 5 and x.requires_grad:
                    x.register_hook(lambda g: g * 3)
        return x


@pytest.mark.parametrize("how", ["no_grad", "backward only", "hook"])
def test_a_layer_autograd_treats_otherwise_is_not_stamped_in_training(how):
    """Found by a probe: the stamping check compared the forward's ops alone, under no_grad, so a layer its parent
    ran under no_grad by its index (no gradients below it), a per-layer value only an autograd.Function's backward
    reads, or a hook on one layer's output, trained stamped with the middle layer's autograd: 0.24, 0.016 and 0.61
    off one device. In training the check runs with autograd on and compares it too."""
    torch.manual_seed(0)
    model, x, t = AutogradByIndex(how), torch.randn(4, 16), torch.randn(4, 16)
    stacks = find_layer_stacks(model)
    assert len(stacks) == 1
    assert check_stamping(WithLoss(model, F.mse_loss, 1), (x, t), model, stacks, joint=True) is not None
    for alike in ("none", "checkpointed closures"):  # (a closure made for each layer is compared by its name, not
        same = AutogradByIndex(alike)                 # its address: a review found layer 0 differ from itself)
        assert check_stamping(WithLoss(same, F.mse_loss, 1), (x, t), same, find_layer_stacks(same), joint=True) is None
    torch.set_default_dtype(torch.float64)
    try:
        model, x, t = model.double(), x.double(), t.double()
        c, checked = mse_training_checked(model, x, t, spec((2,), ("dp",)), 0)
        assert c.plan.stats["stamped_layers"].startswith("none:"), c.plan.stats["stamped_layers"]
        assert checked > 1
    finally:
        torch.set_default_dtype(torch.float32)


class Counts(Stack):
    """A forward that counts its calls in a buffer, in a plain attribute, and decays a buffer in place."""

    def __init__(self):
        super().__init__([Layer() for _ in range(8)])
        self.register_buffer("step", torch.tensor(0.0))
        self.register_buffer("decay", torch.ones(16))
        self.calls = 0

    def forward(self, x):
        self.step += 1
        self.decay.mul_(0.5)
        self.calls += 1
        return super().forward(x) * self.decay * torch.clamp(self.step / 4, max=1.0)


def test_the_stamping_check_leaves_the_model_as_it_was():
    """Its two runs of the forward write fake copies of the buffers, and the plain attributes are put back
    (a probe: the check's runs moved a warm-up counter by 2, the first loss 2.43 where eager gave 1.28)."""
    model = Counts()
    assert check_stamping(model, (torch.randn(4, 16),), model, find_layer_stacks(model)) is None
    assert model.step.item() == 0 and torch.equal(model.decay, torch.ones(16)) and model.calls == 0


class _Normalizes(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x, norm=False):
        h = F.gelu(self.up(x))
        return x + self.down(h.softmax(-1) if norm else h)


class _SixthNormalizes(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_Normalizes() for _ in range(8))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x, norm=(i == 5))
        return x


def test_the_export_of_a_plan_stamped_unchecked_checks_the_stamping_first():
    """spmd.plan stamps without the check (for speed); the DTensor export gives each layer the placements of the
    layer it was stamped from, so a parent telling layer 5 to take a softmax over its column-parallel hidden was
    exported column-parallel there (0.0239 off under parallelize_module; found by a probe)."""
    import warnings

    from tests.support import LATENCY_LINK

    torch.manual_seed(0)
    model, x = _SixthNormalizes(), torch.randn(8, 16)
    pins = {f"layers.{i}.up.weight": [Shard(0)] for i in range(8)} | {f"layers.{i}.down.weight": [Shard(1)]
                                                                      for i in range(8)}
    mesh = spec((2,), ("tp",), link=LATENCY_LINK)
    plan = spmd.plan(model, mesh, (x,), param_placements=pins)
    assert plan.stats["stamped_layers"] == "layers: 3 traced, 5 stamped"
    with pytest.raises(spmd.SpmdError, match=r"layer 5 of layers runs other ops.*plan again with stamp_layers=False"):
        plan.to_parallelize_plan()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        styles = spmd.plan(model, mesh, (x,), param_placements=pins, stamp_layers=False).to_parallelize_plan()
    assert "layers.5.up" in styles
