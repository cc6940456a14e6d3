"""Every rank must compute the same plan without talking, in separate processes whose string hashes
differ (PYTHONHASHSEED): a plan that depended on set order once hung 2-D training. The program must be
one the solver proves optimal: where branch and bound stops at its time limit (BRANCH_SECONDS), the plan
depends on the machine's speed (on a live mesh every rank adopts rank 0's; here nothing would). On the
compute-bound test device this one's relaxation is integral; at SLOW_DEVICE's 1 GB/s, copies make it
fractional and branch and bound ran out of time 0.01% from its bound."""
import os
import subprocess
import sys

SCRIPT = r"""
import torch, warnings
warnings.simplefilter("ignore")
from tests.e2e.training_cases import TRAIN_CASES, _build
from tests.support import COMPUTE_BOUND_DEVICE, compile_graph, spec
case = TRAIN_CASES["gpt-2d-adamw-megatron"]
torch.set_default_dtype(torch.float64)
model, inputs, loss_fn = _build(case)
c = compile_graph(model, inputs, spec((2, 2), ("dp", "tp"), device=COMPUTE_BOUND_DEVICE), loss_fn=loss_fn)
assert not c.plan.stats["status"].startswith("Time limit"), c.plan.stats["status"]
print(c.plan.fingerprint())
"""


def test_plan_is_identical_across_processes_with_different_hash_seeds():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    prints = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": root}
        out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=root, capture_output=True, text=True,
                             timeout=300, check=True)
        prints.add(out.stdout.strip().splitlines()[-1])
    assert len(prints) == 1, prints
