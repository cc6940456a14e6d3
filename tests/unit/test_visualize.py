"""Pictures of the sharded graph: the GPT example on a 2x2 mesh, planned without processes."""
import re
import shutil

import pytest
import torch
import torch.nn.functional as F

import spmd
from tests.models import MLP
from spmd.report.render import MissingGraphvizWarning
from spmd.report.visualize import to_dot
from tests.support import compile_graph, megatron_gpt_plan, spec



def test_dot_source_and_views_option(tmp_path):
    plan = megatron_gpt_plan()
    path = plan.visualize(tmp_path / "gpt.dot")
    source = path.read_text()
    assert source.startswith("digraph spmd") and "subgraph \"cluster_blocks.0\"" in source
    assert "\tview_1 [" not in source
    assert "\tview_1 [" in to_dot(plan, plan.sources, views=True)


def test_without_dot_writes_the_source_and_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    plan = megatron_gpt_plan()
    with pytest.warns(MissingGraphvizWarning, match=r"apt-get install -y graphviz"):
        written = plan.visualize(tmp_path / "gpt.svg")
    assert written == tmp_path / "gpt.dot" and written.read_text().startswith("digraph")
    assert not (tmp_path / "gpt.svg").exists()
    with pytest.warns(MissingGraphvizWarning):
        page = plan.visualize(tmp_path / "gpt.html").read_text()
    assert "digraph spmd" in page and "apt-get install -y graphviz" in page and "Collectives per call" in page


def test_loaded_plan_cannot_be_drawn(tmp_path):
    megatron_gpt_plan().save(tmp_path / "plan.json")
    with pytest.raises(spmd.SpmdError, match="carries no graph"):
        spmd.load_plan(tmp_path / "plan.json").visualize(tmp_path / "x.svg")


def test_training_graph_has_forward_and_backward_boxes(tmp_path):
    """The joint graph: module paths without the loss wrapper's prefix, backward under its own box."""
    torch.manual_seed(0)
    plan = spmd.plan(MLP(16, 64), spec((2,), ("dp",)), (torch.randn(8, 16), torch.randn(8, 16)),
                     loss_fn=lambda y, t: F.mse_loss(y, t))
    source = to_dot(plan, plan.sources)
    for box in ("cluster_forward", "cluster_backward", "cluster_forward_fc1", "cluster_backward_fc2"):
        assert f'"{box}"' in source or f"subgraph {box} " in source, box
    assert "model.fc1" not in source
    assert "all_reduce" in source  # the gradient reductions on dp


def test_compiled_module_visualizes_and_explains(tmp_path):
    """CompiledModule keeps the plan's sources; one rank's graph, built without a process group."""
    from torch.distributed.tensor import Replicate, Shard

    from spmd.report.result import report_of
    from spmd.runtime.compiled import CompiledModule

    torch.manual_seed(0)  # the batch pinned to dp, as in test_explain's golden plan
    c = compile_graph(MLP(16, 64), (torch.randn(2, 16),), spec((2, 2), ("dp", "tp")), 0,
                      in_placements={"x": [Shard(0), Replicate()]})
    compiled = CompiledModule(c, None, report_of(c))
    assert compiled.visualize(tmp_path / "mlp.dot").read_text().startswith("digraph")
    assert re.search(r"fc1  Linear  column-parallel on (dp|tp)", compiled.explain())  # the axes tie here
