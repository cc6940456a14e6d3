"""The messages users read when something cannot be done, one row per case: what they did, and the words
the message must hold (what is wrong, where, and the way out). Rows that need a live mesh run in a
one-rank gloo world inside this process (no process is started). Rank disagreement, dying ranks and
timeouts need several processes: tests/e2e/test_errors.py and test_reliability.py."""
from __future__ import annotations

import copy
import datetime
import json
import re
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

import spmd
from spmd.tools import cli
from tests.models import GPT, MLP, GPTConfig
from tests.support import spec

TP = spec((2,), ("tp",))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A one-rank gloo world in this process, and its mesh."""
    if not dist.is_initialized():
        path = tmp_path_factory.mktemp("pg") / "store"
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60))
    import os

    os.environ.setdefault("RANK", "0")
    yield spmd.init_mesh((1,), ("dp",))
    dist.destroy_process_group()


class _Item(nn.Module):
    def forward(self, x):
        return x * 2 if x.sum().item() > 0 else x  # (`.item()` as a value works: the rank graphs compute it)


class _Sampler(nn.Module):
    def forward(self, x):
        # (its validate_args reads the values: found by a probe)
        return torch.distributions.Normal(x, 0.1).rsample()


def _validating(plan):
    """`plan()` with torch.distributions validating arguments, as by default (torch turns it off for good once
    dynamo has run in the process: a flex_attention call does)."""
    before = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(True)
    try:
        return plan()
    finally:
        torch.distributions.Distribution.set_default_validate_args(before)


class _Branch(nn.Module):
    def forward(self, x):
        return x * 2 if x.sum() > 0 else x


class _TorchReadsValues(nn.Module):
    """torch's own code reads values on the way: torch.cov checks its weights with `aten.equal`, torch.combinations
    picks its pairs with a mask."""

    def __init__(self, op):
        super().__init__()
        self.op = op

    def forward(self, x):
        return torch.cov(x.t()) if self.op == "cov" else torch.combinations(x[0], 2)


class _Degrees(nn.Module):
    """A graph network's mean over each node's edges, its degrees counted by bincount."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x, dst):
        return self.fc(x) / torch.bincount(dst, minlength=4).clamp(min=1).sum()


class _NonZero(nn.Module):
    def forward(self, x):
        return torch.nonzero(x > 0)


class _BackwardItem(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float(g.abs().max())  # a value in backward: the joint graph cannot hold it


class _WithBadFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return _BackwardItem.apply(self.fc(x))


class _TensorAttribute(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.scale = nn.Linear(8, 8), torch.ones(8)  # a plain attribute, not a buffer

    def forward(self, x):
        return self.fc(x) * self.scale


class _TensorsInADict(nn.Module):
    """peft's prompt tuning: `prompt_tokens = {"default": torch.arange(n)}`, a plain dict of tensors."""

    def __init__(self):
        super().__init__()
        self.fc, self.scales = nn.Linear(8, 8), {"default": torch.ones(8)}

    def forward(self, x):
        return self.fc(x) * self.scales["default"]


class _Energy(nn.Module):
    """A force field: forces as the gradient of an energy, taken inside the forward."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 1)

    def forward(self, pos):
        with torch.enable_grad():
            pos = pos.detach().requires_grad_(True)
            e = self.fc2(torch.tanh(self.fc1(pos))).sum()
            (g,) = torch.autograd.grad(e, pos, create_graph=self.training)  # (True in train mode: traced)
        return e, -g


class _Looped(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        from torch._higher_order_ops.while_loop import while_loop

        _, z = while_loop(lambda i, z: i < 3, lambda i, z: (i + 1, torch.tanh(z * 1.5)), (torch.tensor(0), self.fc(x)))
        return z


class _Scanned(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        from torch._higher_order_ops.scan import scan

        _, ys = scan(lambda c, x: (c + x, torch.tanh(c + x)), self.fc(x)[0], self.fc(x))
        return ys


class _ChangesASavedBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.register_buffer("avg", torch.zeros(16))

    def forward(self, x):
        h = self.fc(x)
        out = h * self.avg
        self.avg.mul_(0.9).add_(0.1 * h.detach().mean(0))
        return x + out


class _Jacobian(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 4)

    def forward(self, x):
        return torch.func.vmap(torch.func.jacrev(lambda xi: torch.tanh(self.fc(xi))))(x).flatten(1)


class _OwnError(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.config = nn.Linear(16, 16), object()

    def forward(self, x):
        return self.fc(x) * self.config.scale


class _Searchsorted(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("edges", torch.linspace(-2, 2, 8))
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return self.fc(x) + torch.searchsorted(self.edges, x.contiguous())


def _ctc(out, labels):
    """CTC's loss: torch's tracing has no rule for its output's shape."""
    lengths = torch.full((out.shape[1],), out.shape[0], dtype=torch.long)
    return F.ctc_loss(out.log_softmax(-1), labels, lengths, torch.full_like(lengths, labels.shape[1]))


class _Tempered(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.temperature = nn.Linear(16, 16), nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return self.fc(x) / self.temperature


class _SubMLP(MLP):  # (its forward is MLP's: torch names MLP.forward)
    pass


class _Scripted(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.jit.script(MLP(16, 64))

    def forward(self, x):
        return self.body(x)


def _plan(model, inputs, **kw):
    return spmd.plan(model, TP, inputs, **kw)


def _eager_experts():
    import transformers

    cfg = transformers.MixtralConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                                     num_key_value_heads=1, vocab_size=32, num_local_experts=4, use_cache=False,
                                     experts_implementation="eager")
    ids = torch.randint(0, 32, (2, 8))
    return transformers.MixtralForCausalLM(cfg), (), {"example_kwargs": dict(input_ids=ids, labels=ids),
                                                      "training": True}


def _layerdrop():
    import transformers

    cfg = transformers.BartConfig(vocab_size=32, d_model=16, encoder_layers=2, decoder_layers=1,
                                  encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                  decoder_ffn_dim=32, dropout=0.0,
                                  attention_dropout=0.0, encoder_layerdrop=0.5, max_position_embeddings=16,
                                  use_cache=False)
    ids = torch.randint(3, 32, (2, 8))
    return transformers.BartForConditionalGeneration(cfg).train(), (), {
        "example_kwargs": dict(input_ids=ids, labels=ids), "training": True}


x16 = torch.randn(4, 16)
tokens = torch.randint(0, 128, (2, 16))

# (id, what the user does, the words the message must hold)
ROWS = [
    ("mesh-bigger-than-world", lambda w: spmd.init_mesh((2, 2), ("dp", "tp")),
     [r"mesh \(2, 2\) needs 4 processes but the world has 1", r"--nproc-per-node 4"]),
    ("mesh-duplicate-axis", lambda w: spmd.MeshSpec((2, 2), ("dp", "dp")), [r"axis names must be unique"]),
    ("mesh-zero-size", lambda w: spmd.MeshSpec((0, 2), ("dp", "tp")), [r"shape must be positive ints"]),
    ("mesh-negative-size", lambda w: spmd.MeshSpec((-2,), ("dp",)), [r"shape must be positive ints"]),
    ("pin-uneven", lambda w: _plan(MLP(16, 64), (torch.randn(3, 16),), in_placements={"x": [Shard(0)]}),
     [r"pin \[S\(0\)\] for input 'x' cannot be met", r"dim 0 \(3\) does not divide into 2 pieces", r"What to do"]),
    ("pin-misspelled-input", lambda w: _plan(GPT(GPTConfig()), (tokens,), in_placements={"tokns": [Shard(0)]}),
     [r"names 'tokns'", r"Did you mean 'tokens'", r"Known names \(inputs first\): tokens, tok_emb.weight"]),
    ("pin-misspelled-parameter", lambda w: _plan(MLP(16, 64), (x16,), param_placements={"fc2.wieght": [Shard(0)]}),
     [r"names 'fc2.wieght'", r"Did you mean 'fc2.weight'"]),
    ("pin-wrong-length", lambda w: _plan(MLP(16, 64), (x16,), param_placements={"fc1.weight": [Shard(0), Replicate()]}),
     [r"has 2 placements but the mesh \(tp=2\) has 1 axes", r"one placement per mesh axis"]),
    ("pin-shard-out-of-range", lambda w: _plan(MLP(16, 64), (x16,), param_placements={"fc1.weight": [Shard(5)]}),
     [r"is S\(5\) on axis tp, but it is a 2-D tensor", r"shard a dim in 0..1"]),
    ("pin-shard-a-scalar", lambda w: _plan(_Tempered(), (x16,), param_placements={"temperature": [Shard(0)]}),
     [r"is S\(0\) on axis tp, but it is a 0-D tensor of shape \(\)\. What to do: pin it Replicate\(\)"]),
    ("pin-partial-input", lambda w: _plan(MLP(16, 64), (x16,), in_placements={"x": [Partial()]}),
     [r"is Partial on axis tp: an input or parameter is a whole tensor", r"pin Shard\(d\) or Replicate\(\)"]),
    ("pin-bare-placement", lambda w: _plan(MLP(16, 64), (x16,), in_placements={"x": Shard(0)}),
     [r"is a single placement Shard\(0\)", r"write a list, e\.g\. \[Shard\(0\)\]"]),
    ("pin-text", lambda w: _plan(MLP(16, 64), (x16,), in_placements={"x": ["S(0)"]}),
     [r"holds the text 'S\(0\)'", r"Shard\(0\) there"]),
    ("pin-unknown-output", lambda w: _plan(MLP(16, 64), (x16,), out_placements={3: [Replicate()]}),
     [r"out_placements names output 3", r"numbered \[0\]"]),
    # (found by a probe: a raw TypeError in training, advice on control flow for inference)
    ("trace-script-module", lambda w: _plan(_Scripted(), (x16,), loss_fn=F.mse_loss),
     [r"`body` is a TorchScript module \(torch.jit.script or torch.jit.trace of a module\)",
      r"compile the model with the eager module it was made from"]),
    # (found by a probe: torch's raw "Attempted to use an uninitialized parameter", after a hook warning)
    ("trace-lazy-module", lambda w: _plan(nn.Sequential(nn.LazyLinear(8)), (x16,)),
     [r"0 \(LazyLinear\): a lazy module whose parameters have no shape yet", r"call the model once on an example batch"]),
    ("trace-data-dependent-branch", lambda w: _plan(_Branch(), (x16,)),
     [r"torch.export could not trace _Branch", r"data-dependent", r"What to do: `[^`]*test_error_table.py:\d+: "
      r"return x \* 2 if x.sum\(\) > 0 else x` reads a tensor's values in Python", r"torch\.where", r"loss_fn",
      r"^[^\n]*\(Caused by: [^\n]*\)\nWhat to do: [^\n]*\n\ntorch's whole message:\n"]),  # (the gist, then ours)
    # (found by a probe: Mixtral's `eager` experts were told to write torch.where)
    ("trace-eager-experts", lambda w: (lambda m, i, kw: _plan(m, i, **kw))(*_eager_experts()),
     [r"What to do: MixtralExperts runs transformers' `eager` experts", r"experts_implementation=\"grouped_mm\""]),
    # (found by a probe: told to remove data-dependent control flow, and no line)
    ("trace-torch-reads-values", lambda w: _plan(_TorchReadsValues("cov"), (x16,)),
     [r"What to do: `[^`]*test_error_table.py:\d+: return torch.cov\(x.t\(\)\) if [^`]*` runs torch code "
      r"that calls aten.equal.default, which gives a Python value", r"xc @ xc.T"]),
    ("trace-torch-makes-a-shape", lambda w: _plan(_TorchReadsValues("combinations"), (x16,)),
     [r"What to do: `[^`]*test_error_table.py:\d+: [^`]*` runs torch code that makes a shape from its inputs' values",
      r"torch.triu_indices\(n, n, 1\)"]),
    # (found by a probe: BART's and Wav2Vec2's LayerDrop were told to write torch.where)
    ("trace-layerdrop", lambda w: (lambda m, i, kw: _plan(m, i, **kw))(*_layerdrop()),
     [r"What to do: BartForConditionalGeneration drops whole layers at random in training \(LayerDrop: its config's "
      r"`encoder_layerdrop=0.5`\)", r"modeling_bart.py:\d+: if dropout_probability < self.layerdrop",
      r"Build the model with `encoder_layerdrop=0`"]),
    # (found by a probe: a forward given too few example inputs was told to remove data-dependent control flow)
    ("trace-missing-argument", lambda w: _plan(MLP(16, 64), (x16,), loss_fn=F.mse_loss),
     [r"could not trace the forward\+backward graph of MLP", r"the example inputs do not match MLP.forward's "
      r"arguments \(missing 1 required positional argument: 'x'\)", r"example_kwargs"]),
    ("trace-missing-argument-inherited", lambda w: _plan(_SubMLP(16, 64), (x16,), loss_fn=F.mse_loss),
     [r"the example inputs do not match _SubMLP.forward's arguments \(missing 1 required positional argument"]),
    ("trace-inputs-as-a-list", lambda w: _plan(MLP(16, 64), [x16]),
     [r"a list or tuple reached an op that takes a tensor. If the example inputs were given as a list: spmd.compile "
      r"takes the positional example inputs as a tuple, `\(x,\)`"]),
    ("trace-extra-argument", lambda w: _plan(MLP(16, 64), (x16, x16)),
     [r"the example inputs do not match MLP.forward's arguments \(too many positional arguments\)"]),
    ("trace-item", lambda w: _plan(_Item(), (x16,)),
     [r"torch.export could not trace _Item", r"reads a tensor's values in Python"]),
    ("trace-distribution-validates", lambda w: _validating(lambda: _plan(_Sampler(), (x16,))),
     [r"test_error_table.py:\d+: return torch.distributions.Normal\(x, 0.1\).rsample\(\)` builds a torch.distributions",
      r"Pass `validate_args=False` to it"]),
    ("trace-item-in-loss", lambda w: _plan(MLP(16, 64), (x16, x16), loss_fn=lambda out, y: F.mse_loss(
        out, y, reduction="sum") / max(1, (y > 0).sum().item())),
     [r"could not trace the forward\+backward graph of MLP", r"What to do: `[^`]*test_error_table.py:\d+: ",
      r"takes a Python number from a tensor's values \(`.item\(\)`", r"\.clamp\(min=1\)"]),
    ("trace-bincount-inference", lambda w: _plan(_Degrees(), (x16, torch.randint(0, 4, (8,)))),
     [r"node 'bincount' \(aten.bincount.default\)", r"index_add_\(0, idx, torch.ones\(len\(idx\)\)\)"]),
    ("trace-nonzero", lambda w: _plan(_NonZero(), (x16,)),
     [r"node 'nonzero' \(aten.nonzero.default\)", r"depends on the data", r"torch.where"]),
    ("trace-op-without-a-shape-rule", lambda w: _plan(nn.Linear(16, 8), (torch.randn(6, 2, 16), torch.randint(1, 8, (2, 3))),
                                                      loss_fn=_ctc),
     [r"What to do: aten._ctc_loss.Tensor's output shape depends on its input values", r"training=True` and no `loss_fn`"]),
    # (found by a probe: a graph network's degrees by bincount were told of CTC losses alone)
    ("trace-bincount", lambda w: _plan(_Degrees(), (x16, torch.randint(0, 4, (8,))), loss_fn=lambda out: out.sum()),
     [r"What to do: aten.bincount.default's output shape depends on its input values \([^)]*test_error_table.py:\d+",
      r"index_add_\(0, idx, torch.ones\(len\(idx\)\)\)"]),
    ("custom-function-backward-reads-a-value", lambda w: _plan(_WithBadFunction(), (torch.randn(4, 8),) * 2,
                                                               loss_fn=F.mse_loss),
     [r"trace_joint: could not trace the forward\+backward graph of _WithBadFunction: aten._local_scalar_dense"]),
    ("training-tensor-attribute", lambda w: _plan(_TensorAttribute(), (torch.randn(4, 8),) * 2, loss_fn=F.mse_loss),
     [r"trace_joint: could not trace the forward\+backward graph of _TensorAttribute",
      r"What to do: register `scale` as a buffer \(`self.register_buffer\(name, tensor, persistent=False\)`\)"]),
    # (found by a probe: peft's prompt tuning was told to avoid data-dependent control flow, naming nothing)
    ("training-tensor-in-a-dict-attribute", lambda w: _plan(_TensorsInADict(), (torch.randn(4, 8),) * 2,
                                                            loss_fn=F.mse_loss),
     [r"What to do: register `scales\['default'\]` as a buffer"]),
    # (found by a probe: it compiled, fake matmuls not checking dtypes, then failed at the first call in torch)
    ("example-inputs-in-another-dtype", lambda w: _plan(MLP(16, 64), (x16.double(),)),
     [r"check_dtypes: node 'addmm' \(aten.addmm.default\) at .*multiplies tensors of different dtypes "
      r"\(.*torch.float32.*torch.float64", r"What to do: give example inputs in the dtype the model computes in"]),
    ("budget-impossible", lambda w: _plan(MLP(16, 64), (x16, x16), loss_fn=F.mse_loss, memory_budget=100),
     [r"no plan fits memory_budget=100 B per rank \(even sharding every tensor as far as the mesh allows needs "
      r"about \d+\.\d KiB\)", r"raise the budget"]),
    ("option-misspelled", lambda w: _plan(MLP(16, 64), (x16,), memory_budgt=1e9),
     [r"unknown option 'memory_budgt' \(did you mean 'memory_budget'\?\)"]),
    ("loss-without-training", lambda w: _plan(MLP(16, 64), (x16, x16), loss_fn=F.mse_loss, training=False),
     [r"a loss_fn only makes sense with training=True"]),
    ("compile-mesh-spec-mismatch", lambda w: spmd.compile(MLP(16, 64), w, (x16,), mesh_spec=TP),
     [r"mesh_spec \(tp=2\) does not match the mesh shape \(1,\)\. What to do: describe the mesh"]),
    # (found by a probe: the plan and the errors named the axes by the spec's names, the links taken by position)
    ("compile-mesh-spec-names-the-axes-otherwise", lambda w: spmd.compile(MLP(16, 64), w, (x16,),
                                                                          mesh_spec=spec((1,), ("tp",))),
     [r"mesh_spec names its axes \('tp',\), and the mesh \('dp',\).*What to do: name the spec's axes as the mesh's"]),
    # (found by a probe: "'NoneType' object has no attribute 'ignore_fresh_unbacked_symbols'")
    ("training-while-loop", lambda w: _plan(_Looped(), (torch.randn(4, 8),), training=True),
     [r"runs torch.while_loop, whose backward torch's tracing cannot put into a training graph.*Unroll the loop"]),
    ("training-scan", lambda w: _plan(_Scanned(), (torch.randn(4, 8),), training=True),
     [r"runs torch's `scan`, whose backward torch's tracing cannot put into a training graph.*`associative_scan`"]),
    # (found by a probe: told to make the forward traceable by torch.export)
    ("training-saved-tensor-changed-in-place", lambda w: _plan(_ChangesASavedBuffer(), (x16, torch.randn(4, 16)),
                                                               loss_fn=F.mse_loss),
     [r"modified by an inplace operation", r"What to do: the forward changes in place a tensor autograd saved for "
      r"backward.*eager PyTorch refuses too"]),
    # (found by a probe: a model's own AttributeError, told of torch.export's control flow)
    ("trace-the-models-own-error", lambda w: _plan(_OwnError(), (x16,)),
     [r"What to do: `[^`]*test_error_table.py:\d+: return self.fc\(x\) \* self.config.scale` raised it, in the "
      r"model's own code", r"run the model eagerly on the same example inputs"]),
    # (found by a probe: told of data-dependent control flow)
    ("inference-torch-func-transform", lambda w: _plan(_Jacobian(), (torch.randn(8, 2),)),
     [r"What to do: `[^`]*test_error_table.py:\d+: [^`]*jacrev[^`]*` runs a torch.func transform over the model's "
      r"weights.*compile with `training=True`"]),
    # (found by a probe: torch.export's "fake tensor in the exported program constant's list ... file an issue")
    ("inference-gradient-inside-the-forward", lambda w: _plan(_Energy().eval(), (torch.randn(4, 8),)),
     [r"torch.autograd.grad\(e, pos, .*differentiates inside the forward.*compile with `training=True` and take "
      r"the gradient with `create_graph=True`"]),
    ("training-gradient-inside-the-forward-without-its-graph",
     lambda w: _plan(_Energy().eval(), (torch.randn(4, 8),), training=True),
     [r"differentiates inside the forward.*`create_graph=True`"]),
    # (found by a probe: torch's "'FakeTensor' object has no attribute 'wait'" and a way out that did not apply)
    ("compile-a-model-holding-a-compiled-module",
     lambda w: spmd.compile(nn.Sequential(spmd.compile(MLP(16, 64), w, (x16,)), nn.ReLU()), w, (x16,)),
     [r"compile: Sequential holds a module spmd.compile already compiled \(0\).*What to do: compile the whole "
      r"model from its original modules"]),
]


def _first_error(fn, w) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            fn(w)
        except (spmd.SpmdError, ValueError) as e:
            return f"{type(e).__name__}: {e}"
    raise AssertionError("no error")


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_message(world, row):
    _, fn, words = row
    text = _first_error(fn, world)
    for w in words:
        assert re.search(w, text), f"{w!r} not in:\n{text}"


# ---- rows about files and the command line ------------------------------------------------------

def test_plan_files_that_cannot_be_read(tmp_path):
    (tmp_path / "cut.json").write_text('{"schema": "spmd-plan", "version": 1, "choi')
    with pytest.raises(ValueError, match=r"cut.json: not a plan file \(not JSON"):
        spmd.load_plan(tmp_path / "cut.json")
    (tmp_path / "profile.json").write_text(json.dumps({"schema": "spmd-profile", "version": 1}))
    with pytest.raises(ValueError, match=r"profile.json: not an spmd plan file \(schema 'spmd-profile'\)"):
        spmd.load_plan(tmp_path / "profile.json")
    (tmp_path / "future.json").write_text(json.dumps({"schema": "spmd-plan", "version": 99}))
    with pytest.raises(ValueError, match=r"plan file version 99, this spmd reads versions 1, 2\..*re-plan"):
        spmd.load_plan(tmp_path / "future.json")


def test_the_command_line_on_a_missing_file_and_a_module_without_a_builder(tmp_path, capsys):
    assert cli.main(["plan", str(tmp_path / "nowhere.py") + ":build", "--mesh", "dp=2"]) == 2
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "model.py").write_text("import torch\nmodel = torch.nn.Linear(4, 4)\n")
    assert cli.main(["plan", f"{tmp_path / 'model.py'}:build", "--mesh", "dp=2"]) == 2
    assert "has no function 'build'" in capsys.readouterr().err
    assert cli.main(["explain", str(tmp_path / "nowhere.json")]) == 2
    assert "nowhere.json" in capsys.readouterr().err


# ---- rows at run time, on a compiled module ------------------------------------------------------

def _training(w):
    torch.manual_seed(0)
    model = MLP(16, 64)
    compiled = spmd.compile(model, w, (x16, x16), loss_fn=F.mse_loss)
    return model, compiled


def test_an_op_without_a_rule_runs_replicated_with_one_warning_and_equal(world):
    torch.manual_seed(0)
    model, x = _Searchsorted(), torch.randn(4, 16)
    with pytest.warns(spmd.UnknownOpWarning) as caught:
        compiled = spmd.compile(model, world, (x,))
    messages = [str(w.message) for w in caught if issubclass(w.category, spmd.UnknownOpWarning)]
    assert len(messages) == 1 and "aten.searchsorted.Tensor" in messages[0] and "runs replicated" in messages[0]
    assert "@rule(torch.ops.aten.searchsorted.Tensor)" in messages[0] and "register_sharding" in messages[0]
    assert "test_error_table.py" in messages[0]
    with torch.no_grad():
        torch.testing.assert_close(compiled.gather_outputs(compiled(*compiled.shard_inputs(x))), model(x))


@pytest.mark.parametrize("op", ["sort", "rfft", "qr"])
def test_ops_with_dtensor_rules_run_without_a_warning_and_equal(world, op):
    """torch.sort, torch.fft.rfft and torch.linalg.qr have DTensor rules in torch 2.13: no warning."""
    fns = {"sort": lambda h: torch.sort(h, -1)[0], "rfft": lambda h: torch.fft.rfft(h).abs(),
           "qr": lambda h: torch.linalg.qr(h.reshape(4, 4, 4))[1]}

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            return fns[op](self.fc(x))

    torch.manual_seed(0)
    model = M()
    with warnings.catch_warnings():
        warnings.simplefilter("error", spmd.UnknownOpWarning)
        compiled = spmd.compile(model, world, (x16,))
    with torch.no_grad():
        torch.testing.assert_close(compiled.gather_outputs(compiled(*compiled.shard_inputs(x16))), model(x16))


def test_backward_twice(world):
    _, compiled = _training(world)
    loss = compiled(*compiled.shard_inputs(x16, x16))
    loss.backward()
    with pytest.raises(RuntimeError, match=r"Trying to backward through the graph a second time"):
        loss.backward()


class _AuxHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head, self.aux = nn.Linear(16, 32), nn.Linear(32, 4), nn.Linear(32, 3)

    def forward(self, x):
        f = torch.tanh(self.body(x))
        return self.head(f), self.aux(f.detach())  # (an auxiliary head on frozen features: a graph apart)


def test_a_backward_from_each_output_of_one_call(world):
    """Found by a probe: eager backwards from each output where their graphs are apart; the compiled call's outputs
    share one backward, and the second got torch's "through the graph a second time", which the user's code never
    did. The message says why and gives the two ways out; the second, retain_graph, gives eager's gradients."""
    from tests.support import one_device

    torch.manual_seed(0)
    model = _AuxHead()
    reference = copy.deepcopy(model)
    compiled = one_device(model, (x16,), training=True)
    main, aux = compiled(x16)
    main.square().sum().backward()
    with pytest.raises(spmd.SpmdError, match=r"(?s)second backward.*add the losses and call backward once.*"
                                             r"retain_graph=True to the first backward"):
        aux.square().sum().backward()
    compiled.zero_grad()
    main, aux = compiled(x16)
    main.square().sum().backward(retain_graph=True)
    aux.square().sum().backward()
    main, aux = reference(x16)
    main.square().sum().backward()
    aux.square().sum().backward()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(compiled.get_parameter(name).grad, p.grad)
    loss = compiled(x16)[0].sum()  # (one output's loss backwarded twice: the user's own, eager's words; a review)
    loss.backward()
    with pytest.raises(RuntimeError, match=r"Trying to backward through the graph a second time") as caught:
        loss.backward()
    assert not isinstance(caught.value, spmd.SpmdError)


def test_an_optimizer_over_the_original_parameters(world):
    model, compiled = _training(world)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled(*compiled.shard_inputs(x16, x16)).backward()
    with pytest.raises(spmd.SpmdError, match=r"(?s)SGD steps 4 parameter\(s\) of the original MLP .*`SGD\(compiled\.parameters\(\)"):
        opt.step()


@pytest.mark.parametrize("inputs,words", [
    (lambda: (torch.randn(4, 16, dtype=torch.float64), torch.randn(4, 16)), [r"input 'x': expected float32, got float64",
                                                                             r"convert the input to the compiled dtype"]),
    (lambda: (torch.randn(6, 16, 1), torch.randn(6, 16, 1)), [r"input 'x': expected local shape \[4, 16\]",
                                                        r"compiles for full inputs of other shapes, over the same weights"]),
    (lambda: (torch.randn(4, 16),), [r"takes 2 inputs \(x, target\), got 1"]),
    (lambda: ([1.0] * 16, torch.randn(4, 16)), [r"input 'x': expected a tensor, got list"]),
    (lambda: (_dtensor(torch.randn(4, 16)), torch.randn(4, 16)), [r"input 'x': got a DTensor \(\[R\]\)",
                                                                 r"full_tensor\(\) through compiled\.shard_inputs"]),
])
def test_wrong_inputs_at_run_time_before_any_collective(world, inputs, words):
    _, compiled = _training(world)
    with pytest.raises(spmd.SpmdError) as e:
        compiled(*inputs())
    for w in words:
        assert re.search(w, str(e.value)), str(e.value)


def test_fully_shard_over_a_compiled_module_says_to_leave_it_out(world):
    """Found by a probe: torch's FSDP over a compiled module (or a holder of one) was refused with a message about
    hooks on holders, naming no FSDP."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    _, compiled = _training(world)
    with pytest.raises(spmd.SpmdError, match=r"torch's FSDP \(fully_shard\) over `fc\d` of a compiled module.*leave "
                                             r"the compiled module out of fully_shard"):
        fully_shard(compiled, mesh=DeviceMesh("cpu", [0]))


def _dtensor(t):
    """`t` as a DTensor on this one-rank world (torch's tensor parallelism handing its output over, a probe)."""
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.device_mesh import DeviceMesh

    return distribute_tensor(t, DeviceMesh("cpu", [0]), [Replicate()])


def test_shard_inputs_of_another_rank_says_recompile(world):
    """Inputs of other shapes are compiled for (runtime/shapes.py); of another number of dims, they are refused."""
    _, compiled = _training(world)
    with pytest.raises(spmd.SpmdError, match=r"(?s)expected the full shape \[4, 16\], got \[4, 16, 1\].*recompile"):
        compiled.shard_inputs(torch.randn(4, 16, 1), torch.randn(4, 16, 1))
    assert not compiled._variants


def test_shard_inputs_past_the_limit_on_shapes_says_how_to_train_it(world, monkeypatch):
    """An epoch's smaller last batch (drop_last=False) is compiled for, over the same weights; past the limit on
    sets of shapes, the ways out that train: pad the batch, or drop it."""
    from spmd.runtime import shapes

    _, compiled = _training(world)
    monkeypatch.setattr(shapes, "MAX_VARIANTS", 0)
    with pytest.raises(spmd.SpmdError, match=r"(?s)shapes \[2, 16\], \[2, 16\].*compiled for 1 set.*bucket the shapes: "
                                             r"pad the batch to shapes this module runs.*at the loss's ignore_index"
                                             r".*drop_last=True"):
        compiled.shard_inputs(torch.randn(2, 16), torch.randn(2, 16))


def test_a_serving_module_past_the_limit_on_shapes_says_how_to_serve_and_how_to_raise_it(world, monkeypatch):
    """A module compiled without training is told to pad and drop the padded rows' outputs, not of targets and
    drop_last (a serving probe got the training words), and that the limit may be raised (a probe found it does,
    32 sets equal to eager, and no doc said so)."""
    from spmd.runtime import shapes

    torch.manual_seed(0)
    model = MLP(16, 64).eval()
    compiled = spmd.compile(model, world, (x16,))
    monkeypatch.setattr(shapes, "MAX_VARIANTS", 0)
    with pytest.raises(spmd.SpmdError, match=r"(?s)shapes \[2, 16\]: .*bucket the shapes: pad the batch to shapes "
                                             r"this module runs .*drop the padded rows from the outputs.*"
                                             r"raise the limit before the call, `spmd\.runtime\.shapes\.MAX_VARIANTS = n`") as e:
        compiled.shard_inputs(torch.randn(2, 16))
    assert "ignore_index" not in str(e.value)
    monkeypatch.setattr(shapes, "MAX_VARIANTS", 1)  # (raised: the batch of 2 is compiled for)
    x = torch.randn(2, 16)
    torch.testing.assert_close(compiled.gather_outputs(compiled(*compiled.shard_inputs(x))), model(x))


def test_a_smaller_batch_trains_the_compiled_pieces(world):
    """The smaller batch's graphs read this module's pieces and write their gradients: one optimizer steps them."""
    model, compiled = _training(world)
    x, y = torch.randn(2, 16), torch.randn(2, 16)
    compiled(*compiled.shard_inputs(x, y)).backward()
    F.mse_loss(model(x), y).backward()
    grads = dict(model.named_parameters())
    assert list(compiled._variants) == [((2, 16), (2, 16))]
    assert "Also compiled for other input shapes (1" in compiled.explain(detail=False)
    assert "x [2, 16] [R], target [2, 16] [R]" in compiled.explain(detail=False)
    plans = compiled.plans  # (each set of shapes' plan: its predicted call, collectives and memory)
    assert list(plans) == [((4, 16), (4, 16)), ((2, 16), (2, 16))] and plans[(4, 16), (4, 16)] is compiled.plan
    assert f"    {plans[(2, 16), (2, 16)]}" in compiled.explain(detail=False)
    assert plans[(2, 16), (2, 16)].objective < compiled.plan.objective  # (half the batch)
    assert "Plan on mesh" in plans[(2, 16), (2, 16)].explain(detail=False)
    for name, p in compiled.named_parameters():
        assert torch.allclose(p.grad, grads[name].grad, atol=1e-6), name
    with pytest.raises(spmd.SpmdError, match=r"verify: inputs of the shapes \[2, 16\], \[2, 16\].*runs them too.*"
                                             r"verify with a batch of the compiled shapes \(\[4, 16\], \[4, 16\]\)"):
        compiled.verify(x, y)  # (a probe got shard_inputs' words, to recompile)
    x, y = torch.randn(3, 16), torch.randn(3, 16)  # (pieces of other shapes, given to the call: compiled for too)
    assert torch.allclose(compiled(x, y), F.mse_loss(model(x), y), atol=1e-6)
    assert len(compiled._variants) == 2
    with pytest.raises(spmd.SpmdError, match=r"expected local shape \[4, 16\].*got \[3, 16, 1\]"):
        compiled(torch.randn(3, 16, 1), torch.randn(3, 16, 1))


def test_a_smaller_batch_is_traced_as_the_module_was(world):
    """Found by a probe: the first cut of a smaller batch made in an evaluation loop under torch.no_grad, while a
    layer was frozen for warm-up, or outside the autocast block the module was compiled and is called under, gave
    graphs that never trained (backward: "element 0 of tensors does not require grad"), left the layer untrained
    once unfrozen, or computed in fp32, silently. Each is now traced as the module was."""
    model, compiled = _training(world)
    x, y = torch.randn(2, 16), torch.randn(2, 16)
    with torch.no_grad():
        compiled.shard_inputs(x, y)
    model.fc1.weight.requires_grad_(False)
    compiled.shard_inputs(torch.randn(3, 16), torch.randn(3, 16))
    model.fc1.weight.requires_grad_(True)
    compiled(*compiled.shard_inputs(x, y)).backward()
    assert all(p.grad is not None for p in compiled.parameters())
    compiled.zero_grad()
    compiled(*compiled.shard_inputs(x[:1].expand(3, 16), y[:1].expand(3, 16))).backward()
    assert all(p.grad is not None for p in compiled.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = spmd.compile(model, world, (x16, x16), loss_fn=F.mse_loss)
    local = auto.shard_inputs(x, y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert auto(*local).item() == F.mse_loss(model(x), y).item()


def test_a_smaller_batch_keeps_a_frozen_batch_norm_frozen(world):
    """Found by a review: a batch norm frozen before compiling (`model.bn.eval()` in a training model) was traced
    in training mode in a smaller batch's graphs first cut inside `model.eval()` (its statistics updated by those
    batches, silently)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 16))
    model[1].eval()
    compiled = spmd.compile(model, world, (x16, x16), loss_fn=F.mse_loss)
    x, y = torch.randn(2, 16), torch.randn(2, 16)
    model.eval()
    with torch.no_grad():
        local = compiled.shard_inputs(x, y)
    model.train()
    model[1].eval()
    before = compiled.get_buffer("1.running_mean").clone()
    loss = compiled(*local)
    assert torch.equal(compiled.get_buffer("1.running_mean"), before)
    assert torch.allclose(loss, F.mse_loss(model(x), y))


def test_shard_inputs_of_none_where_a_tensor_was_compiled_says_so(world):
    """Found by a probe: `attention_mask=None` where the example had a mask was told to recompile for shapes."""
    _, compiled = _training(world)
    with pytest.raises(spmd.SpmdError, match=r"(?s)input 'x': expected a tensor, got NoneType.*compiled with a tensor "
                                             r"for 'x'.*pass a tensor") as e:
        compiled.shard_inputs(None, torch.randn(4, 16))
    assert "these shapes" not in str(e.value)


def test_a_meta_compile_before_init(world):
    with torch.device("meta"):
        model = MLP(16, 64)
    compiled = spmd.compile(model, world, (x16,))
    with pytest.raises(spmd.SpmdError, match=r"compiled from the meta device.*compiled.init_weights\(seed=\.\.\.\)"):
        compiled(*compiled.shard_inputs(x16))


def test_a_lazy_modules_way_out_on_meta_equals_one_device(world):
    """The lazy module's refusal says to call the model once on an example batch: done on meta (no
    memory), then `init_weights`, the weights are one device's `torch.manual_seed(0); M(); M(x)`."""
    class Lazy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.LazyLinear(8)

        def forward(self, x):
            return self.fc(x)

    with torch.device("meta"):
        model = Lazy()
        model(torch.empty_like(x16, device="meta"))
    compiled = spmd.compile(model, world, (torch.empty_like(x16, device="meta"),))
    compiled.init_weights(seed=0)
    torch.manual_seed(0)
    eager = Lazy()
    eager(x16)
    for name, value in eager.named_parameters():
        torch.testing.assert_close(compiled.get_parameter(name), value, rtol=0, atol=0)
    torch.testing.assert_close(compiled(*compiled.shard_inputs(x16)), eager(x16))


def test_a_budget_search_out_of_time_says_so_and_not_that_nothing_fits(monkeypatch):
    """When the relaxations at the prices of memory that change the plan run out of time (a 2-layer
    transformers Llama on (2, 2) at 0.8 of its peak: one LP took 79 s), no plan was found, but none was
    proven impossible either: the message says which, with the floor and the way out."""
    from spmd.cost_model import solver

    from tests.support import LATENCY_LINK, SLOW_DEVICE

    dp = spmd.MeshSpec((2,), ("dp",), (LATENCY_LINK,), SLOW_DEVICE)
    # (a large batch: at 0.72 of the peak the cheapest plan's row does not fit, and the floor, everything
    # sharded as far as the mesh allows, is 0.70 of it: no proof that nothing fits. Below the floor (0.6)
    # the message says that nothing fits, proven by the floor)
    model, inputs = MLP(16, 64), (torch.randn(512, 16), torch.randn(512, 16))
    free = spmd.plan(model, dp, inputs, loss_fn=F.mse_loss)
    integral, calls = solver._Search.integral, []

    def slow(self, costs, **options):
        calls.append(options.get("first_found", False))
        if len(calls) > 1:  # every price after the first: the relaxation out of time
            return None, float("nan"), "Time limit reached"
        return integral(self, costs, **options)

    monkeypatch.setattr(solver._Search, "integral", slow)
    monkeypatch.setattr(solver._Search, "polish", lambda *args: None)  # (nor a plan from the weights alone)
    # nor from the cuts of the plans over by their temporaries: their branch and bound runs out of time too
    monkeypatch.setattr(solver._Search, "branch_and_bound", lambda *args: (None, float("nan"), False))
    with pytest.raises(spmd.SpmdError) as e:
        spmd.plan(model, dp, inputs, loss_fn=F.mse_loss, memory_budget=0.72 * free.predicted_peak_bytes)
    message = str(e.value)
    assert "ran out of its 60 s before it found a plan that fits memory_budget" in message, message
    assert "not proven impossible" in message and "the leanest plan found needs" in message, message
    assert "What to do: pin the largest parameters sharded" in message, message
    # below the floor, the same search out of time: nothing fits, and the floor proves it
    with pytest.raises(spmd.SpmdError, match=r"no plan fits memory_budget=.*even sharding every tensor"):
        spmd.plan(model, dp, inputs, loss_fn=F.mse_loss, memory_budget=0.6 * free.predicted_peak_bytes)
    assert "no plan fits" not in message, message


@pytest.mark.parametrize("call, example", [
    ("grad_norm", "`norm = compiled.grad_norm(); if rank == 0: log(norm)`"),
    ("gather_outputs", "`full = compiled.gather_outputs(out); if rank == 0: print(full)`"),
    ("save_safetensors", "`compiled.save_safetensors(path)` on every rank (rank 0 alone writes the file)"),
])
def test_a_rank_waiting_alone_is_shown_its_own_call_made_on_every_rank(capsys, call, example):
    """Found by a probe: a `grad_norm()` or `gather_outputs()` logged under `if rank == 0:` was told to write
    `state = compiled.full_state_dict(); if rank == 0: torch.save(state, path)`, a call it never made."""
    from spmd.runtime import waiting

    waiting._say(call, 0, 60.0)
    said = capsys.readouterr().err
    assert said.startswith(f"spmd: rank 0 has waited 60 s in {call}() for the other ranks.") and \
        said.rstrip().endswith(f"to that rank: {example}."), said
    assert "full_state_dict" not in said, said


@pytest.mark.parametrize("training", [True, False])
def test_forward_mode_derivatives_through_a_compiled_module_are_refused_with_the_way_out(training):
    """Found by a probe: dual tensors (torch.autograd.forward_ad) got torch's "You must implement the jvp
    function for custom autograd.Function", which names neither spmd nor a way out."""
    import torch.autograd.forward_ad as fwAD

    from tests.support import one_device

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    compiled = one_device(model, (x, y), training=True, loss_fn=F.mse_loss) if training else one_device(model, (x,))
    with fwAD.dual_level(), pytest.raises(spmd.SpmdError, match=r"forward-mode derivative .*What to do: pass plain "
                                                                r"tensors .*unpack_dual"):
        dual = fwAD.make_dual(x, torch.randn_like(x))
        compiled(dual, y) if training else compiled(dual)


_KERNEL = torch.randn(6, 4, 3)  # (a module-level tensor a forward reads: not a parameter, a buffer nor an input)


def test_a_tensor_the_forward_captured_is_named_with_the_way_out_in_training():
    """Found by a probe: a module-level tensor a forward reads (`F.conv1d(h, K)`, an index for `index_select`)
    plans and runs for inference, where the graph holds it as a constant; the training trace refused it with
    torch's FakeTensor words and advice about data-dependent control flow."""
    class Conv(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(12, 12)

        def forward(self, x):
            return F.conv1d(self.lin(x), _KERNEL, padding=_PAD.shape[0])

    x, t = torch.randn(2, 4, 12), torch.randn(2, 6, 12)
    spmd.plan(Conv(), spec((2,), ("tp",)), (x,))  # (inference: fine)
    with pytest.raises(spmd.SpmdError, match=r"What to do: the forward reads `_KERNEL` \(Conv\.forward\), a tensor of "
                                             r"its globals .*register_buffer") as e:
        spmd.plan(Conv(), spec((2,), ("tp",)), (x, t), loss_fn=F.mse_loss)
    assert "`_PAD`" not in str(e.value)  # (read for its shape alone: not of the size torch names; a review)


_PAD = torch.zeros(1)  # (a global the forward reads only for its shape: not the cause)


_ORDER = torch.randperm(8)  # (read by helpers the forward calls)


def _shuffled(h):
    return torch.gather(h, 1, _ORDER.expand(h.shape[0], 8))


@pytest.mark.parametrize("through", ["function", "method"])
def test_a_tensor_a_helper_of_the_forward_captured_is_named_with_the_way_out_in_training(through):
    """Found by a probe: the same tensor read one call deeper (a module-level helper, or a method of the module's
    the forward calls) was told torch's words and to remove data-dependent control flow."""
    class Mixer(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))

        def shuffle(self, h):
            return torch.gather(h, 1, _ORDER.expand(h.shape[0], 8))

        def forward(self, x):
            return self.shuffle(x @ self.w) if through == "method" else _shuffled(x @ self.w)

    where = r"_shuffled" if through == "function" else r"Mixer\.shuffle"
    with pytest.raises(spmd.SpmdError, match=rf"What to do: the forward reads .*`_ORDER` \({where}, called from "
                                             r"Mixer\.forward\), .*register_buffer"):
        spmd.plan(Mixer(), spec((2,), ("dp",)), (torch.randn(4, 8), torch.randn(4, 8)), loss_fn=F.mse_loss)


def test_inference_tensors_are_taken_as_examples_and_as_batches_of_other_shapes(world):
    """Found by a probe: a module compiled under `torch.inference_mode` from an inference tensor, or given one of
    new shapes (a generation loop's last output fed back), failed with torch.export's "Inference tensors cannot
    be saved for backward". Such inputs are traced from ordinary copies."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    with torch.inference_mode():
        x = torch.randn(8, 16)
        compiled = spmd.compile(model, world, (x,), training=False)
        for batch in (x, torch.randn(6, 16)):
            torch.testing.assert_close(compiled.gather_outputs(compiled(*compiled.shard_inputs(batch))), model(batch))
    assert list(compiled.plans) == [((8, 16),), ((6, 16),)]


@pytest.mark.parametrize("error, given", [
    (AttributeError("'tuple' object has no attribute 'get_seq_length'"), "a key/value cache"),
    (AttributeError("'FakeTensor' object has no attribute 'get_seq_length'"), "a tensor"),
    (ValueError("Unsupported input type <class 'transformers.cache_utils.DynamicCache'>"), "a key/value cache"),
    (ValueError("Unsupported input type <class 'transformers.cache_utils.StaticCache'>. Export only supports pytree "
                "containers of basic types (Tensor, int, float, ...) as input. To register a custom container type, "
                "use torch.utils._pytree.register_pytree_node."), "a key/value cache"),  # (was "returns a")
])
def test_a_key_value_cache_given_to_the_trace_names_use_cache_false(error, given):
    """Found by a probe: `past_key_values` given as a tuple or a DynamicCache (or a tensor passed where the model
    takes it, GPT-2's second positional input) got torch's words alone, and advice about control flow."""
    from spmd.passes.trace_module import untraceable_way_out

    said = untraceable_way_out(error)
    assert said.startswith(f"the model was given {given} where it takes `past_key_values`") and \
        "use_cache=False" in said and "by keyword" in said, said


def test_a_solve_out_of_time_with_no_plan_names_solver_time_limit(monkeypatch):
    """Found by a probe: T5 (4+4 layers, d_model 1024) on (2, 2) took 58 s of its fixed 60 s to solve alone and
    failed on a loaded host with "the solver found no plan (Time limit reached)", naming no way to give it more
    time. `solver_time_limit=` reaches the solver, and the message names it."""
    from spmd.cost_model import solver

    model, inputs = MLP(16, 64), (torch.randn(8, 16), torch.randn(8, 16))
    limits, solve = [], solver.IlpBuilder.solve

    def recorded(self, time_limit=60.0, **kwargs):
        limits.append(time_limit)
        return solve(self, time_limit=time_limit, **kwargs)

    monkeypatch.setattr(solver.IlpBuilder, "solve", recorded)
    spmd.plan(model, spec((2,), ("dp",)), inputs, loss_fn=F.mse_loss, solver_time_limit=7.5)
    assert limits == [7.5], limits
    monkeypatch.setattr(solver._Search, "integral", lambda self, costs, **options: (None, float("nan"),
                                                                                    "Time limit reached"))
    with pytest.raises(spmd.SpmdError, match=r"found no plan \(.*What to do: give it more time "
                                             r"\(solver_time_limit=, 7\.5 s now"):
        spmd.plan(model, spec((2,), ("dp",)), inputs, loss_fn=F.mse_loss, solver_time_limit=7.5)


def test_another_dtype_at_another_shape_is_named_as_the_dtype(world):
    """Found by a probe: a bool mask at a new batch size (a float one compiled) was told only of its shape, and to
    recompile, where batches of other shapes are compiled for: the dtype is what the module cannot take."""
    _, compiled = _training(world)
    with pytest.raises(spmd.SpmdError, match=r"(?s)of the dtypes the model was compiled for:.*input 'x': expected "
                                             r"torch\.float32, got torch\.float64.*expected the full shape \[4, 16\], "
                                             r"got \[2, 16\].*What to do: pass 'x' in the compiled dtype"):
        compiled.shard_inputs(torch.randn(2, 16, dtype=torch.float64), torch.randn(2, 16))


def test_a_collective_that_refuses_its_input_is_not_called_a_dead_rank():
    """Found by a probe: gloo's all_to_all refusing a complex tensor ("Invalid scalar type") was reported as a rank
    that died or stopped answering, with advice about timeouts."""
    from spmd.core.collectives import speaking

    def refuses(x, group=None):
        raise RuntimeError("Invalid scalar type")

    def dies(x, group=None):
        raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")

    from spmd.core.errors import SpmdCollectiveError

    with pytest.raises(SpmdCollectiveError, match=r"(?s)refuses\b.*refused its input.*no rank died") as caught:
        speaking(refuses)(torch.zeros(2), where="permute_10 on mesh axis dp")
    assert "timeout" not in str(caught.value)
    with pytest.raises(SpmdCollectiveError, match=r"(?s)died or stopped answering.*timeout="):
        speaking(dies)(torch.zeros(2))

    def destroyed(x, group=None):
        raise ValueError("Could not resolve the process group registered under the name 0")

    # (found by a probe: a call after `dist.destroy_process_group()` blamed a dead peer, "over ranks process group")
    with pytest.raises(SpmdCollectiveError, match=r"(?s)^destroyed over process group 'gone' failed.*groups this module "
                                                  r"was compiled over are gone on this rank \(no rank died\).*compile "
                                                  r"the model again") as caught:
        speaking(destroyed)(torch.zeros(2), group="gone")
    assert "timeout" not in str(caught.value)


def test_a_training_compile_inside_parametrize_cached_names_it():
    """Found by a probe: compiled for training inside `parametrize.cached()`, the trace failed with fake-tensor
    words ("Please convert all Tensors to FakeTensors") and advice about data-dependent control flow."""
    import torch.nn.utils.parametrize as parametrize

    class Symmetric(nn.Module):
        def forward(self, w):
            return w.triu() + w.triu(1).t()

    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    parametrize.register_parametrization(model[0], "weight", Symmetric())
    with parametrize.cached():
        with pytest.raises(spmd.SpmdError, match=r"inside torch.nn.utils.parametrize.cached\(\).*What to do: compile "
                                                 r"outside"):
            _plan(model, (x16, x16), loss_fn=F.mse_loss)
    _plan(model, (x16, x16), loss_fn=F.mse_loss)  # (outside it: planned)
    with parametrize.cached():  # (a model with no parametrization inside it: planned; the host's measured profile
        _plan(nn.Linear(16, 16), (x16, x16), loss_fn=F.mse_loss)  # compiles a probe model for training there)


def test_a_smaller_batch_cut_from_inputs_flagged_otherwise_is_traced_with_the_examples_flags(world):
    """Found by a review: `shard_inputs` of a smaller batch traced its graphs from the inputs as given, so a batch
    first cut from an input that needed no gradient made graphs without the input's gradient, and every later batch
    of that size flagged as the example was refused ("traced from an example that did not require grad")."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    x = torch.randn(4, 16, requires_grad=True)
    compiled = spmd.compile(model, world, (x, x16), loss_fn=F.mse_loss)
    compiled(*compiled.shard_inputs(torch.randn(2, 16), torch.randn(2, 16))).backward()
    x2 = torch.randn(2, 16, requires_grad=True)
    compiled(*compiled.shard_inputs(x2, torch.randn(2, 16))).backward()
    assert x2.grad is not None


def test_a_collective_failing_inside_a_call_every_rank_must_make_names_that_call():
    """Found by a docs probe: `if rank == 0: torch.save(compiled.full_state_dict(), path)` with rank 1 going on to
    train: rank 1's gloo aborted on the mismatched collective, and rank 0's error said only that a peer had died.
    The error now carries a note naming the call it came out of and the way out."""
    from spmd.runtime import waiting

    from spmd.core.errors import SpmdCollectiveError

    with pytest.raises(SpmdCollectiveError) as e:
        with waiting.collective("full_state_dict", 0, 2):
            raise SpmdCollectiveError("all_gather over ranks [0, 1] failed: Connection reset by peer")
    note = "\n".join(e.value.__notes__)
    assert "rank 0 was in full_state_dict(), which every rank must call" in note, note
    assert "`state = compiled.full_state_dict(); if rank == 0: torch.save(state, path)`" in note, note


def test_inputs_cut_to_a_new_length_but_one_are_named_beside_the_compiled_shapes(world):
    """Found by a probe: BERT compiled at length 16, then `shard_inputs` with `input_ids` and `attention_mask` cut to
    12 and `token_type_ids` left at 16. The trace for the new shapes failed on a broadcast inside the model, and the
    error said to make the forward traceable. It now lists each input's new shape beside the compiled one."""
    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x, gate):
            return self.fc(x) * gate

    x, gate = torch.randn(4, 6, 8), torch.rand(4, 6, 1)
    compiled = spmd.compile(Gate(), world, (x, gate))
    with pytest.raises(spmd.SpmdError) as e:
        compiled.shard_inputs(x[:, :5], gate)
    said = str(e.value)
    assert said.startswith("shard_inputs: these inputs have other shapes than the compiled ones "
                           "(x [4, 5, 8] (compiled [4, 6, 8]); gate [4, 6, 1])"), said
    assert "an input left at its old shape fails so. The failure: trace_module:" in said, said
    assert compiled.shard_inputs(x[:, :5], gate[:, :5])  # (both cut: compiled for, and cut)
    with pytest.raises(spmd.SpmdError) as e:  # (every input changed: the trace's own words, nothing about one left)
        compiled.shard_inputs(torch.randn(4, 5, 8), torch.rand(4, 3, 1))
    assert str(e.value).startswith("trace_module:"), str(e.value)


def test_the_users_line_is_read_from_torchs_original_traceback_only_where_it_has_source():
    """The line a data-dependent op was called from, in the "Original traceback" torch's interpreter writes: the
    innermost frame outside torch and spmd, with its code; a frame without source (`<stdin>`, exec'd code) is
    skipped (a review: its next line, torch's tlparse hint, was shown as the code)."""
    from spmd.passes.trace_module import _original_line

    spmd_file = spmd.__file__.replace("__init__.py", "passes/trace_joint.py")
    text = (f'Original traceback:\nFile "{spmd_file}", line 65, in forward\n    return self.loss_fn(x)\n'
            '  File "/home/u/my dir/model.py", line 12, in forward\n    torch.unique_consecutive(x).numel() == 1,\n'
            '  File "<stdin>", line 7, in head\nUse tlparse to see full graph.')
    assert _original_line(RuntimeError(text)) == \
        "/home/u/my dir/model.py:12: torch.unique_consecutive(x).numel() == 1,"
    assert _original_line(RuntimeError('File "<stdin>", line 7, in forward\nUse tlparse to see full graph.')) is None


def test_a_loss_fn_of_torch_whose_own_check_reads_values_is_told_to_compute_the_loss_after_the_call():
    """Found by a probe: `F.gaussian_nll_loss` in a loss_fn checks `var < 0` in Python; the refusal said to move
    the check to the training loop with the loss computed by a loss_fn (it was one, and the check is torch's).
    It now names torch's function and the route the probe followed to one device's numbers: no loss_fn, the loss
    on the gathered outputs."""
    from tests.support import one_device

    def loss_fn(out, target):
        return F.gaussian_nll_loss(out[:, :4], target[:, :4], F.softplus(out[:, 4:]))

    with pytest.raises(spmd.SpmdError) as e:
        one_device(nn.Linear(16, 8), (torch.randn(8, 16), torch.randn(8, 8)), loss_fn=loss_fn)
    said = str(e.value).split("torch's whole message")[0]
    assert "torch's own `F.gaussian_nll_loss` checks its arguments' values in Python" in said, said
    assert "Compile with `training=True` and no `loss_fn`" in said and "gather_outputs" in said, said



class _DataMadeSize(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op, self.w = op, nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        if self.op == "repeat_interleave":
            return (x @ self.w).repeat_interleave(torch.tensor([1, 2, 1, 3, 1, 1, 2, 1]), dim=1)
        rows = torch.unique(torch.tensor([0, 0, 2, 3, 3, 5, 6, 7]))  # (several outputs: `_unique2`, then getitem)
        return (x @ self.w)[:, rows] * 2.0


@pytest.mark.parametrize("op, line, size", [("repeat_interleave", "repeat_interleave(torch.tensor", 12),
                                            ("_unique2", "rows = torch.unique(", 6)])
def test_a_loss_meeting_a_size_made_from_values_names_the_op_that_made_it(op, line, size):
    """Found by a probe: `repeat_interleave` by a tensor of counts in the model, then `F.mse_loss`, was told the loss
    checked its values (the guard failed where the loss compared the data-made size with its target's). It names
    the op and the model's line now; an op of several outputs by itself, not the first op after it that carries the
    size (a review: `torch.unique` was named as the index after it)."""
    from tests.support import one_device

    with pytest.raises(spmd.SpmdError) as e:
        one_device(_DataMadeSize(op), (torch.randn(2, 8, 4), torch.randn(2, size, 4)), loss_fn=F.mse_loss)
    said = str(e.value).split("torch's whole message")[0]
    assert f"aten.{op}'s output shape depends on its input values" in said, said
    assert "test_error_table.py" in said and line in said, said
    assert "checks its arguments' values" not in said, said


def test_a_data_dependent_branch_elsewhere_in_a_model_with_layerdrop_is_not_blamed_on_it():
    """A review: a config with LayerDrop above 0 (Wav2Vec2's default 0.1) took every data-dependent refusal as
    LayerDrop's (Wav2Vec2ForCTC's labels check was told to set `layerdrop=0`). Only its own line is."""
    import types

    model = _Branch()
    model.config = types.SimpleNamespace(layerdrop=0.1)
    with pytest.raises(spmd.SpmdError) as e:
        _plan(model, (x16,))
    assert "reads a tensor's values in Python" in str(e.value) and "LayerDrop" not in str(e.value), str(e.value)


def test_torchs_partial_graph_of_a_failed_trace_is_not_printed(capfd):
    """Found by a probe: torch.export prints its partial graph of a trace that failed to stderr, once per road
    (560 lines before a DeBERTa refusal); what else is written there still is."""
    with pytest.raises(spmd.SpmdError, match="reads a tensor's values in Python"):
        _plan(_Branch(), (x16,), training=True, loss_fn=lambda out: out.sum())
    with pytest.raises(spmd.SpmdError, match="reads a tensor's values in Python"):
        _plan(_Branch(), (x16,))
    err = capfd.readouterr().err
    assert "def forward(" not in err, err[:2000]
    import torch.export._trace as export_trace

    from spmd.passes.trace_module import partial_graphs_unprinted

    with partial_graphs_unprinted():  # (torch's module's print, as the trace leaves it: the rest comes through)
        export_trace.print("kept", file=sys.stderr)
        export_trace.print("def forward(self, x):", file=sys.stderr)
    export_trace.print("def forward(self, y):", file=sys.stderr)
    assert capfd.readouterr().err == "kept\ndef forward(self, y):\n"

class _Drawn(nn.Module):
    """A draw of integers (mixup's permutation, a sampled class) or a tensor made empty and written (affine_grid)."""

    def __init__(self, case):
        super().__init__()
        self.fc, self.case = nn.Linear(4, 4), case

    def forward(self, x):
        if self.case == "randperm":
            x = 0.7 * x + 0.3 * x[torch.randperm(x.shape[0])]
        elif self.case == "multinomial":
            x = x + torch.multinomial(torch.softmax(x.detach(), -1), 1).to(x.dtype)
        else:
            theta = self.fc.weight[:2, :3][None].expand(x.shape[0], 2, 3)
            x = x + F.affine_grid(theta, [x.shape[0], 1, 2, 2], align_corners=False).reshape(x.shape[0], 8)[:, :4]
        return self.fc(x)


def test_verify_names_a_structured_outputs_fields(world):
    """Found by a probe: a model returning a dict (or a dataclass) had its rows named `output 0`, `output 1` by
    flat position; each now carries its path in what the forward returns."""
    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            h = self.fc(x)
            return {"logits": h, "pooled": h.mean(1)}

    torch.manual_seed(0)
    x = torch.randn(8, 4)
    report = spmd.compile(Heads(), world, (x,)).verify(x)
    assert report.ok and [d.what for d in report.outputs] == ["output 0 (out['logits'])", "output 1 (out['pooled'])"]
    plain = spmd.compile(nn.Linear(4, 4), world, (x,)).verify(x)
    assert [d.what for d in plain.outputs] == ["output 0"], plain


@pytest.mark.parametrize("case", ["randperm", "multinomial", "affine_grid"])
def test_verify_takes_the_ranks_draws_of_integers_and_ignores_uninitialized_memory(world, case):
    """Found by a probe: a permutation or a sample drawn again by verify's reference was compared as floats only,
    so it was taken as the same draw, and verify said MISMATCH at the `index` after it, naming no random op; and
    the values of an `empty` tensor (affine_grid's, written after) were compared: `BAD empty`, 1.34e+152. Training
    was exact in each case."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    compiled = spmd.compile(_Drawn(case).double(), world, (x, y), loss_fn=F.mse_loss)
    torch.manual_seed(5)
    report = compiled.verify(x, y)
    assert report.ok, report
    assert bool(report.random_ops) == (case != "affine_grid"), report.random_ops
