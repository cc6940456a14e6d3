"""spmd: a compiler-style SPMD graph partitioner for PyTorch.

    mesh = spmd.init_mesh((2, 2), ("dp", "tp"))
    compiled = spmd.compile(model, mesh, example_inputs=(tokens,))
    out = compiled(*compiled.shard_inputs(tokens))
"""
from spmd.api import compile, init_mesh, plan
from spmd.compiler.options import PlanOptions
from spmd.core.errors import SpmdError, SpmdInternalError
from spmd.core.mesh import MeshSpec
from spmd.passes.enumerate_strategies import UnknownOpWarning
from spmd.report.diff import diff_plans
from spmd.report.result import load_plan
from spmd.runtime.init_tape import deferred_init

__all__ = ["compile", "plan", "init_mesh", "MeshSpec", "PlanOptions", "SpmdError", "SpmdInternalError",
           "UnknownOpWarning", "load_plan", "diff_plans", "deferred_init"]
