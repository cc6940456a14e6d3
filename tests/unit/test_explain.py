"""`plan.explain()`: the Megatron summary and alternatives on GPT (the golden text: tests/golden)."""

import torch
import torch.nn.functional as F

import spmd
from tests.models import GPT, MLP, GPTConfig
from tests.support import lm_loss, megatron_gpt_plan, megatron_spec, spec

def test_megatron_summary_on_gpt():
    text = megatron_gpt_plan().explain()
    for line in ("blocks.*.attn.q_proj  Linear     column-parallel on tp; replicated on dp",
                 "blocks.*.attn.o_proj  Linear     row-parallel on tp; replicated on dp; bias [R, R]",
                 "blocks.*.mlp.fc1      Linear     column-parallel on tp; replicated on dp",
                 "blocks.*.ln1          LayerNorm  replicated",
                 "input tokens [S(0), R]: batch split on dp (data parallel)",
                 "all_reduce  tp    4      31.0 KiB  4.00 ms"):
        assert line in text, line


def test_best_alternative_and_why_it_lost():
    plan = megatron_gpt_plan()
    rows = {r.label: r for r in plan.details.nodes}
    q = rows["blocks.*.attn.q_proj.weight"]  # (the two blocks are tied: reported once)
    assert (q.op, q.module, q.chosen, q.alternative) == ("parameter", "blocks.*.attn.q_proj", "[R, S(0)]", "[R, R]")
    assert q.delta > 0 and q.reason.startswith(f"{q.delta * 1e6:.1f} us slower") and "communication" in q.reason
    o = rows["addmm_3"]  # o_proj: row-parallel, its Partial output is all_reduced by its consumer
    assert o.chosen == "[S(0), P]" and o.module == "blocks.*.attn.o_proj" and o.cost.comm_out > 0
    # every shown node's chosen local cost is no worse than its alternative, or the reason says why
    for r in rows.values():
        assert r.alternative is None or r.delta >= -1e-7 or "global optimum" in r.reason
    # the nodes' input resharding adds up to the plan's communication
    assert abs(sum(r.cost.comm_in * r.count for r in rows.values()) - plan.comm_cost) < 1e-9


def test_explain_training_plan_names_phases_and_modules():
    torch.manual_seed(0)
    plan = spmd.plan(MLP(16, 64), spec((2,), ("dp",)), (torch.randn(8, 16), torch.randn(8, 16)),
                     loss_fn=lambda y, t: F.mse_loss(y, t))
    text = plan.explain()
    assert "fc2 (backward)" in text and "fc1 (forward)" in text and "model." not in text
    assert "all_reduce  dp" in text  # gradient reductions, priced as bucketed


def test_repeated_layers_are_reported_once_with_their_count():
    """A 4-layer GPT ties its layers: each op of a layer is one row (`blocks.*`, x4), not four."""
    from tests.models import GPT, GPTConfig

    torch.manual_seed(0)
    tokens = torch.randint(0, 128, (4, 32))
    plan = spmd.plan(GPT(GPTConfig(layers=4)), spec((2, 2), ("dp", "tp")), (tokens, tokens),
                     loss_fn=lambda logits, t: F.cross_entropy(logits.flatten(0, 1), t.flatten()))
    nodes = plan.explain().split("\nNodes")[1]
    assert "blocks.*.attn.q_proj.weight" in nodes and "blocks.1." not in nodes
    rows = [line for line in nodes.splitlines() if " x4 " in line or line.rstrip().endswith(" x4")]
    assert len(rows) > 20  # forward and backward ops of a layer, each once


def test_a_faster_alternative_is_never_called_as_fast():
    """Time decides before memory: an alternative faster alone (it lost to the rest of the plan) that holds
    more memory was once reported "as fast, ... more memory"."""
    from spmd.report.details import Split, _why

    chosen, faster = Split(1e-3, 0.0, 0.0, 1.0), Split(0.5e-3, 0.0, 0.0, 2 * 2**20)
    assert _why(chosen, faster, None).startswith("500.0 us faster alone"), _why(chosen, faster, None)
    assert "more memory per rank (budget)" in _why(chosen, faster, 1e9)
    assert _why(chosen, Split(1e-3, 0.0, 0.0, 2 * 2**20), None).startswith("as fast, 2.00 MiB more memory")


def test_totals_add_up_to_the_objective_and_count_a_shared_resharding_once():
    """Found by a probe: a value two consumers read through the same all_to_all was counted twice in the
    collective totals and in the nodes' communication (the rank graph launches it once, the solver priced
    it once); and a training plan's headline left the gradient buckets' latency out (9.8 of 256 ms here)."""
    import torch.nn as nn
    from torch.distributed.tensor import Shard

    from spmd.report.explain import collective_totals
    from tests.models import GPT, GPTConfig
    from tests.support import lm_loss, megatron_spec

    class TwoReaders(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 64)

        def forward(self, x):
            h = self.fc(x)
            return h.softmax(-1) * h.log_softmax(-1)

    torch.manual_seed(0)
    plan = spmd.plan(TwoReaders(), spec((2,), ("tp",)), (torch.randn(8, 16),), param_placements={"fc.weight": [Shard(0)]})
    assert any(e.shared for e in plan.edges)
    assert sum(r[2] for r in collective_totals(plan)) == sum(plan.collective_summary().values())
    assert abs(sum(r.cost.comm_in * r.count for r in plan.details.nodes) - plan.comm_cost) < 1e-12

    ids = torch.randint(0, 128, (4, 32))
    plan = spmd.plan(GPT(GPTConfig()), megatron_spec(), (ids, ids), loss_fn=lm_loss)
    head = plan.explain(detail=False).splitlines()[0]
    buckets = plan.objective - plan.compute_cost - plan.comm_cost
    assert buckets > 1e-3 and f"gradient buckets' latency {buckets * 1e3:.3f} ms" in head, head


def test_the_collective_table_counts_the_launches_of_the_rank_graphs():
    """Found by a probe: a training plan's table listed `all_reduce dp 37` where the rank graphs launch the
    gradients' all_reduces in one bucket, and its time left out the buckets' latency. Gradient all_reduces now
    count as the buckets they travel in, and their latency is in their row."""
    from collections import Counter

    from spmd.core import collectives as C
    from spmd.report.explain import collective_totals
    from tests.models import GPT, GPTConfig
    from tests.support import compile_graph, lm_loss

    torch.manual_seed(0)
    ids = torch.randint(0, 64, (4, 16))
    c = compile_graph(GPT(GPTConfig(layers=2)), (ids, ids), spec((2, 2), ("dp", "tp")), rank=0, loss_fn=lm_loss)
    grads = c.plan.stats["gradient_all_reduces"]
    assert all(n > 1 and launches == 1 for n, _, launches in grads.values()), grads
    launched = Counter()
    for gm in (c.split.forward, c.split.backward):
        for n in gm.graph.nodes:
            if n.op == "call_function" and n.target in (C.all_reduce, C.all_reduce_start, C.bucket_start):
                launched[{"g0": "dp", "g1": "tp"}[n.kwargs.get("group", n.args[2] if len(n.args) > 2 else None)]] += 1
    listed = {axis: count for kind, axis, count, _, _ in collective_totals(c.plan) if kind == "all_reduce"}
    assert listed == dict(launched), (listed, launched)
    seconds = {axis: t for kind, axis, _, _, t in collective_totals(c.plan) if kind == "all_reduce"}
    assert all(t >= c.plan.mesh.links[i].alpha_beta("all_reduce")[0] for i, t in enumerate(seconds.values()))


def test_collective_counts_and_times_agree_with_the_rank_graphs_and_the_headline():
    """Found by a probe: on (dp=2, tp=2) ViT training, explain counted one all_reduce launch on tp where the
    backward graph launched a bucket and three all_reduces alone (gradients reduced over both axes, which the
    runtime did not bucket, though the plan priced them as bucketed); the picture's title, `str(plan)` and plan
    diffs counted every gradient all_reduce (x37 against one bucket); and the table's time counted the buckets'
    latency shares twice (its total over the headline's communication and buckets' latency)."""
    from spmd.core import collectives as C
    from spmd.report.explain import collective_totals, step_seconds
    from tests.models import ViT, ViTConfig
    from tests.support import compile_graph

    torch.manual_seed(0)
    inputs = (torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,)))
    c = compile_graph(ViT(ViTConfig()), inputs, spec((2, 2), ("dp", "tp")), rank=0, loss_fn=F.cross_entropy)
    launches, alone = {}, []
    for gm in (c.split.forward, c.split.backward):
        for n in gm.graph.nodes:
            if n.target in (C.all_reduce, C.all_reduce_start, C.bucket_start):
                axis = ("dp", "tp")[int(n.kwargs["group"][1:])]
                launches[axis] = launches.get(axis, 0) + 1
                if gm is c.split.backward and n.target is not C.bucket_start:
                    alone.append(n.name)
    totals = {(k, a): n for k, a, n, _, _ in collective_totals(c.plan)}
    assert launches == {a: n for (k, a), n in totals.items() if k == "all_reduce"}
    # every gradient all_reduce in one bucket per axis (the loss's scalar all_reduces, if any, in forward)
    assert not alone and sum(n.target is C.bucket_start for n in c.split.backward.graph.nodes) == 2, alone
    assert dict(c.plan.collective_summary()) == totals

    ids = torch.randint(0, 128, (2, 31))
    plan = spmd.plan(GPT(GPTConfig()), megatron_spec(), (ids, ids), loss_fn=lm_loss)
    table = sum(t for *_, t in collective_totals(plan))
    local = sum(t for _, s, t in step_seconds(plan) if not s.is_collective)
    assert abs(table + local - (plan.objective - plan.compute_cost - plan.recompute_cost)) < 1e-9


def test_rows_of_repeated_layers_add_up_to_the_plans_communication():
    """Found by a probe: a row standing for two layers (x2) showed its representative's resharding cost (the
    first layer's, which reads the embedding's output) for both, so rows x count overstated the plan's
    communication (0.9535 against 0.9282 ms)."""
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 31))  # (an odd sequence: the layers' copies reshard differently)
    plan = spmd.plan(GPT(GPTConfig()), spec((2, 2), ("dp", "tp")), (ids, ids), loss_fn=lm_loss)
    assert any(r.count > 1 for r in plan.details.nodes)
    assert abs(sum(r.cost.comm_in * r.count for r in plan.details.nodes) - plan.comm_cost) < 1e-12


def test_the_node_rows_add_up_to_the_plans_compute_and_say_what_memory_no_row_holds():
    """Found by a probe: the Nodes table left out the ops that keep their input's layout (the bias gradients'
    sums: 21 nodes, 33 us of 15.5 ms), and nodes that computed nothing but held memory, so its rows fell short of the
    plan's compute and activations (35% of them) while it said it lists every costed node."""
    from spmd.core.graph_facts import format_bytes

    torch.manual_seed(0)
    ids = torch.randint(0, 64, (4, 8))
    plan = spmd.plan(GPT(GPTConfig(vocab=64, seq=8, dim=32, heads=4, layers=2)), spec((2, 2), ("dp", "tp")),
                     (ids, ids), loss_fn=lm_loss)
    rows = plan.details.nodes
    assert any(r.reason == "follows its input" and r.op.startswith("sum") for r in rows)
    assert abs(sum(r.cost.compute * r.count for r in rows) - plan.compute_cost) < 1e-12
    assert abs(sum(r.cost.comm_in * r.count for r in rows) - plan.comm_cost) < 1e-12
    unheld = sum(plan.memory.values()) - sum(r.cost.memory * r.count for r in rows)
    assert unheld > 0 and f"the plan's memory also counts {format_bytes(unheld)} that no node's row holds" in \
        plan.explain(), plan.explain()[-600:]


def test_an_input_split_on_the_batch_but_gathered_before_use_is_not_called_data_parallel(tmp_path):
    """Found by a probe: explain said "batch split on dp (data parallel)" from the input's pin alone, while the plan
    gathered it on dp before its first op and every dp rank computed the whole batch. Here a slow link and a small
    input make gathering it cheaper than gathering the wider output; the plan file keeps the note."""
    import dataclasses

    from torch.distributed.tensor import Replicate, Shard

    from spmd.core.profiles import LinkProfile
    from tests.support import SLOW_DEVICE

    fast = dataclasses.replace(SLOW_DEVICE, name="test-fast", flops=1e15, memory_bandwidth=1e15)
    plan = spmd.plan(torch.nn.Sequential(torch.nn.Linear(4, 256)),
                     spec((2,), ("dp",), link=LinkProfile("test-slow", 0.0, 1e6), device=fast), (torch.randn(8, 4),),
                     in_placements={"input": [Shard(0)]}, out_placements={0: [Replicate()]})
    assert [e.steps[0].kind for e in plan.edges] == ["all_gather"]  # (the input, before its matmul)
    said = "input input [S(0)]: its batch split on dp undone before any op reads it (gathered, or moved to another axis)"
    assert said in plan.explain() and "batch split on dp (data parallel)" not in plan.explain()
    plan.save(tmp_path / "plan.json")
    assert said in spmd.load_plan(tmp_path / "plan.json").explain()


def test_the_headline_names_the_runtimes_time_and_the_predicted_step():
    """Found by a probe: the headline said 71.784 ms per call where `predicted_step_s` said 73.07 ms, and nothing said
    why; the runtime's own time around the graphs (no plan changes it) is named, with the sum."""
    import dataclasses

    from tests.support import SLOW_DEVICE

    device = dataclasses.replace(SLOW_DEVICE, name="test-overhead", call_overhead_s=2e-3)
    plan = spmd.plan(MLP(16, 64), spec((2,), ("dp",), device=device), (torch.randn(4, 16),))
    head = plan.explain(detail=False).splitlines()[0]
    assert head.endswith(f"; with the runtime's 2.000 ms around the graphs, {plan.predicted_step_s * 1e3:.3f} ms per "
                         "call (predicted_step_s)"), head


class _TiedAndRead(torch.nn.Module):
    """A tied head (its weight the embedding's), and a layer whose weight the forward reads without calling it."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.mix = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 32, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        h = F.linear(self.emb(ids), self.mix.weight)  # (`self.mix` never called: Mamba's conv1d, read so)
        return self.head(h)


def test_the_module_table_names_modules_the_graph_never_enters_and_a_tied_heads_name():
    """Found by a probe: the module table left the type blank for a module whose weight is read directly or
    that is a tie's first name (T5's `shared`), and a tied head was listed nowhere."""
    torch.manual_seed(0)
    ids = torch.randint(0, 32, (4, 8))
    for training in (False, True):
        extra = dict(loss_fn=lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten())) if training else {}
        plan = spmd.plan(_TiedAndRead(), spec((2,), ("dp",)), (ids, ids) if training else (ids,), **extra)
        rows = {line.split()[0]: line for line in plan.explain(detail=False).splitlines()[3:] if line.startswith("  ")}
        assert rows["mix"].split()[1] == "Linear", rows
        assert rows["emb"].split()[1] == "Embedding" and rows["emb"].endswith("; also head (tied)"), rows
