"""`expand_single_dim` (rules/registry.py) against its definition: every combination of one single-axis
row per mesh axis, an all-Replicate row added where the rule has none, an output column holding a None
(no tensor) on any axis collapsed to None, each distinct strategy once, in the order of its first
combination. The implementation skips the duplicate check where no output can be None; this checks
that skipping it never lets a duplicate through nor changes the order."""
from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard

from spmd.core.specs import Strategy
from spmd.passes.rules.registry import expand_single_dim

PLACEMENTS = (Shard(0), Shard(1), Replicate(), Partial("sum"), Partial("max"))


def by_definition(single, n_out: int, mesh_ndim: int) -> list[Strategy]:
    rows = [tuple(r) for r in single]
    if rows and not any(all(isinstance(p, Replicate) or p is None for p in r) for r in rows):
        rows.insert(0, tuple(Replicate() for _ in rows[0]))
    out: list[Strategy] = []
    for combo in itertools.product(rows, repeat=mesh_ndim):
        cols = [tuple(row[k] for row in combo) for k in range(len(combo[0]))]
        s = Strategy(tuple(None if None in c else c for c in cols[:n_out]), tuple(cols[n_out:]))
        if s not in out:
            out.append(s)
    return out


@st.composite
def rules(draw):
    width = draw(st.integers(1, 4))
    with_none = draw(st.booleans())
    element = st.sampled_from(PLACEMENTS + ((None,) if with_none else ()))
    rows = draw(st.lists(st.lists(element, min_size=width, max_size=width), max_size=6))
    if rows and draw(st.booleans()):  # a rule listing a row twice
        rows.append(list(rows[draw(st.integers(0, len(rows) - 1))]))
    return rows, draw(st.integers(0, width)), draw(st.integers(1, 3))


@settings(max_examples=300, deadline=None, database=None)
@given(rules())
def test_expand_single_dim_is_the_deduplicated_product(case):
    single, n_out, mesh_ndim = case
    assert expand_single_dim(single, n_out, mesh_ndim) == by_definition(single, n_out, mesh_ndim)
