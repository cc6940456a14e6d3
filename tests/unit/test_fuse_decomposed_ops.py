"""fuse_decomposed_ops: log_softmax and its backward, traced apart, become one kernel each where a rank
runs them on whole rows, and stay apart where anything cuts the chain (a collective on a split class dim)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.fx as fx

from spmd.passes.fuse_decomposed_ops import fuse_decomposed_ops
from spmd.passes.trace_joint import trace_joint
from tests.models import GPT, GPTConfig
from tests.support import compile_graph, lm_loss, spec

aten = torch.ops.aten


def _args(traced, inputs, dtype=torch.float32):
    """The joint graph's arguments: the model's state, the inputs, a tangent of 1 for the loss."""
    it = iter(inputs)
    return [traced.state[i.name] if i.kind in ("parameter", "buffer", "constant") else
            next(it) if i.kind == "input" else torch.ones((), dtype=dtype) for i in traced.inputs]


def _run(gm, args) -> list:
    return fx.Interpreter(gm).run(*args, enable_io_processing=False)


def _targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _gpt_joint():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=96, seq=8, dim=32, heads=2, layers=1)
    x, y = torch.randint(0, 96, (2, 8)), torch.randint(0, 96, (2, 8))
    return trace_joint(GPT(cfg), (x, y), lm_loss), (x, y)


def test_log_softmax_and_its_backward_become_one_kernel_each_with_the_same_values():
    traced, inputs = _gpt_joint()
    assert aten.amax.default in _targets(traced.gm)  # traced apart (trace_joint.DECOMPOSED)
    fused = fuse_decomposed_ops(copy.deepcopy(traced.gm))
    ops = _targets(fused)
    assert ops.count(aten._log_softmax.default) == 1 and ops.count(aten._log_softmax_backward_data.default) == 1
    assert aten.amax.default not in ops and aten.exp.default not in ops and aten.log.default not in ops
    args = _args(traced, inputs)
    for got, want in zip(_run(fused, args), _run(traced.gm, args)):
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_chain_cut_by_another_node_stays_apart():
    """What a collective between the max and the shift does (a class dim split over the mesh): the
    pieces are no longer the whole decomposition, and nothing of the forward is fused."""
    traced, _ = _gpt_joint()
    gm = copy.deepcopy(traced.gm)
    amax = next(n for n in gm.graph.nodes if n.target == aten.amax.default)
    with gm.graph.inserting_after(amax):
        cut = gm.graph.call_function(aten.clone.default, (amax,))
    amax.replace_all_uses_with(cut, delete_user_cb=lambda u: u is not cut)
    gm.recompile()
    ops = _targets(fuse_decomposed_ops(gm))
    assert aten._log_softmax.default not in ops and aten.amax.default in ops and aten.log.default in ops
    assert aten._log_softmax_backward_data.default in ops  # the backward's chain is whole: fused


def test_bf16_log_softmax_keeps_its_dtype():
    torch.manual_seed(0)
    model = nn.Linear(8, 16).to(torch.bfloat16)
    x, y = torch.randn(4, 8, dtype=torch.bfloat16), torch.randint(0, 16, (4,))
    traced = trace_joint(model, (x, y), F.cross_entropy)
    fused = fuse_decomposed_ops(copy.deepcopy(traced.gm))
    node = next(n for n in fused.graph.nodes if n.target == aten._log_softmax.default)
    assert node.args[2] is False and node.meta["val"].dtype == torch.bfloat16
    args = _args(traced, (x, y), torch.bfloat16)
    for got, want in zip(_run(fused, args), _run(traced.gm, args)):
        if want is not None:
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_a_rank_on_whole_rows_runs_one_log_softmax():
    """In the pipeline: the rank graphs of a one-rank plan hold the fused kernels."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=96, seq=8, dim=32, heads=2, layers=1)
    x, y = torch.randint(0, 96, (2, 8)), torch.randint(0, 96, (2, 8))
    c = compile_graph(GPT(cfg), (x, y), spec((1,), ("tp",)), rank=0, loss_fn=lm_loss)
    assert aten._log_softmax.default in _targets(c.split.forward)
    assert aten._log_softmax_backward_data.default in _targets(c.split.backward)


def test_the_plan_prices_a_chain_as_the_kernel_the_rank_runs():
    """Where a strategy keeps the class dim whole, the chain's nodes together cost the one fused kernel
    (the cpu profile, a 32K-vocab GPT's loss: 852 ms decomposed, 235 fused), each in proportion to its
    own op, so none pays more than it would laid out apart; where a strategy splits the class dim (vocab
    parallel) or holds a partial sum, each node costs its own op, as the rank graph runs them."""
    from spmd.core.profiles import device_profile_for
    from spmd.core.specs import TensorInfo, local_shape
    from spmd.cost_model.compute import compute_cost
    from spmd.passes.estimate_costs import _fused_chains

    torch.manual_seed(0)
    cfg = GPTConfig(vocab=512, seq=16, dim=32, heads=2, layers=1)
    x = torch.randint(0, 512, (4, 16))
    mesh = spec((2,), ("tp",), device=device_profile_for("cpu"))
    c = compile_graph(GPT(cfg), (x, x), mesh, loss_fn=lm_loss)
    chains = _fused_chains(c.traced)
    ops = {str(f.op) for f in chains.values()}
    assert ops == {str(aten._log_softmax.default), str(aten._log_softmax_backward_data.default)}, ops
    assert len(chains) == 10  # amax, sub, exp, sum, log, sub; exp, sum, mul, sub
    split, shares = 0, {}  # (chain, layout) -> {node: its cost}
    for name, fused in chains.items():
        for s, cost in zip(c.strategies.nodes[name].strategies, c.costs.node_costs[name]):
            placements = [ps for ps in (*s.outputs, *s.inputs) if ps is not None]
            if any(p.is_partial() or p.is_shard() and p.dim % 2 == fused.dim for ps in placements for p in ps):
                assert fused.seconds(name, s, mesh) is None  # priced as its own op
                split += 1
                continue
            shares.setdefault((id(fused), placements[0]), {})[name] = cost
    assert split
    apart = _decomposed_costs(GPT(cfg), (x, x), mesh)
    checked = 0
    for (chain, layout), costs in shares.items():
        fused = next(f for f in chains.values() if id(f) == chain)
        if len(costs) < len(fused.nodes):
            continue  # a layout not every node of the chain offers
        checked += 1
        rows = TensorInfo(local_shape(fused.out.shape, layout, mesh.shape), fused.out.dtype)
        ins = [rows] * len(fused.ins)
        kernel = compute_cost(fused.op, (*(i.shape for i in ins), *fused.extra), {}, ins, [rows], mesh.device)
        assert sum(costs.values()) == pytest.approx(kernel, rel=1e-9), (layout, costs)
        own = {name: apart[(name, layout)] for name in costs}
        assert all(costs[n] < own[n] for n in costs) and kernel < 0.5 * sum(own.values()), (costs, own)
    assert checked >= 2, checked  # the forward chain and the backward one, in some layout each


@pytest.mark.parametrize("shape,names", [((1,), ("tp",)), ((2,), ("tp",)), ((2, 2), ("dp", "tp"))])
def test_no_plan_cuts_a_chain_between_two_whole_layouts(shape, names):
    """A chain priced fused runs fused only if nothing reshards between its nodes: the solver may not
    reshard between two layouts that both keep the class dim whole (it would pay the fused price for
    pieces that run apart), and no piece gains by leaving its chain (shares in proportion to the pieces'
    own costs: with equal shares, the one-rank plan split the [rows, 1] log on the class dim to shed
    its share, and nothing was fused). The rank graphs hold a fused kernel for every chain the plan
    keeps whole."""
    from spmd.core.profiles import device_profile_for
    from spmd.passes.estimate_costs import keeps_whole

    torch.manual_seed(0)
    cfg = GPTConfig(vocab=96, seq=8, dim=32, heads=2, layers=1)
    x, y = torch.randint(0, 96, (2, 8)), torch.randint(0, 96, (2, 8))
    for device in ("cpu", "h100"):
        c = compile_graph(GPT(cfg), (x, y), spec(shape, names, device=device_profile_for(device)), rank=0,
                          loss_fn=lm_loss)
        chains = c.costs.chains
        assert len(chains) == 10
        for e in c.plan.edges:
            if e.consumer in chains and chains.get(e.value[0]) == chains[e.consumer]:
                dim = chains[e.consumer][1]
                assert not (keeps_whole(e.src, dim, 2) and keeps_whole(e.dst, dim, 2)), (e, device)
        whole = {k for k, dim in set(chains.values()) if all(
            keeps_whole(ps, dim, 2) for n, (k2, _) in chains.items() if k2 == k
            for ps in (*c.plan.choices[n].inputs, *c.plan.choices[n].outputs) if ps is not None)}
        ops = _targets(c.split.forward) + _targets(c.split.backward)
        fused = ops.count(aten._log_softmax.default) + ops.count(aten._log_softmax_backward_data.default)
        assert fused == len(whole), (device, whole, fused)


def _decomposed_costs(model, inputs, mesh) -> dict:
    """(node, its first layout) -> seconds, with every chain priced as its pieces."""
    import spmd.passes.estimate_costs as estimate

    with pytest.MonkeyPatch.context() as m:
        m.setattr(estimate, "_fused_chains", lambda traced: {})
        c = compile_graph(model, inputs, mesh, loss_fn=lm_loss)
    return {(name, next(ps for ps in (*s.outputs, *s.inputs) if ps is not None)): cost
            for name, ns in c.strategies.nodes.items() for s, cost in zip(ns.strategies, c.costs.node_costs[name])}
