"""Which renderer draws the pictures (graphviz's `dot`, else graphviz-pure, else the .dot source), and what
visualize does with each answer. No renderer runs here (that is tests/e2e/test_render.py): the programs
are empty executable files found on a PATH of the test's making, and `subprocess.run` is a stand-in."""
import subprocess
import sys
import sysconfig

import pytest

from spmd.report import render
from spmd.report.render import MissingGraphvizWarning, find_renderer
from tests.support import megatron_gpt_plan


def _program(folder, name):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("")
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def nowhere(tmp_path, monkeypatch):
    """An empty PATH, and a Python whose scripts folder holds nothing: no renderer anywhere."""
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "venv" / "bin" / "python"))
    monkeypatch.setattr(sysconfig, "get_path", lambda name, *a, **k: str(empty))
    return tmp_path


def test_dot_is_preferred_when_on_path(nowhere, monkeypatch):
    dot = _program(nowhere / "usr", "dot")
    _program(nowhere / "venv" / "bin", "graphviz-pure")
    monkeypatch.setenv("PATH", str(nowhere / "usr"))
    assert find_renderer() == ("dot", dot)


def test_graphviz_pure_on_path(nowhere, monkeypatch):
    pure = _program(nowhere / "usr", "graphviz-pure")
    monkeypatch.setenv("PATH", str(nowhere / "usr"))
    assert find_renderer() == ("graphviz-pure", pure)


def test_graphviz_pure_next_to_python_when_not_on_path(nowhere):
    """A venv used by its full path (`venv/bin/python script.py`): its bin folder is not on PATH."""
    pure = _program(nowhere / "venv" / "bin", "graphviz-pure")
    assert find_renderer() == ("graphviz-pure", pure)


def _fake_run(calls, returncode=0, stdout=b"<svg/>", stderr=b""):
    def run(command, **kwargs):
        calls.append(command)
        return subprocess.CompletedProcess(command, returncode, stdout, stderr)
    return run


def test_graphviz_pure_renders_svg_png_and_html(nowhere, monkeypatch):
    pure = _program(nowhere / "venv" / "bin", "graphviz-pure")
    calls = []
    monkeypatch.setattr(render.subprocess, "run", _fake_run(calls, stdout=b'<?xml version="1.0"?>\n<svg>drawn</svg>'))
    plan = megatron_gpt_plan()
    assert plan.visualize(nowhere / "gpt.svg").read_text().endswith("<svg>drawn</svg>")
    assert plan.visualize(nowhere / "gpt.png") == nowhere / "gpt.png"
    page = plan.visualize(nowhere / "gpt.html").read_text()
    assert "<svg>drawn</svg>" in page and "<?xml" not in page and "pip install" not in page
    assert calls == [[pure, "-Tsvg"], [pure, "-Tpng"], [pure, "-Tsvg"]]


def test_pdf_refused_by_graphviz_pure_writes_the_source(nowhere, monkeypatch):
    _program(nowhere / "venv" / "bin", "graphviz-pure")
    refusal = b'Format: "pdf" not recognized. Use one of: png svg'
    monkeypatch.setattr(render.subprocess, "run", _fake_run([], 1, b"", refusal))
    with pytest.warns(MissingGraphvizWarning, match=r'cannot write PDF \(Format: "pdf" not recognized.*apt-get'):
        written = megatron_gpt_plan().visualize(nowhere / "gpt.pdf")
    assert written == nowhere / "gpt.dot" and written.read_text().startswith("digraph spmd")


def test_a_failing_renderer_raises_with_its_message(nowhere, monkeypatch):
    _program(nowhere / "venv" / "bin", "graphviz-pure")
    monkeypatch.setattr(render.subprocess, "run", _fake_run([], 101, b"", b"panicked at layout"))
    with pytest.raises(RuntimeError, match=r"graphviz-pure .* failed to render -Tsvg .*panicked at layout"):
        megatron_gpt_plan().visualize(nowhere / "gpt.svg")


def test_without_any_renderer_writes_the_source_and_says_what_to_install(nowhere):
    assert find_renderer() is None
    plan = megatron_gpt_plan()
    with pytest.warns(MissingGraphvizWarning, match=r"pip install graphviz-pure.*apt-get install -y graphviz"):
        written = plan.visualize(nowhere / "gpt.png")
    assert written == nowhere / "gpt.dot" and written.read_text().startswith("digraph spmd")
    assert not (nowhere / "gpt.png").exists()
    with pytest.warns(MissingGraphvizWarning, match="shows the source and the plan as text"):
        page = plan.visualize(nowhere / "gpt.html").read_text()
    assert "pip install graphviz-pure" in page and "digraph spmd" in page and "<svg" not in page


def test_the_layout_search_of_a_large_graph_is_bounded(monkeypatch):
    """Found by a probe: `dot` ran 6+ minutes on a small T5's training plan (805 boxes); past `LARGE` boxes its
    crossing minimization is bounded (15 s there), and a small graph keeps graphviz's own search."""
    calls = []
    monkeypatch.setattr(render.subprocess, "run", lambda args, **kw: calls.append(args) or
                        subprocess.CompletedProcess(args, 0, b"<svg/>", b""))
    small = "digraph g {\n" + "".join(f"\tn{i} [label=<{i}>]\n" for i in range(10)) + "}"
    large = "digraph g {\n" + "".join(f"\tn{i} [label=<{i}>]\n" for i in range(render.LARGE + 1)) + "}"
    for source in (small, large):
        assert render._render(("dot", "/usr/bin/dot"), source, "svg") == b"<svg/>"
    assert calls[0] == ["/usr/bin/dot", "-Tsvg"]
    assert calls[1][:2] == ["/usr/bin/dot", "-Tsvg"] and "-Gmclimit=0.1" in calls[1]
