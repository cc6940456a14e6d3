"""torch.autocast's state, read and set for the device types spmd runs on: the trace records what autocast casts
(`passes/trace_joint.py`), and the compiled module runs under the state it was traced in
(`runtime/autocast_guard.py`)."""
from __future__ import annotations

import contextlib

import torch

DEVICE_TYPES = ("cpu", "cuda")


def autocast_state() -> tuple:
    """((device type, autocast dtype), ...) for each device type where autocast is on; () where it is off."""
    return tuple((t, torch.get_autocast_dtype(t)) for t in DEVICE_TYPES if torch.is_autocast_enabled(t))


def autocast_off() -> contextlib.AbstractContextManager:
    """Autocast off for every device type where it is on now."""
    on = [t for t in DEVICE_TYPES if torch.is_autocast_enabled(t)]
    if not on:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for t in on:
        stack.enter_context(torch.autocast(t, enabled=False))
    return stack


def autocast_on(state: tuple) -> contextlib.AbstractContextManager:
    """Autocast as `autocast_state()` described it."""
    stack = contextlib.ExitStack()
    for t, dtype in state:
        stack.enter_context(torch.autocast(t, dtype=dtype))
    return stack
