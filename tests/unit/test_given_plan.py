"""A plan solved before, given with `plan=` (a `PlanReport`, a `Plan` or a plan file's path): taken as it is
where it is this trace's plan, refused with every difference named where it is not (compiler/given_plan.py).
Compiling with one on gloo ranks: tests/e2e/test_given_plan.py."""
import dataclasses

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

import spmd
from spmd.core.errors import SpmdError
from tests.models import GPT, GPTConfig
from tests.support import lm_loss, spec

TP2 = spec((2,), ("tp",))


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=1))
    tokens = torch.randint(0, 128, (2, 32))
    planned = spmd.plan(model, TP2, (tokens, tokens), loss_fn=lm_loss,
                        param_placements={"blocks.0.mlp.fc1.weight": [Shard(0)]})
    return model, tokens, planned


def _refusal(model, inputs, mesh=TP2, **options) -> str:
    with pytest.raises(SpmdError) as e:
        spmd.plan(model, mesh, inputs, **options)
    return str(e.value)


@pytest.mark.parametrize("form", ["report", "file"])
def test_the_plan_given_is_the_plan_taken(gpt, tmp_path, form):
    model, tokens, planned = gpt
    given = planned
    if form == "file":
        given = tmp_path / "plan.json"
        planned.save(given)
    taken = spmd.plan(model, TP2, (tokens, tokens), loss_fn=lm_loss, plan=given, verify=True)
    assert (taken.fingerprint(), taken.solve_seconds) == (planned.fingerprint(), planned.solve_seconds)
    assert taken.explain(detail=False) == planned.explain(detail=False)
    # the pins it was solved with hold in it: given again, they are met
    again = spmd.plan(model, TP2, (tokens, tokens), loss_fn=lm_loss, plan=given,
                      param_placements={"blocks.0.mlp.fc1.weight": [Shard(0)]})
    assert again.fingerprint() == planned.fingerprint()


def test_a_plan_of_another_graph_is_refused(gpt):
    model, tokens, planned = gpt
    longer = torch.randint(0, 128, (4, 32))
    said = _refusal(model, (longer, longer), loss_fn=lm_loss, plan=planned)
    # (the shapes and dtypes that differ are named: a probe found a wider model, another batch or dtype refused
    # with the digest's words alone)
    assert "other shapes or dtypes: tokens is [2, 32] int64 in the plan, [4, 32] int64 here, targets is [2, 32] " \
           "int64 in the plan, [4, 32] int64 here" in said, said
    assert "What to do: plan again from this model with these inputs and options" in said
    torch.manual_seed(0)
    said = _refusal(GPT(GPTConfig(layers=1, heads=2)), (tokens, tokens), loss_fn=lm_loss, plan=planned)
    assert "its ops are not this graph's, or read other values (another model, configuration or forward" in said
    said = _refusal(GPT(GPTConfig(layers=1, dim=32)), (tokens, tokens), loss_fn=lm_loss, plan=planned)
    assert "other shapes or dtypes: tok_emb.weight is [128, 64] float32 in the plan, [128, 32] float32 here" in said
    said = _refusal(GPT(GPTConfig(layers=1)).double(), (tokens, tokens), loss_fn=lm_loss, plan=planned)
    assert "tok_emb.weight is [128, 64] float32 in the plan, [128, 64] float64 here" in said
    said = _refusal(model, (tokens, tokens), loss_fn=lambda logits, t: lm_loss(logits, t) * 2, plan=planned)
    assert "its loss function took the targets as targets, this compile's takes them as t: another loss_fn" in said


def test_a_plan_for_training_is_refused_for_inference(gpt):
    model, tokens, planned = gpt
    said = _refusal(model, (tokens,), plan=planned)
    assert "it is a plan for training (forward and backward), this compile is for inference (forward only)" in said
    assert said.count("\n  - ") == 1  # (nothing else: every op after the forward's differs)


def test_a_plan_for_another_mesh_is_refused(gpt):
    model, tokens, planned = gpt
    said = _refusal(model, (tokens, tokens), spec((2,), ("dp",)), loss_fn=lm_loss, plan=planned)
    assert "it was solved for a mesh of shape (2,) with axes ('tp',), this one is (2,) with axes ('dp',)" in said


def test_pins_the_plan_does_not_meet_are_refused(gpt):
    model, tokens, planned = gpt
    said = _refusal(model, (tokens, tokens), loss_fn=lm_loss, plan=planned,
                    param_placements={"blocks.0.mlp.fc1.weight": [Replicate()]},
                    in_placements={"tokens": [Shard(1)]})
    assert "param_placements pins 'blocks.0.mlp.fc1.weight' to [R]; the plan lays it out [S(0)]" in said
    assert "in_placements pins input 'tokens' to [S(1)]; the plan lays it out" in said


def test_solver_options_that_would_change_the_plan_are_refused(gpt):
    model, tokens, planned = gpt
    said = _refusal(model, (tokens, tokens), loss_fn=lm_loss, plan=planned, memory_budget=1e6, recompute=True)
    assert "memory_budget=1000000 was given, and the plan was solved under no budget" in said
    assert "recompute=True was given: the plan says which layers recompute" in said


def test_a_plan_with_no_digest_of_its_ops_is_refused(gpt):
    model, tokens, planned = gpt
    stats = {k: v for k, v in planned.stats.items() if k != "wired_graph"}
    old = dataclasses.replace(spmd.core.plan.Plan(**{f.name: getattr(planned, f.name)
                                                    for f in dataclasses.fields(spmd.core.plan.Plan)}), stats=stats)
    said = _refusal(model, (tokens, tokens), loss_fn=lm_loss, plan=old)
    assert "it keeps no digest of its ops and what each reads" in said


def test_the_same_ops_under_other_names_are_refused():
    class Named(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return self.fc(x)

    x = torch.randn(4, 8)
    planned = spmd.plan(nn.Sequential(nn.Linear(8, 8)), TP2, (x,))
    said = _refusal(Named(), (x,), plan=planned)
    assert "the plan's 0.bias, 0.weight, input are not among this compile's inputs, parameters and buffers; this " \
           "compile's fc.bias, fc.weight, x are not in the plan" in said


def test_the_same_ops_reading_other_values_are_refused():
    """`x * 2 + y` against `y * 2 + x`, both inputs of one shape: the same ops with the same shapes, which the plan
    would run with the collectives planned for the other input (found by a probe: 7.3 off one device)."""
    class XFirst(nn.Module):
        def forward(self, x, y):
            return x * 2 + y

    class YFirst(nn.Module):
        def forward(self, x, y):
            return y * 2 + x

    x, y = torch.randn(8, 8), torch.randn(8, 8)
    planned = spmd.plan(XFirst(), TP2, (x, y), in_placements={"x": [Shard(0)], "y": [Shard(1)]})
    said = _refusal(YFirst(), (x, y), plan=planned)
    assert "its ops are not this graph's, or read other values" in said


def test_what_the_plan_was_priced_with_is_taken_or_refused(gpt):
    """The optimizer state factor and the gradient bucket size: left at their defaults, the plan's are taken (its
    memory counts that optimizer state, its explanation those buckets); given otherwise, refused."""
    model, tokens, _ = gpt
    sgd = spmd.plan(model, TP2, (tokens, tokens), loss_fn=lm_loss, optimizer_state_factor=1, bucket_bytes=2**20)
    for taken in (spmd.plan(model, TP2, (tokens, tokens), loss_fn=lm_loss, plan=sgd),
                  spmd.plan(model, TP2, (tokens, tokens), options=spmd.PlanOptions(loss_fn=lm_loss, plan=sgd))):
        assert (taken.request.options.optimizer_state_factor, taken.request.options.bucket_bytes) == (1, 2**20)
    said = _refusal(model, (tokens, tokens), loss_fn=lm_loss, plan=sgd, optimizer_state_factor=0, bucket_bytes=2**21)
    assert "optimizer_state_factor=0 was given, and the plan was priced for 1" in said
    assert "bucket_bytes=2.0 MiB was given, and the plan was priced for 1.0 MiB" in said
    said = _refusal(model, (tokens, tokens), options=spmd.PlanOptions(loss_fn=lm_loss, optimizer_state_factor=4,
                                                                      plan=sgd))
    assert "optimizer_state_factor=4 was given" in said


def test_an_input_of_another_shape_behind_the_same_ops_is_refused():
    """`x + b` with `b` of [8] or of [1]: the same op with the same output (found by a review: the rank graphs then
    failed in torch, or would have waited at a collective)."""
    class Bias(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.b = nn.Parameter(torch.zeros(n))

        def forward(self, x):
            return x + self.b

    x = torch.randn(4, 8)
    planned = spmd.plan(Bias(8), TP2, (x,), param_placements={"b": [Shard(0)]})
    said = _refusal(Bias(1), (x,), plan=planned)
    assert "other shapes or dtypes: b is [8] float32 in the plan, [1] float32 here" in said


def test_a_stamped_plan_is_refused_where_every_layer_is_traced_with_the_way_out(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=8, dim=32))
    tokens = torch.randint(0, 128, (2, 32))
    stamped = spmd.plan(model, TP2, (tokens,))
    assert stamped.stats["stamped_layers"].startswith("blocks: 3 traced, 5 stamped")
    said = _refusal(model, (tokens,), plan=stamped, stamp_layers=False)
    assert "it was solved over layer stacks traced a few layers deep and stamped (blocks: 3 traced, 5 stamped); " \
           "this compile traced every layer (stamp_layers=False). Plan with stamp_layers=False to run it here" in said
    # the way out: a plan over every layer is traced so again, whether stamping is asked or not
    whole = spmd.plan(model, TP2, (tokens,), stamp_layers=False)
    assert spmd.plan(model, TP2, (tokens,), plan=whole).fingerprint() == whole.fingerprint()


def test_crossover_of_a_plan_taken_solves_the_other_sizes(gpt):
    """(found by a review: each other size was refused as another graph, and crossover said nothing changes)"""
    model, tokens, planned = gpt
    taken = spmd.plan(model, TP2, (tokens, tokens), loss_fn=lm_loss, plan=planned,
                      param_placements={"blocks.0.mlp.fc1.weight": [Shard(0)]})
    found = [[(c.between, c.changed) for c in p.crossover(sizes=[1, 2, 8])] for p in (taken, planned)]
    assert found[0] == found[1] and found[0], found


def test_what_is_not_a_plan_is_refused(gpt, tmp_path):
    model, tokens, _ = gpt
    said = _refusal(model, (tokens, tokens), loss_fn=lm_loss, plan={"choices": {}})
    assert "plan must be a solved plan (spmd.plan's result, or spmd.load_plan(path)) or the path of a plan file, " \
           "got dict" in said
    said = _refusal(model, (tokens, tokens), loss_fn=lm_loss, plan=str(tmp_path / "missing.json"))
    assert said.startswith(f"plan={str(tmp_path / 'missing.json')!r}: cannot be read")
    assert "What to do: give the path of a plan file" in said
    (tmp_path / "notes.json").write_text("[1, 2]")
    said = _refusal(model, (tokens, tokens), loss_fn=lm_loss, plan=tmp_path / "notes.json")
    assert "not a plan file (a JSON list, not an object)" in said


def test_a_plan_whose_edges_disagree_with_its_choices_is_refused(gpt):
    """Found by a probe: a plan file edited (a weight's choice made replicated) and signed again compiled, its
    choices saying one thing and the rank graphs, made from its edges, running the old plan; without the
    signatures, the ranks failed at the first call on a shape. Each edge's ends are checked against the choices
    now, and a value read otherwise than it is made needs an edge."""
    from spmd.core.plan import Plan

    model, tokens, planned = gpt
    plan = Plan(**{f.name: getattr(planned, f.name) for f in dataclasses.fields(Plan)})
    weight = next(ph for ph, name in plan.labels.items() if name == "blocks.0.mlp.fc1.weight")
    assert plan.choices[weight].outputs == ((Shard(0),),)
    edited = dataclasses.replace(plan, choices={**plan.choices, weight: dataclasses.replace(
        plan.choices[weight], outputs=((Replicate(),),))})
    said = _refusal(model, (tokens, tokens), loss_fn=lm_loss, plan=edited)
    assert "its edges (the reshardings) disagree with its choices: " in said and f"reads {weight} as [S(0)], made " \
        "as [R], and no edge reshards it" in said, said
    # (and an edge whose ends are not the choices', or that takes another value with the same ends: a review found
    # that one given the other value's resharding, 0.0028 off, its fingerprint unchanged)
    edge = plan.edges[0]
    moved = dataclasses.replace(plan, edges=(dataclasses.replace(edge, src=edge.dst), *plan.edges[1:]))
    said = _refusal(model, (tokens, tokens), loss_fn=lm_loss, plan=moved)
    assert f"the edge into {edge.consumer} (slot {edge.slot}) takes {edge.value[0]} from" in said, said
    other = next(e for e in plan.edges if e.value != edge.value)
    relabelled = dataclasses.replace(plan, edges=tuple(dataclasses.replace(e, value=other.value) if e is edge else e
                                                       for e in plan.edges))
    said = _refusal(model, (tokens, tokens), loss_fn=lm_loss, plan=relabelled)
    assert f"the edge into {edge.consumer} (slot {edge.slot}) takes {other.value[0]} from" in said, said


def test_a_plan_file_without_its_fingerprint_is_refused_whatever_its_version(gpt, tmp_path):
    """Found by a probe: a file set to version 1 with its fingerprint and digest taken off loaded unchecked, its
    edits shown as the plan (predicted memory 123 B) and taken by compile."""
    import json

    _, _, planned = gpt
    planned.save(tmp_path / "plan.json")
    doc = json.loads((tmp_path / "plan.json").read_text())
    for version in (1, 2):
        old = {k: v for k, v in doc.items() if k not in ("fingerprint", "digest")}
        (tmp_path / "old.json").write_text(json.dumps({**old, "version": version}))
        with pytest.raises(ValueError, match=r"the plan file has no fingerprint"):
            spmd.load_plan(tmp_path / "old.json")
