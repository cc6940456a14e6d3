"""The examples run in CI, at small sizes, as the README runs them."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*command, timeout=600):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([*map(str, command)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_demo_on_four_gloo_ranks_matches_one_device():
    """The README's main demo, with the tiny model: torchrun, 4 ranks on a 2x2 mesh."""
    out = _run(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "examples/demo.py", "--tiny")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "OK: every rank matches the single-device model" in out.stdout
    assert out.stdout.count("max |output - single device|") == 4
    assert "Modules (layout per mesh axis):" in out.stdout and "Collectives per call:" in out.stdout
    assert "Nodes (per rank" not in out.stdout  # the summary, not the per-op table
    assert "blocks_1" not in out.stdout.split("first layer")[1]  # the code of one layer


def test_render_gpt_draws_the_plan(tmp_path):
    out = _run(sys.executable, "examples/render_gpt.py", tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Modules (layout per mesh axis):" in out.stdout
    drawn = sorted(p.suffix for p in tmp_path.iterdir())
    assert drawn in ([".svg", ".svg"], [".dot", ".dot"]), drawn  # .dot where graphviz is not installed


def test_demo_on_two_nodes_of_two_ranks():
    """Multi-node as torchrun does it: two launchers (here on one machine, playing two nodes) meet at a
    c10d rendezvous; ranks 0-1 on one node, 2-3 on the other, so the mesh's outer axis (dp) spans nodes."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"spmd-{port}",
               "examples/demo.py", "--tiny"]
    nodes = [subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in nodes]
    for p, (out, err) in zip(nodes, outs):
        assert p.returncode == 0, out[-3000:] + err[-3000:]
    printed = "".join(out for out, _ in outs)
    assert "OK: every rank matches the single-device model" in printed
    assert printed.count("max |output - single device|") == 4
    # the mesh (dp=2, tp=2): tp inside a node, dp across them
    assert "rank 1 (node 0)" in printed and "rank 2 (node 1)" in printed


def test_gpu_smoke_runs_on_gloo():
    """examples/gpu_smoke.py, meant for GPUs with NCCL, in its CPU mode: meta build, init on shards, one
    AdamW step equal to one device."""
    out = _run(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "examples/gpu_smoke.py", "--cpu",
               "--dim", "128")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "OK: one training step equals one device" in out.stdout and out.stdout.count("(gloo)") == 2
