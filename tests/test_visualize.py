"""Pictures of the sharded graph: the GPT example on a 2x2 mesh, planned without processes."""
import functools
import re
import shutil

import pytest
import torch
import torch.nn.functional as F

import spmd
from examples.models import GPT, MLP, GPTConfig
from spmd.cost_model.profiles import LinkProfile
from spmd.visualize import MissingGraphvizWarning, to_dot
from tests.cases import LATENCY_LINK, SLOW_DEVICE, spec

needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz `dot` not installed")


@functools.lru_cache(maxsize=None)
def gpt_plan():
    """GPT (2 blocks) on (dp=2, tp=2): batch 2 splits on dp, the odd sequence never, so tp shards the
    weights Megatron-style (one all_reduce per attention and per MLP). Shared by the test modules."""
    torch.manual_seed(0)
    slow_outer = LinkProfile("test-outer", 10 * LATENCY_LINK.latency_s, LATENCY_LINK.bandwidth / 10)
    mesh = spmd.MeshSpec((2, 2), ("dp", "tp"), (slow_outer, LATENCY_LINK), SLOW_DEVICE)
    return spmd.plan(GPT(GPTConfig()), mesh, (torch.randint(0, 128, (2, 31)),))


def _node_groups(svg: str) -> dict[str, str]:
    """graphviz SVG: node name -> the text of its group."""
    groups = re.findall(r'<g id="[^"]+" class="node">\s*<title>([^<]+)</title>(.*?)</g>', svg, re.S)
    return {title: body for title, body in groups}


def _cluster_titles(svg: str) -> set[str]:
    return set(re.findall(r'<g id="[^"]+" class="cluster">\s*<title>([^<]+)</title>', svg))


@needs_dot
def test_gpt_svg_has_module_boxes_collectives_and_legend(tmp_path):
    plan = gpt_plan()
    out = plan.visualize(tmp_path / "gpt.svg")
    svg = out.read_text()
    assert out.suffix == ".svg" and svg.lstrip().startswith("<?xml")
    clusters = _cluster_titles(svg)
    for box in ("cluster_blocks.0", "cluster_blocks.1", "cluster_blocks.0.attn", "cluster_blocks.0.attn.q_proj",
                "cluster_blocks.1.mlp.fc2", "cluster_lm_head", "cluster_legend"):
        assert box in clusters, box
    nodes = _node_groups(svg)
    collectives = {name: body for name, body in nodes.items() if name.startswith("all_reduce")}
    assert len(collectives) == len(plan.collectives()) == 4
    for body in collectives.values():  # kind, mesh axis, bytes per rank (1 x 31 x 64 fp32), time
        assert "all_reduce(sum)" in body
        assert "on tp · 7.8 KiB · 1.00 ms" in body
        assert 'fill="#d62728"' in body  # eye-catching red
    # ops show their placement per mesh axis and local shape; q_proj is column-parallel on tp
    assert "dp: S(0)" in nodes["addmm"] and "tp: S(1)" in nodes["addmm"]
    assert "[1, 32] of [2, 64]" not in nodes["addmm"] and "[31, 32] of [62, 64]" in nodes["addmm"]
    assert "weight" in nodes["p_blocks_0_attn_q_proj_weight"] and "tp: S(0)" in nodes["p_blocks_0_attn_q_proj_weight"]
    assert "sharded graph on mesh (dp=2, tp=2)" in svg and "all_reduce on tp x4" in svg
    assert "Partial: the sum over the axis" in svg  # the legend
    # views are drawn through: no view/permute nodes, but the data flow survives them
    assert not any(name.startswith(("view", "permute")) for name in nodes)


@needs_dot
def test_collapse_folds_identical_blocks(tmp_path):
    svg = gpt_plan().visualize(tmp_path / "gpt.svg", collapse=True).read_text()
    clusters = _cluster_titles(svg)
    assert "cluster_blocks.0" in clusters and "cluster_blocks.1" not in clusters
    folds = {n: b for n, b in _node_groups(svg).items() if n.startswith("fold_")}
    assert len(folds) == 1
    (body,) = folds.values()
    assert "1 more block like blocks.0" in body and "each: 2x all_reduce on tp" in body
    assert not any(n.startswith("addmm_6") for n in _node_groups(svg))  # blocks.1's ops are folded


def test_dot_source_and_views_option(tmp_path):
    plan = gpt_plan()
    path = plan.visualize(tmp_path / "gpt.dot")
    source = path.read_text()
    assert source.startswith("digraph spmd") and "subgraph \"cluster_blocks.0\"" in source
    assert "\tview_1 [" not in source
    assert "\tview_1 [" in to_dot(plan, views=True)


@needs_dot
def test_html_embeds_the_svg_and_the_plan(tmp_path):
    page = gpt_plan().visualize(tmp_path / "gpt.html").read_text()
    assert page.startswith("<!doctype html>") and "<svg" in page and "<?xml" not in page
    assert "Collectives per call" in page and "column-parallel on tp" in page


def test_without_dot_writes_the_source_and_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    plan = gpt_plan()
    with pytest.warns(MissingGraphvizWarning, match=r"apt-get install -y graphviz"):
        written = plan.visualize(tmp_path / "gpt.svg")
    assert written == tmp_path / "gpt.dot" and written.read_text().startswith("digraph")
    assert not (tmp_path / "gpt.svg").exists()
    with pytest.warns(MissingGraphvizWarning):
        page = plan.visualize(tmp_path / "gpt.html").read_text()
    assert "digraph spmd" in page and "apt-get install -y graphviz" in page and "Collectives per call" in page


def test_loaded_plan_cannot_be_drawn(tmp_path):
    gpt_plan().save(tmp_path / "plan.json")
    with pytest.raises(spmd.SpmdError, match="carries no graph"):
        spmd.load_plan(tmp_path / "plan.json").visualize(tmp_path / "x.svg")


def test_training_graph_has_forward_and_backward_boxes(tmp_path):
    """The joint graph: module paths without the loss wrapper's prefix, backward under its own box."""
    torch.manual_seed(0)
    plan = spmd.plan(MLP(16, 64), spec((2,), ("dp",)), (torch.randn(8, 16), torch.randn(8, 16)),
                     loss_fn=lambda y, t: F.mse_loss(y, t))
    source = to_dot(plan)
    for box in ("cluster_forward", "cluster_backward", "cluster_forward_fc1", "cluster_backward_fc2"):
        assert f'"{box}"' in source or f"subgraph {box} " in source, box
    assert "model.fc1" not in source
    assert "all_reduce" in source  # the gradient reductions on dp


def test_compiled_module_visualizes_and_explains(tmp_path):
    """CompiledModule keeps the plan's sources; one rank's graph, built without a process group."""
    from spmd.pipeline import Compilation, run_pipeline
    from spmd.runtime.compiled import CompiledModule

    torch.manual_seed(0)
    from torch.distributed.tensor import Replicate, Shard

    from spmd.passes.enumerate_strategies import Pins

    torch.manual_seed(0)  # the batch pinned to dp, as in test_explain's golden plan
    c = run_pipeline(Compilation(MLP(16, 64), (torch.randn(2, 16),), spec((2, 2), ("dp", "tp")), rank=0,
                                 group_names=("g_dp", "g_tp"), pins=Pins({"x": [Shard(0), Replicate()]})))
    compiled = CompiledModule(c)
    assert compiled.visualize(tmp_path / "mlp.dot").read_text().startswith("digraph")
    assert re.search(r"fc1  Linear  column-parallel on (dp|tp)", compiled.explain())  # the axes tie here
