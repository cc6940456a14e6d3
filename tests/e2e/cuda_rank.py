"""One rank of a CUDA/NCCL world, compiled on a machine with no GPU: rank 5 of 8 on a (dp=2, tp=4) mesh,
through fake CUDA tensors (tests/fake_cuda) and torch's fake process group. It compiles GPT (sdpa) with
spmd.compile, plans the same model on fake CPU tensors, runs this rank's graphs under FakeTensorMode, and
prints what it found as JSON on its last line: tests/e2e/test_cuda_compile.py asserts on it.

    python tests/e2e/cuda_rank.py [--training] [--dtype bfloat16] [--flex]

--flex: FlexAttention under a causal block mask in place of SDPA (torch refuses its backward on CPU, so
training with it is planned here, on CUDA, and not compared with a plan on CPU tensors).

A process of its own: fake CUDA, the fake process group and the attention kernel override are global.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests import fake_cuda  # noqa: E402  (imports no torch)

RANK, WORLD, SHAPE, AXES = 5, 8, (2, 4), ("dp", "tp")
os.environ["LOCAL_RANK"] = str(RANK)  # with no GPU, spmd.compile takes the rank's device from LOCAL_RANK
INSTALLED = fake_cuda.install(WORLD)  # before torch starts

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch._C import DispatchKey  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

import spmd  # noqa: E402
import spmd.api  # noqa: E402
from spmd.runtime.agreement import Rendezvous  # noqa: E402
from spmd.compiler.meta import fake_model  # noqa: E402
from spmd.compiler.options import PlanOptions  # noqa: E402
from spmd.compiler.pipeline import run_pipeline  # noqa: E402
from spmd.core import collectives as C  # noqa: E402
from spmd.core.specs import local_shape  # noqa: E402
from tests.models import GPT, GPTConfig  # noqa: E402
from tests.support import COMPUTE_BOUND_DEVICE, spec  # noqa: E402

aten = torch.ops.aten
FACTORIES = {aten.arange.default, aten.arange.start, aten.arange.start_step, aten.full.default, aten.zeros.default,
             aten.ones.default, aten.empty.memory_format, aten.empty_strided.default, aten.scalar_tensor.default,
             aten.rand.default, aten.randn.default, aten._to_copy.default, aten.empty_permuted.default}


@contextlib.contextmanager
def gpu_attention_kernels():
    """scaled_dot_product_attention on CUDA tensors decomposes as on an sm80+ GPU (flash for fp16/bf16,
    memory-efficient for fp32). A CPU-only torch build has no CUDA kernel chooser and takes the math
    fallback for (fake) CUDA tensors. Python-dispatcher kernel: AOTAutograd traces under it."""
    op = aten.scaled_dot_product_attention.default

    def kernel(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if q.device.type != "cuda" or enable_gqa or q.dim() != 4:
            return op._op_dk(DispatchKey.CompositeImplicitAutograd, q, k, v, attn_mask, dropout_p, is_causal,
                             scale=scale, enable_gqa=enable_gqa)
        if q.dtype in (torch.float16, torch.bfloat16) and attn_mask is None:
            return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        return aten._scaled_dot_product_efficient_attention(q, k, v, attn_mask, grad, dropout_p, is_causal,
                                                            scale=scale)[0]

    op.py_impl(DispatchKey.CompositeImplicitAutograd)(kernel)
    op._dispatch_cache.clear()
    try:
        yield
    finally:
        op.py_kernels.pop(DispatchKey.CompositeImplicitAutograd, None)
        op._dispatch_cache.clear()


class Record(TorchDispatchMode):
    """The ops a run dispatches: the devices of their tensors, and each functional collective."""

    supports_higher_order_operators = True  # flex_attention passes through here too

    def __init__(self):
        super().__init__()
        self.ops, self.devices, self.c10d = set(), set(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(getattr(func, "overloadpacket", func))
        self.ops.add(name)
        self.devices.update(str(t.device) for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor))
        if name.startswith("_c10d_functional.") and name != "_c10d_functional.wait_tensor":
            strs = [a for a in args if isinstance(a, str)]  # (reduce op,) group name
            self.c10d.append((name.split(".", 1)[1], strs[0] if len(strs) > 1 else None, strs[-1]))
        return out


def graph_facts(compiled) -> dict:
    graphs = [compiled.split.forward, compiled.split.backward] if compiled.split is not None else [compiled.graph_module]
    steps = {f: n for n, f in C.STEP_FUNCTIONS.items()} | {C.bucket_start: "bucket_start",
                                                            C.all_reduce_start: "all_reduce"}
    ops, devices, factories, collectives = set(), set(), [], []
    for gm in graphs:
        for n in gm.graph.nodes:
            if n.op != "call_function":
                continue
            ops.add(str(n.target))
            devices.update(str(d) for d in tree_leaves((n.args, n.kwargs)) if isinstance(d, torch.device))
            # a dtype-only _to_copy (a bf16 log_softmax computed in float32) stays on its input's device
            moves = n.target is not aten._to_copy.default or "device" in n.kwargs
            if n.target in FACTORIES and moves:
                factories.append([str(n.target), str(n.kwargs.get("device"))])
            if n.target in steps and "group" in n.kwargs:
                collectives.append([steps[n.target], n.kwargs.get("reduce_op"), n.kwargs["group"]])
    return {"ops": sorted(ops), "devices": sorted(devices), "factories": factories, "steps": collectives}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--training", action="store_true")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--flex", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)

    dist.init_process_group("fake", store=FakeStore(), rank=RANK, world_size=WORLD)
    mesh = init_device_mesh("cuda", SHAPE, mesh_dim_names=AXES)
    # The fake group moves no data: whatever the other ranks would send is garbage. There is no one else
    # to agree with here: this rank meets only itself.
    Rendezvous.agree_on = lambda self, summary: None
    Rendezvous.agree_on_plan = lambda self, fingerprint: None
    Rendezvous.share_plan = lambda self, make: make()
    Rendezvous.plans_here = lambda self: True
    # the tests' compute-bound profile, fast links: the plan shards a lot. At SLOW_DEVICE's 1 GB/s, copies
    # decide between near-equal plans, and the CUDA graph (other attention kernels) and the CPU one it is
    # checked against could tip apart.
    mesh_spec = spec(SHAPE, AXES, device=COMPUTE_BOUND_DEVICE)

    dtype = getattr(torch, args.dtype)
    cfg = GPTConfig(flex="mask" if args.flex else None)
    with torch.device("meta"):
        model = GPT(cfg).to(dtype)
    batch, seq = 2 * SHAPE[0] * SHAPE[1], cfg.seq
    # forward: meta example inputs; training: real CPU ones, as examples/gpu_smoke.py passes them (traced
    # as fakes on the rank's GPU, like the meta model's parameters)
    meta_inputs = tuple(torch.zeros(batch, seq, dtype=torch.long, device="cpu" if args.training else "meta")
                        for _ in range(2 if args.training else 1))
    loss = (lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten())) if args.training else None
    options = PlanOptions(loss_fn=loss, verify=True)

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    from spmd.passes.enumerate_strategies import UnknownOpWarning
    warnings.simplefilter("error", UnknownOpWarning)  # an op that fell back to Replicate fails the run
    with gpu_attention_kernels(), mode:
        compiled = spmd.compile(model, mesh, meta_inputs, mesh_spec=mesh_spec, options=options)
        facts = graph_facts(compiled)
        # the meta model's shards have no values and forward refuses to run: give it (fake) ones
        compiled.load_sharded_state_dict({k: torch.empty(v.shape, dtype=v.dtype, device=f"cuda:{RANK}")
                                          for k, v in model.state_dict().items()})
        full = [torch.zeros(batch, seq, dtype=torch.long, device=f"cuda:{RANK}") for _ in meta_inputs]
        record = Record()
        with record, torch.autograd.set_multithreading_enabled(False):  # no per-device autograd threads
            out = compiled(*compiled.shard_inputs(*full))
            if args.training:
                out.backward()
        ps = compiled.plan.choices["output_0"].inputs[0]
        grads_ok = all(p.grad is not None and p.grad.shape == p.shape and p.grad.device == p.device
                       for p in compiled.parameters()) if args.training else None

    # the same plan made on fake CPU tensors (what spmd.plan does), for the memory comparison
    cpu_plan = None
    if not (args.flex and args.training):
        cpu_model, cpu_inputs = fake_model(model, meta_inputs)
        cpu_plan = run_pipeline(cpu_model, cpu_inputs, mesh_spec, options).plan
    flex = {name: [str(p) for p in s.outputs[0]] for name, s in compiled.plan.choices.items()
            if name.startswith("flex_attention")}

    facts.update({
        "installed": INSTALLED,
        "group_ranks": {name: dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(name))
                        for name in sorted({g for _, _, g in facts["steps"]})},
        "mesh_groups": [mesh.get_group(i).group_name for i in range(mesh.ndim)],
        "run_ops": sorted(record.ops), "run_devices": sorted(record.devices), "run_c10d": sorted(set(record.c10d)),
        "out": [list(out.shape), str(out.device)],
        "want_out": list(local_shape((batch, seq, cfg.vocab), ps, SHAPE)) if not args.training else [],
        "grads_ok": grads_ok,
        "params_device": sorted({str(p.device) for p in compiled.parameters()}),
        "memory": compiled.plan.memory if hasattr(compiled.plan, "memory") else None,
        "memory_cpu": cpu_plan.memory if cpu_plan else None,
        "objective": compiled.plan.objective, "objective_cpu": cpu_plan.objective if cpu_plan else None,
        "flex": flex,
        "cuda_initialized": torch.cuda.is_initialized(),
    })
    dist.destroy_process_group()
    print(json.dumps(facts, default=str))


if __name__ == "__main__":
    main()
