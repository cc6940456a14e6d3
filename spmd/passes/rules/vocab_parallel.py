"""Vocabulary parallelism: ops that index a dim which is split over ranks, and how a rank runs them.

An embedding table split by rows (its vocabulary) over a mesh axis is looked up with global token ids:
each rank reads the ids that fall in its rows and contributes zeros for the rest, so the result is
Partial(sum) (DTensor's `_MaskPartial`). The loss's pick of each target's log-probability (`gather` on
the class dim) and the gradient ops work the same way on logits split by class. Rules (one mesh axis):

  embedding(weight, ids)              out S(last) <- weight S(1), ids R;  out S(d) <- weight R, ids S(d);
                                      out P <- weight S(0), ids R  (vocab-parallel)
  embedding_dense_backward(g, ids)    (its rule is in indexing.py) weight grad S(0) <- g R, ids R
  gather(x, dim, index)               out S(d) <- x S(d), index S(d) (d != dim, same size);
                                      out S(dim) <- x R, index S(dim);  out P <- x P, index R;
                                      out P <- x S(dim), index R  (vocab-parallel)
  nll_loss_backward(g, x, t, w, .., total_weight)
                                      grad S(0) <- x, t S(0) (batch);  grad S(class) <- x S(class), t R
                                      (vocab-parallel);  grad P <- g P

The loss's forms are reached only where the log-softmax before them runs on split classes: it is kept
whole (one fused kernel) in the joint graph, and has no such rule yet (its decomposition, amax / exp /
sum over the shards, trains equal to one device but changes plans elsewhere; see issue 12's note).

`local_rewrite` registers what a rank runs for the vocab-parallel forms: emit_rank_graph calls the entry of
the node's op with the node's strategy, which gives the op of spmd/core/local_ops.py and its arguments,
with this rank's first row (`start`) and row count filled in; None keeps the op as it is.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from spmd.core import local_ops
from spmd.core.specs import piece_span
from spmd.passes.rules.registry import RuleInput, local_rewrite, rule

aten = torch.ops.aten


@rule(aten.embedding.default)
def embedding(inp: RuleInput) -> list[list]:
    ids = inp.inputs[1]
    rows = [[Shard(len(ids.shape)), Shard(1), Replicate()]]
    rows += [[Shard(d), Replicate(), Shard(d)] for d in range(len(ids.shape))]
    rows.append([Partial(), Shard(0), Replicate()])
    return rows


@rule(aten.gather.default)
def gather(inp: RuleInput) -> list[list]:
    x, index = inp.inputs
    ndim = len(x.shape)
    dim = inp.args[1] % max(ndim, 1)
    rows = [[Shard(d)] * 3 for d in range(ndim) if d != dim and x.shape[d] == index.shape[d]]
    rows.append([Shard(dim), Replicate(), Shard(dim)])
    rows.append([Partial(), Partial(), Replicate()])
    rows.append([Partial(), Shard(dim), Replicate()])
    return rows


@rule(aten.nll_loss_backward.default)
def nll_loss_backward(inp: RuleInput) -> list[list]:
    # tensor inputs: grad_output, self, target, [weight], total_weight
    grad, x = inp.inputs[0], inp.inputs[1]
    has_weight = inp.args[3] is not None
    reduction = inp.args[4]
    classes = 1 if len(x.shape) == 2 else 0
    weight = [Replicate()] if has_weight else []
    rows = [[Shard(classes), Replicate(), Shard(classes), Replicate()] + weight + [Replicate()]]
    if len(x.shape) == 2:
        g = Shard(0) if reduction == 0 and len(grad.shape) == 1 else Replicate()
        rows.append([Shard(0), g, Shard(0), Shard(0)] + weight + [Replicate()])
    rows.append([Partial(), Partial(), Replicate(), Replicate()] + weight + [Replicate()])
    return rows


@local_rewrite(aten.embedding.default)
def _embedding(args, strategy, shapes, mesh_shape, coord):
    split = piece_span(strategy.inputs[0], 0, shapes[0][0], mesh_shape, coord)
    if split is None:
        return None
    return local_ops.masked_embedding, (args[0], args[1]), {"start": split[0], "total": shapes[0][0]}


@local_rewrite(aten.embedding_dense_backward.default)
def _embedding_backward(args, strategy, shapes, mesh_shape, coord):
    grad, ids, num_weights = args[0], args[1], args[2]
    split = piece_span(strategy.outputs[0], 0, num_weights, mesh_shape, coord)
    if split is None:
        return None
    padding_idx = args[3] if len(args) > 3 else -1
    return local_ops.masked_embedding_backward, (grad, ids, split[1], padding_idx), {"start": split[0]}


@local_rewrite(aten.gather.default)
def _gather(args, strategy, shapes, mesh_shape, coord):
    dim = args[1] % max(len(shapes[0]), 1)
    split = piece_span(strategy.inputs[0], dim, shapes[0][dim], mesh_shape, coord)
    if split is None:
        return None
    return local_ops.masked_gather, (args[0], dim, args[2]), {"start": split[0], "total": shapes[0][dim]}


@local_rewrite(aten.nll_loss_backward.default)
def _nll_loss_backward(args, strategy, shapes, mesh_shape, coord):
    x_shape = shapes[1]
    classes = 1 if len(x_shape) == 2 else 0
    split = piece_span(strategy.inputs[1], classes, x_shape[classes], mesh_shape, coord)
    if split is None:
        return None
    return local_ops.masked_nll_loss_backward, tuple(args[:7]), {"start": split[0]}
