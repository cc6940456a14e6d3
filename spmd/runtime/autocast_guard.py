"""torch.autocast around a compiled module: the state it was traced under is the state it runs under.

A trace under `torch.autocast` records autocast's casts as ops of the graph (`_to_copy` to bf16 before a
matmul, to fp32 before a softmax or a loss), so the graph computes what eager autocast computes. The
compiled graph is then a plain ATen program, and a call under another autocast state is a different
program, silently:

- traced without autocast and called under it, autocast casts the graph's ops as it meets them, but the
  graph has lost what the model wrote around them (a `.float()` before the loss was a no-op when traced in
  fp32, so the loss now runs in bf16: measured 0.07422 against eager autocast's 0.07397 on a 2-layer MLP);
- traced under autocast and called without it (to evaluate in fp32), the graph's casts still run: bf16
  where the user asked for fp32.

`AutocastGuard` holds the state at compile time (per device type: enabled, and the dtype) and refuses a
call made under another, with the way out; a call under the same state runs its graphs with autocast off
(`core.autocast.autocast_off`), so the traced casts are the only ones (autocast applied again to a traced graph could cast ops
the trace left alone, such as the exponentials of a decomposed log_softmax).
"""
from __future__ import annotations

from spmd.core.autocast import autocast_state
from spmd.core.errors import SpmdError
from spmd.runtime.source_guard import COPY_BACK


def _described(state: tuple) -> str:
    if not state:
        return "outside torch.autocast"
    return " and ".join(f"under torch.autocast({t!r}, dtype={dtype})" for t, dtype in state)


class AutocastGuard:
    """The autocast state a module was compiled under; `check()` raises where a call is made under another."""

    def __init__(self):
        self.state = autocast_state()

    def check(self) -> None:
        now = autocast_state()
        if now == self.state:
            return
        how = "; ".join(f"with torch.autocast({t!r}, dtype={dtype})" for t, dtype in now) if now else None
        raise SpmdError(
            f"this module was compiled {_described(self.state)}, and its graph holds the dtypes that trace gave "
            + ("each op" if not self.state else "each op (autocast's casts are ops of the graph)")
            + f": called {_described(now)}, it would not compute what the model computes eagerly "
            f"{_described(now)}. What to do: compile under the autocast you call it with ("
            + (f"`{how}: compiled = spmd.compile(...)`" if how else "spmd.compile outside torch.autocast")
            + ") and call it under that autocast only; for another precision (evaluating in fp32), compile a "
            f"second module for it (before training, or after `{COPY_BACK}`) "
            "and give it this one's weights when you use it (`other.load_state_dict(compiled.state_dict())`).")
