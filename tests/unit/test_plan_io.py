"""Plan files (JSON round trip), differences between plans, and the DTensor parallelize_module export."""
import json

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import spmd
from tests.models import MLP
from spmd.core.mesh import MeshSpec
from spmd.core.specs import placement_from_text, placement_str
from spmd.report.plan_io import SCHEMA, VERSION
from tests.support import megatron_gpt_plan, spec


def _mlp(**pins):
    torch.manual_seed(0)
    return spmd.plan(MLP(16, 64), spec((2,), ("dp",)), (torch.randn(8, 16),), **pins)


def test_placements_as_text():
    """One spelling everywhere (dumps, plans, pictures, files); files from before it said P(sum)."""
    for p, text in ((Shard(0), "S(0)"), (Shard(2), "S(2)"), (Replicate(), "R"), (Partial("sum"), "P"),
                    (Partial("max"), "P(max)")):
        assert placement_str(p) == text and placement_from_text(text) == p
    assert placement_from_text("P(sum)") == Partial("sum")
    with pytest.raises(ValueError, match="not a placement"):
        placement_from_text("Shard(0)")


def test_json_round_trip_keeps_everything_explain_needs(tmp_path):
    plan = megatron_gpt_plan()
    path = tmp_path / "plan.json"
    plan.save(path)
    doc = json.loads(path.read_text())
    assert (doc["schema"], doc["version"], doc["fingerprint"]) == (SCHEMA, VERSION, plan.fingerprint())
    assert doc["choices"]["addmm_3"]["outputs"] == [["S(0)", "P"]]  # as dumps and plans print it
    assert doc["mesh"]["axis_names"] == ["dp", "tp"]
    loaded = spmd.load_plan(path)
    assert loaded.fingerprint() == plan.fingerprint()
    assert str(loaded) == str(plan)
    assert loaded.explain() == plan.explain()
    assert loaded.collective_summary() == plan.collective_summary()
    assert loaded.mesh == plan.mesh and loaded.objective == plan.objective
    assert not spmd.diff_plans(plan, loaded)
    # saving again gives the same bytes: stable files diff well in version control
    loaded.save(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_text() == path.read_text()
    # a file written before the one spelling (Partial as "P(sum)") reads as the same plan
    (tmp_path / "old.json").write_text(path.read_text().replace('"P"', '"P(sum)"'))
    assert spmd.load_plan(tmp_path / "old.json").fingerprint() == plan.fingerprint()


def test_a_plan_over_gloo_links_saves_the_same_bytes_again(tmp_path):
    """Found by a probe: the gloo link's large-message sizes were saved as written (8388608) and loaded as floats,
    so a loaded plan saved again differed (8388608.0), against the docs' "the same bytes"."""
    from spmd.core.profiles import link_profile_for
    from tests.support import SLOW_DEVICE

    gloo = link_profile_for("gloo")
    assert gloo.large_messages  # (what the bytes differed in)
    plan = spmd.plan(MLP(16, 64), MeshSpec((2,), ("dp",), (gloo,), SLOW_DEVICE), (torch.randn(4, 16),))
    plan.save(tmp_path / "plan.json")
    spmd.load_plan(tmp_path / "plan.json").save(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_text() == (tmp_path / "plan.json").read_text()


def test_load_rejects_other_versions_and_edited_plans(tmp_path):
    _mlp().save(tmp_path / "p.json")
    doc = json.loads((tmp_path / "p.json").read_text())
    (tmp_path / "v.json").write_text(json.dumps({**doc, "version": VERSION + 1}))
    with pytest.raises(ValueError, match="re-plan"):
        spmd.load_plan(tmp_path / "v.json")
    doc["choices"]["x"]["outputs"] = [["R"]]
    (tmp_path / "e.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="fingerprint"):
        spmd.load_plan(tmp_path / "e.json")


def test_a_plan_for_a_cpu_mesh_loads_back(tmp_path):
    """Found by a review: the CPU device and gloo link profiles hold whole numbers that read back as floats, and
    their plan files were refused as edited."""
    from spmd.core.mesh import MeshSpec
    from spmd.core.profiles import device_profile_for, link_profile_for

    torch.manual_seed(0)
    mesh = MeshSpec((2,), ("dp",), (link_profile_for("gloo"),), device_profile_for("cpu"))
    plan = spmd.plan(MLP(16, 64), mesh, (torch.randn(4, 16),))
    plan.save(tmp_path / "cpu.json")
    assert spmd.load_plan(tmp_path / "cpu.json").fingerprint() == plan.fingerprint()
    # a version 1 file with its digest (written before version 2, over its own version) loads too (a review)
    from spmd.report import plan_io

    doc = {**json.loads((tmp_path / "cpu.json").read_text()), "version": 1}
    doc["digest"] = plan_io._digest(doc)
    (tmp_path / "v1.json").write_text(json.dumps(doc))
    assert spmd.load_plan(tmp_path / "v1.json").fingerprint() == plan.fingerprint()


def test_load_rejects_plan_files_edited_beyond_their_choices(tmp_path):
    """Found by a probe: a mesh edited to (4, 4), parameter roles edited to "replicated" and an edited objective
    loaded, and the plan then described itself with them (the fingerprint covers the choices and steps alone)."""
    _mlp().save(tmp_path / "p.json")
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["mesh"]["shape"] == [2]
    for edit in (lambda d: d["mesh"].update(shape=[4]), lambda d: d.update(objective=d["objective"] / 2),
                 lambda d: d["details"]["params"][0].update(roles=["column-parallel"])):
        edited = json.loads(json.dumps(doc))
        edit(edited)
        (tmp_path / "e.json").write_text(json.dumps(edited))
        with pytest.raises(ValueError, match=r"edited since it was saved.*re-plan"):
            spmd.load_plan(tmp_path / "e.json")
    for key in ("digest", "fingerprint"):  # (deleting the evidence is an edit too)
        (tmp_path / "e.json").write_text(json.dumps({k: v for k, v in doc.items() if k != key}))
        with pytest.raises(ValueError, match=rf"e\.json: the plan file has no {key} \(edited since it was saved.*re-plan"):
            spmd.load_plan(tmp_path / "e.json")
    doc["choices"]["x"]["outputs"] = [["Q"]]  # (a placement no plan writes: the file and the way out named)
    (tmp_path / "e.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"e\.json: not a plan file as written \(not a placement: 'Q'.*What to do"):
        spmd.load_plan(tmp_path / "e.json")


def test_diff_names_changed_placements_collectives_and_costs():
    a = _mlp()  # data parallel: batch split, weights replicated, no collectives in forward
    b = _mlp(param_placements={"fc1.weight": [Shard(0)]})  # forced column-parallel on dp
    d = spmd.diff_plans(a, b)
    assert d
    changed = {name: (x, y) for name, x, y in d.placements}
    assert changed["fc1.weight"] == ("[R]", "[S(0)]")
    text = str(d)
    assert "fc1.weight  [R] -> [S(0)]" in text
    assert "estimated time:" in text and "ms (+" in text
    assert d.collectives and all(x != y for x, y in d.collectives.values())
    for (kind, axis), (x, y) in d.collectives.items():  # (with the bytes they move: a probe saw counts alone)
        moved = d.counted_bytes[kind, axis]
        assert f"  {kind} on {axis}: {x} -> {y} ({y - x:+d}), {moved[0] / 2**10:.1f} -> {moved[1] / 2**10:.1f} KiB" \
            in text, text
    assert str(spmd.diff_plans(a, a)) == "plans are the same (placements, collectives and costs)"


def test_diff_names_sizes_links_and_costs_where_the_layouts_agree():
    """Found by a probe: plans of a GPT 64 and 128 wide (the same placements, twice the collective bytes, 3x the
    time), or on the same mesh with other links, were "the same" and the CLI exited 0. The mesh is compared with
    its links and device, the collectives' bytes where their counts agree, and the costs."""
    import dataclasses

    torch.manual_seed(0)
    mesh = spec((2, 2), ("dp", "tp"))
    example = (torch.randn(8, 16),)
    pins = dict(param_placements={"fc1.weight": [Replicate(), Shard(0)], "fc2.weight": [Replicate(), Shard(1)]},
                in_placements={"x": [Shard(0), Replicate()]})
    narrow = spmd.plan(MLP(16, 64), mesh, example, **pins)
    wide = spmd.plan(MLP(32, 128), mesh, (torch.randn(8, 32),), **pins)
    d = spmd.diff_plans(narrow, wide)
    assert d and not d.layout_differs and d.costs_differ
    assert str(d).startswith("placements and collectives are the same; the sizes or costs differ")
    assert d.collective_bytes and all(b == 2 * a for a, b in d.collective_bytes.values()), d.collective_bytes
    slow = dataclasses.replace(mesh, links=(mesh.links[0], dataclasses.replace(mesh.links[1],
                                                                               latency_s=mesh.links[1].latency_s * 3)))
    d = spmd.diff_plans(narrow, spmd.plan(MLP(16, 64), slow, example, **pins))
    assert d.mesh is not None and "tp: " in d.mesh[1] and str(d).splitlines()[0].startswith("mesh: (dp=2, tp=2) [")


def test_diff_names_graphs_whose_ops_differ_where_nodes_and_costs_agree(tmp_path):
    """Found by a probe: a GPT with 4 heads against one with 8 (or causal against bidirectional) has the same
    nodes, parameters and costs, and the diff said "plans are the same". Each plan keeps a digest of its ops, the
    numbers they take and their shapes (`stats["graph"]`), saved with it."""
    from tests.models import GPT, GPTConfig

    tokens = torch.randint(0, 64, (2, 16))
    plans = []
    for heads in (4, 8):
        torch.manual_seed(0)
        plans.append(spmd.plan(GPT(GPTConfig(layers=2, dim=32, heads=heads, vocab=64, seq=16)), spec((2,), ("dp",)),
                               (tokens,), stamp_layers=False))
    d = spmd.diff_plans(*plans)
    assert d and d.ops_differ and not d.graphs_differ, str(d)
    assert "the graphs' ops take other numbers or give other shapes" in str(d)
    plans[1].save(tmp_path / "b.json")
    assert spmd.diff_plans(plans[0], spmd.load_plan(tmp_path / "b.json")).ops_differ
    assert not spmd.diff_plans(plans[0], plans[0])


def test_to_parallelize_plan_on_gpt(tmp_path):
    """Megatron's MLP exports as is; attention, whose code views to the whole head count, and the
    logits, which parallelize_module's user gets whole, are gathered (tests/e2e/test_parallelize_export.py
    runs it). A plan file keeps that; one from before it says the check was not made."""
    plan = megatron_gpt_plan()
    with pytest.warns(UserWarning, match="not expressed as parallel styles"):
        styles = plan.to_parallelize_plan()
    assert styles.axis == "tp"
    assert isinstance(styles["blocks.0.attn.q_proj"], ColwiseParallel)
    assert styles["blocks.0.attn.q_proj"].output_layouts == (Replicate(),)
    assert isinstance(styles["blocks.1.mlp.fc2"], RowwiseParallel)
    assert styles["blocks.1.mlp.fc2"].input_layouts == (Shard(-1),)
    assert isinstance(styles["lm_head"], ColwiseParallel) and styles["lm_head"].output_layouts == (Replicate(),)
    assert "blocks.0.ln1" not in styles and "tok_emb" not in styles
    assert len(styles.notes) == 4 and "view" in styles.notes[0] and "each rank's 2" in styles.notes[0]
    assert styles.notes[2] == "the model's output 0 is [S(2)] in the plan (each rank returns its piece); the styles " \
        "return it whole"
    assert styles.notes[3].startswith("input 'tokens' is split on dp ([S(0), R]): data parallel there")

    plan.save(tmp_path / "plan.json")
    with pytest.warns(UserWarning):
        loaded = spmd.load_plan(tmp_path / "plan.json").to_parallelize_plan()
    assert loaded.notes == styles.notes and loaded.keys() == styles.keys()
    assert all(repr(loaded[k].__dict__) == repr(styles[k].__dict__) for k in styles)
    doc = json.loads((tmp_path / "plan.json").read_text())
    del doc["details"]["style_regions"], doc["digest"]  # (a version 1 file, from before both)
    doc["version"] = 1
    (tmp_path / "old.json").write_text(json.dumps(doc))
    with pytest.warns(UserWarning, match="predates the check"):
        spmd.load_plan(tmp_path / "old.json").to_parallelize_plan()


def test_to_parallelize_plan_says_what_it_cannot_express():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64))
    plan = spmd.plan(model, spec((2,), ("tp",)), (torch.randn(3, 16),),
                     param_placements={"0.weight": [Shard(0)], "1.weight": [Shard(0)]})
    with pytest.warns(UserWarning, match=r"1\.weight \(LayerNorm\): FSDP on tp, no parallel style"):
        styles = plan.to_parallelize_plan()  # the LayerNorm weight is stored sharded, gathered for use
    assert isinstance(styles["0"], ColwiseParallel) and "1" not in styles
    assert any("0.bias: replicated on tp" in n for n in styles.notes)  # Colwise would shard the bias


def test_diff_matches_parameters_by_name_and_names_recomputation():
    """Found by a probe: training plans name parameters primals_1, primals_2, ... in order, so one more
    parameter shifted every name and the diff reported fc1.weight [S(0)] -> [R] where nothing changed. Now
    parameters and inputs are matched by FQN and name; ops only when both plans come from the same graph.
    A change in recomputation alone is a difference too (it was ignored)."""
    import dataclasses

    class Scaled(MLP):
        def __init__(self):
            super().__init__(16, 64)
            self.register_parameter("a_scale", nn.Parameter(torch.ones(16)))  # registered first: primals_1

        def forward(self, x):
            return super().forward(x) * self.a_scale

    torch.manual_seed(0)
    x = torch.randn(8, 16)
    a = spmd.plan(MLP(16, 64), spec((2,), ("dp",)), (x,), training=True)
    b = spmd.plan(Scaled(), spec((2,), ("dp",)), (x,), training=True)
    d = spmd.diff_plans(a, b)
    assert d.graphs_differ and d.only_b == ["a_scale"] and d.only_a == []
    assert all(name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "x") for name, _, _ in d.placements)
    assert "the graphs differ" in str(d)

    again = dataclasses.replace(a, recompute=("blocks.0",))
    d = spmd.diff_plans(a, again)
    assert d and d.recompute == [("blocks.0", "saved", "recomputed")] and not d.placements
    assert "blocks.0  saved -> recomputed" in str(d)


def test_diff_across_meshes_compares_the_pieces_a_layout_makes():
    """Found by a probe: a data-parallel plan on (2, 2) against the same on (4,) listed every weight as changed,
    `[R, R] -> [R]`. Across meshes of other shapes a layout is compared by its pieces per dim."""
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    square = spmd.plan(MLP(16, 64), spec((2, 2), ("dp", "tp")), (x,), in_placements={"x": [Shard(0), Shard(0)]},
                       param_placements={"fc1.weight": [Replicate(), Replicate()], "fc2.weight": [Replicate(), Shard(1)]})
    line = spmd.plan(MLP(16, 64), spec((4,), ("dp",)), (x,), in_placements={"x": [Shard(0)]},
                     param_placements={"fc1.weight": [Replicate()], "fc2.weight": [Replicate()]})
    d = spmd.diff_plans(square, line)
    changed = {name: (x, y) for name, x, y in d.placements}
    assert d.mesh is not None and "x" not in changed and "fc1.weight" not in changed, str(d)
    assert changed["fc2.weight"] == ("[R, S(1)]", "[R]"), str(d)  # (split in 2 against whole: a change)


def test_to_parallelize_plan_leaves_buffer_updates_out_of_the_outputs():
    """Found by a probe: batch norm's running statistics, updated in place by a train-mode forward, were noted as
    "the model's output 1 is [S(0)] in the plan"; their buffers' layouts are noted with the parameters."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 8))
    plan = spmd.plan(model, spec((2,), ("tp",)), (torch.randn(8, 16),), training=True,
                     param_placements={"0.weight": [Shard(0)]})
    with pytest.warns(UserWarning, match="not expressed as parallel styles"):
        styles = plan.to_parallelize_plan()
    assert not any("the model's output" in n for n in styles.notes), styles.notes
    assert any(n.startswith("1.running_mean (BatchNorm1d)") for n in styles.notes), styles.notes
