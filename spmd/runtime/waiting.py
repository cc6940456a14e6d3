"""A rank left waiting in a collective call says so, instead of hanging without a word.

`full_state_dict()`, `save_safetensors()`, `gather_outputs()`, `verify()` and `clip_grad_norm_()` gather or
reduce over the mesh: every rank must call them. Called on one rank only (`if rank == 0:
torch.save(compiled.full_state_dict(), ...)`, the usual habit from single-device code), that rank waits in
the collective forever (found by a probe: no message, no timeout for 30 minutes). `collective(...)` starts a
timer around such a call; if the call has not returned after `SPMD_WAIT_WARN_S` seconds (default 60), the
waiting rank writes, once, what it is waiting in and the way out. It cannot end the wait (the process group's
own timeout does that); it only turns a silent hang into a named one. Nested calls arm one timer.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading

from spmd.core.errors import SpmdCollectiveError

_state = threading.local()


def _wait_limit() -> float:
    try:
        return float(os.environ.get("SPMD_WAIT_WARN_S", "60"))
    except ValueError:
        return 60.0


# each collective method as every rank calls it, keeping what one rank does alone (a write, a print) to that rank
# (a probe: the one example, `full_state_dict`'s, was given for a `grad_norm()` logged on rank 0 alone)
_ON_EVERY_RANK = {
    "full_state_dict": "`state = compiled.full_state_dict(); if rank == 0: torch.save(state, path)`",
    "save_safetensors": "`compiled.save_safetensors(path)` on every rank (rank 0 alone writes the file)",
    "gather_outputs": "`full = compiled.gather_outputs(out); if rank == 0: print(full)`",
    "grad_norm": "`norm = compiled.grad_norm(); if rank == 0: log(norm)`",
    "clip_grad_norm_": "`compiled.clip_grad_norm_(max_norm)` on every rank (each scales its own pieces)",
    "verify": "`report = compiled.verify(*batch); if rank == 0: print(report)`",
    "embedding_renorm_": "`compiled.embedding_renorm_(name, ids, max_norm)` on every rank, each with its call's ids",
}


def _say(what: str, rank: int, seconds: float) -> None:
    example = _ON_EVERY_RANK.get(what, f"`result = compiled.{what}(...); if rank == 0: ...`")
    print(f"spmd: rank {rank} has waited {seconds:g} s in {what}() for the other ranks. {what}() is collective: "
          f"every rank must call it, and a rank that does not leaves the others waiting here for good (an "
          f"`if rank == 0:` around it does that). What to do: call it on every rank, and keep only what one rank "
          f"does alone to that rank: {example}.", file=sys.stderr, flush=True)


@contextlib.contextmanager
def collective(what: str, rank: int, world: int):
    """Around a call every rank must make: a message on stderr if this rank waits in it too long."""
    if world <= 1 or getattr(_state, "armed", False):
        yield
        return
    limit = _wait_limit()
    timer = threading.Timer(limit, _say, (what, rank, limit))
    timer.daemon = True
    _state.armed = True
    timer.start()
    try:
        yield
    except SpmdCollectiveError as e:
        # (a probe: rank 0 alone in `full_state_dict()` while rank 1 went on to train; rank 1's gloo aborted on
        # the mismatched collective, and rank 0's error said only that a peer died)
        e.add_note(f"spmd: rank {rank} was in {what}(), which every rank must call; a rank that skipped it (an "
                   f"`if rank == 0:` around it) and went on to other collectives, or died meanwhile, ends it so. "
                   f"What to do: call it on every rank: {_ON_EVERY_RANK.get(what, f'`compiled.{what}(...)`')}.")
        raise
    finally:
        timer.cancel()
        _state.armed = False
