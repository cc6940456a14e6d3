"""Compiling for CUDA/NCCL with no GPU: one rank (5 of 8) through fake CUDA tensors and torch's fake process
group (tests/e2e/cuda_rank.py, in a process of its own: fake CUDA and the fake group are process-global)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import fake_cuda

ROOT = Path(__file__).resolve().parents[2]
NCCL_COLLECTIVES = {"all_reduce", "all_reduce_", "all_gather_into_tensor", "reduce_scatter_tensor",
                    "all_to_all_single"}  # all_reduce_: in place (passes/reduce_in_place.py, gradient buckets)
NCCL_REDUCE_OPS = {"sum", "prod", "product", "min", "max", "avg", "premul_sum"}  # no band/bor/bxor
STATIC = ("parameters", "gradients", "optimizer", "inputs")  # the memory a kernel choice cannot change


def _rank(*flags):
    why = fake_cuda.available()
    if why:
        pytest.skip(f"fake CUDA shim cannot be built: {why}")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "tests/e2e/cuda_rank.py", *flags], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _check_common(f, rank=5):
    assert not any("_for_cpu" in op for op in f["ops"] + f["run_ops"])  # CUDA kernels, not CPU ones
    assert f["devices"] == [f"cuda:{rank}"]  # every device a node names (factories: arange, full, ...)
    assert f["factories"] and all(d == f"cuda:{rank}" for _, d in f["factories"])
    assert f["run_devices"] == [f"cuda:{rank}"] and f["params_device"] == [f"cuda:{rank}"]
    assert f["steps"], "the tests' profile should make this plan communicate"
    for kind, reduce_op, group in f["steps"]:
        assert group in f["mesh_groups"]  # the mesh's own groups, and this rank is in them
        assert rank in f["group_ranks"][group]
        assert reduce_op is None or reduce_op in NCCL_REDUCE_OPS
    assert f["run_c10d"] and all(op in NCCL_COLLECTIVES and (red is None or red in NCCL_REDUCE_OPS)
                                 for op, red, _ in f["run_c10d"])
    for k in STATIC:
        assert f["memory"].get(k) == f["memory_cpu"].get(k), k
    # the same FLOP formulas price the CUDA and the CPU kernels (a causal fused kernel does half the work)
    assert f["objective"] == pytest.approx(f["objective_cpu"], rel=1e-3)
    assert not f["cuda_initialized"]


def test_forward_for_cuda_rank_5_of_8():
    f = _rank()
    _check_common(f)
    assert "aten.scaled_dot_product_attention.default" in f["ops"]  # kept whole, as on CPU
    assert f["out"] == [f["want_out"], "cuda:5"]
    assert f["memory"] == f["memory_cpu"]  # the forward graph is the same on both devices


@pytest.mark.parametrize("dtype,kernel", [("float32", "efficient"), ("bfloat16", "flash")])
def test_training_for_cuda_rank_5_of_8(dtype, kernel):
    f = _rank("--training", "--dtype", dtype)
    _check_common(f)
    assert any(f"_scaled_dot_product_{kernel}_attention_backward" in op for op in f["ops"])
    assert f["grads_ok"]
    # activations differ by what the CUDA attention kernels save that the CPU ones do not (RNG state,
    # their fp32 statistics): about a kilobyte here (1,328 bytes for bf16), never a tensor's worth
    act, act_cpu = f["memory"]["activations"], f["memory_cpu"]["activations"]
    assert abs(act - act_cpu) <= 0.01 * act_cpu, (f["memory"], f["memory_cpu"])
    total, total_cpu = sum(f["memory"].values()), sum(f["memory_cpu"].values())
    assert abs(total - total_cpu) <= 0.002 * total_cpu, (f["memory"], f["memory_cpu"])


def test_flex_attention_training_for_cuda_rank_5_of_8():
    """FlexAttention trains on CUDA only (torch refuses its CPU backward): the joint graph keeps its
    forward and backward higher-order ops, every one split on both mesh axes, and the rank's graphs run."""
    f = _rank("--training", "--flex")
    assert {"flex_attention", "flex_attention_backward"} <= set(f["ops"]) & set(f["run_ops"])
    assert len(f["flex"]) == 4, f["flex"]  # two layers, forward and backward
    assert all("R" not in ps for ps in f["flex"].values()), f["flex"]
    assert f["grads_ok"] and f["run_devices"] == ["cuda:5"] and not f["cuda_initialized"]
