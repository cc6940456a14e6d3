"""Pictures rendered by a process of their own (hence e2e): graphviz's `dot` when on PATH, else the
pip-installed `graphviz-pure`. Module boxes, collectives in red, folded repeated blocks, the
self-contained HTML page, valid SVG and PNG files, and graphviz-pure standing in for a missing `dot`."""
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from spmd.report.render import MissingGraphvizWarning, find_renderer
from tests.support import megatron_gpt_plan

needs_renderer = pytest.mark.skipif(find_renderer() is None,
                                    reason="neither graphviz's `dot` nor `graphviz-pure` is installed")


@pytest.fixture
def without_dot(monkeypatch):
    """`dot` hidden (wherever it is looked for), so the fallback renders; skips without graphviz-pure."""
    which = shutil.which

    def no_dot(name, *args, **kwargs):
        return None if Path(name).name == "dot" else which(name, *args, **kwargs)

    monkeypatch.setattr(shutil, "which", no_dot)
    if find_renderer() is None:
        pytest.skip("graphviz-pure is not installed")


def _node_groups(svg: str) -> dict[str, str]:
    """graphviz SVG: node name -> the text of its group."""
    groups = re.findall(r'<g id="[^"]+" class="node">\s*<title>([^<]+)</title>(.*?)</g>', svg, re.S)
    return {title: body for title, body in groups}


def _cluster_titles(svg: str) -> set[str]:
    return set(re.findall(r'<g id="[^"]+" class="cluster">\s*<title>([^<]+)</title>', svg))


@needs_renderer
def test_gpt_svg_has_module_boxes_collectives_and_legend(tmp_path):
    plan = megatron_gpt_plan()
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


@needs_renderer
def test_collapse_folds_identical_blocks(tmp_path):
    svg = megatron_gpt_plan().visualize(tmp_path / "gpt.svg", collapse=True).read_text()
    clusters = _cluster_titles(svg)
    assert "cluster_blocks.0" in clusters and "cluster_blocks.1" not in clusters
    folds = {n: b for n, b in _node_groups(svg).items() if n.startswith("fold_")}
    assert len(folds) == 1
    (body,) = folds.values()
    assert "1 more block like blocks.0" in body and "each: 2x all_reduce on tp" in body
    assert not any(n.startswith("addmm_6") for n in _node_groups(svg))  # blocks.1's ops are folded


@needs_renderer
def test_html_embeds_the_svg_and_the_plan(tmp_path):
    page = megatron_gpt_plan().visualize(tmp_path / "gpt.html").read_text()
    assert page.startswith("<!doctype html>") and "<svg" in page and "<?xml" not in page
    assert "Collectives per call" in page and "column-parallel on tp" in page


@needs_renderer
def test_svg_and_png_files_are_valid(tmp_path):
    plan = megatron_gpt_plan()
    root = ET.parse(plan.visualize(tmp_path / "gpt.svg")).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert root.find(".//{http://www.w3.org/2000/svg}g[@class='cluster']") is not None
    png = plan.visualize(tmp_path / "gpt.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and png[12:16] == b"IHDR"


def test_graphviz_pure_draws_when_dot_is_missing(tmp_path, without_dot):
    assert find_renderer()[0] == "graphviz-pure"
    plan = megatron_gpt_plan()
    svg = plan.visualize(tmp_path / "gpt.svg").read_text()
    assert "(graphviz-pure)" in svg  # its generator comment
    assert ET.fromstring(svg.encode()).tag == "{http://www.w3.org/2000/svg}svg"
    assert len([n for n in _node_groups(svg) if n.startswith("all_reduce")]) == 4
    assert "cluster_blocks.0.attn.q_proj" in _cluster_titles(svg)
    assert plan.visualize(tmp_path / "gpt.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    page = plan.visualize(tmp_path / "gpt.html").read_text()
    assert "<svg" in page and "(graphviz-pure)" not in page and "digraph spmd" not in page


def test_pdf_without_dot_writes_the_source_and_says_why(tmp_path, without_dot):
    """graphviz-pure 0.2.2 writes no PDF: the .dot source, and a warning that names the formats it can do."""
    with pytest.warns(MissingGraphvizWarning, match=r"graphviz-pure cannot write PDF .*Ask for \.svg or \.png"):
        written = megatron_gpt_plan().visualize(tmp_path / "gpt.pdf")
    assert written == tmp_path / "gpt.dot" and written.read_text().startswith("digraph spmd")
    assert not (tmp_path / "gpt.pdf").exists()


def test_the_dot_source_is_the_same_under_every_hash_seed(tmp_path):
    """Found by a docs probe: `python examples/render_gpt.py` rewrote the tracked pictures at every run, their
    edges listed in each process's set order (graphviz numbers edges as they come). Two processes with other
    hash seeds now write the same source."""
    script = ("import sys, torch, spmd; from tests.models import MLP; from tests.support import spec; "
              "from spmd.report.visualize import to_dot; torch.manual_seed(0); "
              "plan = spmd.plan(MLP(), spec((2, 2), ('dp', 'tp')), (torch.randn(8, 16),)); "
              "sys.stdout.write(to_dot(plan, plan.sources))")
    root = str(Path(__file__).resolve().parents[2])
    sources = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=root,
                              env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": root}).stdout
               for seed in ("1", "2")]
    assert sources[0].startswith("digraph spmd") and sources[0] == sources[1]
