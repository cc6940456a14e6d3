"""Whether a model's forward runs other ops in train mode than in eval mode, found by running it.

A compiled graph does what the model did in the mode it was traced in. `CompiledModule` knows the usual
reasons a call in the other mode would differ without running anything (dropout modules, batch norm with
running statistics: `compiled._mode_dependent`). Code that reads `self.training` itself escapes that:
`F.dropout(x, p, self.training)`, a branch taken only in training. So the first call in the other mode,
where nothing known depends on it, runs the traced forward in both modes on fake tensors (no memory, no
values: FakeTensorMode) and compares the floating-point ATen ops each ran, in order, with their arguments.
Different ops, or the same ops with other constants or slices, mean the compiled graph would compute what the
traced mode computes, not what this one does.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


# ops that only move or re-wrap a tensor: how a forward hands values around, not what it computes
_BOOKKEEPING = frozenset({"lift_fresh", "lift_fresh_copy", "alias", "detach", "_to_copy", "clone"})


class _Ops(TorchDispatchMode):
    """The ATen ops run under it that compute floating-point values, in order, each with its arguments
    (tensors as shape and dtype, the rest as written: a constant or a slice that only one mode uses,
    `x * (2.0 if self.training else 3.0)`, runs the same ops). Integer and boolean work (masks and positions a
    model builds only in one mode, such as transformers' caches, which it switches off in training) and
    bookkeeping do not change what the graph computes with the weights."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []  # (op name, overload, arguments)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._overloadpacket.__name__
        if func.namespace == "aten" and name not in _BOOKKEEPING and any(
                isinstance(t, torch.Tensor) and t.is_floating_point() for t in tree_leaves(out)):
            self.calls.append((name, str(func), tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor)
                                                      else repr(a) for a in tree_leaves((args, kwargs or {})))))
        return out


def ops_differ_by_mode(root: torch.nn.Module, inputs: list[tuple[tuple[int, ...], torch.dtype]]) -> str | None:
    """The floating-point ops `root`'s forward runs in only one of the two modes (a short description), or
    None where both run the same ones. `inputs`: the shape and dtype of each positional input of `root`
    (the traced call). The forward runs on fake copies of the parameters and buffers (an in-place update of
    a buffer, a step counter, changes nothing real), with grad enabled and the attention fast path off as in
    a training step (torch's eval-only fast paths are what the graph was traced without, not a difference
    of the model's). A forward that cannot run on fake tensors (data-dependent Python, say) answers None:
    nothing is known. `root` and its submodules keep their modes and attributes."""
    from torch._export.utils import _compiling_state_context
    from torch._subclasses.fake_tensor import FakeTensorMode

    from spmd.passes.kept_state import state_kept

    device = next((t.device for t in root.parameters()), torch.device("cpu"))
    seen = {}
    fastpath = torch.backends.mha.get_fastpath_enabled()
    try:
        torch.backends.mha.set_fastpath_enabled(False)
        for training in (True, False):
            with state_kept(root), FakeTensorMode(allow_non_fake_inputs=True), _compiling_state_context(), \
                    torch.enable_grad():
                state = {name: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device
                                                   ).requires_grad_(t.requires_grad)
                         for kind in (root.named_parameters(remove_duplicate=False),
                                      root.named_buffers(remove_duplicate=False))
                         for name, t in kind if t is not None}
                args = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in inputs]
                root.train(training)
                with _Ops() as ops:
                    torch.func.functional_call(root, state, tuple(args), tie_weights=True, strict=False)
            seen[training] = ops.calls
    except Exception:  # (the trace ran this forward under AOTAutograd; a plain fake run may still not)
        return None
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
    if seen[True] == seen[False]:
        return None
    counts = {mode: Counter(name for name, _, _ in calls) for mode, calls in seen.items()}
    only = {mode: sorted(set(counts[mode]) - set(counts[not mode])) for mode in (True, False)}
    parts = [f"{', '.join(ops[:6])}{f' and {len(ops) - 6} more' if len(ops) > 6 else ''} only in "
             f"{'train' if mode else 'eval'} mode" for mode, ops in only.items() if ops]
    if parts:
        return "; ".join(parts)
    if counts[True] != counts[False]:
        return "the same ops, run a different number of times"
    k, (train, eval_) = next((k, pair) for k, pair in enumerate(zip(seen[True], seen[False])) if pair[0] != pair[1])
    if train[1] != eval_[1]:
        return f"the same ops in another order (op {k}: {train[1]} in train mode, {eval_[1]} in eval mode)"
    return (f"{train[1]} with other arguments (op {k}: {_shown(train[2])} in train mode, {_shown(eval_[2])} in eval "
            "mode)")


def _shown(args: tuple) -> str:
    return ", ".join(f"tensor{list(a[0])}" if isinstance(a, tuple) else a for a in args)
