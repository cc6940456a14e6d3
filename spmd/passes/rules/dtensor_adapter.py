"""The one place that touches DTensor's private sharding-rule registry (torch 2.13).

DTensor registers ~1,100 ATen overloads in two formats; both are queried offline on a DeviceMesh built
without a process group:
  * single-dim rules (`op_single_dim_strategy_funcs`): placements for one mesh axis, which we expand to
    the N-D mesh ourselves (`expand_single_dim`), exactly as DTensor does at run time;
  * strategy functions (`op_strategy_funcs`): given each input's candidate specs, they return every
    acceptable (input specs -> output specs) choice.
A torch upgrade that moves these internals should only need this file to change.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from torch.distributed.tensor import Partial, Replicate
from torch.distributed.tensor._api import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._ops import utils as _dtensor_op_utils
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy
from torch.distributed.tensor._ops.single_dim_strategy import _fill_single_dim_strategy_placeholders
from torch.distributed.tensor.placement_types import Shard
from torch.utils._pytree import tree_map

from spmd.passes.rules.registry import expand_single_dim
from spmd.core.specs import Placements, Strategy, TensorInfo


def _propagator():
    return DTensor._op_dispatcher.sharding_propagator


@functools.lru_cache(maxsize=16)
def offline_mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    """A DeviceMesh with no process group behind it: enough for DTensor's rules, never for running."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    # a real (CPU) mesh tensor even when planning runs inside a FakeTensorMode (compiling with no GPU, as the
    # tests do): a fake one makes every DTensor rule fail on .item() and every op fall back to Replicate, and
    # the cache would hand that mesh to later plans too
    with unset_fake_temporarily():
        return DeviceMesh("cpu", torch.arange(int(torch.tensor(shape).prod())).reshape(shape),
                          mesh_dim_names=names, _init_backend=False, _rank=0)


def _with_replication(single: list[list], outputs, n_in: int) -> list[list]:
    """A single-dim rule list with the all-Replicate rule first, where the rule did not give one (what
    DTensor adds at run time; its helper for it changed signature between torch releases). An output
    with no tensor (a backward op's masked-off gradient) stays None."""
    if any(all(isinstance(p, Replicate) or p is None for p in r) for r in single):
        return single
    return [[None if o is None else Replicate() for o in outputs] + [Replicate()] * n_in] + single


@contextlib.contextmanager
def _no_redistribute_costs():
    """DTensor's strategy functions price every (candidate -> input) pair with its own cost model; we
    discard those numbers (cost_model/ prices resharding), and computing them was 70% of enumeration on
    an 8x8 mesh. They are zero while our queries run. Not thread-safe, like the rest of DTensor's
    offline use here."""
    original = _dtensor_op_utils.redistribute_cost
    _dtensor_op_utils.redistribute_cost = lambda src, dst: 0.0
    try:
        yield
    finally:
        _dtensor_op_utils.redistribute_cost = original


def _meta(info: TensorInfo) -> TensorMeta:
    return TensorMeta(torch.Size(info.shape), torch.empty(info.shape, device="meta").stride(), info.dtype)


# Ops whose DTensor rule reads a dim argument (at this position) as given, without making it positive first:
# torch 2.13's `scan_strategy` compares it with `Shard.dim` (never negative), so a running sum over dim=-1 of
# a value split along its last dim kept the split, and each rank summed its own part, silently (Bloom's and
# Falcon's `attention_mask.cumsum(-1)` under sequence-parallel pins)
_DIM_AS_GIVEN = {torch.ops.aten.cumsum.default: 1, torch.ops.aten.cumprod.default: 1,
                 torch.ops.aten.logcumsumexp.default: 1}


def _positive_dim(op, args: tuple, arg_infos: dict) -> tuple:
    at = _DIM_AS_GIVEN.get(op)
    if at is None or len(args) <= at or not isinstance(args[at], int) or args[at] >= 0:
        return args
    ndim = max(len(arg_infos[args[0].index].shape), 1) if isinstance(args[0], TensorArg) else None
    return args if ndim is None else (*args[:at], args[at] % ndim, *args[at + 1:])


# reductions whose empty dim list means every dim (`x.sum()` traced by torch.export as `sum.dim_IntList(x, [])`), which
# DTensor's rule reads as no dim: its only strategy kept the input whole, so a full sum of a split value gathered it
# instead of summing each piece (a probe: a loss's count of its targets, every inference `x.sum()`)
_ALL_DIMS_WHEN_EMPTY = {torch.ops.aten.sum.dim_IntList: 1, torch.ops.aten.mean.dim: 1, torch.ops.aten.amax.default: 1,
                        torch.ops.aten.amin.default: 1}


def _every_dim_listed(op, args: tuple, arg_infos: dict) -> tuple:
    at = _ALL_DIMS_WHEN_EMPTY.get(op)
    if at is None or len(args) <= at or not isinstance(args[at], (list, tuple)) or len(args[at]) or \
            not isinstance(args[0], TensorArg):
        return args
    return (*args[:at], list(range(len(arg_infos[args[0].index].shape))), *args[at + 1:])


def strategies(op, args: tuple, kwargs: dict, arg_infos: dict[int, TensorInfo],
               candidates: dict[int, list[Placements]], outputs: tuple[TensorInfo | None, ...],
               mesh) -> list[Strategy] | None:
    """DTensor's strategies for `op`, or None when DTensor has no rule.

    `args`/`kwargs` hold `TensorArg(j)` markers where the j-th tensor input goes; `arg_infos[j]` is its
    shape/dtype and `candidates[j]` the placements its producer can deliver.
    """
    prop = _propagator()
    info = prop.op_single_dim_strategy_funcs.get(op)
    func = prop.op_strategy_funcs.get(op)
    if info is None and func is None:
        return None
    dmesh = offline_mesh(mesh.shape, mesh.axis_names)
    args = _every_dim_listed(op, _positive_dim(op, tuple(args), arg_infos), arg_infos)

    def schema(cands: dict[int, list[Placements]], schema_info) -> OpSchema:
        """The OpSchema DTensor's rules read: each tensor arg an OpStrategy over its candidates."""
        def to_strategy(x):
            if isinstance(x, TensorArg):
                meta = _meta(arg_infos[x.index])
                return OpStrategy([OpSpec(DTensorSpec(dmesh, ps, meta)) for ps in cands[x.index]])
            return x

        def tuple_lists(x):  # a list of tensors (cat, stack) is one TupleStrategy
            if isinstance(x, (list, tuple)) and x and all(isinstance(c, OpStrategy) for c in x):
                return TupleStrategy(tuple(x))
            return x

        is_leaf = lambda x: isinstance(x, TensorArg)  # noqa: E731
        s_args = [tuple_lists(a) for a in tree_map(to_strategy, args, is_leaf=is_leaf)]
        s_kwargs = {k: tuple_lists(v) for k, v in tree_map(to_strategy, kwargs, is_leaf=is_leaf).items()}
        return OpSchema(op, tuple(s_args), s_kwargs, schema_info=schema_info)

    if info is not None:
        replicated = {j: [(Replicate(),) * mesh.ndim] for j in arg_infos}  # rules see only metadata
        sch = schema(replicated, prop.op_to_schema_info_for_single_dim_strategy.get(op))
        single = info.func(op, sch.args_meta, sch.kwargs_meta)
        single = _with_replication([list(r) for r in single], outputs, len(arg_infos))
        single = _fill_single_dim_strategy_placeholders({Shard(0)}, single)
        return [s for s in expand_single_dim(single, len(outputs), mesh.ndim) if _plain(s)]

    schema_info = prop.op_to_schema_info.get(op)

    def query(cands):
        with _no_redistribute_costs():
            return func(schema(cands, schema_info))

    try:
        results = [query(candidates)]
    except Exception:
        # One candidate the op cannot take (a view that cannot split an uneven dim) must not cost all
        # the others: ask again one input candidate at a time and keep what DTensor accepts.
        results = []
        for j, cands in candidates.items():
            for ps in cands:
                try:
                    results.append(query({**candidates, j: [ps]}))
                except Exception:
                    continue
        if not results:
            raise
    if any(isinstance(r, TupleStrategy) for r in results):
        return None
    out, seen = [], set()
    for spec in (spec for r in results for spec in r.strategies):
        outs = spec.output_specs
        if not isinstance(outs, (tuple, list)):
            # one spec for an op with several outputs: DTensor's "replicate everything" rules (svd, qr,
            # eigh) answer so; any other single spec says nothing about the other outputs
            if len(outputs) > 1 and not all(isinstance(p, Replicate) for p in outs.placements):
                continue
            outs = tuple(outs if o is not None else None for o in outputs) if len(outputs) > 1 else (outs,)
        # DTensor gives no spec for outputs it leaves plain local tensors: the fused CUDA attention kernels'
        # RNG state (flash's `unused` philox offset, efficient attention's philox seed and offset), the same
        # on every rank. In our graph they are tensors the backward kernel reads: Replicate.
        out_ps = tuple(o.placements if o is not None else None if info is None else (Replicate(),) * mesh.ndim
                       for o, info in zip(outs, outputs))
        if spec.input_specs is None:
            in_ps = tuple(out_ps[0] for _ in arg_infos)
        else:
            in_ps = tuple(s.placements for s in spec.input_specs)
        strategy = Strategy(out_ps, in_ps)
        if _plain(strategy) and strategy not in seen:
            seen.add(strategy)
            out.append(strategy)
    return out


def _plain(s: Strategy) -> bool:
    """Only DTensor's public placements. Its private ones (_StridedShard, _MaskPartial for vocab-parallel
    embedding) need rank-dependent local ops we do not emit yet (TODO: issue 4 covers more rules)."""
    return all(type(p) in (Shard, Replicate, Partial) for ps in s.outputs + s.inputs if ps is not None for p in ps)


class TensorArg:
    """Marker for the j-th tensor input inside an op's args while querying rules."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __repr__(self) -> str:
        return f"TensorArg({self.index})"

    def __eq__(self, other) -> bool:
        return isinstance(other, TensorArg) and other.index == self.index

    def __hash__(self) -> int:
        return hash(("TensorArg", self.index))


def op_name(op: Any) -> str:
    return str(op).replace("aten::", "aten.")
