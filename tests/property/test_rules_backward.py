"""The fused backward kernels trace_joint keeps whole (trace_joint.KEPT_WHOLE), checked like every rule
(tests/property/rule_check.py): each strategy on random inputs split as it claims, on simulated ranks,
against the unsharded kernel. Their Partial forms (a Partial incoming gradient passes through, since each
kernel is linear in it) are the ones DTensor does not have.
"""
from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Shard

from tests.property.rule_check import RUN, Case, _dims, check_case, strategies_of, traced_of

aten = torch.ops.aten


@st.composite
def layer_norm_backward(draw):
    b, s, d = _dims(draw, 3)
    norm = draw(st.sampled_from(((d,), (s, d))))
    affine = draw(st.booleans())
    mask = draw(st.sampled_from(((True, True, True), (True, False, False), (False, True, True))))
    mask = mask if affine else (True, False, False)  # no weight, no weight gradient

    def fn(g, x, *wb):
        w, bias = wb if affine else (None, None)
        _, mean, rstd = aten.native_layer_norm(x, list(norm), w, bias, 1e-5)
        return aten.native_layer_norm_backward(g, x, list(norm), mean, rstd, w, bias, list(mask))
    shapes = ((b, s, d), (b, s, d)) + ((norm, norm) if affine else ())
    return Case(("ln_bwd", b, s, d, norm, affine, mask), shapes,
                frozenset({aten.native_layer_norm_backward.default}), fn, "make_fx")


@st.composite
def gelu_backward(draw):
    shape = tuple(_dims(draw, draw(st.integers(1, 3))))
    approx = draw(st.sampled_from(("none", "tanh")))
    return Case(("gelu_bwd", shape, approx), (shape, shape), frozenset({aten.gelu_backward.default}),
                lambda g, x: aten.gelu_backward(g, x, approximate=approx), "make_fx")


@st.composite
def softmax_backward(draw):
    shape = tuple(_dims(draw, draw(st.integers(2, 3))))
    dim = draw(st.integers(-len(shape), len(shape) - 1))
    log = draw(st.booleans())

    def fn(g, x):
        if log:
            return aten._log_softmax_backward_data(g, aten._log_softmax(x, dim, False), dim, x.dtype)
        return aten._softmax_backward_data(g, aten._softmax(x, dim, False), dim, x.dtype)
    op = aten._log_softmax_backward_data.default if log else aten._softmax_backward_data.default
    return Case(("softmax_bwd", shape, dim, log), (shape, shape), frozenset({op}), fn, "make_fx")


@st.composite
def embedding_backward(draw):
    b, s, vocab, d = _dims(draw, 4)
    padding = draw(st.sampled_from((-1, 0)))
    by_freq = draw(st.booleans())
    idx = draw(st.sampled_from(((b, s), (s,))))
    return Case(("emb_bwd", b, s, vocab, d, padding, by_freq, idx), (idx + (d,), ("index", idx, vocab)),
                frozenset({aten.embedding_dense_backward.default}),
                lambda g, i: aten.embedding_dense_backward(g, i, vocab, padding, by_freq), "make_fx")


@st.composite
def nll_loss_backward(draw):
    """The loss's gradient w.r.t. log-probabilities (n, classes): classes split is vocabulary parallelism
    (each rank its classes' targets, rules/vocab_parallel.py); ignore_index 0 is a real class."""
    n, classes = _dims(draw, 2)
    reduction = draw(st.sampled_from((0, 1, 2)))
    ignore = draw(st.sampled_from((-100, 0)))
    g_shape = (n,) if reduction == 0 else ()

    def fn(g, x, t, total_weight):  # total_weight: any divisor will do here
        return aten.nll_loss_backward(g, x, t, None, reduction, ignore, total_weight)
    return Case(("nll_bwd", n, classes, reduction, ignore),
                (g_shape, (n, classes), ("index", (n,), classes), ()),
                frozenset({aten.nll_loss_backward.default}), fn, "make_fx")


CASES = {f.__name__: f for f in (layer_norm_backward, gelu_backward, softmax_backward, embedding_backward,
                                 nll_loss_backward)}


@RUN
@given(data=st.data())
def test_layer_norm_backward(data):
    check_case(data.draw(layer_norm_backward(), label="case"), data.draw(st.integers(0, 2**32 - 1)))


@RUN
@given(data=st.data())
def test_gelu_backward(data):
    check_case(data.draw(gelu_backward(), label="case"), data.draw(st.integers(0, 2**32 - 1)))


@RUN
@given(data=st.data())
def test_softmax_backward(data):
    check_case(data.draw(softmax_backward(), label="case"), data.draw(st.integers(0, 2**32 - 1)))


@RUN
@given(data=st.data())
def test_embedding_dense_backward(data):
    check_case(data.draw(embedding_backward(), label="case"), data.draw(st.integers(0, 2**32 - 1)))


@RUN
@given(data=st.data())
def test_nll_loss_backward(data):
    check_case(data.draw(nll_loss_backward(), label="case"), data.draw(st.integers(0, 2**32 - 1)))


def _strategies(case: Case, op) -> list:
    traced = traced_of(case)
    node = next(n for n in traced.graph.nodes if n.target is op)
    return [str(s) for s in strategies_of(case, (2,)).nodes[node.name].strategies]


def test_layer_norm_backward_gives_partial_weight_gradients_and_passes_partial():
    """Batch-parallel: weight and bias gradients Partial; and a Partial incoming gradient stays Partial."""
    case = Case(("ln_bwd", 4, 4, 8, (8,), True, (True, True, True)), ((4, 4, 8), (4, 4, 8), (8,), (8,)),
                frozenset({aten.native_layer_norm_backward.default}),
                lambda g, x, w, b: aten.native_layer_norm_backward(
                    g, x, [8], *aten.native_layer_norm(x, [8], w, b, 1e-5)[1:], w, b, [True, True, True]),
                "make_fx")
    got = _strategies(case, aten.native_layer_norm_backward.default)
    # inputs: grad_out, input, mean, rstd, weight, bias
    assert "([S(0)], [S(0)], [S(0)], [S(0)], [R], [R]) -> [S(0)], [P], [P]" in got, got
    assert "([P], [R], [R], [R], [R], [R]) -> [P], [P], [P]" in got, got
    assert not any("S(2)" in s for s in got), got  # never the normalized dim


def test_embedding_backward_scaled_by_frequency_is_never_batch_sharded():
    """Each row is divided by its index's count: a rank holding some of the indices miscounts."""
    case = Case(("emb_bwd", 4, 4, 8, 8, -1, True, (4, 4)), ((4, 4, 8), ("index", (4, 4), 8)),
                frozenset({aten.embedding_dense_backward.default}),
                lambda g, i: aten.embedding_dense_backward(g, i, 8, -1, True), "make_fx")
    traced = traced_of(case)
    node = next(n for n in traced.graph.nodes if n.target is aten.embedding_dense_backward.default)
    for s in strategies_of(case, (2,)).nodes[node.name].strategies:
        assert not (isinstance(s.outputs[0][0], Partial) and isinstance(s.inputs[1][0], Shard)), s
