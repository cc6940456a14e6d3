"""Progress of a long compile on a terminal: one line, redrawn by tqdm, naming the pass that runs and,
while the solver works, its best plan's estimate, the proven lower bound and the gap as they improve
(HiGHS's callbacks from branch and bound, with or without a budget; a budget's price search reports
after each price; a relaxation that is integral at once has nothing to report until it returns).
Silent when stderr is not a terminal (logs, CI, pytest), on every rank but the first, and with
SPMD_PROGRESS=0.
"""
from __future__ import annotations

import os
import sys


class Progress:
    def __init__(self, passes: list[str], rank: int | None = None, stream=None, enabled: bool = True):
        stream = stream if stream is not None else sys.stderr
        on = (enabled and os.environ.get("SPMD_PROGRESS", "1") != "0" and (rank in (None, 0))
              and getattr(stream, "isatty", lambda: False)())
        self.bar = None
        if on:
            from tqdm import tqdm

            self.bar = tqdm(total=len(passes), desc="spmd", file=stream, leave=False, unit="pass",
                            bar_format="{desc}: {n_fmt}/{total_fmt} passes [{elapsed}] {postfix}")

    def start(self, name: str) -> None:
        if self.bar is not None:
            self.bar.set_description(f"spmd {name}")

    def solving(self, objective: float, bound: float, gap: float) -> None:
        """The solver's incumbent and bound (seconds per call) as they improve."""
        if self.bar is not None:
            self.bar.set_postfix_str(f"best {objective * 1e3:.3f} ms, bound {bound * 1e3:.3f} ms, gap {gap:.2%}")

    def done(self, name: str, values: dict) -> None:
        if self.bar is None:
            return
        plan = values.get("plan") if name == "solve_placements" else None
        if plan is not None:
            self.bar.set_postfix_str(f"estimate {plan.objective * 1e3:.3f} ms, bound {plan.lower_bound * 1e3:.3f} ms, "
                                     f"gap {plan.gap_text}")
        elif name == "trace" and values.get("traced") is not None:
            self.bar.set_postfix_str(f"{len(values['traced'].graph.nodes)} nodes")
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
