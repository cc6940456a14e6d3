"""Grouped matrix products of mixture-of-experts layers: transformers' `grouped_mm_fallback` and its backward
(its experts' kernel where torch's `_grouped_mm` does not run: float32 weights, CPU; Mixtral's, Qwen2-MoE's,
OLMoE's default experts there). torch's `_grouped_mm` has DTensor's rule.

    grouped_mm_fallback(x (S, K), w (E, K, N), offs (E,)) -> (S, N)
        x's rows sorted by expert; offs[e] is where expert e's rows end: row i is multiplied by its expert's w[e]
    grouped_mm_fallback_backward(x, w, offs, g (S, N)) -> (dx (S, K), dw (E, K, N))

Along one mesh axis, offs whole (it names rows of x, which stay whole):

    out S(1) <- x R, w S(2)            each rank every expert's own columns (column-parallel)
    out P    <- x S(1), w S(1)         each rank its part of the inner dim (row-parallel)
    out P    <- x P, w R               linear in x
    dx P, dw S(2)    <- x R, w S(2), g S(1)
    dx S(1), dw S(1) <- x S(1), w S(1), g R
    dx P, dw P       <- x R, w R, g P  linear in g
    dx R, dw P       <- x P, w R, g R  dw linear in x, dx free of it

The experts' own dim is not split (expert parallelism would cut offs to a rank's experts: a local rewrite).
The ops belong to transformers and exist once it is imported, so the rules are registered by name.
"""
from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate, Shard

from spmd.passes.rules.registry import RuleInput, rule

FORWARD = "transformers.grouped_mm_fallback.default"
BACKWARD = "transformers.grouped_mm_fallback_backward.default"


def _arity(inp: RuleInput, n: int) -> None:
    """The op's tensors as this rule knows them (another version of transformers may add one: a bias): else the
    rule fails, and the op runs whole with a warning."""
    if len(inp.inputs) != n:
        raise ValueError(f"{inp.op} takes {len(inp.inputs)} tensors, this rule {n}")


@rule(FORWARD)
def grouped_mm(inp: RuleInput) -> list[list]:
    _arity(inp, 3)  # out, x, w, offs
    return [[Shard(1), Replicate(), Shard(2), Replicate()],
            [Partial(), Shard(1), Shard(1), Replicate()],
            [Partial(), Partial(), Replicate(), Replicate()]]


@rule(BACKWARD)
def grouped_mm_backward(inp: RuleInput) -> list[list]:
    _arity(inp, 4)  # dx, dw, x, w, offs, g
    return [[Partial(), Shard(2), Replicate(), Shard(2), Replicate(), Shard(1)],
            [Shard(1), Shard(1), Shard(1), Shard(1), Replicate(), Replicate()],
            [Partial(), Partial(), Replicate(), Replicate(), Replicate(), Partial()],
            [Replicate(), Partial(), Partial(), Replicate(), Replicate(), Replicate()]]
