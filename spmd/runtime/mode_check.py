"""Whether a model's forward runs other ops in train mode than in eval mode, found by running it.

A compiled graph does what the model did in the mode it was traced in. `CompiledModule` knows the usual
reasons a call in the other mode would differ without running anything (dropout modules, batch norm with
running statistics: `compiled._mode_dependent`). Code that reads `self.training` itself escapes that:
`F.dropout(x, p, self.training)`, a branch taken only in training. So the first call in the other mode,
where nothing known depends on it, runs the traced forward in both modes on fake tensors (no memory, no
values: FakeTensorMode) and compares the ATen ops each ran. Different ops mean the compiled graph would
compute what the traced mode computes, not what this one does.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _Ops(TorchDispatchMode):
    """The names of the ATen ops run under it, counted."""

    def __init__(self):
        super().__init__()
        self.seen: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "aten":  # (not prim.device and the like: how a tensor is asked about itself)
            self.seen[func._overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def ops_differ_by_mode(root: torch.nn.Module, inputs: list[tuple[tuple[int, ...], torch.dtype]]) -> str | None:
    """The ops `root`'s forward runs in only one of the two modes (a short description), or None where both
    run the same ops. `inputs`: the shape and dtype of each positional input of `root` (the traced call).
    A forward that cannot run on fake tensors (data-dependent Python, say) answers None: nothing is known.
    `root` and its submodules keep their modes and attributes."""
    from torch._export.utils import _compiling_state_context
    from torch._subclasses.fake_tensor import FakeTensorMode

    from spmd.passes.trace_joint import _state_kept

    device = next((t.device for t in root.parameters()), torch.device("cpu"))
    seen = {}
    try:
        for training in (True, False):
            with _state_kept(root), FakeTensorMode(allow_non_fake_inputs=True), _compiling_state_context(), \
                    torch.no_grad():
                args = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in inputs]
                root.train(training)
                with _Ops() as ops:
                    root(*args)
            seen[training] = ops.seen
    except Exception:  # (the trace ran this forward under AOTAutograd; a plain fake run may still not)
        return None
    only = {mode: sorted(set(seen[mode]) - set(seen[not mode])) for mode in (True, False)}
    if not only[True] and not only[False] and seen[True] == seen[False]:
        return None
    parts = [f"{', '.join(ops[:6])}{f' and {len(ops) - 6} more' if len(ops) > 6 else ''} only in "
             f"{'train' if mode else 'eval'} mode" for mode, ops in only.items() if ops]
    return "; ".join(parts) or "the same ops, run a different number of times"
