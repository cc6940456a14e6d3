"""The messages users read when something cannot be done as asked."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import spmd
from tests.models import MLP
from spmd import SpmdError, UnknownOpWarning
from tests.support import spec


def test_pin_that_cannot_be_met_names_the_pin_and_the_way_out():
    """In the user's names only (a probe saw the placeholder's too: `primals_3`, `input_1`)."""
    with pytest.raises(SpmdError, match=r"pin \[S\(0\)\] for input 'x' cannot be met: it has shape \(3, 16\).*uneven"):
        spmd.plan(MLP(16, 64), spec((2,), ("tp",)), (torch.randn(3, 16),), in_placements={"x": [Shard(0)]})
    with pytest.raises(SpmdError, match=r"for input 'x' cannot be met: it has shape") as said:
        spmd.plan(MLP(16, 64), spec((2,), ("tp",)), (torch.randn(3, 16), torch.randn(3, 16)), loss_fn=F.mse_loss,
                  in_placements={"x": [Shard(0)]})
    assert "primals" not in str(said.value)


def test_pin_with_wrong_number_of_placements():
    with pytest.raises(SpmdError, match=r"2 placements but the mesh \(tp=2\) has 1 axes"):
        spmd.plan(MLP(16, 64), spec((2,), ("tp",)), (torch.randn(4, 16),),
                  param_placements={"fc1.weight": [Shard(0), Replicate()]})


def test_pin_of_unknown_name_lists_known_names():
    with pytest.raises(SpmdError, match=r"names 'fc3.weight', which is not an input or parameter.*Did you mean.*fc1.weight"):
        spmd.plan(MLP(16, 64), spec((2,), ("tp",)), (torch.randn(4, 16),),
                  param_placements={"fc3.weight": [Shard(0)]})


class _UsesSearchsorted(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("edges", torch.linspace(-2, 2, 8))
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        buckets = torch.searchsorted(self.edges, x)
        return self.fc(x) + buckets


def test_unknown_op_falls_back_to_replicate_with_a_warning_naming_op_and_line():
    with pytest.warns(UnknownOpWarning, match=r"aten.searchsorted.Tensor.*test_errors.py:\d+.*searchsorted.*"
                                              r"runs replicated on every rank.*@rule\(torch.ops.aten.searchsorted.Tensor\)"):
        plan = spmd.plan(_UsesSearchsorted(), spec((2,), ("tp",)), (torch.randn(4, 16),))
    name = next(n for n in plan.choices if n.startswith("searchsorted"))
    assert plan.choices[name].outputs[0] == (Replicate(),)


class _MaxNorm(nn.Module):
    def __init__(self, bag: bool = False):
        super().__init__()
        self.e = nn.EmbeddingBag(10, 4, max_norm=1.0) if bag else nn.Embedding(10, 4, max_norm=1.0)
        self.l = nn.Linear(4, 2)

    def forward(self, ids):
        return self.l(self.e(ids))


class _FunctionalMaxNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.table, self.l = nn.Parameter(torch.randn(10, 4)), nn.Linear(4, 2)

    def forward(self, ids):
        return self.l(nn.functional.embedding(ids, self.table, max_norm=1.0, norm_type=3.0))


class _CumulativeNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.l, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4, momentum=None)

    def forward(self, x):
        return self.bn(self.l(x))


class _OwnGenerator(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x):
        return self.l(x) + torch.rand(x.shape, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("case,said", [
    ("max_norm", r"changes parameter e.weight in place \(an Embedding with max_norm.*`model.e.max_norm = None`.*"
                 r"compiled.embedding_renorm_\('e.weight', ids, max_norm=1.0\)"),
    # (a third probe: an EmbeddingBag's was told of weight clipping)
    ("bag max_norm", r"changes parameter e.weight in place \(an EmbeddingBag with max_norm.*"
                     r"compiled.embedding_renorm_\('e.weight', ids, max_norm=1.0\)"),
    # (told of weight clipping before: F.embedding with max_norm on a parameter of the user's)
    ("functional max_norm", r"changes parameter table in place \(`F.embedding` with max_norm.*without max_norm.*"
                            r"compiled.embedding_renorm_\('table', ids, max_norm=1.0, norm_type=3.0\)"),
    ("functional max_norm in eval", r"trace_module: .*changes parameter table in place \(`F.embedding` with max_n"),
    ("cumulative", r"What to do: bn: a batch norm with momentum=None.*`momentum=0.1`"),
    ("generator", r"makes or holds an object torch traces as a script object.*seeded outside the forward"),
    # (a second probe: these were told about an Embedding's max_norm, or to return the new value)
    ("clipped", r"changes parameter l.weight in place \(a weight clipped.*compiled.get_parameter\('l.weight'\)"),
    ("clipped in eval", r"trace_module: .*changes parameter l.weight in place \(a weight clipped"),
    ("momentum", r"changes parameter target.weight in place .*after the optimizer's step")])
def test_what_a_graph_cannot_hold_is_named_with_the_way_out(case, said):
    """Found by a probe (session 59): these failed with torch's internals ("unsupported graph input tangents_1
    (...ParamAOTInput...) report this model", a data-dependent dump, "unsupported graph input kind CUSTOM_OBJ")."""
    import torch.nn.functional as F

    from tests.support import one_device

    x = torch.randn(6, 4)
    with pytest.raises(SpmdError, match=said):
        if case == "max_norm":
            one_device(_MaxNorm(), (torch.randint(0, 10, (6,)), torch.randn(6, 2)), loss_fn=F.mse_loss)
        elif case == "bag max_norm":  # (bags of 3 ids)
            one_device(_MaxNorm(bag=True), (torch.randint(0, 10, (6, 3)), torch.randn(6, 2)), loss_fn=F.mse_loss)
        elif case.startswith("functional max_norm"):
            ids = torch.randint(0, 10, (6,))
            if case.endswith("eval"):
                one_device(_FunctionalMaxNorm(), (ids,), training=False)
            one_device(_FunctionalMaxNorm(), (ids, torch.randn(6, 2)), loss_fn=F.mse_loss)
        elif case == "cumulative":
            one_device(_CumulativeNorm(), (x, x), loss_fn=F.mse_loss)
        elif case == "generator":
            one_device(_OwnGenerator(), (x,))
        elif case == "clipped":
            one_device(_Clipped(), (x, x), loss_fn=F.mse_loss)
        elif case == "clipped in eval":
            one_device(_Clipped(), (x,), training=False)
        else:
            one_device(_Momentum(), (x, x), loss_fn=F.mse_loss)


class _Clipped(nn.Module):
    """A WGAN critic clipping its weight at each forward."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            self.l.weight.clamp_(-0.1, 0.1)
        return self.l(x)


class _Momentum(nn.Module):
    """BYOL's target network, moved toward the online one in the forward."""

    def __init__(self):
        super().__init__()
        self.online, self.target = nn.Linear(4, 4), nn.Linear(4, 4)
        self.target.requires_grad_(False)

    def forward(self, x):
        with torch.no_grad():
            self.target.weight.mul_(0.9).add_(0.1 * self.online.weight)
        return self.online(x) + self.target(x)


class _CausalEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)

    def forward(self, x):
        return self.enc(x, mask=nn.Transformer.generate_square_subsequent_mask(x.shape[1]))


def test_a_transformer_mask_left_to_be_detected_as_causal_names_is_causal():
    """torch's `_detect_is_causal_mask` reads the mask's values when `is_causal` is None: the trace failed on a
    data-dependent guard, and the way out spoke of tensor ops, not of passing `is_causal` (found by a probe of
    torch.nn's layers)."""
    x = torch.randn(4, 6, 16)
    with pytest.raises(SpmdError, match=r"What to do: torch's Transformer layers read a mask's values.*is_causal=True"):
        spmd.plan(_CausalEncoder(), spec((2,), ("tp",)), (x, x), loss_fn=F.mse_loss)


class _Packed(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm, self.fc = nn.LSTM(8, 16, batch_first=True), nn.Linear(16, 4)

    def forward(self, x, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = nn.utils.rnn.pad_packed_sequence(self.lstm(packed)[0], batch_first=True)
        return self.fc(out)


def test_packed_sequences_name_the_packing_and_the_padded_way():
    """An RNN over pack_padded_sequence failed inside torch's LSTM ("zeros(): argument 'size' ... got FakeTensor")
    with the generic way out (found by a probe of torch.nn's layers): it now names the module that packs, why
    a graph cannot hold it, and the padded-and-masked form."""
    with pytest.raises(SpmdError, match=r"What to do: _Packed packs its sequences \(`pack_padded_sequence`\).*"
                                        r"Run the RNN on the padded batch and mask"):
        spmd.plan(_Packed(), spec((2,), ("tp",)), (torch.randn(4, 6, 8), torch.tensor([6, 3, 5, 2])))
    # in training too (found by a probe: the RNN's own weights, held again in its `_flat_weights`, were named as
    # tensors to register as buffers)
    with pytest.raises(SpmdError, match=r"What to do: _Packed packs its sequences \(`pack_padded_sequence`\)"):
        spmd.plan(_Packed(), spec((2,), ("tp",)), (torch.randn(4, 6, 8), torch.tensor([6, 3, 5, 2]),
                                                    torch.randn(4, 6, 4)), loss_fn=F.mse_loss)


def test_a_lazy_module_not_yet_called_names_the_way_out():
    """Found by a probe: an nn.LazyLinear not yet called reached torch's own ValueError (`is_inference` of a
    parameter with no shape) inside spmd.compile."""
    model = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(SpmdError, match=r"Sequential's 0.weight, 0.bias have no shape yet.*What to do: call the model "
                                        r"once on an example batch"):
        spmd.compile(model, None, (torch.randn(4, 3),))


def test_a_call_under_a_torch_func_transform_names_the_way_out():
    """Found by a probe: `torch.func.grad` of `functional_call(compiled, params, ...)` failed deep in the ranks'
    checks (`'Tensor' object has no attribute 'wait'`)."""
    from torch.func import functional_call, grad

    from tests.support import one_device

    x, y = torch.randn(4, 16), torch.randn(4, 16)
    compiled = one_device(MLP(16, 32), (x, y), training=True, loss_fn=F.mse_loss)
    params = {n: p.detach() for n, p in compiled.named_parameters()}
    with pytest.raises(SpmdError, match=r"under a torch.func transform.*What to do: take gradients with loss.backward"):
        grad(lambda ps: functional_call(compiled, ps, (x, y)))(params)


def test_a_plain_dataclass_output_comes_back_as_its_class():
    """Found by a probe: the way out said "make the forward traceable (no data-dependent control flow)" when the
    forward returned a plain dataclass; then it named the class and `register_dataclass`, which worked (a training
    compile took such an output through its loss all along). Now the trace registers it itself, as torch's advice
    does, and the compiled module returns the class, nested in a tuple too."""
    import dataclasses

    from tests.support import one_device

    @dataclasses.dataclass
    class Prediction:
        y: torch.Tensor

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return Prediction(self.lin(x)), x.sum()

    x = torch.randn(2, 4)
    model = Model()
    out, total = one_device(model, (x,))(x)
    assert type(out) is Prediction and torch.allclose(out.y, model(x)[0].y) and torch.allclose(total, x.sum())

    @dataclasses.dataclass
    class Trained:  # (a class of its own: registered by no forward-only compile before it)
        y: torch.Tensor
        z: torch.Tensor | None = None

    class Trains(Model):
        def forward(self, x):
            return Trained(self.lin(x))

    # (found by a probe: training with no loss_fn failed with torch's words unless a forward-only compile had run)
    out = one_device(Trains(), (x,), training=True)(x)
    assert type(out) is Trained and out.z is None
    out.y.square().sum().backward()


class _EmaThroughData(nn.Module):
    def __init__(self, through_data: bool):
        super().__init__()
        self.fc, self.through_data = nn.Linear(4, 4), through_data
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x):
        y = self.fc(x)
        with torch.no_grad():
            if self.through_data:
                self.ema.data.mul_(0.9).add_(0.1 * y.mean(0))
            else:
                self.ema.mul_(0.9).add_(0.1 * y.mean(0))
        return y - self.ema


def test_a_buffer_updated_through_data_in_a_forward_names_the_line_and_the_way_out():
    """Found by a probe: `self.ema.data.mul_(d).add_(...)` in a forward compiled for evaluation failed with torch's
    "fake tensor in the exported program constant's list" and "make the forward traceable". The line is named,
    with the update written on the buffer itself, which runs equal to eager."""
    from tests.support import one_device

    x = torch.randn(6, 4)
    with pytest.raises(spmd.SpmdError, match=r"test_errors.py:\d+: self.ema.data.mul_\(0.9\).add_\(0.1 \* y.mean\(0\)\)` "
                                             r"goes through `.data`.*Update the tensor itself under `torch.no_grad\(\)`"):
        one_device(_EmaThroughData(True).eval(), (x,))
    model = _EmaThroughData(False).eval()
    reference = copy.deepcopy(model)
    compiled = one_device(model, (x,))
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(compiled(x), reference(x))


class _Dropping(nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.fc, self.drop = nn.Linear(8, 8), nn.Dropout(p)

    def forward(self, x):
        return self.drop(self.fc(x))  # DROP


@pytest.mark.parametrize("p, train, warned", [(0.1, True, True), (0.1, False, False), (0.0, True, False)])
def test_a_model_compiled_for_inference_in_train_mode_is_said_to_run_its_dropout(p, train, warned):
    """A model built from its config starts in train mode; compiled for inference its dropout runs (and a dropout
    inside attention keeps the attention whole on every rank: a plan-quality probe found BERT's inference plan
    gathering every layer's q, k and v)."""
    import warnings

    model = _Dropping(p).train(train)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spmd.plan(model, spmd.MeshSpec((2,), ("dp",)), (torch.randn(4, 8),), training=False)
    said = [w for w in caught if "in train mode" in str(w.message)]
    assert bool(said) == warned
    if warned:
        assert "# DROP" in str(said[0].message) and "model.eval()" in str(said[0].message) and said[0].filename == __file__


class _ReadsATensorAttribute(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.fc.weight.gscale = 0.5

    def forward(self, x):
        return self.fc(x) * self.fc.weight.gscale


@pytest.mark.parametrize("training", [False, True])
def test_an_attribute_set_on_a_parameter_and_read_in_the_forward_is_named(training):
    """Found by a probe: `'FakeTensor' object has no attribute 'gscale'`, told to remove data-dependent control flow."""
    import torch.nn.functional as F

    from tests.support import one_device

    x = torch.randn(4, 4)
    with pytest.raises(SpmdError, match=r"reads `gscale`, a Python attribute set on a tensor.*Keep such a number on "
                                        r"the module"):
        if training:
            one_device(_ReadsATensorAttribute(), (x, x), loss_fn=F.mse_loss)
        else:
            one_device(_ReadsATensorAttribute(), (x,), training=False)


class _SharedNormLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)

    def forward(self, x):
        return x + torch.tanh(self.bn(self.fc(x)))


class _SharedLayers(nn.Module):
    """ALBERT's layout with a batch norm: one layer object repeated in the list."""

    def __init__(self):
        super().__init__()
        layer = _SharedNormLayer()
        self.layers = nn.ModuleList([layer] * 3)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_shared_layer_updating_its_buffers_is_named_where_torch_export_fails():
    """Found by a probe: torch.export's lowering fails on a module called several times that updates its buffers
    in place ("expected compiled_fn to be GraphModule"), and the model was told to remove control flow."""
    from tests.support import one_device

    with pytest.raises(SpmdError, match=r"layers.0.bn is one module under 3 names \(layers.1.bn, layers.2.bn too\), "
                                        r"called more than once.*Give each use a module of its own"):
        one_device(_SharedLayers(), (torch.randn(6, 4),), training=False)
