"""bucket_gradients: pack the gradient all_reduces of a rank's backward graph into few large ones.

Before: a backward rank graph whose parameter gradients leave through chains of `all_reduce` steps
(one collective per gradient, each paying the link's latency). After: those all_reduces, grouped by
process group in the order backward produces them, are `bucket_start` / `bucket_wait` pairs of at most
`bucket_bytes` each: one launch per bucket as soon as its last gradient is ready and one wait just
before the first read of its results (or the next collective on its group), so buckets overlap with the
rest of backward, on NCCL and gloo alike. The bucket is reduced in place, and its pieces are views of it
where all of them leave the graph (one copy per gradient: into the bucket).
The cost model prices exactly this: a bucketed all_reduce pays its share of one latency.
"""
from __future__ import annotations

import operator

import torch.fx as fx

from spmd.core import collectives as C
from spmd.core.specs import local_shape, pieces


# the steps of a resharding (core/collectives.py): a gradient on its way out passes through these alone
_RESHARDING = (C.all_reduce, C.all_gather, C.reduce_scatter, C.all_to_all, C.shard_local, C.partial_local)


def _gradient_chain(node: fx.Node) -> bool:
    """An all_reduce whose result only flows (through more resharding steps) to the graph's outputs: a gradient
    on its way out, as the cost model takes every all_reduce of a parameter gradient's resharding to be
    (`comm.step_cost` with its bucket). A chain over two mesh axes (reduce_scatter on dp, all_reduce on tp,
    all_gather on dp; or all_reduce, shard_local, all_reduce) launched its all_reduce alone, where the plan
    priced a share of a bucket (found by a probe of explain's counts against the rank graphs)."""
    for user in node.users:
        if user.op == "output":
            continue
        if user.target in _RESHARDING and _gradient_chain(user):
            continue
        return False
    return True


def _upstream_members(node: fx.Node, members) -> list[fx.Node]:
    """The bucketed all_reduces (`members`) `node` reads through resharding steps."""
    found, stack, seen = [], list(node.all_input_nodes), set()
    while stack:
        n = stack.pop()
        if n in seen or n.op != "call_function" or n.target not in _RESHARDING:
            continue
        seen.add(n)
        if n in members:
            found.append(n)
        stack.extend(n.all_input_nodes)
    return found


def _reaches(starts: set[int], target: int, reads: list[set[int]]) -> bool:
    """Whether bucket `target` is one of `starts` or read by them, through the buckets they read."""
    stack, seen = list(starts), set()
    while stack:
        b = stack.pop()
        if b == target:
            return True
        if b not in seen:
            seen.add(b)
            stack.extend(reads[b])
    return False


def local_bytes(node: fx.Node, mesh_shape: tuple[int, ...]) -> float:
    """Bytes of `node`'s value on one rank, from its global value and its placements."""
    val = node.meta["val"]
    return val.numel() * val.element_size() / pieces(node.meta["spmd_placements"][0], mesh_shape)


def bucket_gradients(backward: fx.GraphModule, mesh_shape: tuple[int, ...], bucket_bytes: float,
                     defer_waits: bool = True) -> fx.GraphModule:
    """A new backward graph (the given one is left as it is). `defer_waits`: move each bucket's wait down
    to its first reader; False: wait right after launch."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(backward.graph, {}))
    members = [n for n in graph.nodes if n.target is C.all_reduce and _gradient_chain(n)]
    buckets: list[list[fx.Node]] = []
    open_by_key: dict[tuple, int] = {}  # key -> the index of its open bucket
    size_by_key: dict[tuple, float] = {}
    bucket_of: dict[fx.Node, int] = {}
    reads: list[set[int]] = []  # per bucket: the buckets whose results its members read (through their chains)
    for node in members:
        kw = node.kwargs
        dtype = node.args[0].meta["val"].dtype if "val" in node.args[0].meta else None
        key = (kw["group"], kw["reduce_op"], kw["world"], dtype)
        nbytes = local_bytes(node.args[0], mesh_shape)
        ups = {bucket_of[u] for u in _upstream_members(node, bucket_of)}
        if key in open_by_key and (size_by_key[key] + nbytes > bucket_bytes or
                                   _reaches(ups, open_by_key[key], reads)):
            # (full; or this one reads, through its chain, a bucket that waits for this one's: a gradient reduced
            # on dp then tp beside one reduced on tp then dp would make two buckets wait on each other; a review)
            del open_by_key[key]
        if key not in open_by_key:
            open_by_key[key] = len(buckets)
            size_by_key[key] = 0.0
            buckets.append([])
            reads.append(set())
        k = open_by_key[key]
        buckets[k].append(node)
        reads[k] |= ups
        size_by_key[key] += nbytes
        bucket_of[node] = k

    order = {n: i for i, n in enumerate(graph.nodes)}
    for bucket in buckets:
        last = max(bucket, key=lambda n: order[n])
        kw = bucket[0].kwargs
        inputs = [n.args[0] for n in bucket]
        with graph.inserting_after(last):
            names = ", ".join(n.args[0].name for n in bucket[:3]) + (", ..." if len(bucket) > 3 else "")
            where = f"a bucket of {len(bucket)} gradient(s) ({names})"
            start = graph.call_function(C.bucket_start, (inputs,),
                                        {"reduce_op": kw["reduce_op"], "group": kw["group"], "world": kw["world"],
                                         "where": where})
        # Views of the bucket where every piece is a gradient the graph returns (they all live until the
        # optimizer's step) or goes into a later bucket (whose launch copies it): a view saves a copy (a gradient
        # reduced on tp, then on dp, was copied twice), though pieces bound for buckets launched far apart keep
        # the whole bucket until the last of those launches, where copies would each go at their own.
        views = all(u.op == "output" or u in bucket_of or u.target is C.bucket_start for n in bucket for u in n.users)
        shapes = [local_shape(tuple(n.meta["val"].shape), n.meta["spmd_placements"][0], mesh_shape) for n in inputs]
        with graph.inserting_after(start):
            done = graph.call_function(C.bucket_wait, (start, shapes),
                                       {"reduce_op": kw["reduce_op"], "world": kw["world"], "group": kw["group"],
                                        "views": views, "where": where})
        for i, node in enumerate(bucket):
            with graph.inserting_after(done):
                piece = graph.call_function(operator.getitem, (done, i))
            piece.meta = dict(node.meta)
            node.replace_all_uses_with(piece)
            graph.erase_node(node)
    _topological_sort(graph)
    if defer_waits:
        _sink_bucket_waits(graph)
    return fx.GraphModule(backward, graph)


def _topological_sort(graph: fx.Graph) -> None:
    """Re-thread the nodes so each follows its inputs (a bucket may read results of an earlier one)."""
    placed: set[fx.Node] = set()
    ordered: list[fx.Node] = []
    for root in list(graph.nodes):
        stack = [(root, False)]
        while stack:
            node, ready = stack.pop()
            if node in placed:
                continue
            if ready:
                placed.add(node)
                ordered.append(node)
                continue
            stack.append((node, True))
            stack.extend((a, False) for a in reversed(node.all_input_nodes) if a not in placed)
    for before, node in zip(ordered, ordered[1:]):
        before.append(node)


def _uses_group(node: fx.Node, group: str) -> bool:
    return node.op == "call_function" and getattr(node.target, "__module__", "") == C.__name__ \
        and node.kwargs.get("group") == group


def sink_wait(wait: fx.Node, group: str) -> None:
    """Move `wait` (with the getitems that pick out its results) down to just before the first node that
    reads its result, or that launches another collective on `group`, or the output: gloo mismatches
    collectives when two are in flight on one group (seen here), so each group keeps at most one
    outstanding."""
    carried = [u for u in wait.users if u.target is operator.getitem]
    readers = (set(wait.users) - set(carried)) | {u for g in carried for u in g.users}
    node = wait.next
    while node.op not in ("root", "output") and node not in readers and not _uses_group(node, group):
        node = node.next
    if node is wait.next:
        return
    node.prepend(wait)
    for g in carried:
        node.prepend(g)


def _sink_bucket_waits(graph: fx.Graph) -> None:
    """Move each bucket_wait (and its getitems) down to just before the first node that reads them (`sink_wait`)."""
    for wait in [n for n in graph.nodes if n.target is C.bucket_wait]:
        sink_wait(wait, wait.args[0].kwargs["group"])
