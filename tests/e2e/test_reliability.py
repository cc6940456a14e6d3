"""A rank that dies or hangs in the middle of a training step: the others fail, fast, naming what they
were doing, and nothing is left running (docs/reliability.md has the measured times)."""
import time
from pathlib import Path

import pytest

from tests.support import launch_ranks

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "e2e" / "scripts" / "dying_rank.py"


@pytest.mark.parametrize("how,limit_s", [("die", 30.0), ("hang", 20.0)])
def test_the_survivor_fails_fast_and_says_which_collective(how, limit_s):
    timeout_s = 10.0
    procs = launch_ranks([str(SCRIPT), how, str(timeout_s)])
    try:
        out0, err0 = procs[0].communicate(timeout=180)
        t_end = time.time()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # the hanging rank: a real job's launcher does this
        out1, _ = procs[1].communicate(timeout=60)
    assert procs[0].returncode not in (0, None), out0 + err0
    t_event = float(next(line for line in out1.splitlines() if "at step 2" in line).split(", ")[-1])
    elapsed = t_end - t_event
    assert elapsed < (limit_s if how == "die" else timeout_s + limit_s), elapsed
    assert "SpmdCollectiveError" in err0, err0[-3000:]
    assert "over ranks [0, 1] failed (" in err0 and "spmd.init_mesh(..., timeout=" in err0, err0[-3000:]
    message = next(line for line in err0.splitlines() if "SpmdCollectiveError:" in line)
    assert "on mesh axis dp" in message or "a bucket of" in message, message
    print(message)
    assert "rank 0 finished" not in out0
    print(f"{how}: the survivor failed {elapsed:.1f} s after rank 1 stopped")
