"""FlexAttention (`torch.ops.higher_order.flex_attention` and its backward).

q, k, v are [batch, heads, seq, head_dim] and every score depends on one (batch, head) pair, so along one
mesh axis all of them may be sharded together on batch (dim 0) or on heads (dim 1), as for SDPA. What
FlexAttention adds are its user functions, traced into subgraphs that travel with the op unchanged:
`score_mod(score, b, h, q_idx, kv_idx, *buffers)` and the block mask's `mask_mod(b, h, q_idx, kv_idx,
*buffers)`. On a shard they would see local batch/head indices, so a dim is shardable only where neither
function reads its index (a causal or sliding-window mask reads only q_idx and kv_idx; ALiBi reads h, and
then heads stay whole). The block mask's tensors ([B or 1, H or 1, ...]) follow on a dim they span and are
replicated where they broadcast; k/v broadcast the same way (one kv head: MQA). Captured buffers stay
replicated; their gradients, summed over the local batch or heads, come out Partial.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.utils._pytree import tree_flatten

from spmd.core.specs import TensorInfo
from spmd.passes.rules.registry import RuleInput, rule

_HOP = torch.ops.higher_order
_FORWARD = getattr(_HOP, "flex_attention", None)
_BACKWARD = getattr(_HOP, "flex_attention_backward", None)

# the index argument a user function receives for dim 0 (batch) and dim 1 (heads), by function kind
_SCORE_INDEX = {0: 1, 1: 2}  # score_mod(score, b, h, q_idx, kv_idx, ...)
_MASK_INDEX = {0: 0, 1: 1}  # mask_mod(b, h, q_idx, kv_idx, ...)


def _subgraph(node) -> fx.GraphModule | None:
    if isinstance(node, fx.Node) and node.op == "get_attr":
        return getattr(node.graph.owning_module, node.target)
    return node if isinstance(node, fx.GraphModule) else None


def reads_index(fn, position: int) -> bool:
    """Whether traced user function `fn` reads its argument at `position` (True when it cannot tell)."""
    gm = _subgraph(fn)
    if gm is None:
        return fn is not None
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return position >= len(placeholders) or bool(placeholders[position].users)


def _roles(inp: RuleInput) -> list[str]:
    """Each tensor input's role, in the pytree order of `inp.inputs`: q k v | out lse grad_out grad_lse |
    mask (a block-mask tensor) | buffer (captured by score_mod or mask_mod)."""
    args = inp.args
    if inp.op is _FORWARD:
        named = [("q", args[0]), ("k", args[1]), ("v", args[2]), (None, args[3]), ("mask", args[4])]
        rest = args[5:]
    else:
        named = [("q", args[0]), ("k", args[1]), ("v", args[2]), ("out", args[3]), ("lse", args[4]),
                 ("grad_out", args[5]), ("grad_lse", args[6]), (None, args[7]), (None, args[8]), ("mask", args[9])]
        rest = args[10:]
    named += [("buffer", a) for a in rest]  # scale, kernel_options: no tensors; then the captured buffers
    roles = []
    for role, arg in named:
        roles += [role] * sum(isinstance(leaf, TensorInfo) for leaf in tree_flatten(arg)[0])
    roles += ["buffer"] * sum(isinstance(leaf, TensorInfo) for leaf in tree_flatten(inp.kwargs)[0])
    return roles


@rule(*(op for op in (_FORWARD, _BACKWARD) if op is not None))
def flex_attention(inp: RuleInput) -> list[list]:
    """Batch- or head-parallel where the user functions do not read that index."""
    forward = inp.op is _FORWARD
    score_mod = inp.args[3] if forward else inp.args[7]
    block_mask = inp.args[4] if forward else inp.args[9]
    mask_mod = block_mask[-1] if isinstance(block_mask, tuple) and block_mask else None
    roles = _roles(inp)
    if len(roles) != len(inp.inputs):
        return []
    q = inp.inputs[0]
    rows = []
    for d in (0, 1):
        if reads_index(score_mod, _SCORE_INDEX[d]) or reads_index(mask_mod, _MASK_INDEX[d]):
            continue
        ins = []
        for role, t in zip(roles, inp.inputs):
            if role == "buffer":
                ins.append(Replicate())
            elif role in ("mask", "k", "v") and len(t.shape) > d and t.shape[d] == 1 < q.shape[d]:
                ins.append(Replicate())  # broadcast along d: every shard reads the one entry
            else:
                ins.append(Shard(d))
        if forward:
            outs = [Shard(d) for _ in inp.outputs]
        else:  # grad q, k, v like q, k, v; a broadcast k/v's or a buffer's grad is a sum over the local part
            outs = [p if isinstance(p, Shard) else Partial() for p in ins[:3]] + [Partial() for _ in inp.outputs[3:]]
        rows.append(outs + ins)
    return rows
