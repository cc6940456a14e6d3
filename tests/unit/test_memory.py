"""The schedule's live-bytes peak (cost_model/memory.py): what is alive at the worst point, by hand."""
import re

import pytest
import torch
from torch.distributed.tensor import Shard

import spmd
from spmd.core.graph_facts import format_bytes
from tests.models import MLP
from tests.support import LATENCY_LINK, SLOW_DEVICE, compile_graph

MESH = spmd.MeshSpec((2,), ("dp",), (LATENCY_LINK,), SLOW_DEVICE)


def test_forward_peak_is_two_hidden_activations():
    """fc1 -> gelu -> fc2 on a batch of 4: fc1's output (4 x 64 floats) is still alive while gelu
    writes its own, so the peak is two of them, each the size of this rank's shard."""
    torch.manual_seed(0)
    model, x = MLP(16, 64), torch.randn(4, 16)
    whole = spmd.plan(model, spmd.MeshSpec((1,), ("dp",), (LATENCY_LINK,), SLOW_DEVICE), (x,))
    assert whole.memory["temporaries"] == 2 * 4 * 64 * 4
    assert whole.stats["peak_live_at"] == "gelu"
    split = spmd.plan(model, MESH, (x,), in_placements={"x": [Shard(0)]})
    pieces = [2 if isinstance(split.choices[n].outputs[0][0], Shard) else 1 for n in ("addmm", "gelu")]
    assert split.memory["temporaries"] == sum(4 * 64 * 4 / p for p in pieces)


def test_training_temporaries_come_on_top_of_saved_activations_and_fit_the_budget():
    torch.manual_seed(0)
    model = MLP(16, 64)
    inputs = (torch.randn(8, 16), torch.randn(8, 16))
    free = spmd.plan(model, MESH, inputs, loss_fn=torch.nn.functional.mse_loss)
    assert free.memory["activations"] > 0
    # the schedule holds more than the row (what is held when backward starts): gradients and temporaries;
    # less than every kind at its most at once (every gradient is held only when backward ends)
    row = sum(b for k, b in free.memory.items() if k not in ("gradients", "optimizer step", "temporaries"))
    assert row < free.predicted_peak_bytes < sum(free.memory.values())
    budget = 0.8 * free.predicted_peak_bytes
    tight = spmd.plan(model, MESH, inputs, loss_fn=torch.nn.functional.mse_loss, memory_budget=budget)
    assert tight.predicted_peak_bytes <= budget
    assert tight.memory_budget == budget


def test_budget_without_room_for_temporaries_keeps_the_plan_and_warns():
    """On one device every plan is the same: a budget its terms fit but its temporaries overflow gets
    that plan back with a warning naming the real budget, not an error about a smaller one."""
    torch.manual_seed(0)
    one = spmd.MeshSpec((1,), ("dp",), (LATENCY_LINK,), SLOW_DEVICE)
    model, inputs = MLP(16, 64), (torch.randn(8, 16), torch.randn(8, 16))
    free = spmd.plan(model, one, inputs, loss_fn=torch.nn.functional.mse_loss)
    row = sum(b for k, b in free.memory.items() if k not in ("gradients", "optimizer step", "temporaries"))  # when backward starts
    budget = (row + free.predicted_peak_bytes) / 2
    with pytest.warns(UserWarning, match=rf"memory_budget {re.escape(format_bytes(budget))}.*no plan fits whole "
                      r"\(proven"):
        tight = spmd.plan(model, one, inputs, loss_fn=torch.nn.functional.mse_loss, memory_budget=budget)
    assert tight.predicted_peak_bytes == free.predicted_peak_bytes


def test_resharded_copies_are_alive_while_their_readers_run():
    """A weight stored sharded and all_gathered for its matmul (FSDP): the gathered copy (64 x 16
    floats) is alive from the transpose that reads it until the addmm that reads the transpose."""
    from torch.distributed.tensor import Replicate

    from spmd.cost_model.memory import peak_live_bytes
    from spmd.core.plan import Edge

    torch.manual_seed(0)
    model, x = MLP(16, 64), torch.randn(4, 16)
    c = compile_graph(model, (x,), spmd.MeshSpec((1,), ("dp",), (LATENCY_LINK,), SLOW_DEVICE))
    args = (c.traced.graph, c.plan.choices, c.traced.tensor_info, (1,))
    assert peak_live_bytes(*args) == (2 * 4 * 64 * 4, "gelu")
    weight = next(i.placeholder for i in c.traced.inputs if i.name == "fc1.weight")
    reader = next(iter(next(n for n in c.traced.graph.nodes if n.name == weight).users))
    gather = Edge((weight, 0), reader.name, 0, (Shard(0),), (Replicate(),), (), 0.0)
    assert peak_live_bytes(*args, edges=[gather]) == (64 * 16 * 4 + 4 * 64 * 4, "addmm")


def test_unreduced_gradients_do_not_outlive_backward_reads():
    """Data parallel: every weight's gradient is made whole (Partial) and reduced right where backward
    makes it, so the schedule's temporaries do not grow with depth (they did when each layer's unreduced
    gradient was held to the end of backward)."""
    from torch.distributed.tensor import Replicate

    from tests.models import GPT, GPTConfig
    from tests.support import lm_loss, spec

    temporaries = []
    for layers in (2, 6):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab=64, seq=4, dim=256, heads=4, layers=layers))
        tokens = torch.randint(0, 64, (2, 4))  # few tokens: weights outweigh activations
        plan = spmd.plan(model, spec((2,), ("dp",)), (tokens, tokens), loss_fn=lm_loss,
                         param_placements={k: [Replicate()] for k, _ in model.named_parameters()},
                         in_placements={"tokens": [Shard(0)], "targets": [Shard(0)]})
        temporaries.append(plan.memory["temporaries"])
    layer_bytes = sum(p.numel() * 4 for k, p in model.named_parameters() if k.startswith("blocks.0."))
    assert temporaries[1] - temporaries[0] < layer_bytes, temporaries


def test_hills_are_the_top_of_each_run_over_a_level():
    """`Schedule.hills`: the points where a plan holds more than a level, one per run of such points (its
    highest), highest first. By hand on fc1 -> gelu -> fc2: the one run over 1.5 KB tops at gelu (two
    4 x 64 activations); in training, every run the walk crosses at half the peak, each its own top."""
    from spmd.compiler.budget import schedule_of

    torch.manual_seed(0)
    model, x = MLP(16, 64), torch.randn(4, 16)
    one = spmd.MeshSpec((1,), ("dp",), (LATENCY_LINK,), SLOW_DEVICE)
    c = compile_graph(model, (x,), one)
    schedule = schedule_of(c.traced)
    assert [p.at for p in schedule.hills(c.plan, 1500.0, 4)] == ["gelu"]
    assert schedule.hills(c.plan, 2 * 4 * 64 * 4, 4) == []

    c = compile_graph(model, (x, torch.randn(4, 16)), one, loss_fn=torch.nn.functional.mse_loss)
    schedule = schedule_of(c.traced)
    points = list(schedule.walk(c.plan.choices, (1,), c.plan.edges))
    peak, worst = schedule.peak(c.plan.choices, (1,), c.plan.edges)
    level = peak / 2
    runs, top = [], None  # by hand: split the walk into runs over the level
    for live, i, made in points:
        if live > level:
            top = (live, i, made) if top is None or live > top[0] else top
        elif top is not None:
            runs, top = runs + [top], None
    runs += [top] if top is not None else []
    assert len(runs) >= 2
    hills = schedule.hills(c.plan, level, len(runs))
    assert [(p.index, p.made) for p in hills] == [(i, made) for _, i, made in sorted(runs, key=lambda r: -r[0])]
    assert hills[0] == worst
    assert len(schedule.hills(c.plan, level, 1)) == 1


@pytest.mark.parametrize("recompute", [True, "selective"])
def test_the_walk_of_a_recomputing_plan_is_the_walk_of_the_rank_graph_it_emits(recompute):
    """`Schedule.walk` with the plan's rebuilt regions holds what the rank graph recompute_layers emits
    holds (walked with the same rules, its copies and all): the same peak at the same node. On one H200
    the step's peak it predicts this way was measured to 1-2% for a GPT with every layer recomputed,
    whole or selectively (bench/results_gpu.md); counting the regions' frees at every point instead
    said 0.74x and 0.67x."""
    from types import SimpleNamespace

    from torch.distributed.tensor import Replicate

    from spmd.compiler.budget import schedule_of
    from spmd.cost_model.memory import Schedule
    from spmd.passes.solve_placements import rebuilt_regions
    from spmd.passes.trace_module import tensor_info_of
    from tests.models import GPT, GPTConfig
    from tests.support import lm_loss, spec

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=64, seq=32, dim=32, heads=4, layers=3))
    inputs = (torch.randint(0, 64, (8, 32)), torch.randint(0, 64, (8, 32)))
    c = compile_graph(model, inputs, spec((1,), ("dp",)), rank=0, loss_fn=lm_loss, recompute=recompute)
    assert len(c.plan.recompute) + len(c.plan.recompute_selective) == 3
    traced = schedule_of(c.traced)
    regions = rebuilt_regions(c.plan, c.recomputable)
    predicted, at = traced.peak(c.plan.choices, (1,), c.plan.edges, regions)

    graph = c.rank_gm.graph  # on one device, every value whole: bytes from the graph's own fake values
    assert any("spmd_recomputes" in n.meta for n in graph.nodes)
    info = {n.name: tensor_info_of(n) for n in graph.nodes if n.op != "output"}
    whole = {name: SimpleNamespace(outputs=tuple((Replicate(),) for _ in (i if isinstance(i, tuple) else (i,))))
             for name, i in info.items() if i is not None}
    gradients = {traced.nodes[i].name: p for i, ps in traced.gradient_at.items() for p in ps}
    emitted, there = Schedule(graph, info, set(gradients), gradients).peak(whole, (1,))
    assert (predicted, at.at) == (emitted, there.at)
    # saving every layer instead holds more
    assert traced.peak(c.plan.choices, (1,), c.plan.edges)[0] > 1.3 * predicted


def test_a_parameter_backward_never_reaches_holds_no_gradient_and_no_optimizer_state():
    """Backward makes no gradient for a parameter the loss does not reach (its graph output is None): the
    runtime leaves its .grad None, and torch's optimizers keep no state for it. The plan counted both."""
    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.used(x)

    torch.manual_seed(0)
    inputs = (torch.randn(4, 8), torch.randn(4, 8))
    plan = spmd.plan(TwoHeads(), spmd.MeshSpec((1,), ("dp",), (LATENCY_LINK,), SLOW_DEVICE), inputs,
                     loss_fn=torch.nn.functional.mse_loss)
    used = (8 * 8 + 8) * 4
    assert plan.memory["parameters"] == 2 * used
    assert plan.memory["gradients"] == used
    assert plan.memory["optimizer"] == 2 * used  # (AdamW: two states per element)


def test_the_optimizers_foreach_step_is_a_point_of_the_schedule_and_of_the_budget():
    """Found by a memory probe: AdamW's foreach step (torch's default on CUDA) makes the square root of every
    second moment at once, one more copy of the parameters beside every gradient and the state; a plan predicted
    1524 MiB per rank and the step measured 1.25x that. On a device whose optimizers step so, the plan counts it
    ("optimizer step", at the optimizer's step), and a budget keeps it in: the plan then shards the weights."""
    import dataclasses

    from spmd.core.profiles import LinkProfile

    torch.manual_seed(0)
    model = MLP(256, 256)
    inputs = (torch.randn(2, 256), torch.randn(2, 256))  # (a small batch: the weights decide the peak)
    loss = torch.nn.functional.mse_loss
    mesh = spmd.MeshSpec((2,), ("dp",), (LinkProfile("test-slow-link", 1e-2, 1e8),), SLOW_DEVICE)  # (replicated)
    plain = spmd.plan(model, mesh, inputs, loss_fn=loss)
    assert "optimizer step" not in plain.memory  # (a CPU steps tensor by tensor)
    foreach = dataclasses.replace(mesh, device=dataclasses.replace(SLOW_DEVICE, foreach_optimizer=True))
    free = spmd.plan(model, foreach, inputs, loss_fn=loss)
    assert free.memory["optimizer step"] == free.memory["parameters"] == pytest.approx(plain.memory["parameters"])
    step = sum(b for k, b in free.memory.items() if k not in ("activations", "temporaries"))
    assert free.predicted_peak_bytes == pytest.approx(step) and free.stats["peak_live_at"] == "the optimizer's step"
    assert free.predicted_peak_bytes > plain.predicted_peak_bytes
    budget = plain.predicted_peak_bytes  # (the peak without the step's temporaries: over it with them)
    tight = spmd.plan(model, foreach, inputs, loss_fn=loss, memory_budget=budget)
    assert tight.predicted_peak_bytes <= budget
    assert tight.memory["parameters"] < free.memory["parameters"]  # (weights sharded to make room)


def test_a_budget_the_unbudgeted_plan_breaks_only_at_the_optimizers_step_finds_a_plan_that_fits():
    """Found by a review: on a 2-D mesh the price search judges plans by the budget row and the walk's extra, and
    drops the row of the step from its relaxations; the plan over only at the optimizer's step came back, warned
    as the leanest found, where one that fits existed. The step is in the extra now, and a cut."""
    import dataclasses
    import warnings

    from tests.models import GPT, GPTConfig
    from tests.support import lm_loss, megatron_spec

    torch.manual_seed(0)
    model = GPT(GPTConfig())
    tokens = torch.randint(0, GPTConfig().vocab, (4, GPTConfig().seq))
    mesh = megatron_spec()
    mesh = dataclasses.replace(mesh, device=dataclasses.replace(mesh.device, foreach_optimizer=True))
    # (small gradient buckets: one of all the gradients, packed as backward ends, would hold more than the step)
    free = spmd.plan(model, mesh, (tokens, tokens), loss_fn=lm_loss, bucket_bytes=2**14)
    assert free.stats["peak_live_at"] == "the optimizer's step"
    budget = 0.9 * free.predicted_peak_bytes
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no "the leanest it found")
        tight = spmd.plan(model, mesh, (tokens, tokens), loss_fn=lm_loss, memory_budget=budget, bucket_bytes=2**14)
    step = sum(b for k, b in tight.memory.items() if k not in ("activations", "temporaries"))
    assert step <= tight.predicted_peak_bytes <= budget
