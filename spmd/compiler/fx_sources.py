"""The Python source torch.fx keeps for every graph module it generates code for, released after a compile.

torch.fx registers each GraphModule's generated code in a process-wide cache (the `eval_cache` of
`torch.fx.graph_module._loader`, plus a lazy `linecache` entry) so that tracebacks can show its lines,
and never removes it. One compilation makes 19 of them (a 2-layer GPT's training step, ~180 KiB of
source), most for intermediate graphs nobody holds after it (export, the joint trace, the passes): a
process that compiles again and again (a sweep over shapes, a server, a test session) grew by that much
each time, for ever (tests/e2e/test_repeated_compiles.py measured it).

`release_sources(since, kept)` drops the sources registered since `mark()`, except those of the graph
modules the compilation hands back, which are dropped when those modules are collected. Only
traceback text is lost, and only for graphs no one can run any more. Compilations running at the same
time in several threads may drop each other's entries early (tracebacks then show no source line).
"""
from __future__ import annotations

import linecache
import re
import weakref
from typing import Iterable

import torch.fx as fx

_KEY = re.compile(r"<eval_with_key>\.(\d+)")


def _loader():
    """torch.fx's source cache, or None when this torch keeps it otherwise (then nothing is released)."""
    try:
        from torch.fx.graph_module import _loader as loader
    except ImportError:
        return None
    if isinstance(getattr(loader, "eval_cache", None), dict) and isinstance(getattr(loader, "next_id", None), int):
        return loader
    return None


def mark() -> int | None:
    """Where the cache stands now: the number the next generated source will get."""
    loader = _loader()
    return loader.next_id if loader is not None else None


def _forget(loader, key: str) -> None:
    loader.eval_cache.pop(key, None)
    linecache.cache.pop(key, None)


def _keys_of(gm: fx.GraphModule) -> set[str]:
    """The cache keys of `gm`'s generated code and of its graph-module children's."""
    keys = set()
    for m in gm.modules():
        code = getattr(type(m).__dict__.get("forward"), "__code__", None)
        if isinstance(m, fx.GraphModule) and code is not None:
            keys.add(code.co_filename)
    return keys


def release_sources(since: int | None, kept: Iterable[fx.GraphModule]) -> int:
    """Drop the sources registered since `since` (a `mark()`), except those of `kept`, whose sources go
    when they are collected. Returns how many were dropped now."""
    loader = _loader()
    if loader is None or since is None:
        return 0
    owners = {key: gm for gm in kept for key in _keys_of(gm)}
    dropped = 0
    for key in list(loader.eval_cache):
        m = _KEY.match(key)
        if m is None or int(m.group(1)) < since:
            continue
        if key in owners:
            weakref.finalize(owners[key], _forget, loader, key)
        else:
            _forget(loader, key)
            dropped += 1
    return dropped
