"""spmd: a compiler-style SPMD graph partitioner for PyTorch.

    mesh = spmd.init_mesh((2, 2), ("dp", "tp"))
    compiled = spmd.compile(model, mesh, example_inputs=(tokens,))
    out = compiled(*compiled.shard_inputs(tokens))
"""
from spmd.api import compile, init_mesh, plan
from spmd.errors import SpmdError, SpmdInternalError
from spmd.mesh import MeshSpec
from spmd.passes.enumerate_strategies import UnknownOpWarning
from spmd.plan_io import diff_plans, load_plan

__all__ = ["compile", "plan", "init_mesh", "MeshSpec", "SpmdError", "SpmdInternalError", "UnknownOpWarning",
           "load_plan", "diff_plans"]
