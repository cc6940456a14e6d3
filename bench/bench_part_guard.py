"""What the guards on a compiled model's submodules cost its eager calls (runtime/source_guard.py `_PartGuard`;
no processes): a frozen part of the model called eagerly, as for features, beside a compiled module that
trains the rest, on a mesh of one device.

Models: 200 `Linear(4, 4)` in a Sequential (flat), a chain of modules 100 deep (each a Linear and the next),
and a 12-layer transformers GPT-2 (32 wide). Per model, median microseconds per eager call of the frozen
part, each timed in turns with the same call on an uncompiled twin (no guards):
- plain: the twin;
- before any step: the guarded part while nothing in the process has trained (one compare per module);
- after a step, kept: the same call again with no step between (each part's last look kept);
- first after a step: the call right after a step of the compiled module (every part looks again; what the
  step wrote is found once for the model, `_verdict`, and a part that passes passes those inside it).

    python bench/bench_part_guard.py      # prints the rows of bench/results_part_guard.md
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class _Chain(nn.Module):
    def __init__(self, depth: int):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.inner = _Chain(depth - 1) if depth > 1 else None

    def forward(self, x):
        x = self.fc(x)
        return self.inner(x) if self.inner is not None else x


def _flat():
    return nn.Sequential(nn.Sequential(*[nn.Linear(4, 4) for _ in range(200)]), nn.Linear(4, 4)), torch.randn(2, 4)


def _chain():
    return nn.Sequential(_Chain(100), nn.Linear(4, 4)), torch.randn(2, 4)


def _gpt2():
    from transformers import GPT2Config, GPT2Model

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            cfg = GPT2Config(n_embd=32, n_head=2, vocab_size=64, n_positions=32, n_layer=12, resid_pdrop=0.0,
                             embd_pdrop=0.0, attn_pdrop=0.0)
            self.backbone, self.head = GPT2Model(cfg), nn.Linear(32, 4)

        def forward(self, ids):
            return self.head(self.backbone(ids).last_hidden_state[:, -1])

    return Head().eval(), torch.randint(0, 64, (1, 4))


def _paired_us(fn, base, rounds: int = 60, calls: int = 5) -> float:
    """Median over rounds of (fn - base) per call, the two taken in turn."""
    gaps = []
    for i in range(rounds):
        t = {}
        for f in ((fn, base) if i % 2 == 0 else (base, fn)):
            start = time.perf_counter()
            for _ in range(calls):
                f()
            t[f] = (time.perf_counter() - start) / calls
        gaps.append(t[fn] - t[base])
    return 1e6 * statistics.median(gaps)


def _after_steps_us(step, fn, base, rounds: int = 30) -> float:
    """Median over rounds of (fn - base) for one call each right after a step, the two taken in turn."""
    gaps = []
    for i in range(rounds):
        step()
        t = {}
        for f in ((fn, base) if i % 2 == 0 else (base, fn)):
            start = time.perf_counter()
            f()
            t[f] = time.perf_counter() - start
        gaps.append(t[fn] - t[base])
    return 1e6 * statistics.median(gaps)


def _us(fn, rounds: int = 60, calls: int = 5) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
    return 1e6 * statistics.median(times)


def main() -> None:
    from spmd.runtime import source_guard
    from tests.support import one_device

    torch.set_num_threads(1)
    print("| model | modules in the part | plain, us | before any step, +us | after a step, kept, +us "
          "| first after a step, +us |")
    print("|---|---|---|---|---|---|")
    cases = []
    for name, build in (("200 Linear, flat", _flat), ("chain 100 deep", _chain), ("GPT-2, 12 layers", _gpt2)):
        torch.manual_seed(0)
        model, x = build()
        torch.manual_seed(0)
        twin, _ = build()
        part, twin_part = (model.backbone, twin.backbone) if name.startswith("GPT") else (model[0], twin[0])
        part.requires_grad_(False)
        y = torch.randn(model(x).shape)
        compiled = one_device(model, (x, y), training=True, loss_fn=F.mse_loss, optimizer_state_factor=0)
        cases.append((name, part, twin_part, x, y, compiled, torch.optim.SGD(compiled.parameters(), lr=0.01)))

    def caller(p, x):
        def call():
            with torch.no_grad():
                p(x)
        return call

    assert source_guard._clock[0] == 0  # (nothing has trained in this process: the parts' hooks are one compare)
    before = [_paired_us(caller(part, x), caller(twin_part, x)) for _, part, twin_part, x, *_ in cases]
    for (name, part, twin_part, x, y, compiled, opt), early in zip(cases, before):
        call, plain = caller(part, x), caller(twin_part, x)

        def step(compiled=compiled, opt=opt, x=x, y=y):
            compiled(x, y).backward()
            opt.step()
            opt.zero_grad()

        step()
        kept = _paired_us(call, plain)
        first = _after_steps_us(step, call, plain)
        row = (name, sum(1 for _ in part.modules()), _us(plain), early, kept, first)
        print("| {} | {} | {:.0f} | {:.0f} | {:.0f} | {:.0f} |".format(*row), flush=True)


if __name__ == "__main__":
    main()
