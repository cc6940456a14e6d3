"""A change to process-wide state (a torch flag, a function patched on a torch class) that overlapping users
share, on any thread: the first to enter makes it, the last to leave undoes it.

A plain save-and-restore around each use is wrong as soon as two uses overlap: the one that leaves first puts
back the original under the other's feet, and the one that leaves last puts back what it saved, the first's
patch, for good (reviews found this three times: oneDNN left off, `trunc_normal_` left patched, a custom
Function's `apply` left wrapped). What a patch must do per thread (collect what this thread's trace sees, act only
for it) it keeps in a `threading.local` of its own; `saved` is what `make` returned, for the patch to call the
function it stands in for.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable


class SharedPatch:
    """`with patch:` holds `make()`'s change while any user is inside; `undo(saved)` runs when the last leaves."""

    def __init__(self, make: Callable[[], Any], undo: Callable[[Any], None]):
        self._make, self._undo = make, undo
        self._lock = threading.Lock()
        self._users = 0
        self.saved: Any = None  # (kept after the undo: a call already inside the patch still finds it)

    @property
    def active(self) -> bool:
        return self._users > 0

    def __enter__(self) -> "SharedPatch":
        with self._lock:
            if self._users == 0:
                self.saved = self._make()
            self._users += 1
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                self._undo(self.saved)


def class_attribute_patch(owner: type, name: str, replacement: Any) -> SharedPatch:
    """`owner.name = replacement` while in use; then `owner`'s own attribute again, or none where it had none of
    its own (inherited, as `torch.Tensor.__setitem__` from TensorBase). `saved` is `owner.__dict__`'s entry before
    (None where there was none)."""
    def make():
        before = owner.__dict__.get(name)
        setattr(owner, name, replacement)
        return before

    def undo(before):
        if before is None:
            delattr(owner, name)
        else:
            setattr(owner, name, before)

    return SharedPatch(make, undo)


@contextlib.contextmanager
def collecting(patch: SharedPatch, here: threading.local, collector):
    """`patch` held and `collector` open on this thread, in `here.open` beside any outer ones (the patch adds what
    it sees to each), while the block runs; yields `collector`."""
    with patch:
        here.open = getattr(here, "open", ()) + (collector,)
        try:
            yield collector
        finally:
            here.open = tuple(c for c in here.open if c is not collector)
