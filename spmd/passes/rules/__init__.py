"""Per-op sharding rules: ours by op family in this folder (registered in `registry.RULES` by importing
them), DTensor's through `dtensor_adapter`."""
from spmd.passes.rules import (attention, cast, conv, factory, flex_attention, grouped_mm, indexing,  # noqa: F401
                               linalg, local_sizes, matmul, norm, pointwise, pool, random, softmax, tuple_ops,
                               vocab_parallel)
from spmd.passes.rules.registry import (LOCAL_REWRITES, RULES, RuleInput, expand_single_dim, rule,  # noqa: F401
                                       rule_for)
