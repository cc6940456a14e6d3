"""enumerate_strategies and estimate_costs answer each distinct question once: a node asking a rule (or a
cost formula) what an earlier node asked, the same op on the same shapes with the same input candidates,
gets the earlier answer. Checked against the same passes with the memo turned off, on a 2-layer GPT
(too shallow for layer tying, so every node is enumerated on its own), training on (2, 2)."""
import torch
import torch.nn.functional as F

import spmd.passes.enumerate_strategies as enumerate_pass
import spmd.passes.estimate_costs as estimate_pass
from spmd.core.graph_facts import hashable_args
from spmd.passes.rules.dtensor_adapter import TensorArg
from spmd.passes.trace_joint import trace_joint
from tests.models import GPT, GPTConfig
from tests.support import spec

MESH = spec((2, 2), ("dp", "tp"))


def _traced():
    torch.manual_seed(0)
    tokens = torch.randint(0, 128, (4, 32))
    return trace_joint(GPT(GPTConfig(layers=2)), (tokens, tokens),
                       lambda logits, t: F.cross_entropy(logits.flatten(0, 1), t.flatten()))


def test_strategies_and_costs_are_those_each_node_gets_alone(monkeypatch):
    traced = _traced()
    table = enumerate_pass.enumerate_strategies(traced, MESH)
    costs = estimate_pass.estimate_costs(traced, table, MESH)

    # the memo answered: nodes of the second block hold the first block's very tuple of strategies
    shared = {id(ns.strategies) for ns in table.nodes.values()}
    assert len(shared) < len(table.nodes) * 0.75

    def no_key(*args):
        raise TypeError("memo off")

    monkeypatch.setattr(enumerate_pass, "_query_key", lambda *a: None)
    monkeypatch.setattr(estimate_pass, "hashable_args", no_key)
    alone = enumerate_pass.enumerate_strategies(traced, MESH)
    alone_costs = estimate_pass.estimate_costs(traced, alone, MESH)
    assert len({id(ns.strategies) for ns in alone.nodes.values()}) == len(alone.nodes)
    assert table.nodes.keys() == alone.nodes.keys()
    for name, ns in table.nodes.items():
        other = alone.nodes[name]
        assert (ns.strategies, ns.inputs, ns.outputs, ns.source, ns.excluded) == \
            (other.strategies, other.inputs, other.outputs, other.source, other.excluded), name
        assert costs.node_costs[name] == alone_costs.node_costs[name], name
    assert len({ns.variant for ns in table.nodes.values()}) == len(table.nodes)  # variants stay per node


def test_questions_tell_apart_what_rules_tell_apart():
    # a bool and an int, an int and a float, a list and a tuple: other arguments to an op
    assert hashable_args((True,)) != hashable_args((1,))
    assert hashable_args((2,)) != hashable_args((2.0,))
    assert hashable_args(([1, 2],)) != hashable_args(((1, 2),))
    assert hashable_args(({"dim": 1},)) != hashable_args(({"dim": 2},))
    assert hashable_args((TensorArg(0), 1)) == hashable_args((TensorArg(0), 1))
    assert hashable_args((TensorArg(0), 1)) != hashable_args((TensorArg(1), 1))


def test_merged_followers_keep_what_their_producer_offers():
    """merge_followers decides what a producer offers by its strategy list's variant (tied layers repeat
    the question). Each pruned node must keep exactly its strategies whose input the pruned producer
    makes, a getitem included: checked node by node on a stamped 8-layer Llama."""
    from spmd.passes.enumerate_strategies import StrategyTable
    from spmd.passes.find_layer_stacks import find_layer_stacks, truncated
    from spmd.passes.find_repeated_blocks import find_repeated_blocks
    from spmd.passes.merge_followers import merge_followers
    from spmd.passes.stamp_layers import stamp_layers
    from tests.models import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig(layers=8, vocab=128, dim=64, heads=4, kv_heads=2, ffn=128, seq=32))
    tokens = torch.randint(0, 128, (4, 32))
    stacks = find_layer_stacks(model)
    with truncated(model, stacks):
        short = trace_joint(model, (tokens, tokens),
                            lambda logits, t: F.cross_entropy(logits.flatten(0, 1), t.flatten()))
    traced = stamp_layers(short, stacks, model)
    blocks = find_repeated_blocks(traced, 4)
    table = enumerate_pass.enumerate_strategies(traced, MESH, blocks=blocks)
    merged = merge_followers(traced, table)
    assert merged.merged_followers > 0
    check = StrategyTable(merged.nodes)  # candidates of the pruned producers
    for name, ns in merged.nodes.items():
        before = table.nodes[name]
        if ns.source in ("placeholder", "output") or len(ns.inputs) != 1:
            assert ns is before
            continue
        offered = set(check.output_candidates(ns.inputs[0]))
        kept = tuple(s for s in before.strategies if s.inputs[0] in offered)
        assert ns.strategies == (kept if kept else before.strategies), name


def test_shard_and_replicate_have_no_subclasses():
    """specs.shard_factor, pieces, is_even and redistribute._direct test `type(p) is Shard` (or Replicate),
    not isinstance, which runs torch's Python `__instancecheck__` on every miss: right only while no
    placement subclasses them (Partial has subclasses, and is tested with isinstance)."""
    from torch.distributed.tensor import Replicate, Shard

    def subclasses(cls):
        return [s for c in cls.__subclasses__() for s in (c, *subclasses(c))]

    assert subclasses(Shard) == [] and subclasses(Replicate) == []


def test_answers_by_identity_are_per_object_and_keep_it_alive():
    """`ByIdentity`: one answer per (object, extra), made once; an equal object is another object; and the
    object is kept alive with its answer, so its id cannot pass to a new object and fetch a stale answer."""
    import gc
    import weakref

    from spmd.core.memo import ByIdentity

    class Row(list):
        pass

    memo, made = ByIdentity(), []
    row = Row([1, 2])
    assert memo.get(row, 0, lambda: made.append("a") or "a") == "a"
    assert memo.get(row, 0, lambda: made.append("again") or "again") == "a" and made == ["a"]
    assert memo.get(row, 1, lambda: "a1") == "a1"
    assert memo.get(Row([1, 2]), 0, lambda: "equal, not the same") == "equal, not the same"
    alive = weakref.ref(row)
    del row
    gc.collect()
    assert alive() is not None
