"""Per-pass unit tests on tiny graphs, with structural assertions."""
import operator
import re

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from tests.models import MLP, GPT, GPTConfig
from spmd.core.mesh import MeshSpec
from spmd.core.profiles import LinkProfile
from spmd.core.specs import Pins
from spmd.passes.enumerate_strategies import enumerate_strategies
from spmd.passes.estimate_costs import estimate_costs
from spmd.passes.solve_placements import solve_placements
from spmd.passes.trace_module import trace_module
from spmd.runtime.simulate import simulate
from spmd.core import collectives
from tests.support import LATENCY_LINK, SLOW_DEVICE, compile_graph, spec

MESH = spec((2,), ("tp",), LATENCY_LINK, SLOW_DEVICE)


def _compile(model, example, mesh=MESH, rank=0, **pins):
    return compile_graph(model, example, mesh, rank, **pins)


# --- trace_module -------------------------------------------------------------------------------------

def test_trace_names_every_placeholder_and_keeps_shapes_and_source():
    traced = trace_module(MLP(16, 64), (torch.randn(4, 16),))
    assert [(i.kind, i.name) for i in traced.inputs] == [
        ("parameter", "fc1.weight"), ("parameter", "fc1.bias"), ("parameter", "fc2.weight"),
        ("parameter", "fc2.bias"), ("input", "x")]
    for node in traced.graph.nodes:
        if node.op in ("placeholder", "call_function"):
            assert node.name in traced.tensor_info
    addmm = [n for n in traced.graph.nodes if n.target is torch.ops.aten.addmm.default]
    assert len(addmm) == 2
    assert traced.tensor_info[addmm[0].name].shape == (4, 64)
    assert "tests/models.py" in addmm[0].meta["stack_trace"]


def test_trace_keeps_sdpa_whole():
    traced = trace_module(GPT(GPTConfig(layers=1)), (torch.randint(0, 128, (2, 32)),))
    targets = {n.target for n in traced.graph.nodes}
    assert torch.ops.aten.scaled_dot_product_attention.default in targets


# --- enumerate_strategies -----------------------------------------------------------------------------

def test_strategies_exclude_uneven_shards():
    traced = trace_module(MLP(16, 64), (torch.randn(3, 16),))
    table = enumerate_strategies(traced, MeshSpec((2,), ("tp",)))
    assert (Shard(0),) not in table.output_candidates(("x", 0))  # 3 rows do not split in 2
    assert (Shard(1),) in table.output_candidates(("x", 0))
    addmm = next(n for n in table.nodes if n.startswith("addmm"))
    assert table.nodes[addmm].excluded > 0


def test_strategies_getitem_follows_its_producer():
    traced = trace_module(GPT(GPTConfig(layers=1)), (torch.randint(0, 128, (2, 32)),))
    table = enumerate_strategies(traced, MeshSpec((2, 2), ("dp", "tp")))
    getitem = next(n for n in traced.graph.nodes if n.target is operator.getitem)
    src, idx = getitem.args
    assert table.nodes[getitem.name].source == "follow"
    assert table.output_candidates((getitem.name, 0)) == table.output_candidates((src.name, idx))


def test_pins_restrict_the_node():
    traced = trace_module(MLP(16, 64), (torch.randn(4, 16),))
    table = enumerate_strategies(traced, MeshSpec((2,), ("tp",)),
                                 Pins(params={"fc1.weight": [Shard(0)]}, outputs={0: [Replicate()]}))
    assert [s.outputs[0] for s in table.nodes["p_fc1_weight"].strategies] == [(Shard(0),)]
    assert [s.inputs[0] for s in table.nodes["output_0"].strategies] == [(Replicate(),)]


# --- estimate_costs / solve_placements ----------------------------------------------------------------

def test_sharded_matmul_costs_less_compute():
    traced = trace_module(MLP(16, 64), (torch.randn(3, 16),))
    table = enumerate_strategies(traced, MESH)
    costs = estimate_costs(traced, table, MESH)
    name = next(n for n in table.nodes if n.startswith("addmm"))
    by_out = {s.outputs[0]: c for s, c in zip(table.nodes[name].strategies, costs.node_costs[name])}
    assert by_out[(Shard(1),)] < by_out[(Replicate(),)]


def _brute_force(table, costs) -> float:
    """The cheapest plan over all strategy combinations, priced as the solver's model prices it: every
    node's compute, every edge's resharding, a collective resharding several consumers share once (the
    rank graph emits it once)."""
    import itertools

    names = list(table.nodes)
    best = float("inf")
    for combo in itertools.product(*(range(len(table.nodes[n].strategies)) for n in names)):
        choice = dict(zip(names, combo))
        total, made = 0.0, set()
        for n in names:
            ns = table.nodes[n]
            s = ns.strategies[choice[n]]
            total += costs.node_costs[n][choice[n]]
            for j, v in enumerate(ns.inputs):
                src, dst = table.nodes[v[0]].strategies[choice[v[0]]].outputs[v[1]], s.inputs[j]
                if src != dst and any(step.is_collective for step in costs.redistribute(v, src, dst, False)):
                    if (v, dst) in made:
                        continue
                    made.add((v, dst))
                total += costs.edge_cost(v, src, dst)
        best = min(best, total)
    return best


def test_solver_is_exact_on_a_small_graph():
    """Brute force over all strategy combinations of a 2-layer MLP agrees with the ILP optimum."""
    traced = trace_module(MLP(4, 8, bias=False), (torch.randn(3, 4),))
    table = enumerate_strategies(traced, MESH)
    costs = estimate_costs(traced, table, MESH)
    plan = solve_placements(table, costs)
    best = _brute_force(table, costs)
    assert plan.objective == pytest.approx(best, rel=1e-9)
    assert plan.gap <= 1e-6


class _TwoWholeReaders(torch.nn.Module):
    """h = x @ w, then two ops that scan h's last dim, so each needs it whole."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 64))

    def forward(self, x):
        h = x @ self.w
        return torch.cumsum(h, -1) + torch.cumsum(h, -1).flip(-1)


def test_a_resharding_two_consumers_share_is_priced_once():
    """Both cumsums read h's columns whole: the rank graph reshards h once (insert_collectives shares it),
    and the solver prices it once: its optimum is the brute-force optimum with shared reshardings, the
    second consumer's edge is marked shared and costs nothing, and objective = compute + edges."""
    model, x = _TwoWholeReaders(), torch.randn(2, 8)
    traced = trace_module(model, (x,))
    # links that move bytes slowly: resharding h (2 x 64) costs a quarter of gathering w (8 x 64)
    mesh = spec((2,), ("tp",), LinkProfile("test-narrow-link", 1e-6, 1e8), SLOW_DEVICE)
    table = enumerate_strategies(traced, mesh, Pins(params={"w": (Shard(1),)}, inputs={"x": (Replicate(),)}))
    costs = estimate_costs(traced, table, mesh)
    plan = solve_placements(table, costs)
    assert plan.objective == pytest.approx(_brute_force(table, costs), rel=1e-9)
    # h leaves the matmul split by columns; both scans need its columns whole (all_gathered, or
    # all_to_all'd to rows): one resharding, two edges
    into_scans = [e for e in plan.edges if e.value[0] == "mm"]
    assert [e.consumer for e in into_scans] == ["cumsum", "cumsum_1"], plan.edges
    assert [e.shared for e in into_scans] == [False, True] and into_scans[1].cost == 0.0, into_scans
    assert into_scans[0].cost > 0.0 and into_scans[0].dst == into_scans[1].dst
    assert plan.objective == pytest.approx(plan.compute_cost + plan.comm_cost, rel=1e-9)
    assert sum(plan.collective_summary().values()) == 1, plan.collective_summary()
    c = _compile(model, (x,), mesh, param_placements={"w": [Shard(1)]}, in_placements={"x": [Replicate()]})
    steps = [n for n in c.global_gm.graph.nodes if n.target in collectives.STEP_FUNCTIONS.values()]
    assert len(steps) == 1, steps


# --- insert_collectives / emit_rank_graph -------------------------------------------------------------

def test_megatron_mlp_gets_exactly_one_all_reduce():
    c = _compile(MLP(16, 64), (torch.randn(3, 16),), spec((2,), ("tp",)), out_placements={0: [Replicate()]})
    steps = [n for n in c.global_gm.graph.nodes if n.target in collectives.STEP_FUNCTIONS.values()]
    kinds = [n.target.__name__ for n in steps]
    assert kinds.count("all_reduce") == 1
    assert not {"all_gather", "all_to_all", "reduce_scatter"} & set(kinds)


def test_rank_graph_bakes_local_shapes_and_groups():
    c = _compile(GPT(GPTConfig(layers=1)), (torch.randint(0, 128, (1, 31)),))
    code = c.rank_gm.code
    # column-parallel q_proj on 2 ranks: 64 features -> 32 per rank, 4 heads -> 2 per rank
    assert "[1, 31, 32]" in code and "[1, 31, 2, 16]" in code
    assert "group = 'g0'" in code and "mesh_axis" not in code
    assert "torch.ops.aten.view.default" not in code  # views become reshapes on local tensors


def test_rank_graphs_differ_only_in_rank_coordinates():
    model, x = MLP(16, 64), (torch.randn(8, 16),)
    mesh = spec((2,), ("dp",))
    a = _compile(model, x, mesh, rank=0, in_placements={"x": [Replicate()]}, param_placements={"fc1.weight": [Shard(1)]})
    b = _compile(model, x, mesh, rank=1, in_placements={"x": [Replicate()]}, param_placements={"fc1.weight": [Shard(1)]})
    assert a.plan.fingerprint() == b.plan.fingerprint()
    assert a.rank_gm.code != b.rank_gm.code
    assert a.rank_gm.code.replace("index = 0", "index = 1") == b.rank_gm.code


@pytest.mark.parametrize("training", [False, True])
def test_an_input_named_like_a_builtin_passes_every_check(training):
    """nn.Sequential's argument is `input`, a name FX suffixes (`input_1`) in every graph it makes: the
    trace takes FX's name, so the checks after insert_collectives, `simulate` and `compiled.verify`
    find the input by the name the graphs they read give it (the tests run with SPMD_VERIFY=1)."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    x = torch.randn(4, 8)
    loss = (lambda out, target: ((out - target) ** 2).mean()) if training else None
    c = compile_graph(model, (x, torch.randn(4, 8)) if training else (x,), MESH, 0, verify=True,
                      training=training, loss_fn=loss)
    if not training:  # (a joint graph's placeholders are primals_<i>)
        for gm in (c.traced.gm, c.global_gm, c.rank_gm):
            assert [n.name for n in gm.graph.find_nodes(op="placeholder")][-1] == "input_1"
        assert c.traced.inputs[-1].placeholder == "input_1" and c.traced.inputs[-1].name == "input"
    outs = simulate(c, (x, torch.randn(4, 8), torch.ones(())) if training else (x,))  # (the loss's tangent)
    assert len(outs) == 2


def test_the_pipeline_runs_with_the_collector_paused_and_leaves_it_as_it_was():
    import gc

    from spmd.compiler.pipeline import collector_paused

    collections = []
    gc.callbacks.append(lambda phase, info: collections.append(phase))
    try:
        compile_graph(MLP(16, 64), (torch.randn(8, 16),), MESH, 0)
    finally:
        gc.callbacks.pop()
    # at most the one collection the first allocation after the pipeline starts (without the pause: dozens)
    assert collections.count("start") <= 1 and gc.isenabled()
    with collector_paused():
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer pipeline still runs
    assert gc.isenabled()
    gc.disable()  # a user who turned it off keeps it off
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_planning_a_meta_model_copies_it_with_the_collector_paused_too():
    """`spmd.plan` copies a meta model into fake tensors (a deepcopy: thousands of objects) before the
    pipeline; with the collector on, that copy paid collections of its own (0.3 s of LLaMA3-8B's plan
    where an earlier plan's objects were still alive)."""
    import gc

    import spmd

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab=64, seq=16, dim=32, heads=2, layers=4))
        tokens = torch.zeros(2, 16, dtype=torch.long)
    collections = []
    gc.collect()
    gc.callbacks.append(lambda phase, info: collections.append(phase))
    try:
        spmd.plan(model, MESH, (tokens,))
    finally:
        gc.callbacks.pop()
    assert collections.count("start") <= 1 and gc.isenabled()


def test_a_quiet_pipeline_writes_no_dumps_whatever_the_environment_says(tmp_path, monkeypatch):
    """spmd's own compilations (the host probe's) stay out of the user's SPMD_DUMP folder."""
    from spmd.compiler.options import PlanOptions
    from spmd.compiler.pipeline import run_pipeline

    monkeypatch.setenv("SPMD_DUMP", str(tmp_path))
    run_pipeline(MLP(16, 64), (torch.randn(3, 16),), MESH, PlanOptions(), quiet=True)
    assert list(tmp_path.iterdir()) == []
    run_pipeline(MLP(16, 64), (torch.randn(3, 16),), MESH, PlanOptions())
    assert list(tmp_path.iterdir())


def test_dump_writes_one_file_per_pass(tmp_path):
    compile_graph(MLP(16, 64), (torch.randn(3, 16),), MESH, 0, dump_dir=str(tmp_path))
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["01-find_layer_stacks.txt", "02-trace.txt", "03-merge_tied_parameters.txt",
                     "04-find_repeated_blocks.txt", "05-enumerate_strategies.txt", "06-estimate_costs.txt",
                     "07-solve_placements.txt", "08-insert_collectives.txt", "09-emit_rank_graph.txt",
                     "10-fuse_decomposed_ops.txt", "11-reduce_in_place.txt", "12-overlap_collectives.txt"]
    lines = (tmp_path / "07-solve_placements.txt").read_text().splitlines()
    # the user's source line heads the block of nodes it made
    head = next(i for i, line in enumerate(lines) if line.startswith("# ") and "tests/models.py:" in line)
    assert lines[head].endswith("return self.fc2(F.gelu(self.fc1(x)))"), lines[head]
    assert lines[head + 1].split()[0] in ("view", "permute", "addmm", "gelu")
    assert any(line.startswith("Plan on mesh (tp=2)") for line in lines)
    calls = [line for line in lines if " = aten." in line]  # each op with its placements and compute at the right
    assert calls and all(re.search(r"  # \[(R|S\(\d\)|P)\]  \d+\.\d us$", line) for line in calls), calls
