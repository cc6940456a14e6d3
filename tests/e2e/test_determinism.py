"""Every rank must compute the same plan without talking, in separate processes whose string hashes
differ (PYTHONHASHSEED): a plan that depended on set order once hung 2-D training."""
import os
import subprocess
import sys

SCRIPT = r"""
import torch, warnings
warnings.simplefilter("ignore")
from tests.e2e.training_cases import TRAIN_CASES, _build
from tests.support import compile_graph, spec
case = TRAIN_CASES["gpt-2d-adamw-megatron"]
torch.set_default_dtype(torch.float64)
model, inputs, loss_fn = _build(case)
c = compile_graph(model, inputs, spec((2, 2), ("dp", "tp")), loss_fn=loss_fn)
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
