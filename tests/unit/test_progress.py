"""Progress on a terminal: pass names and, after the solve, the estimate, bound and gap; silent when the
stream is not a terminal, on ranks other than the first, and with SPMD_PROGRESS=0."""
from __future__ import annotations

import io

import torch

from spmd.compiler import progress as progress_module
from spmd.compiler.pipeline import PIPELINE
from tests.models import MLP
from tests.support import compile_graph, spec


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _compile_with(stream, monkeypatch, rank=None, **options):
    made = []

    class Recording(progress_module.Progress):
        def __init__(self, passes, rank_=None, stream_=None, enabled=True):
            super().__init__(passes, rank if rank is not None else rank_, stream, enabled)
            made.append(self)

    monkeypatch.setattr("spmd.compiler.pipeline.Progress", Recording)
    compile_graph(MLP(16, 64), (torch.randn(4, 16),), spec((2,), ("tp",)), **options)
    return made[0]


def test_a_terminal_sees_the_passes_and_the_solvers_gap(monkeypatch):
    out = _Terminal()
    p = _compile_with(out, monkeypatch)
    text = out.getvalue()
    assert p.bar is not None
    assert "spmd trace" in text and "spmd solve_placements" in text, text
    assert "gap 0.00%" in text and "bound" in text, text
    assert p.bar.n >= 5 and p.bar.total == len(PIPELINE)


def test_silent_when_not_a_terminal_on_other_ranks_or_switched_off(monkeypatch):
    plain = io.StringIO()
    assert _compile_with(plain, monkeypatch).bar is None and plain.getvalue() == ""
    other = _Terminal()
    assert _compile_with(other, monkeypatch, rank=1).bar is None and other.getvalue() == ""
    monkeypatch.setenv("SPMD_PROGRESS", "0")
    off = _Terminal()
    assert _compile_with(off, monkeypatch).bar is None and off.getvalue() == ""


def test_a_budgeted_solve_reports_its_best_plan_and_bound_while_it_searches(monkeypatch):
    out = _Terminal()
    _compile_with(out, monkeypatch, memory_budget=2**30)
    assert "best " in out.getvalue() and "bound" in out.getvalue(), out.getvalue()
