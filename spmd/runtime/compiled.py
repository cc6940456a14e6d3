"""`CompiledModule`: this rank's generated graph plus its local parameter shards."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import functools
import math
import operator
import os
import re
import sys
import warnings
import weakref
from collections import OrderedDict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.utils._foreach_utils import (_device_has_foreach_support, _group_tensors_by_device_and_dtype,
                                         _has_foreach_support)
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.weak import WeakIdKeyDictionary

from spmd.compiler.attribute_reads import (AttributeGuard, grad_flag_reader, grad_mode_reader, hooks_read_training,
                                           reads_training)
from spmd.compiler import fx_sources
from spmd.compiler.call import Call
from spmd.compiler.meta import is_meta
from spmd.core import collectives, local_ops
from spmd.core.autocast import autocast_off, autocast_on
from spmd.core.errors import SpmdCollectiveError, SpmdError, SpmdInternalError, user_stacklevel
from spmd.core.graph_facts import is_view, may_draw
from spmd.core.mesh import coordinate
from spmd.core.specs import contiguous_strides, local_shape, placements_str, shard_factor
from spmd.passes.split_joint_graph import input_grad_key
from spmd.passes.trace_joint import OUTPUT_COPY, with_loss
from spmd.runtime import checkpoint_guard, clip_guard, compare, optimizer_guard, scaler_guard, source_guard, waiting
from spmd.runtime.autocast_guard import AutocastGuard
from spmd.runtime.distribute import collective_device, gather_full, gather_to_first, local_shard, local_slices, \
    extremes_over_mesh, max_over_mesh, same_piece, shard_full, total_norm
from spmd.runtime.distribute import values_digest as _digest
from spmd.runtime.inputs import CutPieces, InputSpec, check_full
from spmd.runtime.materialize import is_placeholder_value, local_piece
from spmd.runtime.mode_check import (grad_mode, ops_differ_by_frozen, ops_differ_by_grad, ops_differ_by_input_grads,
                                     ops_differ_by_mode)
from spmd.runtime.shapes import (Shapes, check_room, check_shared, full_key, pinned_to, requires_grad_flags,
                                 variant_key, verify_refusal)


def _untied_hint(model, missing: list[str]) -> str:
    """Where a transformers model whose configuration ties its word embeddings misses its output embeddings: the
    tie was lost before compiling (accelerate's init_empty_weights registers the tied head as a second tensor)."""
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False) or not hasattr(model, "get_output_embeddings"):
        return ""
    try:
        head = model.get_output_embeddings()
    except Exception:  # (a model without a head)
        return ""
    names = {f"{name}.weight" for name, m in model.named_modules() if m is head}
    if not names & set(missing):
        return ""
    return ("; its configuration ties the word embeddings, and the model held its head as a tensor of its own when "
            "compiled (accelerate's init_empty_weights does that): call model.tie_weights() before spmd.compile")


def _renamed_hint(unexpected: list[str]) -> str:
    """Where a checkpoint misses some of the model's tensors and holds others under other names."""
    if not unexpected:
        return ""
    return (f"; the checkpoint holds {len(unexpected)} tensors under other names ({', '.join(unexpected[:3])}"
            f"{', ...' if len(unexpected) > 3 else ''}): names transformers converts when it loads (a legacy "
            "`LayerNorm.gamma`, mixture-of-experts weights stored expert by expert) are not converted here; convert "
            "the checkpoint once, `safetensors.torch.save_model(X.from_pretrained(folder), 'converted.safetensors')`, "
            "and load that (not save_pretrained: it writes some families' old names back, GPT-NeoX's `embed_out`, "
            "Mixtral's experts one by one)")


def _beside_weights(model, key: str) -> bool:
    """Whether a checkpoint key that is not the model's sits in a module of the model that holds parameters of its
    own (`down_proj.weight_scale_inv` beside `down_proj.weight`): a value that changes what those weights are, not
    a buffer an older version saved (`rotary_emb.inv_freq`, GPT-2's `attn.bias`) nor another model's name."""
    if model is None:
        return True
    path = key.rpartition(".")[0]
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return False
    return bool(module._parameters)


def _ignored_unexpected(model, key: str) -> bool:
    """Whether a transformers model says a checkpoint key is to be left out when it loads
    (`_keys_to_ignore_on_load_unexpected`: patterns, as older GPT-2 checkpoints' `attn.masked_bias`)."""
    import re

    patterns = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()
    return any(re.search(p, key) for p in patterns)


def _part_at(children: list[str], held: dict, prefix: str, index, container: "nn.Module | None"):
    """The part at `index` (a position, a slice or a `nn.ModuleDict` key) of the model's module `container` at
    `prefix`, counted over all its children as the model counts them: the holder of its pieces, or for a child
    that holds no parameter or buffer (an activation), the model's own module, of which the compiled module holds
    nothing (a review: iterating a compiled Sequential stopped at its ReLU). A part with state but no holder is
    refused by name."""
    if isinstance(index, slice):
        return [_part_at(children, held, prefix, k, container) for k in range(len(children))[index]]
    where = f"`{prefix}` of the model" if prefix else "the model"
    try:
        name = index if isinstance(index, str) and index in children else children[operator.index(index)]
    except (IndexError, TypeError):
        raise (KeyError(index) if isinstance(index, str) else
               IndexError(f"{where} has parts {children}: no {index!r}")) from None
    if name in held:
        return held[name]
    child = None if container is None else container._modules.get(name)
    if child is not None and next(child.parameters(), None) is None and next(child.buffers(), None) is None:
        return child
    path = f"{prefix}.{name}" if prefix else name
    raise SpmdError(f"`{path}` of the model has no part in the compiled module (it holds "
                    f"{[n for n in children if n in held]} under {where}). What to do: reach the parts that hold "
                    "weights by name (`compiled.get_submodule(...)`).")


class _Indexed:
    """Indexed as the model's container at this place is (`nn.Sequential` and `nn.ModuleList` by position, slices
    too; `nn.ModuleDict` by key, iterated over its keys, with `keys()`, `values()`, `items()`, `in`): the parts are
    the holders of their pieces (`_part_at`). Subclasses give `_container()`, the model's module, and
    `_container_path()`, its path."""

    def _container(self) -> "nn.Module | None":
        raise NotImplementedError

    def _container_path(self) -> str:
        raise NotImplementedError

    def _names(self) -> list[str]:
        container = self._container()
        return list(container._modules) if container is not None else list(self._modules)

    def __getitem__(self, index):
        return _part_at(self._names(), self._modules, self._container_path(), index, self._container())

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self):
        if isinstance(self._container(), nn.ModuleDict):
            return iter(self._names())
        return (self[k] for k in range(len(self)))

    def __contains__(self, item) -> bool:
        if isinstance(self._container(), nn.ModuleDict):
            return item in self._names()
        return any(part is item for part in self)

    def keys(self):
        return self._names()

    def values(self):
        return [self[k] for k in self._names()]

    def items(self):
        return [(k, self[k]) for k in self._names()]

    def __bool__(self) -> bool:  # (a holder of no parts is still one: `if compiled.fc:`)
        return True


class _Pieces(_Indexed, nn.Module):
    """Holds this rank's pieces under the model's names (`CompiledModule._place`): a module only so that names
    go through it. The compiled module saves and loads them (its state dict is the model's): in its walk a
    holder adds nothing; asked itself (`compiled.encoder.state_dict()`, `.load_state_dict(...)`), it answers
    for its part of the compiled module. It is never called, so hooks on it are refused.

    It passes for the model's module it holds the pieces of in `isinstance` (its `__class__`, as `unittest.mock`'s
    specs do), and has none of that module's methods or attributes: code that picks modules by type over
    `compiled.modules()` (transformers' Trainer putting LayerNorm weights in the group without weight decay) found
    none, and decayed them (a probe: 0.077 off after 3 steps, silently). A plain attribute of the model's module
    set on it (`m.p = 0.0` on a dropout) is refused: it would reach no graph."""

    def __init__(self, root: "CompiledModule", prefix: str):
        super().__init__()
        self.__dict__["_root"], self.__dict__["_prefix"] = weakref.ref(root), prefix
        # (not for a parametrized module's, nor under one's `parametrizations`: torch's parametrize, asked of such a
        # holder, took it for parametrized and set its properties on the class it named, torch's own Linear; a review)
        part = self._part()
        plain = part is not None and not torch.nn.utils.parametrize.is_parametrized(part) and \
            "parametrizations" not in prefix.split(".")
        self.__dict__["_model_class"] = type(part) if plain else _Pieces

    @property
    def __class__(self):
        own = type(self)
        return self.__dict__.get("_model_class", own) if own is _Pieces else own  # (parametrized: its own class)

    @__class__.setter
    def __class__(self, cls):
        """torch's parametrize gives the module a class of its own, made from `module.__class__`, and takes it
        back: here a holder's, made from `_Pieces`, with the properties parametrize then sets on it."""
        if not issubclass(cls, _Pieces):
            cls = type(cls.__name__, (_Pieces,), {})
        object.__dict__["__class__"].__set__(self, cls)

    def __dir__(self):
        """nn.Module's, with this holder's own class (it has none of the model's module's methods)."""
        return sorted({*dir(type(self)), *self.__dict__, *self._parameters, *self._buffers, *self._modules})

    def _part(self) -> "nn.Module | None":
        """The model's module whose pieces this holds, where the model is known."""
        root = self.__dict__["_root"]()
        source = None if root is None else root.__dict__.get("_source_model")
        try:
            return None if source is None else source.get_submodule(self.__dict__["_prefix"])
        except AttributeError:
            return None

    def __setattr__(self, name: str, value) -> None:
        if not name.startswith("_") and name != "training" and not isinstance(value, (torch.Tensor, nn.Module)) \
                and name not in self.__dict__ and (part := self._part()) is not None and name in part.__dict__:
            kind, on_model = type(part).__name__, _module_ref("model", self._prefix)
            raise SpmdError(
                f"`{self._prefix}.{name}` set on the compiled module: `{self._prefix}` only holds this rank's pieces "
                f"of the model's `{self._prefix}` ({kind}), whose `{name}` the graph took as it was when traced, so "
                f"this would reach nothing. What to do: set it on the model (`{on_model}.{name} = ...`) and "
                "compile again (the compiled module refuses to run once a value its forward read has changed), or "
                "make it an input of the forward.")
        super().__setattr__(name, value)

    def _container(self) -> "nn.Module | None":
        """The model's module at this holder's path (its container, where indexed: `compiled.blocks[1]`; found by a
        probe: not subscriptable; a review found a first version counting the holders, which are only the parts
        that hold weights)."""
        return self._part()

    def _container_path(self) -> str:
        return self.__dict__["_prefix"]

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """As `nn.Module`'s, after the compiled module follows the flags set since (`_follow_requires_grad`): an
        optimizer built from `[p for p in compiled.fc.parameters() if p.requires_grad]` right after
        `model.fc.requires_grad_(False)` took the frozen layer (found by a probe)."""
        root = self._root()
        if root is not None and root.__dict__.get("_flags"):
            root._follow_requires_grad(strict=False)
        return super().named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        pass

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        pass

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        if destination is not None or args:  # (a walk from above: the compiled module saves its pieces itself)
            return super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        mine = self._prefix + "."
        return OrderedDict((prefix + k[len(mine):], v) for k, v in self._root().state_dict(keep_vars=keep_vars).items()
                           if k.startswith(mine))

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self._root()._load_part(self._prefix + ".", state_dict, strict)

    def _apply(self, fn, recurse: bool = True):
        self._root()._refuse_conversion(fn, [(f"{self._prefix}.{n}", t) for n, t in
                                             [*self.named_parameters(), *self.named_buffers()]])
        return super()._apply(fn, recurse)

    def __deepcopy__(self, memo):
        root = self._root()
        if root is None or id(root) not in memo:
            raise SpmdError(f"`{self._prefix}` of a compiled module holds pieces of the compiled module's own "
                            "weights: a copy of it alone would still answer for the compiled module. What to do: "
                            "copy the compiled module (copy.deepcopy(compiled)), or copy its state_dict().")
        import copy

        new = object.__new__(type(self))
        memo[id(self)] = new
        new.__dict__ = {k: (v if k == "_root" else copy.deepcopy(v, memo)) for k, v in self.__dict__.items()}
        return new  # (its `_root` is set by the copied compiled module's `_index`)

    def __getstate__(self):
        raise SpmdError(f"`{self._prefix}` of a compiled module cannot be pickled: it holds pieces of the compiled "
                        "module's weights. What to do: save its `state_dict()`.")

    def __getattr__(self, name: str):
        """As the compiled module's: a name only the model's submodule has (`compiled.lm_head.in_features`) is
        refused with the way out."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            part = self._part()
            if part is None or name.startswith("__") or not _has_static(part, name):
                raise
        if _inside_ddp_construction():  # (DDP asks an embedding's `sparse`: its words, not the read's; a probe)
            raise SpmdError(_DDP_OVER_PIECES + " (DistributedDataParallel was being built over it: transformers' "
                            "Trainer builds one through accelerate when torch.distributed is initialized; there, "
                            "set `compiled._is_accelerate_prepared = True` before the Trainer, see "
                            "docs/huggingface.md.)") from None
        raise _only_the_model_has(type(self).__name__, part, name, self._prefix + ".") from None

    def _refused(self, *args, **kwargs):
        import sys

        frame = sys._getframe(1)
        while frame is not None and "distributed/fsdp" not in frame.f_code.co_filename.replace("\\", "/"):
            frame = frame.f_back
        if frame is not None:  # (torch's fully_shard / FSDP registering its hooks: a probe got the message below)
            raise SpmdError(
                f"torch's FSDP (fully_shard) over `{self._prefix}` of a compiled module: the compiled module already "
                "holds only this rank's pieces, laid out as its plan says, and runs its own graph on them, so FSDP "
                "would shard pieces and its hooks would never run. What to do: leave the compiled module out of "
                "fully_shard (wrap only the plain modules around it); for FSDP's layout, let the plan shard the "
                "weights on the data-parallel axis (param_placements=... Shard(0) on that axis, or memory_budget).")
        raise SpmdError(f"`{self._prefix}` of a compiled module only holds this rank's pieces of the model's weights "
                        "under their names: it is never called, so a hook on it would never run. What to do: hook the "
                        "model before spmd.compile (the hook runs while tracing, into the graph), or the compiled "
                        "module itself.")

    register_forward_hook = register_forward_pre_hook = register_backward_hook = _refused
    register_full_backward_hook = register_full_backward_pre_hook = _refused
    register_load_state_dict_pre_hook = register_load_state_dict_post_hook = _refused

    def register_parameter(self, name: str, param) -> None:
        if name not in self._parameters:
            self._no_new_tensor(name)
        super().register_parameter(name, param)

    def register_buffer(self, name: str, tensor, persistent: bool = True) -> None:
        if name not in self._buffers:
            self._no_new_tensor(name)
        super().register_buffer(name, tensor, persistent)

    def _no_new_tensor(self, name: str):
        """A parameter or buffer added to a holder (`torch.nn.utils.prune` moves `weight` to `weight_orig` and adds
        a mask) is one no graph reads. Refused before anything moves: prune's own rollback then failed on its
        half-done change with a raw KeyError that hid the refusal, and left the holder altered (found by a
        probe). A piece of its own put back (`remove_parametrizations`) is not new. The compiled module places
        its pieces with nn.Module's own methods."""
        root, fqn = self._root(), f"{self._prefix}.{name}"
        if root is None or fqn in root._param_names or fqn in root._aliases:
            return
        raise SpmdError(f"`{self._prefix}` of a compiled module only holds this rank's pieces of the model's weights "
                        f"under their names: a new tensor on it (`{name}`) would be read by no graph (pruning adds the "
                        "original weight and a mask, and changes what the forward computes). What to do: prune the "
                        "model before spmd.compile (the forward then computes it, in the graph).")

    def forward(self, *args, **kwargs):
        raise SpmdError("this module only holds pieces of the model's weights under their names: call the "
                        "compiled module itself")


# names of a holder's own (a model name through one of them is held flat); first-level names beginning with
# "_" are too (the compiled module's own attributes, set after the pieces are placed, begin so)
_HOLDER_OWN = frozenset(vars(_Pieces)) | {"_root", "_prefix"}

# after calls 1, 2, 4, ..., the ranks' generators are compared every so many calls of a graph that draws (a power
# of two): as often as the check costs at most GENERATOR_CHECK_SHARE of a call (`generator_check_period`), and at
# least every GENERATOR_CHECK_EVERY calls
GENERATOR_CHECK_EVERY = 1024
GENERATOR_CHECK_SHARE = 0.01

# model -> the live modules compiled from it, whose traced modes explain the model's mode (`_model_mode_unexplained`)
_compiled_modules = WeakIdKeyDictionary()


def _all_compiled() -> list:
    """Every compiled module alive in this process (copies too)."""
    return [c for modules in list(_compiled_modules.values()) for c in list(modules)]


# model -> the mode it was last compiled in (`spmd.compile(model.eval(), ...)` leaves the model in eval mode, also
# once that module is gone or where a copy of it lives on)
_last_compiled_mode = WeakIdKeyDictionary()

# names a model's first-level child may not take in the compiled module's tree (its own attributes, set before
# or after the pieces are placed); such a child's pieces are held flat (`CompiledModule._place`)
_RESERVED = frozenset({"graph_module", "plan", "split", "rank", "coord", "mesh_spec", "group_names", "device_mesh",
                       "compile_backend"})


def _collective(method):
    """A method every rank must call (it gathers or reduces over the mesh): a rank left waiting in it says so
    (runtime/waiting.py). torch.compile runs it as it is, as forward: a wrapper under torch.compile that called
    gather_outputs ran its collectives on fake tensors, and the ranks fell out of step, a hang (found by a probe)."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with waiting.collective(method.__name__, self.rank, self.mesh_spec.size):
            return method(self, *args, **kwargs)
    return torch.compiler.disable(call)


class CompiledModule(nn.Module):
    """Runs one rank's graph. Parameters are this rank's shards, as ordinary `nn.Parameter`s.

    `compiled(*local_inputs)` takes local shards of the user inputs (see `shard_inputs`) and returns
    local shards of the outputs (see `gather_outputs`). `plan` and `code` show what was decided.
    """

    def __init__(self, compilation, device_mesh=None, plan=None, source_model=None, src_data_rank: int | None = 0,
                 call: Call | None = None, compile_graphs: bool | str = False, recompile=None):
        """`compilation`: the compiler's output for this rank. `plan`: what `.plan` shows (spmd.compile
        hands a report object that explains and draws itself; default: the bare plan). `source_model`: the
        model as the user built it (default: the compiled one). `src_data_rank`: the rank whose weights
        every rank takes its pieces from (None: each rank cuts its own; see runtime/materialize.py).
        `call`: the names of the positional and keyword inputs (compiler/call.py). `compile_graphs`: run the
        rank graphs through `torch.compile` (True: inductor; a string: that backend; see `_runner`). `recompile`:
        (options, example_inputs, example_kwargs, weights=False) -> (compilation, call, its plan's report), this
        rank's compilation for other input shapes (spmd.compile's; None: the module takes the compiled shapes alone; see
        runtime/shapes.py)."""
        super().__init__()
        c = compilation
        if c.binding is None or c.rank_gm is None:
            raise SpmdInternalError("CompiledModule needs a compilation made for a rank (a RankBinding)")
        self.plan = plan if plan is not None else c.plan
        self.mesh_spec = c.mesh
        self.rank = c.binding.rank
        self.coord = c.mesh.coordinate(self.rank)
        self.group_names = c.binding.group_names
        self.graph_module = c.rank_gm
        self.split = c.split  # SplitGraphs when compiled for training, else None
        self.compile_backend = graph_backend(compile_graphs)
        # torch.compile'd graphs, made at first use (kept out of the module tree: an OptimizedModule would
        # show up in `modules()`); see `_graph`
        self.__dict__["_compiled_graphs"] = {}
        self.device_mesh = device_mesh
        self._device = c.binding.device  # where this rank's inputs must be (None: wherever they are)
        self._saved_bytes: int | None = None  # see last_saved_bytes
        self._out_spec = c.traced.out_spec
        self._outputs_made = _OutputsMade()  # (the positions of the outputs calls returned: gather_outputs)
        self._inputs_walked = False  # see _refuse_inputs_from_held_parameters
        self._state_outputs = _outputs_of_state(c)  # {output position: FQN} for a parameter or buffer returned
        # (output position, the copy the last call returned of a parameter, its version then: held until the next
        # call, as a loop writes into it and lets it go before that)
        self._returned_state: list[tuple] = []
        # the outputs that get a gradient (the others, such as the logits next to a model's own loss,
        # were detached in the trace), by position among the flat outputs
        self._shapes = Shapes.of(c, c.mesh, self.rank, c.binding.device, self.plan)  # (the compiled shapes' graphs and layouts)
        # other input shapes' (an epoch's smaller last batch), compiled by `shard_inputs` over these pieces
        self.__dict__["_variants"]: dict[tuple, Shapes] = {}
        # an inference module's graphs for calls under no_grad or inference mode, where its forward computes
        # otherwise then (`_grad_off`): (the mode, the full input shapes) -> Shapes
        self.__dict__["_grad_variants"]: dict[tuple, Shapes] = {}
        self.__dict__["_recompile"] = recompile
        self.__dict__["_refused_shapes"]: dict[tuple, SpmdError] = {}  # (refused once: not compiled again each epoch)
        self._options = c.options
        self._call = call if call is not None else Call(tuple(i.name for i in c.traced.inputs if i.kind == "input"), ())
        # the traced (unsharded) graph and its signature, for `verify` (constants only: no weights)
        self._traced_gm = c.traced.gm
        self._graph_inputs = tuple(c.traced.inputs)
        self._graph_outputs = tuple(c.traced.output_kinds())
        self._tensor_info = dict(c.traced.tensor_info)
        self._aliases = dict(c.traced.aliases)  # extra name of a tied parameter -> the name it is held under
        # the model as the user built it (meta: no memory), for init_weights; not a submodule: its
        # parameters are not this module's
        self.__dict__["_source_model"] = source_model if source_model is not None else c.model
        optimizer_guard.watch(self._source_model)  # an optimizer over the original parameters fails at its first step
        clip_guard.watch_source(self._source_model, self)  # clipping them raises; its zero_grad() zeroes ours too
        # whether this rank's pieces were cut from its own model's values (else they came from rank src_data_rank's,
        # and its own model may hold others: ranks built with their own seeds)
        self._cut_here = src_data_rank is None or not dist.is_initialized() or dist.get_world_size() == 1 or \
            self.rank == src_data_rank
        self._uninitialized: set[str] = set()  # FQNs allocated but not yet given values (a meta model)
        self._param_names: dict[str, str] = {}  # FQN -> where the piece is held (its path: the FQN itself, mostly)
        self._flat_names: dict[str, str] = {}  # `_p__...` -> FQN, for a name that would hide an attribute
        self._state_placements: dict[str, tuple] = {}  # FQN -> placements
        self._order: list[tuple[str, str]] = []  # (kind, attribute or input name) per placeholder
        self._order_names: list[str] = []  # FQN or input name per placeholder
        self._input_specs: list[InputSpec] = self._shapes.input_specs
        self._global_shapes: dict[str, tuple[int, ...]] = {}  # FQN -> full shape
        # buffers a state dict (and so a checkpoint) leaves out: computed by the model, not saved
        self._non_persistent = {f"{path}.{b}" if path else b for path, m in self._source_model.named_modules()
                                for b in m._non_persistent_buffers_set}
        # (and the tensor constants the trace lifted: the model holds none of them, so no state dict names them; a
        # probe found T5's `_tensor_constant0` in full_state_dict(), which model.load_state_dict then refused)
        self._constants = {gi.name for gi in c.traced.inputs if gi.kind == "constant"}
        self._non_persistent |= self._constants
        # a loss_fn module's own parameters (`loss_fn.log_var`): trained and checkpointed here, but not the model's,
        # so neither in the model's state dict (`full_state_dict(persistent_only=True)`) nor needed from one
        model_names = {n for n, _ in (*self._source_model.named_parameters(remove_duplicate=False),
                                      *self._source_model.named_buffers(remove_duplicate=False))}
        self._loss_names = {gi.name for gi in c.traced.inputs if gi.kind in ("parameter", "buffer")
                            and gi.name.startswith("loss_fn.") and gi.name not in model_names}
        model_params = dict(self._source_model.named_parameters(remove_duplicate=False))
        if isinstance(c.options.loss_fn, nn.Module):  # (a loss module's own, `loss_fn.log_var`: frozen as the model's)
            model_params.update(c.options.loss_fn.named_parameters(prefix="loss_fn", remove_duplicate=False))
        for gi in c.traced.inputs:
            ps = c.plan.choices[gi.placeholder].outputs[0]
            info = c.traced.tensor_info[gi.placeholder]
            if gi.kind == "tangent":
                continue
            if gi.kind == "input":
                self._order.append(("input", gi.name))
                self._order_names.append(gi.name)
                continue
            full = c.traced.state[gi.name]
            local = local_piece(full, ps, c.mesh, self.rank, c.binding.device, src_data_rank)
            if is_placeholder_value(full):
                self._uninitialized.add(gi.name)
            tensor = nn.Parameter(local, requires_grad=gi.name not in c.traced.frozen) \
                if gi.kind == "parameter" else local
            if gi.kind == "parameter" and getattr(model_params.get(gi.name), "__dict__", None):
                # (what the user set on it, read where optimizer groups are made: `p._no_weight_decay = True`)
                tensor.__dict__.update(model_params[gi.name].__dict__)
            attr = self._place(gi.name, tensor)
            self._param_names[gi.name] = attr
            self._state_placements[gi.name] = ps
            self._global_shapes[gi.name] = tuple(info.shape)
            self._order.append(("parameter" if gi.kind == "parameter" else "buffer", attr))
            self._order_names.append(gi.name)
        for alias, canonical in self._aliases.items():  # (a tied weight under each of its names, as the model's)
            self._place(alias, self.piece(canonical), alias=True)
        self._index()
        shape, coord = self.mesh_spec.shape, self.coord
        # (the copies shard_inputs cut, cut again where their batch was written since: they follow it as views do)
        self._cut_pieces = CutPieces(lambda full, s: local_shard(full, s.placements, shape, coord))
        # the mode the graph was traced in (its dropout and batch norm are that mode's for good), and what in
        # the model would behave otherwise in the other mode (None: nothing)
        ops = _op_names(c.traced.graph)
        self._traced_mode = self._source_model.training
        _compiled_modules.setdefault(self._source_model, weakref.WeakSet()).add(self)
        _last_compiled_mode[self._source_model] = self._traced_mode
        source_guard.mark_hooks(self, c.options.loss_fn if c.traced.joint else None)
        self._mode_dependent = _mode_dependent(ops, self._source_model)
        # the model's modules whose forward reads their mode (dropout, batch norm, an attention's dropout rate),
        # each with its mode as traced: one switched alone after compiling (`model.norm.eval()`, freezing batch
        # norm) would not reach the graph, and is refused (`_submodule_switched`)
        self._modes = [(m, path, m.training) for path, m in self._source_model.named_modules()
                       if path and (reads_training(type(m)) or hooks_read_training(m))]
        # what was traced (the model, with its loss), run in both modes on fake tensors at the first call in the
        # other mode where nothing known depends on it (`_ops_differ_by_mode`); the answer, once known
        self.__dict__["_traced_root"] = with_loss(c.model, c.options.loss_fn if c.traced.joint else None)
        self._mode_checked: str | None | bool = False
        # a module whose forward asks whether grad is on (`torch.is_grad_enabled()`): every graph is traced with
        # grad on, so a call under no_grad is checked once for another branch (`_refuse_no_grad`)
        self._grad_reader = grad_mode_reader(self._traced_root)
        self._grad_differs: dict[bool, str | None] = {}  # under inference mode or not -> what differs (None: nothing)
        # a module whose forward reads a tensor's `requires_grad` (`if x.requires_grad:`): a call whose inputs are
        # flagged otherwise than the example's is checked once per flag pattern for another branch
        # (`_refuse_other_flags`)
        self._flag_reader = grad_flag_reader(self._traced_root) or (
            "torch.utils.checkpoint(use_reentrant=True)" if c.traced.reentrant and self.split is not None else None)
        self._reentrant = c.traced.reentrant
        self._flags_differ: dict[tuple, str | None] = {}  # (traced flags, a call's) -> what differs (None: nothing)
        # plain attributes the forward read (a temperature, a dropout rate): constants of the graph, so a new
        # value set on the model after compiling would reach nothing; each call checks them (a few microseconds)
        self._attributes = AttributeGuard({"": self._source_model, "loss_fn": c.options.loss_fn})
        # the torch.autocast state of the trace (the graph holds its casts): each call is made under the same
        self._autocast = AutocastGuard()
        # requires_grad set on the model's parameters after compiling (a layer frozen or unfrozen by the training
        # loop), and on the loss module's (a probe froze an uncertainty weight): followed by this module's pieces,
        # which the model's flags would otherwise not reach
        self._frozen_when_compiled = set(c.traced.frozen)
        self._flags = [(model_params[fqn], self._get(attr), fqn, model_params[fqn].requires_grad)
                       for fqn, attr in self._param_names.items()
                       if fqn in model_params and isinstance(self._get(attr), nn.Parameter)] if self.split else []
        self._frozen_pieces = [(piece, fqn) for _, piece, fqn, _ in self._flags if fqn in self._frozen_when_compiled]
        self._flags_shared = True  # (a flag set on a piece goes to the model's parameter; not a copy's)
        # a graph that draws random numbers draws them whole on every rank (rules/random.py): the ranks'
        # generators must agree, which the first call checks (one small all_gather), and calls 2, 4, 8, ... and
        # every `_generator_period`-th after it (a rank that drew numbers its peers did not since: sampling on
        # rank 0 alone for a log)
        self._draws = (bool(ops & _RANDOM_OPS) or any(may_draw(n) for n in c.traced.graph.nodes if n.op == "call_function")
                       ) and self.mesh_spec.size > 1  # (attention's dropout, inside its kernel)
        self._generators_agreed = not self._draws
        self._warned_plain_pieces = False  # (`_warn_plain_parameters_on_pieces`: said once)
        self._fast_path_warning = None  # (`_warn_fast_path_with_grad`: looked at once)
        # (from the plan, rank 0's on every rank, links included: a rank's own mesh spec may price its links
        # otherwise, and ranks checking at other calls would meet in different collectives)
        self._generator_period = generator_check_period(self.plan.mesh, self.plan.predicted_step_s)
        self._calls = 0
        # inputs replicated over a mesh axis must be the same along it, which the first call checks, and the
        # generators' calls after it (`_agree_on_inputs`: a data-parallel loader feeding each rank its own batch,
        # after a first call on one batch, was found by a probe)
        self._replicated_inputs = self.mesh_spec.size > 1 and any(
            isinstance(p, Replicate) and n > 1 for spec in self._input_specs
            for p, n in zip(spec.placements, self.mesh_spec.shape))
        self._inputs_agreed = not self._replicated_inputs
        # and a graph with collectives, the call itself (`_agree_on_call`): one rank calling alone pairs them apart
        self._collective_calls = self.mesh_spec.size > 1 and bool(self.plan.collectives())
        self._shard_calls, self._shards_agreed = 0, False  # shard_inputs' calls, checked at the same counts
        self._input_names = [name for kind, name in self._order if kind == "input"]
        self.train(self._traced_mode)
        # each module whose forward reads its mode, held here too, in the mode it was traced in (a holder of no
        # weights for a dropout): `compiled.train()` at each epoch sets them all, as `model.train()` does, and a
        # batch norm frozen before compiling (`model.bn.eval()`) then ran in the traced mode where eager's trains,
        # silently (found by a probe); `compiled.bn.eval()` after it puts it back, as on the model
        for _, path, was in list(self._modes):
            holder = self._holder(path)
            if holder is not None:
                holder.training = was
                self._modes.append((holder, path, was))
        self._state_factor = c.options.optimizer_state_factor if c.plan.joint else None
        self._watch_pieces()

    def _watch_pieces(self) -> None:
        """This module's pieces, known to the guards that catch torch's tools misused on them."""
        if self._state_factor is not None:  # an optimizer keeping other state than planned warns at its first step
            optimizer_guard.expect(self.parameters(), self._state_factor,
                                   (self.group_names, self.mesh_spec.shape, self._collective_device()))
        # torch's clip_grad_norm_ over pieces of sharded parameters would clip each rank by its own norm, and
        # GradScaler would skip the step on the ranks whose piece overflowed only
        sharded = {fqn: self._get(attr) for fqn, attr in self._param_names.items()
                   if isinstance(self._get(attr), nn.Parameter)
                   and any(isinstance(p, Shard) for p in self._state_placements[fqn])}
        clip_guard.watch(sharded)
        cut = {fqn: p for fqn, p in sharded.items()  # (pieces that are not the whole)
               if any(isinstance(pl, Shard) and n > 1 for pl, n in zip(self._state_placements[fqn], self.mesh_spec.shape))}
        # an optimizer that reads more than each element is refused over them, and an optimizer's state_dict()
        # over them says whose pieces it holds (loaded on another rank, it raises)
        optimizer_guard.watch_pieces(cut)
        optimizer_guard.place({fqn: (p, self._state_placements[fqn]) for fqn, p in cut.items()}, self.coord,
                              self.mesh_spec.shape)
        scaler_guard.watch(list(sharded.values()), self.mesh_spec.shape, self.group_names, self._collective_device())
        # and torch.distributed.checkpoint would take plain pieces (the optimizer's state_dict()) for replicated
        # tensors: it would save one rank's and load it into all
        checkpoint_guard.watch({fqn: self._get(attr) for fqn, attr in self._param_names.items()
                                if any(isinstance(p, Shard) and n > 1
                                       for p, n in zip(self._state_placements[fqn], self.mesh_spec.shape))})
        # and the model it was made from keeps its old weights once these move: calling or saving it then raises
        source_guard.watch(self._source_model, self, getattr(self._traced_root, "loss_fn", None))
        source_guard.mark_written(self)  # (weights given in place from a module of another plan: seen at a call)

    @property
    def code(self) -> str:
        """This rank's generated Python (collectives visible): forward, and backward when training."""
        if self.split is None:
            return self.graph_module.code
        return ("# ---- forward: returns the outputs, then the values saved for backward ----" +
                self.split.forward.code + "\n# ---- backward: saved values and incoming gradients -> "
                "parameter gradients ----" + self.split.backward.code)

    def code_of(self, module: str) -> str:
        """The lines of this rank's forward code that one module computes (`"blocks.0"`: the first layer),
        with the collectives that move their values."""
        gm = self.split.forward if self.split is not None else self.graph_module
        inside = set()
        for node in gm.graph.nodes:
            paths = [path for path, _ in (node.meta.get("nn_module_stack") or {}).values()]
            if any(p == module or p.startswith(module + ".") for p in paths) or (
                    node.op == "call_function" and getattr(node.target, "__module__", "") == collectives.__name__
                    and any(a.name in inside for a in node.all_input_nodes)):
                inside.add(node.name)
        lines = [line for line in gm.code.splitlines() if line.strip().split(" = ")[0] in inside]
        if not lines:
            raise ValueError(f"code_of: no op of module {module!r} in this rank's graph")
        return "\n".join(lines)

    def explain(self, detail: bool = True) -> str:
        """The plan in words: layouts per module, collective totals, (detail) every node's cost and alternative; and
        the other input shapes compiled for since (an epoch's smaller last batch), with their inputs' layouts."""
        text = self.plan.explain(detail)
        if not self._variants:
            return text
        lines = [f"Also compiled for other input shapes ({len(self._variants)}; runtime/shapes.py), over the same "
                 "pieces: each parameter and buffer laid out as above; the inputs, and each plan's predicted call "
                 "(`compiled.plans[shapes].explain()` explains one):"]
        for shapes in self._variants.values():
            lines.append("  " + ", ".join(f"{s.name} {list(s.shape)} {placements_str(s.placements)}"
                                          for s in shapes.input_specs))
            lines.append(f"    {shapes.plan}")
        return text.rstrip("\n") + "\n\n" + "\n".join(lines) + "\n"

    @property
    def plans(self) -> dict:
        """The plan of each set of input shapes this module runs, keyed by the full inputs' shapes: the compiled
        one's (`self.plan`) first, then those compiled for since (an epoch's smaller last batch, other sequence
        lengths), whose parameters and buffers keep the first plan's layouts."""
        return {shapes.key: shapes.plan for shapes in (self._shapes, *self._variants.values())}

    def visualize(self, path, collapse: bool | None = None, views: bool = False, title: str | None = None):
        """Draw the sharded graph (all ranks' view, collectives explicit) to .svg/.png/.dot/.html."""
        return self.plan.visualize(path, collapse=collapse, views=views, title=title)

    def memory_report(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Measured bytes this rank holds, by the plan's categories (`plan.memory` predicts them):
        parameters, gradients, optimizer state, and the activations a training step saves (found at the first)."""
        params = [p for p in self.parameters()]
        report = {"parameters": _storage_bytes(params),
                  "gradients": _storage_bytes(p.grad for p in params if p.grad is not None),
                  "buffers": _storage_bytes(self.buffers())}
        if optimizer is not None:
            report["optimizer"] = _storage_bytes(t for st in optimizer.state.values() for t in st.values()
                                                 if isinstance(t, torch.Tensor) and t.dim() > 0)
        if self.split is not None:
            report["activations"] = self.last_saved_bytes
        return report

    @_collective
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None, *, also=(), parameters=None) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` over the full gradients: returns their total norm (`grad_norm`,
        the same on every rank, equal to the single-device model's) and scales this rank's gradient shards
        by min(1, max_norm / (norm + 1e-6)) in place. Call it on every rank, after backward.

        `also`: what one optimizer steps beside this module, clipped by the one norm of all of them, as
        `torch.nn.utils.clip_grad_norm_` over the whole model clips: other compiled modules (a body and a head
        compiled apart), and plain parameters whose gradients are the same on every rank (an eager layer's, kept
        in step as DDP keeps them). Clipping each compiled module by its own norm clipped each by another factor
        (3.7e-3 off after 3 steps; found by a probe). `parameters`: only these of this module's (its pieces, as
        `compiled.parameters()` or a param group's `params` hold them), clipped by their own full norm, as
        `torch.nn.utils.clip_grad_norm_(group["params"], ...)` clips a group on one device (the same subset on
        every rank). `foreach`, as torch's: the kernels that scale the gradients (None: torch's choice), the same
        values either way."""
        also = [also] if isinstance(also, (torch.Tensor, nn.Module)) else list(also)  # (a generator, read once)
        if parameters is not None and not isinstance(parameters, torch.Tensor):
            parameters = list(parameters)
        modules = [self] + [m for m in also if isinstance(m, CompiledModule)]
        plain = [p for m in also if not isinstance(m, CompiledModule)
                 for p in ([m] if isinstance(m, torch.Tensor) else m.parameters() if isinstance(m, nn.Module) else m)]
        plain = [p for p in plain if p.grad is not None]
        if any(p in clip_guard._watched for p in plain):
            raise SpmdError("clip_grad_norm_(also=...): pass a compiled module itself, not its parameters (this rank's "
                            "pieces: their norm is this rank's own).")
        mine = self._grads(parameters)  # (once: a subset's names are compared over the mesh)
        norms = [self._norm_of(mine, norm_type, error_if_nonfinite)] + \
            [m.grad_norm(norm_type, error_if_nonfinite) for m in modules[1:]]
        if plain:
            norms.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.detach(), norm_type)
                                                               .to(norms[0].device) for p in plain]), norm_type))
            self._refuse_plain_apart(norms[-1])
        norm = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(
            torch.stack([n.to(torch.promote_types(n.dtype, norms[0].dtype)) for n in norms]), norm_type)
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is "
                               "non-finite, so it cannot be clipped. To disable this error and scale the "
                               "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        grads = [g for _, g in mine] + [g for m in modules[1:] for _, g in m._grads()] + \
            [p.grad.detach() for p in plain]
        for (device, _), ([same], _) in _group_tensors_by_device_and_dtype([grads]).items():
            if (foreach is None and _has_foreach_support(same, device)) or (foreach and
                                                                          _device_has_foreach_support(device)):
                torch._foreach_mul_(same, coef.to(device))
            elif foreach:
                raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
            else:
                for g in same:
                    g.mul_(coef.to(device))
        return norm

    def _refuse_plain_apart(self, norm: torch.Tensor) -> None:
        """`clip_grad_norm_(also=...)`'s plain parameters must have the same gradients on every rank: their norm
        is compared over the mesh (one all_reduce of two values per mesh axis). Gradients a layer took from this
        rank's piece alone (an eager layer between two compiled modules) differ, and each rank clipped by its own
        norm, which moved even the compiled modules' replicas apart (2.4e-4 after 3 steps; found by a probe)."""
        if not self._on_live_mesh():
            return
        mine = norm.detach().to(self._collective_device(), torch.float64)
        mine = torch.where(torch.isfinite(mine), mine, torch.full_like(mine, float("inf")))  # (NaN, inf: as one)
        most, least = extremes_over_mesh(mine, self.mesh_spec.shape, self.group_names)
        if float(most) != float(least):  # (a NaN norm everywhere, GradScaler's overflow step, goes on)
            raise SpmdError(
                f"clip_grad_norm_(also=...): the plain parameters' gradients differ between the ranks (their norm is "
                f"{float(mine):.6g} on this rank, between {float(least):.6g} and {float(most):.6g} over the "
                "mesh), so each rank would clip by its own norm and its replicas drift apart. They were computed from "
                "each rank's own piece (an eager layer on a compiled module's output piece). What to do: sum them over "
                "the ranks holding other pieces first (`torch.distributed.all_reduce(p.grad, "
                "group=mesh.get_group(axis))` over each mesh axis the output is split on; or run such layers on whole "
                "tensors, `gather_outputs` then `shard_inputs`).")

    @_collective
    def embedding_renorm_(self, name: str, ids: torch.Tensor, max_norm: float, norm_type: float = 2.0) -> None:
        """What `nn.Embedding(max_norm=...)` does before its lookup, for the compiled module's piece of the
        embedding weight `name`: each row some rank's `ids` look up whose `norm_type`-norm exceeds `max_norm` is
        scaled in place to it (`torch.embedding_renorm_`). Call it on every rank before the call, with that
        call's ids (the whole batch, or this rank's part of it): a row is renormalized where any rank looks it up,
        as one device renormalizes the rows of the whole batch (the rows looked up are a union over the mesh, one
        all_reduce of a flag per row and mesh axis). The weight must hold whole rows on each rank (`Shard(0)` or
        `Replicate()`); a compile refuses an Embedding with max_norm, whose forward changes its weight."""
        weight = self.piece(name)
        fqn = name if name in self._state_placements else self._aliases.get(name, name)
        placements, shape = self._state_placements[fqn], self._global_shapes[fqn]
        cut = [axis for axis, p in enumerate(placements) if self.mesh_spec.shape[axis] > 1
               and not isinstance(p, Replicate) and not (isinstance(p, Shard) and p.dim == 0)]
        if weight.dim() != 2 or cut:
            raise SpmdError(
                f"embedding_renorm_({name!r}): renormalizing rows needs each rank to hold whole rows of a 2-D weight, "
                f"and the plan places {name} {placements_str(placements)}"
                f"{f' (shape {tuple(shape)})' if weight.dim() != 2 else ''}, cut across its rows on mesh axis "
                f"{', '.join(self.mesh_spec.axis_names[a] for a in cut) or '-'}. What to do: pin it "
                f"`param_placements={{{fqn!r}: [Shard(0)]}}` or [Replicate()] (one per mesh axis) when compiling.")
        ids = ids.detach().reshape(-1).to(self._collective_device(), torch.long)
        seen = torch.zeros(shape[0] + 1, dtype=torch.int32, device=ids.device)  # (the last: some rank's ids are out
        outside = bool(((ids < 0) | (ids >= shape[0])).any())                    # of range, said on every rank)
        seen[shape[0] if outside else ids] = 1
        seen = max_over_mesh(seen, self.mesh_spec.shape, self.group_names)
        if seen[-1]:
            raise SpmdError(f"embedding_renorm_({name!r}): some rank's ids are outside [0, {shape[0]}) "
                            f"({'this one' if outside else 'not this one'}), as an Embedding of {shape[0]} rows would "
                            "refuse. What to do: pass the ids the call looks up.")
        seen = seen[:-1]
        rows = local_slices(tuple(shape), placements, self.mesh_spec.shape, self.coord)[0]
        mine = seen[rows].nonzero().reshape(-1).to(weight.device)
        with torch.no_grad():
            torch.embedding_renorm_(weight, mine, max_norm, norm_type)

    @_collective
    def grad_norm(self, norm_type: float = 2.0, error_if_nonfinite: bool = False, *, parameters=None) -> torch.Tensor:
        """`torch.nn.utils.get_total_norm` of the full gradients (the norm a training loop logs): the same
        on every rank, equal to the single-device model's. Gradients come out of backward in their
        parameter's placements (Shard or Replicate, never Partial), so each mesh axis that shards some
        gradient reduces once (`distribute.total_norm`). Call it on every rank, after backward.
        `parameters`: of those of this module's parameters alone (see `clip_grad_norm_`)."""
        return self._norm_of(self._grads(parameters), norm_type, error_if_nonfinite)

    def _norm_of(self, named: list[tuple[str, torch.Tensor]], norm_type: float,
                 error_if_nonfinite: bool) -> torch.Tensor:
        """`grad_norm` of the gradient pieces `named` ((name, piece), as `_grads` gives them)."""
        grads = [(g, self._state_placements[fqn]) for fqn, g in named]
        if not grads:
            return torch.tensor(0.0)
        # (in the gradients' promoted dtype, as torch's stack of per-tensor norms is: the first gradient's narrowed a
        # bf16-and-fp32 model's norm to bf16, found by a probe)
        dtype = functools.reduce(torch.promote_types, (g.dtype for g, _ in grads)).to_real()  # (a complex model's: real)
        norm = total_norm(grads, float(norm_type), self.mesh_spec.shape, self.group_names).to(dtype)
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is "
                               "non-finite, so it cannot be clipped. To disable this error and scale the "
                               "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
        return norm

    def _grads(self, parameters=None) -> list[tuple[str, torch.Tensor]]:
        """(parameter name, this rank's gradient piece), in the model's parameter order; of `parameters` alone
        where given (this module's pieces: another tensor is refused by name)."""
        params = [(fqn, self._get(attr)) for fqn, attr in self._param_names.items()]
        if parameters is not None:
            given = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            mine = {id(p) for _, p in params}
            if any(id(p) not in mine for p in given):
                theirs = clip_guard._of_source(given)
                raise SpmdError(
                    f"clip_grad_norm_(parameters=...) / grad_norm(parameters=...) was given "
                    f"{'the model parameters ' + ', '.join(theirs[:3]) if theirs else 'tensors'} that are not this "
                    "compiled module's parameters (the pieces it holds and trains). What to do: pass this module's "
                    "own, from `compiled.parameters()`, `compiled.named_parameters()` or an optimizer's param group "
                    "over them; another compiled module's go in `also=`.")
            chosen = {id(p) for p in given}
            params = [(fqn, p) for fqn, p in params if id(p) in chosen]
            self._agree_on_subset(tuple(fqn for fqn, _ in params))
        return [(fqn, p.grad) for fqn, p in params if isinstance(p, nn.Parameter) and p.grad is not None]

    def _agree_on_subset(self, names: tuple[str, ...]) -> None:
        """Every rank names the same parameters in `parameters=` (compared at each call: one all_reduce of two numbers
        per mesh axis; a subset remembered by one rank and new to another would have skipped it there), else every
        rank raises: the norm reduces over the axes its gradients are cut on, and subsets chosen by a piece's size
        would issue other collectives on each rank, a hang (a review)."""
        if not self._on_live_mesh():
            return
        import hashlib

        mine = int.from_bytes(hashlib.sha1("\0".join(names).encode()).digest()[:6], "little")
        most, least = extremes_over_mesh(torch.tensor(mine, dtype=torch.int64, device=self._collective_device()),
                                         self.mesh_spec.shape, self.group_names)
        if int(most) != int(least):
            raise SpmdError(
                f"clip_grad_norm_(parameters=...) / grad_norm(parameters=...): the ranks name other parameters "
                f"({len(names)} on this rank: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}), so their "
                "norms would reduce over other mesh axes. What to do: choose the subset by name, the same on every "
                "rank (`[p for n, p in compiled.named_parameters() if ...]`), not by a piece's size or values.")

    def sharded_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers (the non-persistent ones too) as DTensors over the runtime mesh (local
        shards, no copies), keyed by the model's names: the form torch.distributed.checkpoint saves and
        loads in parallel. (`state_dict()` is the same without the non-persistent buffers.)"""
        if self.device_mesh is None:
            raise SpmdError("sharded_state_dict needs the runtime mesh: compile with spmd.compile")
        return self._named_state(keep_vars=False, persistent_only=False)

    def _named_state(self, keep_vars: bool, persistent_only: bool) -> dict[str, torch.Tensor]:
        """The model's names (a tied parameter under each of them) -> this rank's piece as a DTensor over the
        runtime mesh, where it lies in the whole (the piece itself without a runtime mesh: a mesh of one)."""
        out = {}
        for fqn, attr in self._param_names.items():
            if fqn in self._constants or (persistent_only and fqn in self._non_persistent):
                continue
            local = self._get(attr)
            out[fqn] = self._as_whole(fqn, local if keep_vars else local.detach())
        source_guard.handed_out(self, out.items())  # (whose pieces: torch.distributed.checkpoint saving them)
        return self._with_aliases(out)

    def _as_whole(self, fqn: str, local: torch.Tensor) -> torch.Tensor:
        """`local`, cut as `fqn`'s piece, as a DTensor over the runtime mesh (itself without one)."""
        from torch.distributed.tensor import DTensor

        if self.device_mesh is None:
            return local
        shape = self._global_shapes[fqn]
        whole = DTensor.from_local(local, self.device_mesh, list(self._state_placements[fqn]), run_check=False,
                                   shape=torch.Size(shape), stride=contiguous_strides(shape))
        # (whose piece it is: torch.save keeps it, so a load on another rank is seen, `_saved_here`)
        whole._spmd_piece_of = (tuple(self.coord), tuple(self.mesh_spec.shape))
        return whole

    def _saved_here(self, fqn: str, value) -> None:
        """Raise where `value`, a DTensor from `state_dict()` or `optimizer_state_dict()`, holds another rank's
        piece than this rank's: `torch.save` on rank 0 alone, then a `torch.load` of that file on every rank (the
        single-device habit) hands each rank rank 0's pieces, of the same shapes, and a load took them as its
        own, silently (0.51 off)."""
        saved = getattr(value, "_spmd_piece_of", None)
        mine = (tuple(self.coord), tuple(self.mesh_spec.shape))
        mesh = getattr(value, "device_mesh", None)
        if mesh is not None and mesh != self.device_mesh and mesh.get_coordinate() is not None:
            # (a module's on another mesh: this rank's piece is the one at this rank's coordinate in that mesh; a
            # probe's (2, 2) module loaded into a (4,) one was told it came from a file saved by one rank)
            mine = (tuple(mesh.get_coordinate()), tuple(mesh.shape))
        if saved is None or same_piece(saved, mine, getattr(value, "placements", ())):
            return
        coord, shape = saved
        raise SpmdError(
            f"the state dict's {fqn!r} is the piece of the rank at mesh coordinate {coord} (of a mesh {shape}), and "
            f"this rank is at {mine[0]}: a file saved by one rank (`torch.save(compiled.state_dict(), ...)` on "
            "rank 0) and loaded on every rank hands each rank that rank's pieces. What to do: save whole tensors "
            "(`compiled.full_state_dict()`, with `compiled.load_state_dict` taking them on any rank), or let each "
            "rank save and load its own file (`f'ckpt_{rank}.pt'`), or use torch.distributed.checkpoint "
            "(`dcp.save(compiled.state_dict())`), which loads on any mesh and plan.")

    def _piece_of(self, fqn: str, value, piece: torch.Tensor, exact: bool = False):
        """This rank's piece of `value` for `fqn`, whose piece is shaped as `piece`: a DTensor resharded to
        this plan's layout, a full tensor cut; a number, or a whole that is the piece, as it is. `exact`: the
        value is the parameter's own (a state dict's entry), of its whole shape exactly, as torch's load
        requires; else an optimizer's state, which may be a number or have other dims (a factored one's)."""
        whole = tuple(value.shape) if isinstance(value, torch.Tensor) else None  # (DTensor: whole)
        shape = self._global_shapes.get(fqn)
        # (a piece-shaped tensor was once taken for this rank's piece: half a bias from a smaller configuration
        # loaded into both halves, silently; a tensor of one, a vector or a number broadcast over the whole)
        if shape is not None and (whole != tuple(shape) if exact else
                                  bool(whole) and len(whole) == len(shape) and whole != tuple(shape)):
            got = f"a tensor of shape {list(whole)}" if whole is not None else f"a {type(value).__name__}"
            raise SpmdError(f"size mismatch for {fqn}: copying {got} from the state dict, the model's is "
                            f"{list(shape)}. What to do: load a state dict of this model's configuration (whole "
                            "tensors, or the DTensors of its state_dict()).")
        if hasattr(value, "to_local"):
            self._saved_here(fqn, value)
            if value.device_mesh != self.device_mesh:  # (another module's, on another mesh: DTensor does not
                # redistribute across meshes, torch's raw NotImplementedError; found by a probe)
                return local_shard(value.full_tensor(), self._state_placements[fqn], self.mesh_spec.shape, self.coord)
            return value.redistribute(self.device_mesh, list(self._state_placements[fqn])).to_local()
        if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) != tuple(piece.shape):
            return local_shard(value, self._state_placements[fqn], self.mesh_spec.shape, self.coord)
        return value

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """`state_dict()` is the model's: its names (a tied parameter under each), its persistent entries,
        and each value this rank's piece as a DTensor over the runtime mesh (no copy), as FSDP2's modules
        give theirs. torch.distributed.checkpoint then saves each piece where it lies in the whole, and
        loads it back on any mesh and plan. (Plain pieces under one name on every rank would be taken for
        one replicated tensor: it would save one rank's piece and load it into all of them.)"""
        for name, value in self._named_state(keep_vars, persistent_only=True).items():
            destination[prefix + name] = value

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """`optimizer`'s state (an optimizer over `compiled.parameters()`) keyed by the model's names, each
        state cut like its parameter a DTensor over the runtime mesh: what torch.distributed.checkpoint saves
        beside `state_dict()`, and loads on any mesh and plan (`load_optimizer_state_dict`). An optimizer
        that has not stepped yet is given its state first (a step at a learning rate of 0, as torch's
        `get_optimizer_state_dict` does; the optimizer itself is left without it), so that a checkpoint has
        somewhere to load into: saved before the first step, a checkpoint holds that made-up state (AdamW: step 1,
        zero moments), so save after it. (The optimizer's
        own `state_dict()` holds plain pieces keyed by position: right for torch.save on each rank and a
        load on the same plan, wrong for torch.distributed.checkpoint, which refuses it.)"""
        from spmd.runtime.optimizer_state import named_state_dict

        return named_state_dict(self, optimizer)

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Load `optimizer_state_dict`'s form (as torch.distributed.checkpoint filled it in, or full tensors
        under the model's names) into `optimizer`: each rank takes its pieces."""
        from spmd.runtime.optimizer_state import load_named_state_dict

        load_named_state_dict(self, optimizer, state)

    def _with_aliases(self, state: dict) -> dict:
        """`state` with every tied parameter listed under each of its names too (one tensor, many keys)."""
        for alias, canonical in self._aliases.items():
            if canonical in state:
                state[alias] = state[canonical]
        return state

    def load_sharded_state_dict(self, state: dict[str, torch.Tensor], _partial: bool = False,
                                _agreed: bool = False) -> None:
        """Copy DTensors (as loaded by torch.distributed.checkpoint into `sharded_state_dict()`) or full
        tensors into this rank's shards. (`_partial`: entries that are absent are left as they are.)"""
        loaded = set()
        if not _agreed:
            self._agree_on_loaded(state)
        elsewhere = source_guard.from_elsewhere(self, state.values())  # (before its own pieces are written)
        self._agree_on_whose_pieces(state, self._check_tied_shapes)
        with torch.no_grad():
            for fqn, attr in self._param_names.items():
                value = self._entry(state, fqn)
                if value is None and (_partial or fqn in self._non_persistent):  # (computed, or a lifted
                    continue                                                     # constant: not saved)
                if value is None:
                    raise SpmdError(f"load_sharded_state_dict: no entry for {fqn!r}. What to do: load a state "
                                    "dict saved from this model (compiled.sharded_state_dict() or full_state_dict()).")
                local = self._get(attr)
                local.copy_(self._piece_of(fqn, value, local, exact=True))
                loaded.add(fqn)
        self._uninitialized -= loaded
        if loaded:  # (given weights: not stale beside a module compiled alike that trained, once all are)
            source_guard.given(self, loaded, elsewhere)

    def _check_tied_shapes(self, state: dict) -> None:
        """Every name of a tied parameter in `state` of its shape, the names whose entry is not taken too (torch's
        load copies each into the one tensor, and refuses any of another shape): a 3x3 `emb.weight` beside a
        right `head.weight` was dropped without a word, and a wrong `head.weight` reported as `emb.weight`'s
        (found by a probe)."""
        for fqn in set(self._aliases.values()):
            shape = self._global_shapes.get(fqn)
            for name in (fqn, *self._names_of(fqn)):
                value = state.get(name)
                if shape is not None and isinstance(value, torch.Tensor) and tuple(value.shape) != tuple(shape):
                    raise SpmdError(f"size mismatch for {name}: copying a tensor of shape {list(value.shape)} from the "
                                    f"state dict, the model's is {list(shape)} ({name} is tied to "
                                    f"{', '.join(n for n in (fqn, *self._names_of(fqn)) if n != name)}). What to do: "
                                    "load a state dict of this model's configuration (whole tensors, or the DTensors "
                                    "of its state_dict()).")

    def _agree_on_whose_pieces(self, state: dict, check=None) -> None:
        """Every rank refuses, before any piece is written, where any rank was given DTensors holding another rank's
        pieces (`_saved_here`): files named by LOCAL_RANK on a shared folder, written by every node's ranks over
        each other, refused on the ranks that read another's and loaded on the others; in a `try: resume
        except: start fresh` loop the replicas then trained from different weights, and without it the others
        went on into the step's collectives (gloo's SIGABRT on a size mismatch; found by a probe)."""
        mine = None
        if check is not None:  # (`check(state)`: a refusal of this rank's own, raised on every rank alike)
            try:
                check(state)
            except SpmdError as e:
                mine = e
        for fqn in self._param_names:
            value = self._entry(state, fqn)
            if hasattr(value, "to_local") and mine is None:
                try:
                    self._saved_here(fqn, value)
                except SpmdError as e:
                    mine = e
                    break
        if self._on_live_mesh() and torch._guards.detect_fake_mode(list(state.values())) is None:
            anywhere = self._mesh_check(
                "load_state_dict", "load_state_dict compares whose pieces each rank was given with its peers'",
                "load on every rank of the mesh.", lambda: self._apart_anywhere(mine is not None, "loaded pieces"))
        else:
            anywhere = mine is not None
        if mine is not None:
            raise mine
        if anywhere:
            raise SpmdError(
                "load_state_dict / load_optimizer_state_dict: another rank of the mesh refused what it was given (its "
                "own message says why), so no rank loaded anything. Where it was given another rank's pieces (one "
                "rank's file loaded on every rank, or each rank's file on a folder every machine shares named by "
                "LOCAL_RANK, which the other machines' ranks write over), what to do: let each rank save and load "
                "its own file, named by its global rank (`f'ckpt_{dist.get_rank()}.pt'`), or use "
                "torch.distributed.checkpoint (`dcp.save(compiled.state_dict())`).")

    def _on_live_mesh(self) -> bool:
        """A mesh of more than one rank over a process group (not a CUDA rank planned here on fake tensors): where
        the ranks' checks that take a collective run."""
        return dist.is_initialized() and self.device_mesh is not None and self.mesh_spec.size > 1 and \
            torch._guards.active_fake_mode() is None

    def _mesh_check(self, call: str, compares: str, way_out: str, collective):
        """`collective()` (a comparison of the ranks' values), with a message on stderr if this rank waits in it
        too long; a failed collective raised as what `call` compares and the way out."""
        try:
            with waiting.collective(call, self.rank, self.mesh_spec.size):
                return collective()
        except SpmdCollectiveError as e:
            raise SpmdCollectiveError(f"{compares} (a collective), and the collective failed ({e.__cause__ or e}). "
                                      f"What to do: {way_out}") from e

    def _agree_on_loaded(self, state: dict, unexpected=()) -> None:
        """Whole tensors loaded (not DTensors: those say whose piece each is) the same on every rank: each rank cuts
        its piece from the one it was given, so a head re-drawn with each rank's own seed and loaded with
        `strict=False` left the replicas of a replicated weight 0.11 apart after 3 steps, and a sharded one made of
        two draws, silently (found by a probe). One digest (of a sample) per parameter and buffer of the module, in
        the same order on every rank (none for an entry not given whole), compared over the mesh: every rank loads
        together, as it trains together, and ranks given other entries are told so (a review found them out of
        step)."""
        if not self._on_live_mesh() or torch._guards.detect_fake_mode(list(state.values())) is not None:
            return  # (fake values: a CUDA rank planned here)
        values = []
        for fqn in sorted(self._param_names):
            v = self._entry(state, fqn)
            whole = isinstance(v, torch.Tensor) and not hasattr(v, "to_local") and not v.is_meta and \
                tuple(v.shape) == tuple(self._global_shapes.get(fqn, ()))
            values.append((fqn, v if whole else _NOT_GIVEN))
        # (and the keys that are not the model's: a strict load refused on one rank alone left the others waiting
        # here; now every rank compares first, then raises alike; a review)
        keys = ",".join(sorted(map(str, unexpected))).encode()
        values.append(("keys that are not the model's",
                       torch.frombuffer(bytearray(keys), dtype=torch.uint8) if keys else _NOT_GIVEN))
        what = self._given_apart(values, "load_state_dict", "the whole tensors each rank was given", "the same entries",
                                 "loaded tensors")
        if what is not None:
            raise SpmdError(
                f"load_state_dict: what the ranks were given differs ({what}): each rank takes its piece of "
                "the one it was given, so the replicas of a replicated weight would train apart and a sharded one "
                "would be made of several. What to do: give every rank the same entries and values (seed every rank "
                "alike before drawing new weights, or load the same checkpoint), or load DTensors "
                "(torch.distributed.checkpoint into compiled.state_dict()).")

    def _given_apart(self, values: list, call: str, compared: str, alike: str, what: str) -> str | None:
        """Where `values` ((name, tensor) in the same order on every rank: what a load was given) differ between the
        ranks ("'fc.bias' along 'dp'", or "on other ranks of the mesh" where only another rank saw it), or None
        where every rank was given the same: a sampled digest of each, compared over the mesh."""
        apart, anywhere = self._mesh_check(
            call, f"{call} compares {compared} with its peers'", f"load on every rank of the mesh, with {alike}.",
            lambda: self._values_apart(values, lambda axis, k: True, what, sampled=True))
        if not anywhere:
            return None
        return ", ".join(f"{name!r} along {axis!r}" for name, axis in apart[:4]) or "on other ranks of the mesh"

    def _agree_on_loaded_state(self, state: dict[str, dict]) -> None:
        """`_agree_on_loaded` for an optimizer's state (FQN -> {"exp_avg": ..., "step": ...}): the whole tensors
        each rank was given alike on every rank, before any is taken. Each rank cuts its piece of the moments from
        the state it was given, so per-rank files or state built by hand left the replicas of a replicated
        parameter 12.7 apart after 2 AdamW steps (a sharded one's moments made of two states; found by a probe),
        where `load_state_dict` refused the same mistake for the weights. One digest per parameter of the
        module (of its entries given whole, by key), in the same order on every rank."""
        if not self._on_live_mesh() or torch._guards.detect_fake_mode(
                [v for entries in state.values() for v in entries.values() if isinstance(v, torch.Tensor)]) is not None:
            return
        import zlib

        given = {self._aliases.get(fqn, fqn): entries for fqn, entries in state.items()}
        values = []
        for fqn in sorted(self._param_names):
            whole = [(zlib.crc32(str(key).encode()), _digest(torch.tensor(float(v)) if isinstance(v, (int, float))
                                                             else v, sampled=True))
                     for key, v in sorted((given.get(fqn) or {}).items(), key=lambda kv: str(kv[0]))
                     if (isinstance(v, torch.Tensor) and not hasattr(v, "to_local") and not v.is_meta) or
                     (isinstance(v, (int, float)) and not isinstance(v, bool))]  # (a `step` kept as a number)
            values.append((fqn, torch.tensor(whole, dtype=torch.int64) if whole else _NOT_GIVEN))
        what = self._given_apart(values, "load_optimizer_state_dict", "the whole tensors of the state each rank was "
                                 "given", "the same state", "loaded optimizer state")
        if what is not None:
            raise SpmdError(
                f"load_optimizer_state_dict: the optimizer state the ranks were given differs ({what}): each rank "
                "takes its piece of the state it was given, so the replicas of a replicated parameter would train "
                "apart and a sharded one's moments would be made of several states. What to do: give every rank "
                "the same state (one checkpoint, `get_optimizer_state_dict` of one optimizer), or load DTensors "
                "(torch.distributed.checkpoint into compiled.optimizer_state_dict(optimizer)).")

    def _place(self, fqn: str, tensor: torch.Tensor, alias: bool = False) -> str:
        """Hold `tensor` (this rank's piece of `fqn`) where the model holds it: `blocks.0.mlp.fc1.weight` in a
        tree of `_Pieces` modules named as the model's, so every tool that goes by names (parameter groups made
        by name, `get_parameter`, `torch.func.functional_call`, a parent module's `named_parameters()`) sees the
        model's names. Where the first name would hide an attribute of this module (`plan`, `forward`), flat
        under `_p__blocks__0__...` instead. Returns where it is held (its path)."""
        parts = fqn.split(".")
        if not self._holds_under(parts) or (len(parts) == 1 and parts[0] in self._modules):
            owner, leaf, path = self, "_p__" + fqn.replace(".", "__"), "_p__" + fqn.replace(".", "__")
            self._flat_names[path] = fqn
        else:
            owner, leaf, path = self._holder(".".join(parts[:-1])) if len(parts) > 1 else self, parts[-1], fqn
            if owner is None:
                raise SpmdInternalError(f"CompiledModule: {fqn!r} goes through a module that is not a holder")
        if isinstance(tensor, nn.Parameter):
            nn.Module.register_parameter(owner, leaf, tensor)
        else:
            nn.Module.register_buffer(owner, leaf, tensor, persistent=not alias)
        return path

    def _holds_under(self, parts: list[str]) -> bool:
        """Whether the names `parts` (a piece's, or a module path's) may go through holders: not where the first
        would hide this module's own attribute (`plan`, `forward`) or a graph module of its own, nor where a later
        one is a holder's own attribute."""
        taken = self._modules.get(parts[0])  # (a graph module of this one's, or a holder: only a holder is shared)
        return not (parts[0] in self.__dict__ or hasattr(type(self), parts[0]) or parts[0] in _RESERVED
                    or not all(parts) or parts[0].startswith("_") or any(p in _HOLDER_OWN for p in parts[1:])
                    or (taken is not None and not isinstance(taken, _Pieces)))

    def _holder(self, path: str) -> "_Pieces | None":
        """The holder at the model's module path `path`, made (empty, and those on the way) where there is none;
        None where the name would hide this module's own attribute (its pieces are then held flat: `_place`)."""
        parts = path.split(".")
        if not self._holds_under(parts):
            return None
        owner = self
        for k, part in enumerate(parts):
            child = owner._modules.get(part)
            if child is None:
                child = _Pieces(self, ".".join(parts[:k + 1]))
                owner.add_module(part, child)
            elif not isinstance(child, _Pieces):
                return None
            owner = child
        return owner

    def _owner(self, path: str) -> tuple[nn.Module, str]:
        *parts, leaf = path.split(".")
        owner = self
        for part in parts:
            owner = owner._modules[part]
        return owner, leaf

    def _index(self) -> None:
        """(holder, name) of each piece, found once: the calls read the pieces through them (a parametrization
        registered on a holder is read as torch reads it)."""
        for holder in self.modules():  # (a copy's holders answer for the copy)
            if isinstance(holder, _Pieces):
                holder.__dict__["_root"] = weakref.ref(self)
        self.__dict__["_slots"] = {path: self._owner(path) for path in self._param_names.values()}
        self.__dict__["_arg_slots"] = [self._slots[attr] if kind != "input" else (None, None)
                                       for kind, attr in self._order]
        self.__dict__["_arg_tables"] = [
            (None, None) if kind == "input" else
            ((owner._parameters if kind == "parameter" else owner._buffers), leaf)
            for (kind, _), (owner, leaf) in zip(self._order, self._arg_slots)]
        # (the graph's sharded state arguments: where, and the shapes of this rank's pieces, checked at each call;
        # a replicated one's piece is the whole tensor)
        pieces = {k: torch.Size(local_shape(self._global_shapes[fqn], self._state_placements[fqn], self.mesh_spec.shape))
                  for k, ((kind, _), fqn) in enumerate(zip(self._order, self._order_names)) if kind != "input"}
        at = [k for k, shape in pieces.items() if tuple(shape) != self._global_shapes[self._order_names[k]]]
        self.__dict__["_sharded_at"] = tuple(at)
        self.__dict__["_state_at"] = operator.itemgetter(*at) if len(at) > 1 else (lambda args: tuple(args[k] for k in at))
        self.__dict__["_state_shapes"] = tuple(pieces[k] for k in at)

    def _get(self, path: str) -> torch.Tensor:
        """The piece held at `path` (`_param_names` gives each FQN's)."""
        owner, leaf = self._slots[path] if "_slots" in self.__dict__ else self._owner(path)
        return getattr(owner, leaf)

    def piece(self, fqn: str) -> torch.Tensor:
        """This rank's piece of the model's parameter or buffer `fqn` (any of a tied tensor's names)."""
        attr = self._param_names.get(fqn) or self._param_names.get(self._aliases.get(fqn, ""))
        if attr is None:
            names = sorted([*self._param_names, *self._aliases])
            close = difflib.get_close_matches(fqn, names, n=1)
            raise KeyError(f"{fqn!r} is not a parameter or buffer of the compiled model"
                           + (f"; did you mean {close[0]!r}?" if close else f" (it has {len(names)}: {names[:3]} ...)"))
        return self._get(attr)

    def __getattr__(self, name: str):
        """nn.Module's lookup (parameters, buffers, holders), and where that fails for a name the model has
        (`compiled.generate`, `compiled.config`, `compiled.save_pretrained`), an AttributeError that says why
        the compiled module does not answer for the model and what does. (Forwarding would run the model's
        own code on the weights it was compiled with, or report its device and dtype for the pieces'.)"""
        try:
            return super().__getattr__(name)
        except AttributeError:
            source = self.__dict__.get("_source_model")
            if source is None or name.startswith("__") or not _has_static(source, name):
                raise
        raise _only_the_model_has(type(self).__name__, source, name, "") from None

    def __getstate__(self):
        """A compiled module is not pickled whole (`torch.save(compiled)`): it holds its graphs, the mesh's process
        groups and this rank's pieces, which are no checkpoint. Its weights are."""
        raise SpmdError("a compiled module cannot be pickled whole (torch.save(compiled), pickle.dumps): it holds "
                        "its graphs, the mesh's process groups and this rank's pieces. What to do: save its weights: "
                        "`torch.save(compiled.state_dict(), f'ckpt_rank{rank}.pt')` on every rank, "
                        "`compiled.save_safetensors(path)` (one file, gathered), or torch.distributed.checkpoint "
                        "with `compiled.state_dict()`; compile the model again to load them.")

    def __deepcopy__(self, memo):
        """A copy with pieces of its own (an exponential moving average of the weights kept beside the module
        that trains, as timm's `ModelEma` makes it): the same model, plan, graphs and mesh. A copy made before
        training holds the weights of then until its user updates them (in place, through `.data`, or by a load):
        a copy is a snapshot, never refused as stale. (Copying the model itself after training would be refused:
        its weights are the old ones; the copy does not copy it.)"""
        import copy

        new = object.__new__(type(self))
        new.__dict__ = dict(self.__dict__)
        new.__dict__.pop("_twin_layouts", None)  # (`source_guard.written_across_plans`' table is the original's)
        for name in ("_modules", "_non_persistent_buffers_set", "_uninitialized", "_compiled_graphs", "_variants",
                     "_grad_variants",
                     *(k for k, v in self.__dict__.items() if k.endswith("_hooks") and isinstance(v, dict))):
            new.__dict__[name] = type(self.__dict__[name])(self.__dict__[name])  # (its own table, same entries)
        memo[id(self)] = new
        for store in ("_parameters", "_buffers"):
            new.__dict__[store] = {k: copy.deepcopy(v, memo) for k, v in self.__dict__[store].items()}
        for name, child in self._modules.items():  # the holders of the pieces (the graphs are shared)
            if isinstance(child, _Pieces):
                new._modules[name] = copy.deepcopy(child, memo)
        new._index()
        new._flags = [(param, memo.get(id(piece), piece), fqn, was) for param, piece, fqn, was in self._flags]
        new._flags_shared = False  # (a copy's flags are its own: an EMA copy frozen must not freeze the model)
        new._frozen_pieces = [(memo.get(id(piece), piece), fqn) for piece, fqn in self._frozen_pieces]
        new._watch_pieces()  # (compiled from the same model: the guards know the copy's pieces too)
        new.__dict__["_copy"] = True  # (a snapshot its user keeps up to date, or not: never stale)
        _compiled_modules.setdefault(self._source_model, weakref.WeakSet()).add(new)  # (its mode explains the model's)
        return new

    def _apply(self, fn, recurse: bool = True):
        """`.to(...)`, `.half()`, `.cuda()` and the like, on the pieces. Where they would change a dtype or a
        device, the graph (traced for the old ones, its collectives bound to this rank's device) would fail
        at the first call with an error about mismatched operands: this refuses before anything is
        converted (each conversion tried first on an empty tensor of the piece's kind)."""
        self._refuse_conversion(fn)
        return super()._apply(fn, recurse)

    def _persistent_names(self) -> set[str]:
        return set(self._param_names) - self._non_persistent

    def _refuse_conversion(self, fn, items=None) -> None:
        for name, t in (self._state_items() if items is None else items):
            probe = fn(torch.empty((0,), dtype=t.dtype, device=t.device))
            if (probe.dtype, probe.device) != (t.dtype, t.device):
                raise SpmdError(
                    f"this module's graph was compiled for its parameters and buffers as they are ({name}: "
                    f"{t.dtype} on {t.device}); converting them (to {probe.dtype} on {probe.device}) would not "
                    "change the graph. What to do: convert the model before compiling (model.to(...), then "
                    "spmd.compile); for mixed precision, spmd.compile under torch.autocast, and call the "
                    "compiled module under the same autocast.")

    def _state_items(self):
        return [(fqn, t) for fqn, attr in self._param_names.items() if (t := self._get(attr)) is not None]

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """torch's `load_state_dict`, for the model's own state dict: keyed by the model's names
        (`model.state_dict()`, a checkpoint of the single-device model: full tensors; `compiled.state_dict()`:
        DTensors) it goes to `load_sharded_state_dict` (each rank cuts or takes its pieces); the attribute names
        of older versions (`0__weight`: this rank's pieces) are taken too. With `strict`, keys of neither kind,
        or a persistent entry missing, are an error; without, they are reported as torch reports them. The
        model's load pre-hooks run first, on a copy of the state dict (the key renames of old checkpoints that
        transformers' Mamba or torch's weight_norm make); its post hooks, which set the model's own tensors, do
        not, and a warning names them. (`assign` is not taken.)"""
        from torch.nn.modules.module import _IncompatibleKeys

        state_dict = self._run_load_pre_hooks(state_dict, strict)
        missing, unexpected = self._model_keys(state_dict)
        self._agree_on_loaded(state_dict, unexpected)  # (before a strict refusal: every rank raises alike)
        if strict and (unexpected or missing):
            raise SpmdError("load_state_dict: " + _listed((("keys that are not the model's", unexpected),
                                                           ("entries missing", missing)))
                            + ". What to do: load the model's own, whole state dict (or pass strict=False).")
        foreign = set(unexpected)
        self.load_sharded_state_dict({k: v for k, v in state_dict.items() if k not in foreign}, _partial=True,
                                     _agreed=True)
        return _IncompatibleKeys(missing, unexpected)

    def _run_load_pre_hooks(self, state_dict: dict, strict: bool) -> dict:
        """`state_dict` as the source model's load pre-hooks leave it (a copy; spmd's own hooks left out), as
        torch's `load_state_dict` hands it on: a pre-hook renaming an old checkpoint's keys was skipped, so its
        entries were refused as unexpected, or left out silently without `strict` (found by a probe). Post hooks
        (they write the model's own tensors, a buffer derived from the loaded weights: 9.78 off, silently) are
        named in a warning, with the way out."""
        model = self.__dict__.get("_source_model")
        if model is None:
            return state_dict
        mine = lambda h: getattr(getattr(h, "hook", h), "spmd_guard", False)  # noqa: E731
        pre = [(path, h) for path, m in model.named_modules() for h in m._load_state_dict_pre_hooks.values()
               if not mine(h)]
        post = [(path, m) for path, m in model.named_modules()
                if any(not mine(h) for h in m._load_state_dict_post_hooks.values())]
        if post:
            where = ", ".join(f"`{path or type(model).__name__}` ({type(m).__name__})" for path, m in post[:3])
            warnings.warn(
                f"load_state_dict: {where} of the model registered load_state_dict post hooks, which set the "
                "model's own tensors after a load (a buffer derived from the loaded weights): the compiled module's "
                "pieces are not the model's, so they are not run. What to do: load the checkpoint into the model "
                "and compile it after, or set what the hook sets in the state dict before loading it.",
                stacklevel=3)
        if not pre:
            return state_dict
        metadata = getattr(state_dict, "_metadata", None)
        state_dict = dict(state_dict)
        missing, unexpected, errors = [], [], []
        for path, hook in pre:
            local = metadata.get(path, {}) if metadata is not None else {}
            hook(state_dict, f"{path}." if path else "", local, strict, missing, unexpected, errors)
        if errors:
            raise SpmdError("load_state_dict: the model's load pre-hooks said: " + "; ".join(map(str, errors)))
        return state_dict

    def _load_part(self, under: str, state_dict: dict, strict: bool):
        """`load_state_dict` asked of a holder (`compiled.encoder.load_state_dict(...)`): its entries, named from
        it, loaded into the pieces under `under` (`encoder.`)."""
        from torch.nn.modules.module import _IncompatibleKeys

        names = {fqn: [n for n in self._load_names(fqn) if n.startswith(under)] for fqn in self._param_names}
        names = {fqn: ns for fqn, ns in names.items() if ns}  # (a tied weight held here under another name too)
        mine = {n for ns in names.values() for n in ns}
        missing = [ns[0][len(under):] for fqn, ns in names.items()
                   if fqn not in self._non_persistent and not any(n[len(under):] in state_dict for n in ns)]
        unexpected = [k for k in state_dict if under + k not in mine]
        self._agree_on_loaded({under + k: v for k, v in state_dict.items()}, unexpected)
        if strict and (unexpected or missing):
            raise SpmdError(f"load_state_dict of `{under[:-1]}`: "
                            + _listed((("unexpected keys", unexpected), ("entries missing", missing)))
                            + ". What to do: load that module's own state dict (or pass strict=False).")
        foreign = set(unexpected)
        self.load_sharded_state_dict({under + k: v for k, v in state_dict.items() if k not in foreign}, _partial=True,
                                     _agreed=True)
        return _IncompatibleKeys(missing, unexpected)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The pieces under the model's names (as the tree holds them; a name held flat, `_p__plan__weight`, as
        the model's: `plan.weight`, in the model's order), each with the `requires_grad` its model's parameter has
        now (`parameters()` comes here too)."""
        if self.__dict__.get("_flags"):
            self._follow_requires_grad(strict=False)
        if not self._flat_names:
            return super().named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)
        return self._model_named(super().named_parameters(recurse=recurse, remove_duplicate=False), prefix, recurse,
                                 remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        if not self._flat_names:
            return super().named_buffers(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)
        return self._model_named(super().named_buffers(recurse=recurse, remove_duplicate=False), prefix, recurse,
                                 remove_duplicate)

    def _model_named(self, named, prefix: str, recurse: bool, remove_duplicate: bool):
        """`named` (every name, duplicates too) under the model's names, in the model's order, each tensor
        once under its first name where `remove_duplicate`."""
        if "_model_order" not in self.__dict__:
            model = self._source_model
            order = [n for n, _ in model.named_parameters(remove_duplicate=False)]
            order += [n for n, _ in model.named_buffers(remove_duplicate=False)]
            self.__dict__["_model_order"] = {n: k for k, n in enumerate(order)}
        rank = self._model_order
        out = sorted(((self._flat_names.get(n, n), t) for n, t in named), key=lambda item: rank.get(item[0], len(rank)))
        if not recurse:  # (the model's own, at its root)
            out = [(n, t) for n, t in out if "." not in n]
        seen = set()
        lead = prefix + "." if prefix else ""
        for name, t in out:
            if remove_duplicate and id(t) in seen:
                continue
            seen.add(id(t))
            yield lead + name, t

    def get_parameter(self, target: str):
        path = self._param_names.get(self._aliases.get(target, target))
        if path in self._flat_names and isinstance(self._get(path), nn.Parameter):
            return self._get(path)
        return super().get_parameter(target)

    def get_buffer(self, target: str):
        path = self._param_names.get(self._aliases.get(target, target))
        if path in self._flat_names and not isinstance(self._get(path), nn.Parameter):
            return self._get(path)
        return super().get_buffer(target)

    def __copy__(self):
        raise SpmdError("copy.copy of a compiled module would share its pieces with the original under a second "
                        "module. What to do: copy.deepcopy(compiled) (pieces of its own), or use the module itself.")

    def _load_names(self, fqn: str) -> tuple[str, ...]:
        """The keys `fqn` may come under in a state dict: its names, and the attribute names older versions
        held the pieces under (`blocks__0__weight`)."""
        names = (fqn, *self._names_of(fqn))
        return names + tuple(n.replace(".", "__") for n in names if "." in n)

    def _stored_as(self, fqn: str, keys) -> str | None:
        """The name of `fqn` among `keys` (a state dict, a checkpoint's tensors) whose entry torch's
        `load_state_dict` leaves in it: each module copies its own names in turn, so of a tied tensor's names
        the last one present (in module order) wins."""
        return next((n for n in reversed((fqn, *self._names_of(fqn))) if n in keys), None)

    def _entry(self, state: dict, fqn: str):
        """`fqn`'s entry in `state` (`_stored_as`, then the older attribute names); None where there is none."""
        name = self._stored_as(fqn, state)
        if name is None:
            name = next((n for n in self._load_names(fqn)[1 + len(self._names_of(fqn)):] if n in state), None)
        return None if name is None else state[name]

    def _model_keys(self, state: dict) -> tuple[list[str], list[str]]:
        """(persistent entries missing, keys that are not the model's) of `state`. A batch norm's
        `num_batches_tracked` is not missing from a checkpoint older than it (a plain dict, with no metadata of
        versions), as torch's batch norm takes such checkpoints (found by a probe: refused)."""
        known = {n for fqn in self._param_names for n in self._load_names(fqn)}
        missing = [fqn for fqn in self._param_names if fqn not in self._non_persistent and fqn not in self._loss_names
                   and not any(n in state for n in self._load_names(fqn)) and not self._older_than(fqn, state)]
        return missing, [k for k in state if k not in known]

    def _older_than(self, fqn: str, state: dict) -> bool:
        """Whether `fqn` is a batch norm's `num_batches_tracked` and `state` a plain dict (torch's batch norm takes
        one without the entry, as from before its version 2)."""
        path, _, name = fqn.rpartition(".")
        if name != "num_batches_tracked" or (model := self.__dict__.get("_source_model")) is None:
            return False
        try:
            module = model.get_submodule(path)
        except AttributeError:
            return False
        if not isinstance(module, nn.modules.batchnorm._NormBase):
            return False
        # (metadata says the version where the state dict comes from a module's state_dict(); a compiled module's
        # holders write their own, not the batch norm's: only a plain dict, which has none, is taken as older)
        return getattr(state, "_metadata", None) is None

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """A compiled module inside another module: the outer module's `load_state_dict` hands it the entries
        under its prefix, keyed as `state_dict()` keys them (the model's names), or by older attribute names."""
        mine = OrderedDict((k[len(prefix):], v) for k, v in state_dict.items() if k.startswith(prefix))
        if (metadata := getattr(state_dict, "_metadata", None)) is not None:
            mine._metadata = {k[len(prefix):]: v for k, v in metadata.items() if k.startswith(prefix)}
        missing, unexpected = self._model_keys(mine)
        foreign = set(unexpected)
        self.load_sharded_state_dict({k: v for k, v in mine.items() if k not in foreign}, _partial=True)
        missing_keys.extend(prefix + fqn for fqn in missing)
        if strict:
            unexpected_keys.extend(prefix + k for k in unexpected)

    def apply(self, fn):
        """Refused: `fn` would run on the holders of this rank's pieces, which pass for the model's modules in
        `isinstance`, so an init function (`compiled.apply(model._init_weights)`) would draw each rank's piece on
        its own, with the fan-in of the piece, and stop at the first attribute only the model has, half done (a
        review)."""
        raise SpmdError(
            "compiled.apply(fn) would run fn on the holders of this rank's pieces of the model's weights: an init "
            "function would draw each rank's piece on its own, not the model's values. What to do: apply it to the "
            "model before spmd.compile (the compiled module takes the model's weights), or, for a model built on "
            "the meta device, `compiled.init_weights(seed, init_fn=fn)`, which gives each rank the pieces of "
            "`model.apply(fn)` on one device.")

    def init_weights(self, seed: int | None = None, init_fn=None, **replay) -> None:
        """Give this rank's shards of a model compiled from the meta device the values of the model's own
        init: the local pieces of what `torch.manual_seed(seed); model = Model(cfg)` (then
        `model.apply(init_fn)`, if given) gives on one CPU device. No rank holds more than one module's
        tensors in full beside its shards (runtime/init_weights.py); no communication.

        seed: `torch.manual_seed(seed)` first (None: go on from the global generator). A transformers
        model replays its own post_init as construction runs it (`hf_init_kwargs`). `replay`: reset_fns
        (for modules that set tensors in `__init__` without a `reset_parameters`), init_roots,
        discard_writes, tied_reset_owner, strict, init_dtype (see `init_weights.init_local_shards`)."""
        from spmd.runtime.init_tape import record_init_fn, replay_local_shards, tape_of
        from spmd.runtime.init_weights import (has_peft_layers, hf_init_kwargs, init_local_shards, is_transformers,
                                               peft_init_kwargs)

        model = self._source_model
        if not is_meta(model):
            raise SpmdError("init_weights replays the init of a model built on the meta device; this one was built "
                            "with values, and its shards already hold them (from rank src_data_rank).")
        if seed is None:
            self._agree_on_generator()
        loaded = sorted(self.__dict__.get("_given", ()))
        if loaded:  # (transformers' own init_weights leaves loaded weights alone; this replays the init over all)
            warnings.warn(f"init_weights replays the model's init over every weight, and {len(loaded)} of them were "
                          f"loaded ({', '.join(loaded[:3])}{', ...' if len(loaded) > 3 else ''}): they now hold the "
                          "init's values, not the checkpoint's. What to do: call init_weights first (it also computes "
                          "the buffers no checkpoint holds), then load.", stacklevel=2)
        placements = dict(self._state_placements)
        for alias, canonical in self._aliases.items():
            placements.setdefault(alias, placements[canonical])
        recorded = None if is_transformers(model) else tape_of(model)  # (transformers: its post_init, below)
        if recorded is not None:
            if replay:
                raise SpmdError(f"init_weights: {', '.join(sorted(replay))} describe the construction of a model built "
                                "under torch.device('meta'); this one was built by spmd.deferred_init, which recorded "
                                "its construction. What to do: leave them out (do any change inside the build function).")
            tape, final = recorded
            if init_fn is not None:
                tape, final = record_init_fn(model, tape, init_fn)
            local = replay_local_shards(tape, final, placements, self.mesh_spec.shape, self.coord, seed=seed,
                                        device=self._device or "cpu")
        else:
            kwargs = hf_init_kwargs(model) if is_transformers(model) else {}
            if has_peft_layers(model):  # (the adapters: wrapped in after the base model was built)
                for key, value in peft_init_kwargs(model).items():
                    kwargs[key] = {**kwargs.get(key, {}), **value}
            given = [k for k in (replay.get("reset_fns") or {}) if isinstance(k, type)]
            for cls, ours in (kwargs.get("reset_fns") or {}).items():  # (a draw between the module's children:
                if getattr(ours, "built_after", None) and any(issubclass(cls, k) for k in given):  # no fn redoes it)
                    ours(None)  # (raises, naming the draw, the children after it and the way out)
            for key, value in replay.items():     # (the user's reset_fns / init_roots entries join transformers')
                kwargs[key] = {**kwargs[key], **value} if isinstance(kwargs.get(key), dict) else value
            if "init_dtype" not in kwargs:
                _warn_init_dtype(model)
            local = init_local_shards(model, placements, self.mesh_spec.shape, self.coord, seed=seed, init_fn=init_fn,
                                      device=self._device or "cpu", **kwargs)
        with torch.no_grad():
            for fqn, attr in self._param_names.items():
                piece = local.pop(fqn, None)
                if piece is None:
                    continue
                target = self._get(attr)
                if tuple(piece.shape) != tuple(target.shape):
                    raise SpmdInternalError(f"init_weights: {fqn} came as {tuple(piece.shape)}, its shard is "
                                            f"{tuple(target.shape)}")
                target.data = piece.to(target.dtype)  # the piece itself: the empty shard is never touched
                self._uninitialized.discard(fqn)
        source_guard.mark_written(self)

    def _agree_on_generator(self) -> None:
        """`init_weights()` with no seed draws from each rank's global generator: ranks seeded apart (a data
        loader's habit, `torch.manual_seed(1000 + rank)`) drew their own replicas of every replicated weight
        (0.108 off rank 0's, silently; found by a probe). The generators' states are compared over the mesh."""
        if not self._on_live_mesh():
            return
        values = [("the global random generator", torch.get_rng_state())]
        apart, anywhere = self._mesh_check(
            "init_weights", "init_weights() with no seed compares the ranks' random generators",
            "call it on every rank of the mesh.",
            lambda: self._values_apart(values, lambda axis, k: True, "random generators"))
        if anywhere:
            raise SpmdError(
                "init_weights() with no seed draws from each rank's global random generator, and the ranks' "
                "generators differ" + (f" along {', '.join(repr(a) for _, a in apart)}" if apart else "") + ": each rank "
                "would draw its own replicas of the replicated weights. What to do: pass the seed, "
                "compiled.init_weights(seed=...), the same on every rank.")

    def load_safetensors(self, path, strict: bool = True):
        """Fill this rank's shards from a safetensors checkpoint (one file, an index JSON of shards, or the
        folder `save_pretrained` wrote), reading only this rank's slice of each tensor, one at a time. A tied
        parameter is found under any of its names (where the file holds several, they must be equal: the
        model ties them). `strict`: every parameter and persistent buffer must be there, and nothing else
        (a transformers model's `_keys_to_ignore_on_load_unexpected` aside). Call it on every rank of the mesh
        (the ranks compare what they read: the same files, and no rank failed). Returns the missing and
        unexpected keys, as `load_state_dict` (with strict=False, a checkpoint none of whose names is the
        model's also warns: a prefix such as `model.` loaded nothing, silently)."""
        from spmd.runtime.checkpoint import checkpoint_files

        failed, files, missing, unexpected, stored_as = None, {}, [], [], {}
        try:  # the ranks agree on the files before any piece is written: a rank that read another machine's older
            files = checkpoint_files(path)  # copy was refused only after it had loaded it (replicas apart after)
        except SpmdError as e:
            failed = e
        except Exception as e:
            failed = SpmdError(f"load_safetensors: reading {path} failed on rank {self.rank}: {type(e).__name__}: {e}")
        digest = self._agree_on_checkpoint(files, failed, written=False)
        if failed is not None:
            raise failed
        try:  # (every failure joins the ranks' comparison below: one rank raising alone left the others waiting)
            files, missing, unexpected, stored_as = self._read_safetensors(path, strict)
        except SpmdError as e:
            failed = e
        except Exception as e:  # (OSError, a header cut short, anything else: every rank learns it failed)
            failed = SpmdError(f"load_safetensors: reading {path} failed on rank {self.rank}: {type(e).__name__}: {e}")
        self._agree_on_checkpoint(files, failed, digest=digest)  # (the files as compared before: their digest)
        if failed is not None:
            raise failed
        if stored_as:
            source_guard.given(self, set(stored_as), elsewhere=True)
        if missing and unexpected and stored_as:  # (strict=False: a partial load, likely of renamed entries)
            warnings.warn(f"load_safetensors: {len(missing)} tensors of the model were not in {path} and keep their "
                          f"values ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"
                          + _renamed_hint(unexpected) + ".", stacklevel=2)
        if missing and not stored_as:
            warnings.warn(
                f"load_safetensors: none of the model's {len(missing)} tensors is in {path}: its names "
                f"({', '.join(unexpected[:3])}{', ...' if len(unexpected) > 3 else ''}) are not the model's "
                f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}), so nothing was loaded. What to "
                "do: load a checkpoint of this model, with its names as the model's `state_dict()` has them.",
                stacklevel=2)
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)

    def _read_safetensors(self, path, strict: bool):
        """`load_safetensors`' reading: (the files, missing, unexpected, {fqn: the name it was read under})."""
        from spmd.runtime.checkpoint import checkpoint_files, read_pieces

        files = checkpoint_files(path)
        missing, wanted, stored_as, tied, again = [], {}, {}, {}, []
        peft = self._peft_names()
        for fqn in self._param_names:
            if fqn in self._non_persistent or fqn in self._loss_names:
                continue
            names = [n for n in reversed((fqn, *self._names_of(fqn))) if n in files]
            if not names and fqn in peft:  # (a peft model's base checkpoint, or its adapter's file)
                names = [n for n in peft[fqn][0] if n in files][:1]
            if not names:
                missing.append(fqn)
                continue
            shape = self._global_shapes[fqn]
            index = local_slices(shape, self._state_placements[fqn], self.mesh_spec.shape, self.coord)
            stored_as[fqn] = names[0]
            if names[0] in wanted:  # (one entry for two tensors: a peft `modules_to_save` copy and its original)
                again.append((fqn, names[0], index, shape))
                continue
            for name in names:
                wanted[name] = (index, shape)
            if len(names) > 1:
                tied[fqn] = names
        read_names = set(stored_as.values())
        unexpected = [k for k in self._model_keys(files)[1]
                      if k not in read_names and not _ignored_unexpected(self._source_model, k)]
        read = {}
        # (a peft model: all of the adapter's tensors missing from the base checkpoint, or all of the base's from the
        # adapter's file; each loads apart, as peft loads them)
        one_part = bool(peft) and bool(stored_as) and len({peft[f][1] for f in missing}) == 1
        if missing and strict and not one_part:
            raise SpmdError(f"load_safetensors: {len(missing)} tensors of the model are not in {path} "
                            f"({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}). What to do: load "
                            "a checkpoint of this model, or strict=False to keep the others as they are"
                            + _untied_hint(self._source_model, missing) + _renamed_hint(unexpected) + ".")
        beside = [k for k in unexpected if _beside_weights(self._source_model, k)]
        if beside and strict:  # (a quantized checkpoint's scales, a LoRA's parts: they change what the weights are)
            raise SpmdError(
                f"load_safetensors: {path} holds {len(beside)} tensors that are not the model's, beside its weights "
                f"({', '.join(beside[:5])}{', ...' if len(beside) > 5 else ''}), as torch's strict load_state_dict "
                "refuses (a quantized checkpoint's scales, adapter weights, or names transformers converts when it "
                "loads). What to do: load a checkpoint of this model as its state_dict() names it, or strict=False "
                "to leave them out.")
        if unexpected and not beside and strict:  # (an older file's buffers: rotary inv_freq, GPT-2's attn.bias)
            warnings.warn(f"load_safetensors: {path} holds {len(unexpected)} tensors that are not the model's "
                          f"({', '.join(unexpected[:3])}{', ...' if len(unexpected) > 3 else ''}), left out, as "
                          "transformers leaves them out (buffers older versions saved).", stacklevel=3)
        later = {fqn for fqn, *_ in again}
        by_name = {name: fqn for fqn in stored_as if fqn not in later for name in tied.get(fqn, (stored_as[fqn],))}
        with torch.no_grad():
            for name, piece in read_pieces(files, wanted):
                fqn = by_name[name]
                if fqn in tied:  # (each name of a tied tensor the file holds: compared once all are read)
                    read[name] = piece
                    if any(n not in read for n in tied[fqn]):
                        continue
                    piece, others = read.pop(stored_as[fqn]), [(n, read.pop(n)) for n in tied[fqn][1:]]
                    apart = [n for n, other in others if not torch.equal(other.to(piece.dtype), piece)]
                    if apart:
                        raise SpmdError(
                            f"load_safetensors: {path} holds {stored_as[fqn]!r} and {', '.join(map(repr, apart))}, "
                            "which the model ties (one tensor), with other values (a model fine-tuned untied, "
                            "saved with its tied configuration). What to do: compile the model untied "
                            "(transformers: tie_word_embeddings=False in its config), or load a checkpoint whose "
                            "tied entries are equal.")
                self.piece(fqn).copy_(piece)
                self._uninitialized.discard(fqn)
            for fqn, name, index, shape in again:
                for _, piece in read_pieces(files, {name: (index, shape)}):
                    self.piece(fqn).copy_(piece)
                self._uninitialized.discard(fqn)
        return files, missing, unexpected, stored_as

    def _peft_names(self) -> dict[str, tuple[tuple[str, ...], bool]]:
        """{fqn: (its names in the checkpoints a peft model loads, whether it is the adapter's own)} for a peft
        model (runtime/peft_names.py), else {}."""
        from spmd.runtime import peft_names

        model = self.__dict__.get("_source_model")
        if model is None or not peft_names.is_peft_model(model):
            return {}
        adapters = peft_names.adapter_names(model)
        return {fqn: peft_names.checkpoint_names(fqn, adapters) for fqn in self._param_names}

    def _agree_on_checkpoint(self, files, failed, written: bool = True, digest: bytes | None = None) -> bytes | None:
        """Every rank of the mesh loaded, from the same files (their headers, sizes and samples of their
        contents), and none failed: a load on rank 0 alone (FSDP1's habit) left the other ranks' replicas with
        their own values (0.127 off after 3 steps), and a rank that failed alone (a truncated shard) left the
        others waiting; found by a probe. `written`: whether this rank's pieces were written already (the
        check after the read) or not (the one before); `digest`: the files' digest, computed already (the
        check before returns it). Returns the digest compared."""
        from spmd.runtime.checkpoint import headers_digest

        if not self._on_live_mesh():
            return None
        broken = failed is not None
        try:
            digest = b"failed" if broken else digest or headers_digest(files)
        except Exception:  # (a shard's header cut on this rank alone: the others must not wait for it; found by
            digest, broken = b"failed", True  # a review)
        values = [("the checkpoint's files", torch.frombuffer(bytearray(digest), dtype=torch.uint8))]
        (apart, _), failed_anywhere = self._mesh_check(
            "load_safetensors", "load_safetensors compares the files each rank read with its peers'",
            "load on every rank of the mesh, from the same checkpoint.",
            lambda: (self._values_apart(values, lambda axis, k: True, "checkpoint loaded"),
                     self._apart_anywhere(broken, "checkpoint loaded")))
        if failed is None and broken:  # (its own digest failed: as a failed read)
            raise SpmdError(f"load_safetensors: the checkpoint's files at this rank (rank {self.rank}) could not be "
                            "read whole (a header cut or damaged). What to do: copy the checkpoint to this machine "
                            "again, and load again on every rank.")
        done = ("this rank read its pieces" if written else "nothing was loaded on any rank")
        if failed is None and failed_anywhere:
            raise SpmdError(f"load_safetensors failed on another rank of the mesh (its message says why); {done}. "
                            "What to do: fix what that rank reports, and load again on every rank.")
        if failed is None and apart:
            raise SpmdError(
                "load_safetensors: the ranks read different checkpoints (the files' names, headers, sizes or contents differ along "
                f"{', '.join(repr(axis) for _, axis in apart)}); {done}. On several "
                "machines, a path on each machine's local disk is a file of each machine's (save_safetensors writes "
                "on the mesh's first rank only, and another machine may hold an older file under the same name). "
                "What to do: load the same checkpoint on every rank (a shared filesystem, or the same file copied "
                "to every machine).")
        return digest

    @_collective
    def save_safetensors(self, path, metadata: dict | None = None):
        """Write the full model (every persistent parameter and buffer, a tied one under each of its names)
        to one safetensors file. Call it on every rank: each tensor is gathered in turn to rank 0, in host
        memory, which writes it as it arrives: rank 0 holds one full tensor at a time beside its shards, and the
        other ranks nothing more than their shards (each part is sent once, point to point:
        `distribute.gather_to_first`). Every rank returns once the file is whole (a load that follows reads it)."""
        from spmd.runtime.checkpoint import SafetensorsWriter, atomic_path

        source_guard.stale(self)  # (a sibling trained since this one had the weights: it would save the old ones)
        names = [(fqn, n) for fqn in self._param_names if fqn not in self._non_persistent and fqn not in self._loss_names
                 for n in (fqn, *self._names_of(fqn))]  # (a loss_fn module's tensors are not the model's)
        self._require_values(fqn for fqn, _ in names)
        self._check_writable(path)
        writer = None
        if not any(self.coord):  # (the mesh's first rank, which the pieces are sent to)
            specs = [(n, self.piece(fqn).dtype, self._global_shapes[fqn]) for fqn, n in names]
            tmp, final = atomic_path(path)
            writer = SafetensorsWriter(tmp, specs, metadata)
        try:
            for fqn, name in names:
                full = self._gathered_to_first(fqn)
                if writer is not None:
                    writer.write(name, full)
                del full
        except BaseException:
            if writer is not None:  # no half-written checkpoint left behind under any name
                writer.file.close()
                tmp.unlink(missing_ok=True)
            raise
        failed = None
        if writer is not None:
            try:
                writer.close()
                os.replace(tmp, final)
            except OSError as e:  # (the disk full at the end: told to every rank below)
                tmp.unlink(missing_ok=True)
                failed = e
        # every rank returns once the file is whole (a load right after on another rank read a file not there yet)
        if self._on_live_mesh() and self._apart_anywhere(failed is not None, "save_safetensors") and failed is None:
            raise SpmdError(f"save_safetensors: the mesh's first rank, which writes, could not finish {path} (its "
                            "message says why).")
        if failed is not None:
            raise SpmdError(f"save_safetensors: writing {path} failed: {failed}") from failed
        return path

    def _check_writable(self, path) -> None:
        """The mesh's first rank, which writes, can write `path`, told to every rank before any tensor is gathered
        (a folder given, as `save_pretrained` takes one, or a missing folder: rank 0 raised a raw error after
        gathering the whole model, and the others a raw gloo error or nothing; found by a probe)."""
        problem = None
        if not any(self.coord):
            p = Path(path)
            if p.is_dir():
                problem = f"{path} is a folder; save_safetensors writes one file (name it: {p / 'model.safetensors'})"
            elif not p.parent.is_dir():
                problem = f"the folder {p.parent} does not exist (make it first)"
        anywhere = problem is not None
        if self._on_live_mesh():
            anywhere = self._apart_anywhere(anywhere, "save_safetensors's path")
        if anywhere:
            what = problem or f"the mesh's first rank, which writes, cannot write {path}"
            raise SpmdError(f"save_safetensors: {what}"
                            ". What to do: pass a file path in an existing folder (every rank calls save_safetensors; "
                            "the mesh's first rank writes).")

    def _gathered_to_first(self, fqn: str) -> torch.Tensor | None:
        """`fqn`'s full value on rank 0 (None on the others)."""
        piece, placements = self.piece(fqn).detach(), self._state_placements[fqn]
        if self.device_mesh is None:
            return piece
        if any(isinstance(p, Partial) for p in placements):  # (a buffer whose pieces sum to it: all_reduced)
            full = gather_full(piece, placements, self.mesh_spec, self.coord, self.group_names)
            return None if any(self.coord) else full
        ranks = self.device_mesh.mesh
        return gather_to_first(piece, placements, self._global_shapes[fqn], self.mesh_spec.shape, self.coord,
                               lambda c: int(ranks[c]))

    def _names_of(self, fqn: str) -> list[str]:
        """The other names of a tied parameter."""
        return [a for a, c in self._aliases.items() if c == fqn]

    @_collective
    def full_state_dict(self, persistent_only: bool = False) -> dict[str, torch.Tensor]:
        """Every parameter and buffer as a full tensor (gathered on every rank), keyed by FQN (not a tensor constant
        the trace lifted, which the model does not hold). `persistent_only`:
        the keys of the model's own `state_dict()` (no non-persistent buffer, such as a rotary embedding's
        `inv_freq`, nor a loss_fn module's parameter), for
        `model.load_state_dict(...)`."""
        source_guard.stale(self)  # (a sibling trained since this one had the weights: these are the old ones)
        names = [n for n in self._param_names if n not in self._constants
                 and not (persistent_only and (n in self._non_persistent or n in self._loss_names))]
        self._require_values(names)
        out = {}
        for gi_name in names:
            local = self._get(self._param_names[gi_name])
            ps = self._state_placements[gi_name]
            full = gather_full(local.detach(), ps, self.mesh_spec, self.coord, self.group_names)
            # (a copy, as the gathered ones are: a replicated piece handed out as it is changed with the next
            # step, and a snapshot kept, `best = compiled.full_state_dict()`, with it: 0.06 off, silently)
            out[gi_name] = full.clone() if full.untyped_storage().data_ptr() == local.untyped_storage().data_ptr() \
                else full
        source_guard.gathered(self, out.values())
        return self._with_aliases(out)

    @contextlib.contextmanager
    def no_sync(self):
        """DDP's `no_sync()`, so that a gradient accumulation loop written for DDP runs as it is (it raised
        AttributeError; found by a probe). Nothing is skipped: each backward reduces its micro-batch's gradients
        in the graph, and `.grad` sums them as the loop's last backward would, so the step is the same; the
        communication of the micro-batches inside is not saved."""
        yield

    def input_placements(self) -> dict[str, tuple]:
        return {s.name: s.placements for s in self._input_specs}

    @torch.compiler.disable  # (its occasional check of the inputs is a collective: as `_collective`'s)
    def shard_inputs(self, *full_inputs: torch.Tensor, **full_kwargs: torch.Tensor):
        """Cut full inputs (the same on every rank) into this rank's local shards. Keyword inputs (a model
        compiled with example_kwargs) come back as `(args, kwargs)`: `compiled(*args, **kwargs)`; tuples, lists and
        dicts of tensors in their structures (`compiler/call.py`). A piece is a
        view of its input or a copy, as the plan lays it out; either way a call sees the batch as it is then (a
        copy whose batch was written in place since, a static buffer refilled, is cut again: `inputs.CutPieces`).

        Inputs of other shapes than the compiled ones (same dtypes and dims: an epoch's smaller last batch, another
        sequence length) are compiled for at their first cut, on every rank, over this module's pieces (each
        parameter and buffer keeps its layout; runtime/shapes.py): the call then runs their graphs, and the
        optimizer steps the same weights. Up to `shapes.MAX_VARIANTS` such sets of shapes, each compiled once."""
        flat = self._call.flatten(full_inputs, full_kwargs, "shard_inputs")
        known = len(self._variants)
        shapes = self._shapes_of_full(flat)
        self._shard_calls += 1  # (every rank cuts from the same batch: checked at the module's calls' counts, and
        # where it compiled for new shapes, as every rank did together: each rank's own slices of a batch given as
        # if whole came as a batch of new shapes, at a call the counts skip, and trained on half of each; a probe)
        if not self._shards_agreed or len(self._variants) != known or self._check_due(self._shard_calls):
            self._shards_agreed = False  # (until the check passes: asked again at the next call)
            self._agree_on_full_inputs(flat, "shard_inputs", sampled=self._shard_calls > 1)
            self._shards_agreed = True
        local = tuple(shard_full(t, s.placements, self.mesh_spec, self.coord, self.group_names)
                      for t, s in zip(flat, shapes.input_specs))
        for full, piece, spec in zip(flat, local, shapes.input_specs):
            if isinstance(full, torch.Tensor):
                self._cut_pieces.record(full, piece, spec)
                _cut_by_shard_inputs[piece] = True
        return self._call.as_given(local)

    def _shapes_of_full(self, flat: tuple) -> Shapes:
        """The graphs full inputs `flat` are for: the compiled shapes', or another set's, compiled at its first
        cut (`_compile_variant`); other inputs are refused (`check_full`)."""
        key = variant_key(flat, self._shapes) if self._recompile is not None else None
        if key is None:
            check_full(flat, self._input_specs)
            return self._shapes
        try:
            return self._variants.get(key) or self._compile_variant(flat, key)
        except SpmdError as e:
            kept = [tuple(shape) == tuple(spec.shape) for spec, shape in zip(self._shapes.input_specs, key)]
            if type(e) is not SpmdError or not str(e).startswith(("trace_joint:", "trace_module:")) or all(kept) \
                    or not any(kept):  # (only where some inputs changed and others kept theirs: a review)
                raise
            raise self._new_shapes_untraceable(key, e) from e

    def _new_shapes_untraceable(self, key: tuple, error: SpmdError) -> SpmdError:
        """`error`, met tracing the model again for full inputs of the new shapes `key`, prefixed with those shapes
        beside the compiled ones: inputs cut to a new length but one left at the old (`token_type_ids`) gave a
        trace error about broadcasting from inside the model, and advice to change the model (found by a probe)."""
        shapes = "; ".join(
            f"{spec.name} {list(shape)}" + ("" if tuple(shape) == tuple(spec.shape) else f" (compiled {list(spec.shape)})")
            for spec, shape in zip(self._shapes.input_specs, key) if shape is not None)
        return SpmdError(f"shard_inputs: these inputs have other shapes than the compiled ones ({shapes}), so the "
                         "model was traced again for them, and that trace failed. Where the inputs were meant to "
                         "change together (a new length on each), check they did: an input left at its old shape "
                         f"fails so. The failure: {error}")

    def _compile_variant(self, flat: tuple, key: tuple, grad: str = "on") -> Shapes:
        """This module's graphs for full inputs of the shapes `key`, over its pieces: the model compiled again
        (every rank at once, as `shard_inputs` is called: planned on rank 0 and agreed on), with each parameter and
        buffer pinned to its layout here (`shapes.pinned_to`), traced as this module was: each of its modules in
        its mode then, under its autocast state, with gradients on and the parameters frozen at compile time frozen
        (found by a probe: a first cut of a smaller batch in an evaluation loop under torch.no_grad, outside the
        autocast block, or while a layer was frozen for warm-up, gave graphs that never trained, computed in fp32,
        or left a layer untrained). Shapes refused once are refused again without compiling. `grad`, "no_grad" or
        "inference_mode": the graphs an inference module runs for a call under that mode, at the shapes `key`,
        where its forward asks whether grad is on and computes otherwise (`_grad_off`), traced in that mode."""
        vkey = key if grad == "on" else (grad, key)
        if vkey in self._refused_shapes:
            raise self._refused_shapes[vkey]
        # (found by a probe: an empty batch met the trace's "float division by zero" and advice on torch.export; an
        # input compiled empty, a prefix of length 0, stays allowed: a review)
        empty = [(spec.name, tuple(t.shape)) for spec, t in zip(self._input_specs, flat)
                 if isinstance(t, torch.Tensor) and not t.numel() and math.prod(spec.shape)]
        if empty and self.split is not None:
            raise SpmdError(
                f"shard_inputs: {', '.join(repr(name) for name, _ in empty)} {'is' if len(empty) == 1 else 'are'} "
                f"empty (shape {list(empty[0][1])}): a training step over no examples has nothing to learn from (on "
                "one device its mean loss is NaN). What to do: skip the empty batch.")
        if len(flat) == len(self._shapes.input_flags):  # (flagged as the example was, not as the call's inputs
            flat = tuple(_flagged(t, flag) for t, flag in zip(flat, self._shapes.input_flags))  # are; a review)
        if grad == "on":
            check_room(key, self._shapes, len(self._variants))
        self._agree_on_key(vkey)
        args, kwargs = self._call.unflatten(flat)
        model = self._source_model
        modes = [(m, m.training) for m in model.modules()]
        flags = [(param, param.requires_grad) for param, _, _, _ in self._flags]
        if model.training != self._traced_mode:  # (an evaluation batch cut after model.eval(): traced as this
            model.train(self._traced_mode)       # module runs, which refuses the other mode at its call)
        for m, path, was in self._modes:  # (a batch norm frozen before compiling: frozen in the variant too)
            if not isinstance(m, _Pieces):
                m.training = was
        try:  # (traced on fake tensors: the model's own weights, old once this trained, are not read)
            for (param, _, fqn, _) in self._flags:
                param.requires_grad_(fqn not in self._frozen_when_compiled)
            with source_guard.inside(), autocast_off(), autocast_on(self._autocast.state), \
                    torch.inference_mode(False), grad_mode(grad):
                options = pinned_to(self._options, self._shapes, key, self.mesh_spec.shape)
                try:
                    c, _, report = self._recompile(options, args, kwargs, weights=False)
                except SpmdError as e:
                    # an output pin made for the compiled shapes that does not divide these (a batch of 5 split
                    # over 2): dropped, as an input's is (found by a probe: the batch was refused). Every rank
                    # met the same error (planned on rank 0, brought to the others), so every rank retries
                    if not (options.out_placements and re.search(r"pin \S+ for output \d+ cannot be met", str(e))):
                        raise
                    c, _, report = self._recompile(dataclasses.replace(options, out_placements={}), args, kwargs,
                                                   weights=False)
        finally:
            for m, was in modes:
                m.training = was
            for param, was in flags:
                param.requires_grad_(was)
        shapes = Shapes.of(c, self.mesh_spec, self.rank, self._device, report)
        try:
            check_shared(shapes, self._shapes, [self._shapes, *self._variants.values()] if grad == "on" else [])
        except SpmdError as e:
            self._refused_shapes[vkey] = e
            raise
        (self._variants if grad == "on" else self._grad_variants)[vkey] = shapes
        if self.mesh_spec.size > 1 and c.plan.collectives():  # (its calls are collective, as the first plan's may not)
            self._collective_calls = True
        if self.mesh_spec.size > 1 and any(isinstance(p, Replicate) and n > 1 for spec in shapes.input_specs
                                           for p, n in zip(spec.placements, self.mesh_spec.shape)):
            self._replicated_inputs, self._inputs_agreed = True, False  # (checked at its next call)
        return shapes

    def _agree_on_key(self, key: tuple) -> None:
        """Every rank compiling for the same shapes (one all_gather of them), else the ranks' shapes named."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        keys = [None] * dist.get_world_size()
        try:
            dist.all_gather_object(keys, key)
        except RuntimeError as e:  # (a probe: a raw gloo timeout, or a peer aborted by gloo's size check)
            raise SpmdCollectiveError(
                f"this rank got inputs of new shapes ({', '.join(str(list(s)) for s in key)}) and asked its peers "
                f"whether they got the same, and the collective failed or timed out ({e}): a peer that got other "
                "shapes (the compiled ones: an uneven last batch on this rank alone) went on into its graph's own "
                "collectives. What to do: give every rank batches of the same shapes (a DataLoader with "
                "drop_last=True, or a DistributedSampler, whose batches are the same size on every rank).") from e
        if any(k != key for k in keys):
            shown = _shapes_by_rank(keys)
            raise SpmdError(
                f"the ranks got inputs of different shapes ({shown}), none of them the compiled ones: every rank must "
                "take the same global batch (shard_inputs cuts each rank's piece from it), or its own slice of "
                "batches of one size. What to do: give every rank batches of the same shapes (a DataLoader with "
                "drop_last=True, or a DistributedSampler, whose batches are the same size on every rank).")

    @_collective
    def gather_outputs(self, outputs):
        """Full outputs on every rank from this rank's local output shards: the whole output a call returned, or
        any of the last call's output tensors (alone, or in a structure of one's own: `gather_outputs(out.logits)`),
        each gathered in the layout of the output it is."""
        flat, spec = tree_flatten(outputs)
        full = []
        for t, (k, call) in zip(flat, self._output_positions(flat, spec)):
            ps = self._outputs_made.shapes(call, self._shapes).out_placements.get(k) if k is not None else None
            full.append(gather_full(t, ps, self.mesh_spec, self.coord, self.group_names) if ps is not None else t)
            if k in self._state_outputs and full[-1] is not t and not full[-1].is_inference() and not _shares(
                    full[-1], self.piece(self._state_outputs[k])):
                # (the model's own tensor gathered anew: a write into it is refused at the next call, as a write into
                # the returned copy is; a probe clamped a gathered weight, 0.19 off after 3 steps, silently). One held
                # per output, the last gathered, unless an earlier one was written (a review: a loop gathering the
                # same output again held every copy until the next call)
                if not any(e[0] == k and e[3] == "gathered" and e[1]._version != e[2] for e in self._returned_state):
                    self._returned_state = [e for e in self._returned_state if e[0] != k or e[3] != "gathered"]
                    self._returned_state.append((k, full[-1].detach(), full[-1]._version, "gathered"))
        return tree_unflatten(full, spec)

    def _output_positions(self, flat: list, spec) -> list[tuple[int | None, int]]:
        """The output position of each tensor of `flat`, with the call that returned it: one of the last call's outputs by identity or by the
        memory it reads (`out.logits.detach()`), else its place in the whole output when `flat` has the output's
        structure and is an output of an earlier call at that place. A tensor that is neither (a slice or reshape
        of an output, a tensor computed from one, an output of an earlier call given alone) is refused: gathered in
        output 0's layout it came back as this rank's piece (a GPT-2's logits with half the vocabulary, silently;
        found by a probe), and where the output is one tensor, `out.softmax(-1)` of vocabulary-sharded logits
        came back whole in shape and 0.05 off (a probe)."""
        whole = spec in (self._out_spec, *(v.out_spec for v in self._variants.values()))
        positions = []
        for k, t in enumerate(flat):
            made = self._outputs_made.positions(t) if isinstance(t, torch.Tensor) else {}
            last = [j for j, call in made.items() if call == self._outputs_made.calls]
            if not isinstance(t, torch.Tensor):
                positions.append((None, 0))
            elif last:  # (as it came, or `out.logits.detach()`: the output's memory, as it is)
                positions.append((min(last), self._outputs_made.calls))
            elif whole and k in made:  # (an earlier call's, as it came or detached)
                positions.append((k, made[k]))
            else:
                raise SpmdError(
                    f"gather_outputs: tensor {k} of its argument (shape {tuple(t.shape)}) is not one of the last "
                    "call's outputs, nor an output of an earlier call in the whole output's place, so its layout is "
                    "unknown. What to do: "
                    "pass the whole output as the call returned it (`compiled.gather_outputs(out)`, then pick from "
                    "the result), or a tensor of the last call's output as it came or detached (no slice, reshape "
                    "or copy).")
        return positions

    @_collective
    def verify(self, *full_inputs: torch.Tensor, mode: str = "auto", **full_kwargs: torch.Tensor):
        """Check this compiled model against one device before a long run; call it on every rank with
        the same full inputs (as for `shard_inputs`; with the targets when training with a loss_fn).

        Every node of the traced graph is gathered and compared (forward and backward when training;
        the incoming gradient of each output is ones). Returns a `VerifyReport` (the same on every
        rank): the max error of each output and gradient, relative to the reference's magnitude, and
        the first node out of tolerance. `mode`: "one device" runs the single-device graph on rank 0
        alongside; "op by op" checks each op on its own gathered inputs (memory: the largest op);
        "auto" picks "one device" when its run fits half of rank 0's free memory. Weights, gradients
        and optimizer state are left as they were, and so are the random generators. See runtime/compare.py."""
        self._require_values()
        full = self._full_inputs(full_inputs, full_kwargs, "verify")
        self._agree_on_full_inputs(full)
        # (the random generators as they were after it: a model with dropout drew during the check, and the training
        # after it would draw other masks than the same run without it; found by a probe)
        cuda = [self._device] if self._device is not None and self._device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            return compare.verify(self, full, mode)

    def _agree_on_full_inputs(self, full: tuple, caller: str = "verify", sampled: bool = False) -> None:
        """`verify`'s full inputs the same on every rank (it cuts each rank's shard from them and runs the reference
        on rank 0's): inputs drawn unseeded on each rank gave a MISMATCH at the first op that reads them, for a
        module that trains equal to one device (found by a check of the docs' examples). So `shard_inputs`'s, at
        its first call (found by a probe: each rank's shard cut from a batch of its own, the gathered output mixed
        them, 0.56 and 0.79 off, silently)."""
        import torch.distributed as dist

        tensors = [(spec.name, t) for spec, t in zip(self._input_specs, full) if isinstance(t, torch.Tensor)]
        if not dist.is_initialized() or not tensors or torch._guards.detect_fake_mode(full) is not None:
            return
        apart, anywhere = self._values_apart(tensors, lambda axis, k: True, f"{caller}'s full inputs", sampled)
        if anywhere:
            what = ", ".join(f"{name!r} along {axis!r}" for name, axis in apart) or "on other ranks of the mesh"
            if caller == "verify":
                why = ("it takes the same full inputs on every rank, cuts each rank's shard from them and runs one "
                       "device's reference on rank 0's, so its comparison would be of other data")
                other = ""
            else:
                why = ("it takes the same full inputs (the global batch) on every rank and cuts each rank's shard "
                       "from them, so the shards would come from different batches and the outputs mix them")
                other = ("; or, to feed each rank its own slice (a data-parallel loader), pin the input sharded "
                         "(in_placements={name: [Shard(0), ...]}) and pass each rank's slice to the compiled module")
            raise SpmdError(
                f"{caller}'s full inputs differ between ranks ({what}): {why}. What to do: give every rank the same "
                "full inputs (seed the generator alike before drawing random ones: torch.manual_seed(0) on every "
                f"rank; or load the same batch){other}.")

    def _full_inputs(self, args: tuple, kwargs: dict, what: str) -> tuple:
        """Full inputs given by position and keyword, as the graph's flat tuple, checked."""
        flat = self._call.flatten(args, kwargs, what)
        if what == "verify" and (key := variant_key(flat, self._shapes)) is not None:
            raise verify_refusal(key, self._shapes, key in self._variants)
        check_full(flat, self._input_specs)
        return flat

    def _require_values(self, of=None) -> None:
        """Refuse where weights (those named in `of`; None: all) were never given values: a model compiled from
        the meta device, before `init_weights` or a load. Its pieces hold whatever memory they were given:
        computed with, saved or gathered, they would be garbage, without a word."""
        unset = self._uninitialized if of is None else self._uninitialized & set(of)
        if unset:
            names = sorted(unset)
            if set(names) <= set(self._non_persistent):  # (no checkpoint holds them: a load cannot give them)
                raise SpmdError(
                    f"the model was compiled from the meta device and {len(names)} of its buffers have no values yet "
                    f"({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}); they are not persistent, so no "
                    "checkpoint holds them (computed in __init__: a rotary embedding's inv_freq, a relative position "
                    "index, position ids). What to do: "
                    "compiled.init_weights(seed=...) first, which computes them (and draws the weights), then load the "
                    "checkpoint: compiled.load_safetensors(path), or torch.distributed.checkpoint's dcp.load into "
                    "compiled.state_dict() (docs/training.md, the whole loop).")
            raise SpmdError(f"the model was compiled from the meta device and {len(names)} of its parameters and "
                            f"buffers have no values yet ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}). "
                            "What to do: compiled.init_weights(seed=...) (the model's own init, on shards), "
                            "compiled.load_safetensors(path), or torch.distributed.checkpoint's dcp.load into "
                            "compiled.state_dict() (docs/training.md, the whole loop).")

    def _graph(self, which: str, shapes: Shapes | None = None):
        """What runs `which` ("graph": inference; "forward"/"backward": training) of `shapes` (None: the compiled
        shapes'): the graph module, or that module through torch.compile with `compile_backend` (compiled at
        its first call)."""
        shapes = self._shapes if shapes is None else shapes
        gm = shapes.graph_module if which == "graph" else getattr(shapes.split, which)
        if self.compile_backend is None:
            return gm
        return self._compiled(which, shapes, gm, lambda: _OrUncompiled(gm, _runner(gm, self.compile_backend), which))

    def _compiled(self, which: str, shapes: Shapes, gm, make):
        """The compiled form of `which`'s graph `gm` of `shapes`, made by `make()` at the first ask (and again for
        another graph module)."""
        # (the compiled shapes' table is each copy's own, `__deepcopy__`)
        table = self._compiled_graphs if shapes is self._shapes else shapes.graphs
        made = table.get(which)
        if made is None or made[0] is not gm:
            made = table[which] = (gm, make())
        return made[1]

    def _run_emptying(self, which: str, shapes: Shapes, args: list):
        """`which`'s graph of `shapes` run on `args`, a list it empties as it starts, so that each argument lives
        only as long as the graph reads it (`_emptying`; through inductor, `_InductorEmptying`); through another
        torch.compile backend, every argument is held until it returns. (As eager's autograd, a backward that
        fails part-way has let its saved activations go: a retry needs a new forward.)"""
        gm = getattr(shapes.split, which)
        if self.compile_backend == "inductor":
            return self._compiled(which, shapes, gm, lambda: _InductorEmptying(gm, which))(args)
        if self.compile_backend is not None:  # (another backend: held until it returns)
            return self._graph(which, shapes)(*args)
        made = shapes.emptying.get(which)
        if made is None or made[0] is not gm:
            made = shapes.emptying[which] = (gm, _emptying(gm))
        return made[1](args) if made[1] is not None else gm(*args)

    @property
    def last_saved_bytes(self) -> int:
        """Bytes of the activations a training step saves for backward (parameters saved are counted as
        parameters, not here); 0 before the first step. The graph's shapes are fixed, so every step saves
        the same: found at the first (of the graphs of the shapes that call took: an epoch's smaller last batch,
        compiled for apart, saves less)."""
        return self._saved_bytes or 0

    def _graph_args(self, inputs) -> list:
        """The graph's placeholders in order: this rank's parameters and buffers (read from their holders'
        tables, as `getattr` would find them but without its fallback path: ~1 us each) and the inputs."""
        it = iter(inputs)
        try:
            return [table[leaf] if table is not None else next(it) for table, leaf in self._arg_tables]
        except KeyError:  # moved out of the tables (torch.nn.utils.parametrize): as getattr finds it
            return self._moved_state_args(inputs)

    def _refuse_piece_shapes(self, args) -> None:
        """A parameter or buffer of another shape than this rank's piece (the whole tensor put where the piece
        was: `p.data = full`, `torch.func.functional_call(compiled, model.state_dict())`) ran without error where
        its shape happened to fit the graph's ops, and computed something else (a loss 0.22 and 127 off)."""
        wrong = [(self._order_names[k], tuple(args[k].shape), tuple(want))
                 for k, want in zip(self._sharded_at, self._state_shapes) if args[k].shape != want]
        listed = ", ".join(f"{fqn} is {got}, its piece {want}" for fqn, got, want in wrong[:3]) + (
            ", ..." if len(wrong) > 3 else "")
        raise SpmdError(
            f"{len(wrong)} parameter(s) or buffer(s) of the compiled module are not this rank's pieces ({listed}; "
            f"whole: {', '.join(str(self._global_shapes[f]) for f, _, _ in wrong[:3])}). The graph computes on "
            "pieces. What to do: give whole weights through `compiled.load_state_dict(state)` (each rank cuts its "
            "pieces), or hand `torch.func.functional_call` this rank's pieces (`compiled.state_dict()` values' "
            "`.to_local()`), not the model's whole tensors; change a piece in place (`p.copy_(...)`) rather than "
            "through `p.data = ...`.")

    def _moved_state_args(self, inputs) -> list:
        """`_graph_args` where a parameter or buffer is no longer in nn.Module's tables: a parametrization
        (torch.nn.utils.parametrize) computes it on this rank's piece, which is the full computation's
        piece only where the piece is the whole tensor (replicated on every axis)."""
        from torch.distributed.tensor import Replicate

        for (table, leaf), fqn in zip(self._arg_tables, self._order_names):
            if table is not None and leaf not in table and any(
                    not isinstance(p, Replicate) for p in self._state_placements[fqn]):
                raise SpmdError(f"{fqn} is computed by a parametrization (torch.nn.utils.parametrize), but "
                                f"this rank holds a piece of it ({self._state_placements[fqn]}), and the "
                                "parametrization would run on the piece alone. What to do: parametrize the model "
                                "before spmd.compile (the plan then shards what it computes), or pin the "
                                "parameter replicated (param_placements).")
        it = iter(inputs)
        return [getattr(owner, leaf) if owner is not None else next(it) for owner, leaf in self._arg_slots]

    def _agree_on_generators(self) -> None:
        """Every rank's random generator in the same state, before the first call of a graph that draws (it
        draws each dropout mask whole on every rank, and a replicated value's must be the same mask
        everywhere). A rank seeded otherwise (`torch.manual_seed(rank)` for its data, say) would drop other
        elements than its peers, and the replicas would drift apart, silently: every rank raises instead.

        The digests are gathered over each mesh axis's own group: the ranks agree along every axis exactly
        when all of the mesh agrees (its axes connect it), and only the mesh's ranks take part (a module
        compiled over part of the world, or one mesh of several, would hang in a gather over the world). A
        rank whose own axes agree learns that some other rank's do not from a flag reduced along each axis in
        turn (the mesh's maximum), so every rank raises."""
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _resolve_process_group

        if not dist.is_initialized():
            self._generators_agreed = True
            return
        agreed_before = self._generators_agreed
        cuda = self._device is not None and self._device.type == "cuda"
        state = torch.cuda.get_rng_state(self._device) if cuda else torch.get_rng_state()
        apart = []  # (axis name, {digest: [ranks]}) for each axis whose ranks differ
        for axis, (name, size) in enumerate(zip(self.mesh_spec.axis_names, self.mesh_spec.shape)):
            if size == 1:
                continue
            digests = self._gather_digests(axis, [_digest(state)], "random generators")[:, 0].tolist()
            if len(set(digests)) > 1:
                states: dict[int, list[int]] = {}
                group = _resolve_process_group(self.group_names[axis])
                for r, d in zip(dist.get_process_group_ranks(group), digests):  # (the group's ranks in order)
                    states.setdefault(d, []).append(r)
                apart.append((name, states))
        self._generators_agreed = not self._apart_anywhere(bool(apart), "random generators")  # (else asked again)
        if not self._generators_agreed:
            seen = "; ".join(
                f"along mesh axis {name!r}, {len(states)} states among {sum(map(len, states.values()))} ranks: "
                + " | ".join(("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs)) for rs in states.values())
                for name, states in apart) or "along none of this rank's mesh axes, but elsewhere in the mesh"
            since = "" if self._calls <= 1 or not agreed_before else (
                f" at call {self._calls} of this module (they agreed before: some rank has since drawn random numbers "
                "its peers did not, such as sampling on rank 0 alone for a log, or a data loader iterated on one "
                "rank)")
            raise SpmdError(
                f"the ranks' random generators differ ({seen}){since}, and this graph draws random numbers "
                f"({', '.join(_draw_names(self._traced_gm.graph))}): each rank draws them whole, so replicated values (a dropout mask, "
                "noise, timesteps) would come out differently on each rank and the replicas would drift apart. What to "
                "do: seed every rank alike before "
                "the step (torch.manual_seed(seed), the same seed everywhere), and give per-rank work such as "
                "data shuffling or sampling a torch.Generator of its own.")

    def _check_due(self, n: int) -> bool:
        """Whether the ranks' agreement is checked at call `n` (of the module, or of shard_inputs): 1, 2, 4, 8,
        ... and every `_generator_period`-th, the same calls on every rank (each check is collective)."""
        return n & (n - 1) == 0 or n % self._generator_period == 0

    def _agree_on_inputs(self, inputs, specs: list[InputSpec]) -> None:
        """Every input the plan replicates over a mesh axis the same along it, at the first call and at the
        generators' calls after it (`_check_due`): a data-parallel loader feeding each rank a batch of its own,
        where the plan takes the batch whole on every rank, would have each rank train on other data with
        weights it holds in common with its peers, and the replicas would drift apart, silently (and after a
        first call on one batch, a probe found half of each rank's rows dropped at every step). One digest per
        such input (of a sample, after the first call: `_digest`), all_gathered over each axis's group; a flag
        reduced along each axis in turn makes every rank raise."""
        import torch.distributed as dist

        if not dist.is_initialized() or torch._guards.detect_fake_mode(inputs) is not None:
            self._replicated_inputs = False  # (fake tensors, as a CUDA rank planned on this host: no values)
            return
        apart, anywhere = self._values_apart(
            [(spec.name, t) for spec, t in zip(specs, inputs)],
            lambda axis, k: isinstance(specs[k].placements[axis], Replicate), "replicated inputs",
            sampled=self._calls > 1)
        self._inputs_agreed = not anywhere  # (else asked again)
        if not self._inputs_agreed:
            what = ", ".join(f"{name!r} along {axis!r}" for name, axis in apart) or "on other ranks of the mesh"
            at = f" at call {self._calls} of this module" if self._calls > 1 else ""
            dims = {spec.name: t.dim() for spec, t in zip(specs, inputs) if isinstance(t, torch.Tensor)}
            scalars = [name for name, _ in apart if dims.get(name) == 0]
            # (a count such as transformers' `num_items_in_batch`, each rank's own: a number has no slices to pin;
            # found by a probe, told to pin it sharded)
            count = (f" A number ({', '.join(map(repr, scalars))}) cannot be split: give every rank the whole "
                     "batch's (transformers' Trainer does with `average_tokens_across_devices`).") if scalars else ""
            raise SpmdError(
                f"inputs the plan replicates differ between ranks{at} ({what}): every rank must hold the same full "
                "value of a replicated input, or the ranks train on other data with weights they hold in common, "
                "and the replicas drift apart. What to do: give every rank the same global batch and cut it with "
                "compiled.shard_inputs(...); or, to feed each rank its own slice (a data-parallel loader), pin the "
                f"input sharded on that axis (in_placements={{name: [Shard(0), ...]}}) and pass each rank's slice.{count}")

    def _agree_on_call(self, inputs) -> None:
        """The same call on every rank of the mesh, at the checked calls of a module whose graph has collectives:
        the optimizer steps taken over it (`source_guard._count_step`) and the grad, inference and train/eval
        modes. A rank calling it alone (evaluating under no_grad on rank 0 while its peers train) paired its
        collectives with their next call's, and every rank went on wrong from then on (found by a probe: 0.02
        off, no error)."""
        if not dist.is_initialized() or torch._guards.detect_fake_mode(inputs) is not None:
            return  # (fake tensors, as a CUDA rank planned on this host: `_agree_on_inputs`)
        call = torch.tensor([torch.is_grad_enabled(), torch.is_inference_mode_enabled(), self.training,
                             self.__dict__.get("_steps", 0)], dtype=torch.int64)
        apart, anywhere = self._values_apart([("the call", call)], lambda axis, k: True, "calls")
        if anywhere:
            where = f"along {', '.join(repr(axis) for _, axis in apart)}" if apart else "elsewhere in the mesh"
            raise SpmdError(
                f"the ranks made different calls of this module at its call {self._calls} ({where}: the "
                "optimizer steps taken over it, grad mode, inference mode or train/eval mode differ): a rank called "
                "it where its peers did not (evaluating on rank 0 alone while the others train), and the graphs' "
                "collectives paired calls apart, so every rank computed with its peers' other values (the steps "
                "since its last checked call are not to be trusted: resume from a checkpoint). What to do: make "
                "every call of a compiled module on every rank of its mesh (evaluate on all ranks, then log on one), "
                "in the same modes.")

    def _agree_on_shapes(self, inputs: tuple) -> None:
        """Every rank's pieces of the same shapes, at each call of a module compiled for more than one set of input
        shapes (`_variants`, which every rank compiled together): each rank picks its graphs by its own pieces'
        shapes, and a loader's uneven last batch (5 rows over 3 ranks: 2, 2 and 1) had rank 2 run the graphs of an
        earlier batch of 3 while its peers ran the compiled ones; their collectives paired, and every rank trained
        5.4% off with no error (found by a probe). Pieces of one call have the same shapes on every rank (uneven
        pieces are no layout spmd makes), so a digest and its negation, reduced to their maximum over the mesh (the
        ranks' largest digest and smallest), settle it: one all_reduce per mesh axis. Only where they differ are
        the shapes gathered, to name them. With one set of shapes, a rank given others compiles for them, which its
        peers do not join, and that fails loudly (`_agree_on_key`)."""
        if not dist.is_initialized() or torch._guards.detect_fake_mode(inputs) is not None:
            return
        shapes = tuple(tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in inputs)
        digest = _shapes_digest(shapes)
        mine = torch.tensor(digest, dtype=torch.int64, device=self._collective_device())
        largest, smallest = _first_call(
            lambda: extremes_over_mesh(mine, self.mesh_spec.shape, self.group_names), "input shapes")
        if int(largest) == int(smallest):
            return
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, shapes)
        raise SpmdError(
            f"the ranks called this module (call {self._calls}) with pieces of different shapes "
            f"({_shapes_by_rank(every)}): each rank "
            "would run the graphs of its own shapes, and their collectives would pair across graphs. An uneven last "
            "batch cut by hand (5 rows over 3 ranks: 2, 2 and 1) does that. What to do: give every rank pieces of "
            "the same shapes: cut the whole batch with compiled.shard_inputs(...) on every rank (a batch that does "
            "not divide is compiled for whole or refused, never cut unevenly), or use a DataLoader with "
            "drop_last=True or a DistributedSampler, whose batches are the same size on every rank.")

    def _values_apart(self, values: list[tuple[str, torch.Tensor]], compared, what: str,
                      sampled: bool = False) -> tuple[list, bool]:
        """((name, mesh axis) of each of `values` that differs between the ranks along an axis where
        `compared(axis, k)` asks for value k, and whether any rank of the mesh found one): a digest per value,
        all_gathered over each axis's group, and a flag reduced over the mesh, so every rank learns it."""
        apart = []
        for axis, (axis_name, size) in enumerate(zip(self.mesh_spec.axis_names, self.mesh_spec.shape)):
            picked = [k for k in range(len(values)) if size > 1 and compared(axis, k)]
            if picked:
                every = self._gather_digests(axis, [_digest(values[k][1], sampled) for k in picked], what)
                apart += [(values[k][0], axis_name) for j, k in enumerate(picked) if len(set(every[:, j].tolist())) > 1]
        return apart, self._apart_anywhere(bool(apart), what)

    def _collective_device(self) -> torch.device:
        """Where this rank's own small collectives run (`distribute.collective_device`)."""
        return collective_device(self._device)

    def _gather_digests(self, axis: int, digests: list[int], what: str) -> torch.Tensor:
        """Every rank's `digests` along mesh axis `axis`: one row per rank of its group, in the group's order."""
        from torch.distributed import _functional_collectives as funcol

        mine = torch.tensor(digests, dtype=torch.int64, device=self._collective_device())
        # (all_gather_single where torch has it: all_gather_tensor, which torch 2.11 has alone, warns in newer ones)
        gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
        every = _first_call(lambda: funcol.wait_tensor(gather(mine, 0, self.group_names[axis])), what)
        return every.view(self.mesh_spec.shape[axis], len(digests))

    def _apart_anywhere(self, apart_here: bool, what: str) -> bool:
        """Whether any rank of the mesh found its `what` apart from its peers' (a flag reduced over the
        mesh), so that every rank raises, not only those whose own axes saw it."""
        flag = torch.tensor([int(apart_here)], dtype=torch.int64, device=self._collective_device())
        return bool(_first_call(lambda: max_over_mesh(flag, self.mesh_spec.shape, self.group_names), what).item())

    def _update_buffers(self, names, values) -> None:
        """Each buffer of `names` (FQNs) takes its new value, this rank's piece (placed as the buffer): what
        the forward updates in place in eager (batch norm's running statistics), the graph returns."""
        with torch.no_grad():
            for name, value in zip(names, values):
                attr = self._param_names.get(name) or self._param_names[self._aliases[name]]
                piece = self._get(attr)
                if value.shape != piece.shape and value.numel() != piece.numel():
                    # (torch's broadcast error named nothing; found by a probe: QAT's per-channel fake-quant scale)
                    raise SpmdError(
                        f"buffer {name!r} changes its shape in the forward ({list(piece.shape)} when compiled, "
                        f"{list(value.shape)} after the call: a quantization observer's scale sized at its first "
                        "call), and the compiled module holds it at the shape it was compiled with. What to do: run "
                        "the model once before spmd.compile (`model(example)`), so that it has its final shape.")
                piece.copy_(value)
        if names:
            source_guard.buffers_moved(self, names)  # (the model's own buffers, its siblings' copies, are behind now)

    def _check_input_grads(self, inputs, shapes: Shapes) -> None:
        """An input that requires grad, where the step was traced without its gradient: autograd would leave
        it (and the layers that made it) without one, silently. Its example input must have required grad."""
        for t, name in zip(inputs, self._input_names):
            if isinstance(t, torch.Tensor) and t.requires_grad and name not in shapes.traced_with_grad:
                raise SpmdError(
                    f"input {name!r} requires grad, but the compiled step was traced from an example {name!r} "
                    "that did not, so it computes no gradient for it (the layers before it would not train). "
                    "What to do: pass an example input that requires grad (`x.requires_grad_()`) to "
                    "spmd.compile, or `.detach()` the input where its gradient is not wanted.")
        if not self._inputs_walked:
            self._inputs_walked = True
            self._refuse_inputs_from_held_parameters(inputs)

    def _refuse_inputs_from_held_parameters(self, inputs) -> None:
        """An input computed, outside, from one of the model's parameters that this module holds as pieces (an
        eager embedding tied to the compiled head: `spmd.compile(model.dec)` with `model.emb.weight is
        model.dec.head.weight`). The outside use reads the original tensor, which an optimizer over the compiled
        module's pieces never steps, and its gradient lands there: the embedding read stale weights, 0.069 off
        after 3 steps (found by a probe). Walked once, at the first call that takes a gradient."""
        held = {id(p): n for n, p in self._source_model.named_parameters(remove_duplicate=False)}
        for t, name in zip(inputs, self._input_names):
            if not (isinstance(t, torch.Tensor) and t.grad_fn is not None):
                continue
            seen, todo = set(), [t.grad_fn]
            while todo and len(seen) < 100_000:
                fn = todo.pop()
                if fn is None or fn in seen:
                    continue
                seen.add(fn)
                variable = getattr(fn, "variable", None)  # (AccumulateGrad: a leaf's)
                if variable is not None and id(variable) in held:
                    raise SpmdError(
                        f"input {name!r} is computed, outside this compiled module, from the model's parameter "
                        f"{held[id(variable)]!r}, which this module holds as pieces: that use reads the original "
                        "tensor, which an optimizer over the compiled module's parameters never steps, and its "
                        "gradient goes there, not to the pieces (a tied embedding read stale weights). What to do: "
                        "compile the whole computation that uses the parameter (the embedding inside the compiled "
                        "module: spmd.compile(model) with a loss_fn), or untie the parameter before compiling.")
                todo.extend(f for f, _ in fn.next_functions)

    def _ops_differ_by_mode(self) -> str | None:
        """What the traced forward does in only one mode, found by running it in both on fake tensors
        (runtime/mode_check.py): code that reads `self.training` itself (`F.dropout(x, p, self.training)`),
        which `_mode_dependent` cannot see. Asked once."""
        if self._mode_checked is False:
            inputs = [(spec.shape, spec.dtype) for spec in self._input_specs]
            with source_guard.inside():
                self._mode_checked = ops_differ_by_mode(self._traced_root, inputs)
        return self._mode_checked

    def _grad_off(self) -> str | None:
        """For a call with grad off, to a module whose forward asks whether grad is on (`torch.is_grad_enabled()`,
        or inference mode): "no_grad" or "inference_mode" where the forward runs other ops so than with grad on,
        as every graph is traced (found on fake tensors, once for each: `ops_differ_by_grad`), else None. An
        inference module then runs graphs traced in that mode (`_compile_variant`); a training module's graph,
        or one that cannot compile again, would compute the grad-on branch, and is refused."""
        inference = torch.is_inference_mode_enabled()
        if inference not in self._grad_differs:
            inputs = [(spec.shape, spec.dtype) for spec in self._input_specs]
            with source_guard.inside():
                self._grad_differs[inference] = ops_differ_by_grad(self._traced_root, inputs, inference)
        if not self._grad_differs[inference]:
            return None
        if self.split is None and self._recompile is not None:
            return "inference_mode" if inference else "no_grad"
        way = ("call it with grad on (outside no_grad or inference_mode; the outputs can be detached), or compile "
               "the model for inference (training=False) for such calls, which then runs graphs traced in that mode"
               if self.split is not None else "call it with grad on (outside no_grad or inference_mode)")
        raise SpmdError(
            f"{self._grad_reader} asks torch whether grad is on (`torch.is_grad_enabled()` or "
            f"`torch.is_inference_mode_enabled()`), and its forward computes otherwise with grad off "
            f"({self._grad_differs[inference]}); the compiled graph was traced with grad on, so this call, under "
            f"{'torch.inference_mode()' if inference else 'torch.no_grad()'}, would compute the grad-on branch. "
            f"What to do: {way}, or make the branch depend on something the graph takes, the module's mode "
            "(`self.training`, with a module compiled in each mode) or an input.")

    def _refuse_other_flags(self, inputs: tuple, shapes: Shapes) -> None:
        """Raise where a forward that reads a tensor's `requires_grad` runs other ops for this call's inputs, some
        flagged otherwise than the example inputs the graph was traced from, than for those (found on fake tensors,
        once per flag pattern): the graph would compute the example's branch (a probe: 0.77 off, silently)."""
        now, traced = requires_grad_flags(inputs), shapes.input_flags
        if now == traced or len(now) != len(traced):
            return
        if (traced, now) not in self._flags_differ:
            specs = [(spec.shape, spec.dtype) for spec in shapes.input_specs]
            with source_guard.inside():
                self._flags_differ[traced, now] = ops_differ_by_input_grads(self._traced_root, specs, traced, now)
        differs = self._flags_differ[traced, now]
        if not differs and self._reentrant and self.split is not None and any(a and not b for a, b in zip(traced, now)):
            # (in torch's code, which the fake run does not tell apart: what it runs trains or not; a review)
            differs = "a reentrant checkpoint gives what it runs a gradient only where one of its inputs requires grad"
        if not differs:
            return
        name, was = next((spec.name, a) for spec, a, b in zip(shapes.input_specs, traced, now) if a != b)
        raise SpmdError(
            f"{self._flag_reader} reads a tensor's requires_grad, and its forward computes otherwise when input "
            f"{name!r} {'does not require' if was else 'requires'} grad, as at this call, than when it "
            f"{'does' if was else 'does not'}, as the example input did ({differs}): the compiled graph keeps the "
            f"example's branch. What to do: pass {name!r} flagged as the example was ("
            f"{f'`{name}.requires_grad_()`' if was else f'`{name}.detach()`'}), or compile a module for these calls "
            f"from an example {name!r} flagged as theirs, or make the branch depend on something the graph takes "
            "(an input's value, the module's mode).")

    def _refuse_other_frozen(self) -> None:
        """As `_refuse_other_flags`, for the parameters frozen since compiling, or unfrozen (`if self.fc.weight.
        requires_grad:`; a review: 0.94 off after freezing on the model, silently)."""
        traced = frozenset(fqn for _, _, fqn, _ in self._flags if fqn in self._frozen_when_compiled)
        now = frozenset(fqn for _, piece, fqn, _ in self._flags if not piece.requires_grad)
        if now == traced:
            return
        if now not in self._flags_differ:
            ids = {fqn: id(param) for param, _, fqn, _ in self._flags}
            inputs = [(spec.shape, spec.dtype) for spec in self._input_specs]
            with source_guard.inside():
                self._flags_differ[now] = ops_differ_by_frozen(
                    self._traced_root, inputs, frozenset(ids[f] for f in traced), frozenset(ids[f] for f in now))
        if self._flags_differ[now]:
            fqn = sorted(now ^ traced)[0]
            raise SpmdError(
                f"{self._flag_reader} reads a tensor's requires_grad, and its forward computes otherwise with "
                f"{fqn} {'frozen' if fqn in now else 'trainable'}, as now, than as it was compiled "
                f"({self._flags_differ[now]}): the compiled graph keeps the branch of the compile. What to do: compile "
                f"the model again with its parameters frozen as now (where this module has trained, copy its weights "
                f"into the model first, `{source_guard.COPY_BACK}`, on every rank), or make the branch depend on "
                "something the graph "
                "takes (an input's value, the module's mode).")

    def _refuse_another_mode(self) -> None:
        """Raise where this module (`.eval()` on it) or the model it was compiled from (`model.eval()` after
        compiling, with no live module compiled from it in that mode) is in the other mode than the traced one,
        and the graph does what the traced mode does."""
        by_module = self.training != self._traced_mode
        if not by_module and not self._model_mode_unexplained():
            return
        reason = self._mode_dependent or self._ops_differ_by_mode()
        if not reason:
            return
        traced, now = ("train", "eval") if self._traced_mode else ("eval", "train")
        if by_module:
            raise SpmdError(
                f"this module was compiled from the model in {traced} mode, and its graph does what that mode "
                f"does ({reason}); .{now}() does not change a compiled graph, so this call would "
                f"run in {traced} mode. What to do: compile the model in {now} mode for this use "
                f"(spmd.compile(model.{now}(), ...); where this module has trained, copy its weights into the "
                f"model first, `{source_guard.COPY_BACK}`, on every rank), or call .{traced}() on this "
                "module again.")
        raise SpmdError(
            f"the model this module was compiled from in {traced} mode is in {now} mode now (`model.{now}()` "
            f"after compiling), and this module's graph does what {traced} mode does ({reason}): a compiled "
            f"graph keeps the mode it was traced in, so this call would run in {traced} mode. What to do: "
            f"to use it in {now} mode, compile the model in that mode (spmd.compile(model.{now}(), ...); where "
            f"this module has trained, copy its weights into the model first, `{source_guard.COPY_BACK}`, on every "
            f"rank); to go on with this module, put the model back, `model.{traced}()`.")

    def _submodule_switched(self) -> None:
        """Raise, naming the first module whose forward reads its mode and was switched alone since compiling
        (`model.norm.eval()`, `compiled.drop.train()`): the graph does what its traced mode does (its running
        statistics or dropout), silently."""
        switched = [(m, path, was) for m, path, was in self._modes if m.training is not was]
        m, path, was = switched[0]
        traced, now = ("train", "eval") if was else ("eval", "train")
        who, owner = ("the compiled module's", "compiled") if isinstance(m, _Pieces) else ("the model's", "model")
        kind = type(self._source_model.get_submodule(path)).__name__
        how = f"`{_module_ref(owner, path)}.{now}()`" + (
            f", or `{owner}.{now}()`, which sets every module's mode as `model.{now}()` does" if isinstance(m, _Pieces)
            else "")
        others = list(dict.fromkeys(p for _, p, _ in switched[1:] if p != path))
        also = f" (and {', '.join(f'`{p}`' for p in others[:3])}{', ...' if len(others) > 3 else ''})" if others else ""
        raise SpmdError(
            f"{who} `{path}` ({kind}){also} was switched to {now} mode after compiling ({how}"
            f"), and it was in {traced} mode when traced: its forward reads its mode (dropout, batch "
            f"norm's statistics), and the compiled graph does what {traced} mode did, so this call would run it "
            f"in {traced} mode. What to do: compile the model with its modules in the modes you want "
            f"(`{_module_ref('model', path)}.{now}()` before spmd.compile; where this module has trained, copy its "
            f"weights into the model first, `{source_guard.COPY_BACK}`, on every rank), or put it back "
            f"(`{_module_ref(owner, path)}.{traced}()`).")

    def _model_mode_unexplained(self) -> bool:
        """The model in the other mode than this module was traced in, not the mode the last compile from it
        left it in, and no live module compiled from it in that mode (`spmd.compile(model.eval(), ...)` beside a
        training module leaves the model in eval mode, also once that module is gone): the user's
        `model.eval()`, which this module would not follow."""
        mode = self._source_model.training
        if _last_compiled_mode.get(self._source_model) == mode:
            return False  # as the last compile left it
        return not any(c is not self and c._traced_mode == mode
                       for c in _compiled_modules.get(self._source_model, ()))

    def _follow_requires_grad(self, strict: bool = True) -> None:
        """A `requires_grad` the model's parameter changed since the last call goes to its piece (freezing: no
        gradient accumulates; unfreezing: where the graph computes the gradient, else an error). Also at each
        `parameters()` / `named_parameters()` (`strict=False`: an unfreezing the graph cannot follow is left to the
        next call's error), so the optimizer a loop builds right after freezing or unfreezing on the model, from
        `[p for p in compiled.parameters() if p.requires_grad]`, holds what one device's would (a probe: the
        unfrozen layer was left out and never trained, 0.148 off; a frozen one went in and decayed, 0.033 off).
        One set on the piece since (`compiled.fc.requires_grad_(False)`) goes to the model's parameter, so the two
        stay one flag, as one tensor's: a layer frozen on the compiled module and unfrozen on the model stayed
        frozen, and one unfrozen on the compiled module and frozen again on the model stayed trainable (a probe:
        0.014 off after 6 steps, silently). A copy (`copy.deepcopy(compiled)`, an EMA) follows neither way: its
        flags are its own."""
        if strict:
            for piece, fqn in self._frozen_pieces:  # (unfrozen on the compiled module itself: its piece's flag)
                if piece.requires_grad:
                    raise _unfrozen(fqn, "on the compiled module (its parameter's requires_grad_(True))")
        if not self._flags_shared:  # (a copy's flags are its own: an EMA copy frozen stays frozen; a review)
            return
        for k, (param, piece, fqn, was) in enumerate(self._flags):
            now = param.requires_grad
            if now is was:
                if piece.requires_grad is not now and not (piece.requires_grad and fqn in self._frozen_when_compiled):
                    now = piece.requires_grad  # (set on the compiled module: the model's follows)
                    param.requires_grad_(now)
                    self._flags[k] = (param, piece, fqn, now)
                continue
            if now and fqn in self._frozen_when_compiled:  # (one no gradient reaches is only set: none comes)
                if not strict:
                    continue
                raise _unfrozen(fqn, "on the model")
            piece.requires_grad_(now)
            self._flags[k] = (param, piece, fqn, now)

    # torch.compile around this module (or a model holding it) runs it as it is: dynamo does not trace its
    # runtime (guards, copy-back, collectives' bookkeeping; tracing it recursed without end). The rank graphs
    # themselves go through torch.compile with `compile_graphs=True`
    @torch.compiler.disable
    def forward(self, *inputs: torch.Tensor, **kw_inputs: torch.Tensor):
        if torch._C._functorch.peek_interpreter_stack() is not None:
            _refuse_functorch()
        self._attributes.check()
        self._autocast.check()
        source_guard.stale(self)  # (another module compiled from the same model trained; this one did not)
        source_guard.written_across_plans(self, _all_compiled)  # (an EMA teacher of another plan than its student)
        source_guard.model_changed(self)  # (the model given new weights after compiling, before this trained)
        source_guard.hooks_changed(self)  # (hooks on the model added after compiling, or removed)
        source_guard.buffers_changed(self)  # (the model's buffers set after compiling, which this holds copies of)
        if self._flags:
            self._follow_requires_grad()
        grad_off = self._grad_off() if self._grad_reader is not None and not torch.is_grad_enabled() else None
        if self.training != self._traced_mode or self._source_model.training != self._traced_mode:
            self._refuse_another_mode()
        elif any(m.training is not was for m, _, was in self._modes) and \
                (self._mode_dependent or self._ops_differ_by_mode()):
            self._submodule_switched()  # (one whose switch changes nothing, a dropout of 0, may switch)
        elif _last_compiled_mode.get(self._source_model, self._traced_mode) != self._traced_mode:
            # the model is back in this module's mode since a compile in the other one: its next switch is
            # the user's (`model.eval()` to evaluate with this module), no longer what that compile left
            del _last_compiled_mode[self._source_model]
        self._require_values()
        if self._state_outputs and (self._returned_state or self._on_live_mesh()):  # (a check every rank makes)
            self._refuse_lost_writes()
        self._calls += 1
        if self.split is None and torch.is_grad_enabled() and self._fast_path_warning is None:
            self._warn_fast_path_with_grad()
        due = self._check_due(self._calls)
        if self._calls == 1 or due:
            self._refuse_data_parallel_wrap()
        if self._draws and (not self._generators_agreed or due):
            self._agree_on_generators()
        inputs = self._call.flatten(inputs, kw_inputs)
        if self._variants and self._collective_calls:  # (any of its graphs': `_compile_variant` sets it)
            self._agree_on_shapes(inputs)
        if self._shapes.check.accepts(inputs):
            shapes = self._shapes
        else:
            try:
                with _quiet_meta_failures():
                    shapes = self._shapes_taking(inputs)
            except Exception:
                # (a piece laid out otherwise than taken has another local shape: say that, rather than what the
                # trace of a variant for its shape met; found by a probe. Plain tensors only: a DTensor has its own
                # refusal, which the lookup would hide)
                if _laid_out and all(type(t) is torch.Tensor for t in inputs if isinstance(t, torch.Tensor)):
                    try:
                        self._check_layouts(inputs, self._shapes)
                    except SpmdError as e:
                        raise e from None  # (the variant's failure is not the story: a probe got both tracebacks)
                raise
        if grad_off is not None:
            shapes = self._grad_variants.get((grad_off, shapes.key)) or self._compile_variant(
                tuple(torch.empty(shape, dtype=spec.dtype, device="meta")
                      for shape, spec in zip(shapes.key, shapes.input_specs)), shapes.key, grad_off)
        self._cut_pieces.check(inputs, shapes.input_specs)
        if _laid_out:
            self._check_layouts(inputs, shapes)
        if due and self._collective_calls:
            self._agree_on_call(inputs)
        if self._replicated_inputs and (not self._inputs_agreed or due):
            self._agree_on_inputs(inputs, shapes.input_specs)
        if self.split is not None and torch.is_grad_enabled():
            self._check_input_grads(inputs, shapes)
            if not self._warned_plain_pieces and (self._calls == 1 or due):
                self._warn_plain_parameters_on_pieces(inputs, shapes)
        if self._flag_reader is not None:
            self._refuse_other_flags(inputs, shapes)
            if self._flags:
                self._refuse_other_frozen()
        args = self._graph_args(inputs)
        if tuple(t.shape for t in self._state_at(args)) != self._state_shapes:
            self._refuse_piece_shapes(args)
        with autocast_off():  # (the graph's casts are the trace's: autocast must not cast its ops again)
            flat = self._run_graphs(args, shapes)
        self._cut_pieces.seen(inputs)
        self._outputs_made.record(flat, shapes if shapes is not self._shapes else None)
        self._lay_out(flat, shapes)
        if self._state_outputs:
            # (detached: the same version counter, without the call's graph and what its forward saved; not an
            # inference tensor, which keeps no version)
            self._returned_state = [(k, flat[k].detach(), flat[k]._version, "returned")
                                    for k, fqn in self._state_outputs.items()
                                    if k < len(flat) and isinstance(flat[k], torch.Tensor) and not flat[k].is_inference()
                                    and not _shares(flat[k], self.piece(fqn))]
        return tree_unflatten(list(flat), shapes.out_spec)

    def _refuse_lost_writes(self) -> None:
        """The last call returned a copy of a parameter the forward returns (a training graph's: its gradient reaches
        the parameter only so), where eager returns the parameter itself; written into in place since (a learnable
        temperature clamped through the output), the write went nowhere (a probe: 0.27 off after 3 steps, silently).
        Refused at the next call, before the write's absence changes anything more."""
        returned, self._returned_state = self._returned_state, []
        written = [(k, how) for k, t, version, how in returned if t._version != version]
        # (every rank refuses together: a write on some ranks alone, a loop's rank-0 handling of gathered outputs,
        # raised there while the others went into the call's collectives; a review)
        if self._on_live_mesh() and self._apart_anywhere(bool(written), "the check of writes into returned state") \
                and not written:
            raise SpmdError("another rank wrote into an output of a call that is the model's own parameter or buffer "
                            "(after gather_outputs, or the returned copy), which changes nothing in the model. What to "
                            "do: write into the parameter itself on every rank (`compiled.get_parameter(name)`), or "
                            "clone the output before writing into it.")
        for k, how in written[:1]:
            fqn = self._state_outputs[k]
            made = ("the compiled module returned a copy of its piece (in training, so that its gradient reaches the "
                    "parameter)" if how == "returned" else
                    "gather_outputs gathered it into a new tensor (the module holds pieces)")
            kind = "parameter" if isinstance(self.piece(fqn), nn.Parameter) else "buffer"
            when = "since" if how == "returned" else "after gather_outputs"
            raise SpmdError(
                f"output {k} of {'the last call' if how == 'returned' else 'a call'}, the model's {fqn!r} (the forward "
                f"returns it), was written into in place {when}; {made}, where eager returns the tensor itself, so the "
                f"write changed nothing in the model. What to do: write into the {kind} itself, under "
                f"torch.no_grad() (`compiled.get_{kind}({fqn!r})`, e.g. `.clamp_(...)`: each rank its piece), or make "
                "the change in the forward; for a scratch copy, `.clone()` the output before writing into it.")

    def _shapes_taking(self, inputs: tuple) -> Shapes:
        """The graphs whose pieces `inputs` are: another set of input shapes' (compiled by `shard_inputs`, or here
        for the full shapes of which they are pieces in the compiled layouts: every rank's slice of a smaller last
        batch); else the compiled shapes' check refuses them, with its reasons."""
        key = full_key(inputs, self._shapes, self.mesh_spec.shape) if self._recompile is not None else None
        if key is not None and any(tuple(t.shape) == spec.shape != spec_local for t, spec, spec_local in zip(
                inputs, self._input_specs, self._shapes.check.expected_shapes())):
            key = None  # (the whole compiled input where this rank takes its piece: the mistake `check_local` names)
        for shapes in self._variants.values():  # (no two sets take pieces of the same shapes: `check_shared`)
            if shapes.check.accepts(inputs):
                if key is not None and shapes.key != key and self._replicated_inputs:
                    # pieces in the compiled layouts (a loader's slices) that a set taking its inputs whole would
                    # take too: checked for agreement at this call, not only at the due ones (a review)
                    self._inputs_agreed = False
                return shapes
        if key is not None:
            examples = tuple(torch.empty(shape, dtype=t.dtype, device="meta") for shape, t in zip(key, inputs))
            try:
                shapes = self._variants.get(key) or self._compile_variant(examples, key)
            except SpmdError as e:  # (its own refusals, `shard_inputs: ...`, and the ranks' disagreement say enough)
                if type(e) is not SpmdError or str(e).startswith(("shard_inputs:", "the ranks got inputs of different")):
                    raise
                raise self._pieces_read_as(inputs, key, e) from e
            if shapes.check.accepts(inputs):
                return shapes
        self._shapes.check(inputs)
        raise SpmdInternalError("LocalCheck refused inputs that check_local accepts")

    def _pieces_read_as(self, inputs: tuple, key: tuple, error: SpmdError) -> SpmdError:
        """`error`, met compiling for the full shapes `key` that a call's inputs of new shapes were read as pieces of,
        prefixed with that reading: each rank's slice of a batch for an input the plan takes whole (Replicate) read
        as a whole batch of half the rows beside the other inputs' full ones, and the user got a trace error about
        batch sizes from inside their model (found by a probe)."""
        if "were read as this rank's pieces" in str(error):
            return error
        reading = "; ".join(
            f"{spec.name} {list(t.shape)} as a piece of {list(shape)} {placements_str(spec.placements)}"
            for t, spec, shape in zip(inputs, self._shapes.input_specs, key) if isinstance(t, torch.Tensor))
        whole = [spec.name for spec in self._shapes.input_specs
                 if all(not isinstance(p, Shard) for p in spec.placements)]
        hint = (f" The plan takes {', '.join(whole)} whole on every rank: a rank's own slice of it is no piece (pass "
                "the whole batch through compiled.shard_inputs, or pin the inputs split, in_placements)."
                if whole and len(whole) < len(key) else "")
        return SpmdError(f"this call's inputs, of other shapes than the compiled ones, were read as this rank's pieces "
                         f"of inputs laid out as compiled ({reading}), and compiling for those shapes failed.{hint} "
                         f"The failure: {error}")

    def _warn_fast_path_with_grad(self) -> None:
        """Warn (once) where this inference graph gives an nn.TransformerEncoder's padded positions eager's zeros
        under no_grad (passes/encoder_fast_path.py) and this call has grad on, with parameters requiring it: eager
        takes the standard path there (a review: 2.43 off at padded positions)."""
        from spmd.passes.encoder_fast_path import emulated

        found = [path or type(m).__name__ for path, m in self._source_model.named_modules()
                 if isinstance(m, nn.TransformerEncoder) and m.layers in emulated
                 and any(p.requires_grad for p in m.parameters())]
        self._fast_path_warning = bool(found)
        if found:
            warnings.warn(
                f"{found[0]} (nn.TransformerEncoder): this compiled inference graph gives its padded positions the "
                "zeros eager gives under torch.no_grad() (its nested-tensor fast path), and this call has grad on "
                "with parameters that require it, where eager takes the standard path and gives other values there "
                "(the positions that are not padded agree). What to do: call it under torch.no_grad() or "
                "torch.inference_mode(), as an evaluation does, or leave the padded positions out of what you use.",
                stacklevel=user_stacklevel())

    def _warn_plain_parameters_on_pieces(self, inputs: tuple, shapes: Shapes) -> None:
        """Warn (once) where an input this training call takes split is this rank's piece computed by plain
        parameters (an eager layer between two compiled modules, run on the first one's output piece): their
        gradients then hold this rank's piece's part alone, where one device's hold the whole batch's. The ranks'
        replicas drift apart, silently, and under DDP (which averages) they are 1/n of one device's, since a
        compiled loss is the whole batch's (found by a probe: 0.016 off one device after 3 steps; 0.025 under DDP).
        Looked for in the autograd graph behind the input, back to the last compiled module's step; an input
        `shard_inputs` cut (from a whole tensor) is not looked at."""
        names = self.mesh_spec.axis_names
        for t, spec in zip(inputs, shapes.input_specs):
            if not isinstance(t, torch.Tensor) or t.grad_fn is None or t in _cut_by_shard_inputs or \
                    _laid_out.get(t) is not None:
                continue
            split = [names[a] for a, p in enumerate(spec.placements)
                     if isinstance(p, Shard) and self.mesh_spec.shape[a] > 1]
            found = _plain_parameters_behind(t) if split else []
            if found:
                self._warned_plain_pieces = True
                shapes_said = ", ".join(str(tuple(p.shape)) for p in found[:4]) + (", ..." if len(found) > 4 else "")
                warnings.warn(
                    f"input {spec.name!r} of this training call is this rank's piece ({placements_str(spec.placements)}"
                    f", split over {', '.join(split)}), computed from {len(found)} plain parameter(s) of shape "
                    f"{shapes_said} outside the compiled modules: each rank's gradients for them come from its own "
                    "piece alone, where one device's come from the whole batch, so their replicas drift apart (and "
                    "DDP's average makes them 1/n of one device's: the compiled loss is the whole batch's). What to do: "
                    "run such layers on whole tensors, `this(*this.shard_inputs(layer(other.gather_outputs(out))))`, "
                    "or sum their gradients over the ranks holding other pieces after backward, a sum over "
                    f"{', '.join(split)} (`torch.distributed.all_reduce(p.grad, group=mesh.get_group({split[0]!r}))`"
                    f"{', and likewise over each axis' if len(split) > 1 else ''}: over the whole world, a "
                    "replicated axis would count each piece again).", stacklevel=user_stacklevel())
                return

    def _lay_out(self, flat, shapes: Shapes) -> None:
        """Each output piece's layout, for a compiled module it is handed to next (`_check_layouts`)."""
        layouts = shapes.laid_out
        if layouts is None:
            layouts = shapes.laid_out = {k: self._layout_key(ps) for k, ps in shapes.out_placements.items()}
        mesh = (tuple(self.group_names), tuple(self.mesh_spec.shape))
        for k, t in enumerate(flat):
            if isinstance(t, torch.Tensor) and k in layouts:
                _laid_out.record(t, (mesh, layouts[k]))

    def _layout_key(self, placements) -> tuple:
        """`placements` with every axis of size 1 as Replicate (there every layout is the whole tensor; a review
        found `[S(0)]` into `[R]` refused on a mesh of one device)."""
        return tuple(Replicate() if n == 1 else p for p, n in zip(placements, self.mesh_spec.shape))

    def _check_layouts(self, inputs: tuple, shapes: Shapes) -> None:
        """A piece another compiled module returned, handed over as it is, must be laid out as this module takes
        that input: on a (2, 2) mesh an output `[S(0), S(1)]` and an input `[S(1), S(0)]` have the same local
        shape, and each rank took its piece of another part of the tensor (losses 1.0056 where eager gave 1.0118;
        found by a probe)."""
        mesh = (tuple(self.group_names), tuple(self.mesh_spec.shape))
        for t, spec in zip(inputs, shapes.input_specs):
            made = _laid_out.get(t) if isinstance(t, torch.Tensor) else None
            if made is None:
                continue
            mine = self._layout_key(spec.placements)
            if made[0] == mesh:
                apart = made[1] != mine
            else:  # (a module on another mesh over the same ranks: a probe's (2, 2) of its own groups, 0.13 off)
                apart = not _same_pieces(tuple(t.shape), made[1], made[0][1], mine, mesh[1])
            if apart:
                there = "" if made[0] == mesh else f" on mesh {made[0][1]}"
                raise SpmdError(
                    f"input {spec.name!r} is a piece a compiled module returned (this one or another), laid out as "
                    f"{placements_str(made[1])}{there}, and this module takes it as {placements_str(spec.placements)}"
                    f"{'' if made[0] == mesh else f' on mesh {mesh[1]}'}: each rank would read its piece of another "
                    "part of the tensor. What to do: pass producer.gather_outputs(out) through this module's "
                    "shard_inputs(...), or pin the two alike (out_placements on the producer, in_placements here).")

    def _refuse_data_parallel_wrap(self) -> None:
        """A compiled module called from torch's DistributedDataParallel that manages its parameters: DDP's
        broadcast at its construction wrote rank 0's pieces over every other rank's (each rank holds its own
        piece), and its reducer averages gradients of different pieces (weights 0.48 off after 3 steps, silently;
        found by a probe). Looked for in the calling frames at the first call and the checked ones after."""
        import sys

        from torch.nn.parallel import DistributedDataParallel as DDP

        codes = (DDP.forward.__code__, getattr(DDP, "_run_ddp_forward", DDP.forward).__code__)
        frame, mine = sys._getframe(2), None
        while frame is not None:  # (every calling frame: a compiled module nested deep in the DDP'd model; a review)
            if frame.f_code in codes:
                ddp = frame.f_locals.get("self")
                managed = getattr(ddp, "_module_parameters", None)
                mine = mine or {id(p) for p in self.parameters()}
                if managed is None or any(id(p) in mine for p in managed):
                    raise SpmdError(_DDP_OVER_PIECES + " Reload the weights first: the broadcast has already "
                                    "written them.")
            frame = frame.f_back

    def _run_graphs(self, args: list, shapes: Shapes) -> list:
        if shapes.split is None:
            anchor = next((t for t in args if isinstance(t, torch.Tensor) and t.requires_grad), None) \
                if torch.is_grad_enabled() else None
            if anchor is None:
                flat = self._graph("graph", shapes)(*args)
            else:  # autograd would go back through the collectives as if they were not there: the graph runs
                flat = _ForwardOnly.apply(self, shapes, anchor, *args)  # unrecorded, and its backward says so
            if shapes.buffer_updates:
                self._update_buffers([name for _, name in shapes.buffer_updates],
                                     [flat[k] for k, _ in shapes.buffer_updates])
                flat = [flat[k] for k in shapes.user_outputs]
        else:
            flat = _RankStep.apply(self, shapes, *args)
        return flat


class CompiledContainer(_Indexed, CompiledModule):
    """The compiled module of an `nn.Sequential`, `nn.ModuleList` or `nn.ModuleDict`, indexed and iterated as the
    model is (`compiled[0]`, `compiled[-1]`, `len(compiled)`, `for part in compiled`; a dict's keys): known since
    session 84, `compiled[0]` said "not subscriptable". Only such a root is a container: any other compiled module
    has no `__iter__` or `__len__`, as its model has none (a review: `torch.optim.SGD(compiled)` then read as an
    iteration)."""

    def _container(self) -> "nn.Module | None":
        return self.__dict__.get("_source_model")

    def _container_path(self) -> str:
        return ""


def compiled_module_class(model) -> type:
    """`CompiledContainer` for a model that is a container, else `CompiledModule`."""
    return CompiledContainer if isinstance(model, (nn.Sequential, nn.ModuleList, nn.ModuleDict)) else CompiledModule


def _outputs_of_state(c) -> dict[int, str]:
    """{output position: FQN} of the user's outputs that are a parameter or buffer itself, or a view of one
    (a DINO center returned from the forward, which eager's caller may update in place)."""
    from spmd.passes.trace_module import flat_outputs

    state = {gi.placeholder: gi.name for gi in c.traced.inputs if gi.kind in ("parameter", "buffer")}
    found = {}
    for node, kind in zip(flat_outputs(c.traced.graph.output_node()), c.traced.output_kinds()):
        if kind.kind != "output":
            continue
        if isinstance(node, torch.fx.Node) and node.meta.get(OUTPUT_COPY):
            node = node.args[0]  # (the trace's copy of an output that is a parameter: `trace_joint._with_own_outputs`)
        while isinstance(node, torch.fx.Node) and node.op == "call_function" and is_view(node.target):
            node = node.args[0]
        if isinstance(node, torch.fx.Node) and node.op == "placeholder" and node.target in state:
            found[int(kind.name.rsplit("_", 1)[1])] = c.traced.aliases.get(state[node.target], state[node.target])
    return found


class _LaidOut:
    """Output pieces -> (their module's mesh groups, their layout), for every compiled module, by the memory they
    read (`out.detach()` hands over the same piece; a review), while that memory lives: a piece handed to another
    module is taken in that module's layout (`CompiledModule._check_layouts`)."""

    def __init__(self):
        self._by_memory: dict[tuple, tuple] = {}
        self._prune_at = 64

    def __bool__(self) -> bool:
        return bool(self._by_memory)

    def record(self, t: torch.Tensor, layout: tuple) -> None:
        if (memory := _memory_of(t)) is None:
            return
        if len(self._by_memory) > self._prune_at:
            self._by_memory = {m: e for m, e in self._by_memory.items() if not e[0].expired()}
            self._prune_at = max(64, 2 * len(self._by_memory))
        self._by_memory[memory] = (StorageWeakRef(t.untyped_storage()), layout)

    def get(self, t: torch.Tensor):
        if (memory := _memory_of(t)) is None:
            return None
        entry = self._by_memory.get(memory)
        return entry[1] if entry is not None and not entry[0].expired() else None


_laid_out = _LaidOut()
_cut_by_shard_inputs = WeakIdKeyDictionary()  # the pieces `shard_inputs` returned (cut from a whole tensor)


def _plain_parameters_behind(t: torch.Tensor, limit: int = 4096) -> list[torch.Tensor]:
    """The nn.Parameters that are not a compiled module's pieces whose gradients the autograd graph behind `t`
    accumulates, back to the steps of compiled modules (at most `limit` nodes are looked at)."""
    found, seen, todo = [], set(), [t.grad_fn]
    while todo and len(seen) < limit:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if getattr(node, "_forward_cls", None) in (_RankStep, _ForwardOnly):
            continue
        leaf = getattr(node, "variable", None)
        if isinstance(leaf, nn.Parameter) and leaf not in clip_guard._watched and leaf.requires_grad:
            found.append(leaf)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return found


@functools.lru_cache(maxsize=256)
def _same_pieces(local: tuple, made: tuple, made_mesh: tuple, taken: tuple, mesh: tuple) -> bool:
    """Whether every rank's piece of shape `local`, laid out as `made` on a mesh of shape `made_mesh`, is the part
    of the tensor a layout `taken` on `mesh` gives that rank: both meshes number the same ranks in row-major
    order (`api._refuse_rank_layout`). A layout that holds a Partial sum is compared as it is written."""
    if math.prod(made_mesh) != math.prod(mesh):
        return True  # (not the same ranks: not this check's to say)
    if any(isinstance(p, Partial) for p in (*made, *taken)):
        return (made, made_mesh) == (taken, mesh)
    full = tuple(n * shard_factor(made, made_mesh, d) for d, n in enumerate(local))
    return all(local_slices(full, made, made_mesh, coordinate(rank, made_mesh)) ==
               local_slices(full, taken, mesh, coordinate(rank, mesh)) for rank in range(math.prod(mesh)))


class _OutputsMade:
    """The positions of the output tensors calls returned, and the call that returned each there, while their
    memory lives: `gather_outputs` finds the last call's outputs (as they came, or `out.logits.detach()`) and
    tells an earlier call's output (kept by an evaluation loop, as it came or detached) from a tensor made from
    one (`out.softmax(-1)`), where both sit in the output's structure. By memory, each with a weak reference to
    its storage (a storage freed and its address reused is not the output's), and by identity for tensors with no
    memory; not an attribute on the tensor, which `torch.save` would write and a weights-only load refuse."""

    def __init__(self):
        self.calls = 0  # (the number of the last call)
        self._by_memory: dict[tuple, tuple[StorageWeakRef, dict]] = {}  # memory -> (its storage, {position: call})
        self._empty = WeakIdKeyDictionary()  # tensor -> {position: call}
        self._prune_at = 64  # (doubled past what lives after each pruning: an evaluation loop keeping every output
        #                      alive costs no walk of them all at every call)
        self._variant_calls: dict[int, object] = {}  # call -> the `Shapes` it ran, where not the compiled ones
        self._variants_prune_at = 64

    def record(self, flat, shapes=None) -> None:
        """The outputs of a call; `shapes`: the other input shapes' graphs that made them (None: the compiled)."""
        self.calls += 1
        if shapes is not None:
            self._variant_calls[self.calls] = shapes
            if len(self._variant_calls) > self._variants_prune_at:  # (only the calls whose outputs live)
                live = {call for entry in self._by_memory.values() if not entry[0].expired() for call in entry[1].values()}
                live.update(call for made in self._empty.values() for call in made.values())
                self._variant_calls = {call: v for call, v in self._variant_calls.items() if call in live}
                self._variants_prune_at = max(64, 2 * len(self._variant_calls))
        if len(self._by_memory) > self._prune_at:
            self._by_memory = {m: e for m, e in self._by_memory.items() if not e[0].expired()}
            self._prune_at = max(64, 2 * len(self._by_memory))
        for k, t in enumerate(flat):
            if not isinstance(t, torch.Tensor):
                continue
            if (memory := _memory_of(t)) is None:
                self._empty.setdefault(t, {})[k] = self.calls
                continue
            entry = self._by_memory.get(memory)
            if entry is None or entry[0].expired():
                entry = self._by_memory[memory] = (StorageWeakRef(t.untyped_storage()), {})
            entry[1][k] = self.calls  # (one tensor at two places: HF's last hidden state and hidden_states[-1])

    def shapes(self, call: int, first):
        """The `Shapes` whose graphs made call `call`'s outputs (`first`: the compiled ones)."""
        return self._variant_calls.get(call, first)

    def positions(self, t: torch.Tensor) -> dict[int, int]:
        """{position: the call that returned `t` (or the tensor whose memory it reads) there}."""
        if (memory := _memory_of(t)) is None:
            return self._empty.get(t, {})
        entry = self._by_memory.get(memory)
        return entry[1] if entry is not None and not entry[0].expired() else {}


@contextlib.contextmanager
def _quiet_meta_failures():
    """torch's fake tensors log each op whose meta function fails with its whole traceback (at ERROR), before
    the failure propagates: a variant traced for a piece's shape printed two per rank ahead of the refusal that
    says what happened (found by a probe). The failure itself still propagates."""
    import logging

    log = logging.getLogger("torch._subclasses.fake_tensor")
    was = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(was)


def _memory_of(t: torch.Tensor) -> tuple | None:
    """What a tensor reads: its storage, offset, shape, strides and dtype (a tensor and its `detach()` read the
    same; an empty one reads nothing to tell it by)."""
    ptr = t.untyped_storage().data_ptr()
    return (ptr, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype) if ptr else None


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _only_the_model_has(owner: str, source: nn.Module, name: str, path: str) -> AttributeError:
    """The error for `name`, which the model's module at `path` ("" or "lm_head.") has and the compiled module's
    `owner` does not."""
    whose = f"the model's `{path[:-1]}`" if path else "the model it was compiled from"
    read = f"{_module_ref('model', path[:-1])}.{name}" if path else f"model.{name}"
    more = (" To generate on the mesh with the pieces (a serving probe was sent to the whole model here): a "
            "right-padded buffer of the longest length run whole at each step, a static key/value cache in the "
            "model's buffers, or transformers' TorchExportableModuleWithStaticCache compiled around the model, each "
            "a loop of compiled calls (docs/huggingface.md, \"Generation\")." if name == "generate" else "")
    if name.startswith("reset_"):  # (found by a probe: swa_utils.update_bn over an AveragedModel of the compiled
        # module resets each batch norm's statistics, and the way out to read them from the model did nothing)
        more = (" To change the compiled module's values with it (`torch.optim.swa_utils.update_bn` resets a batch "
                "norm's statistics, then runs the model): copy them back, run it on the model, and load the "
                "model's values into the compiled module, `compiled.load_state_dict(model.state_dict())`.")
    return AttributeError(
        f"'{owner}' object has no attribute '{name}'; {whose} ({type(source).__name__}) has one. The compiled module runs the traced forward on this rank's pieces, "
        f"and only that: the model's own methods run the model, whose weights are those it was compiled with. "
        f"What to do: read values from the model (`{read}`); for its methods with the trained weights "
        f"(`generate`, `save_pretrained`), copy them back first, `{source_guard.COPY_BACK}` "
        f"(every rank then holds the whole model); to change the model (a configuration, gradient checkpointing), "
        f"change it and compile again.{more}")


def _has_static(model: nn.Module, name: str) -> bool:
    """Whether `model` has attribute `name`, found without running it (a property such as transformers'
    deprecated `is_gradient_checkpointing` warns when read)."""
    stores = (model.__dict__, *(model.__dict__.get(k, {}) for k in ("_parameters", "_buffers", "_modules")))
    return any(name in store for store in (*stores, *map(vars, type(model).__mro__)))


def _listed(kinds) -> str:
    """"3 entries missing: a, b, c; 1 unexpected keys: d", for each (what, keys) with keys."""
    return "; ".join(f"{len(keys)} {what}: {', '.join(keys[:4])}{', ...' if len(keys) > 4 else ''}"
                     for what, keys in kinds if keys)


_NOT_GIVEN = torch.empty(0)  # (an entry a load was not given whole: the same digest on every rank)


def _shapes_by_rank(every: list) -> str:
    """Each rank's input shapes (None for a non-tensor, left out), as the ranks' disagreements name them."""
    return "; ".join(f"rank {r}: {', '.join(str(list(s)) for s in shapes if s is not None)}"
                     for r, shapes in enumerate(every))


def _shapes_digest(shapes: tuple) -> int:
    """A number for a call's input shapes (None for a non-tensor), the same in every process (Python's own hash of
    None is not, before 3.12), below 2**61 so that its negation fits an int64 too."""
    digest = 17
    for shape in shapes:
        for n in ((-1,) if shape is None else (len(shape), *shape)):
            digest = (digest * 1_000_003 + n + 2) % (2**61 - 1)
    return digest


def _first_call(collective, what: str):
    """A collective of a compiled module's first call (its check of the ranks' `what`), whose failure says
    that the call is collective: a module called on some ranks only (rank 0 alone, to evaluate) waits for
    the others there, even where its graph has no collective of its own."""
    from spmd.core.errors import SpmdCollectiveError

    try:
        return collective()
    except RuntimeError as e:
        raise SpmdCollectiveError(
            f"a compiled module checks, on every rank of its mesh, that the ranks' {what} agree (at its first call; "
            "the random generators of a graph that draws again at calls 2, 4, 8, ... and then every few calls, "
            f"at most every {GENERATOR_CHECK_EVERY}th), and the collective failed or timed out ({e}). What to do: call the "
            "compiled module on every rank of its mesh, as many times on each (a call on some ranks only waits for "
            "the others, or moves their count of calls apart; to evaluate on one rank, compile the model for a mesh "
            "of that rank alone).") from e


def _unfrozen(fqn: str, where: str) -> SpmdError:
    return SpmdError(
        f"{fqn} was frozen (requires_grad=False) when the model was compiled, so the compiled graph computes no "
        f"gradient for it; unfreezing it {where} now would train nothing (its .grad would stay None). What to do: "
        "compile the model with it unfrozen (a parameter frozen later is followed: its gradient is simply not "
        "kept).")


def generator_check_period(mesh_spec, step_s: float) -> int:
    """Every how many calls the ranks' random generators are compared once past the powers of two: the
    smallest power of two at which the check (an all_gather of digests and a flag all_reduce along each mesh axis,
    priced by the mesh's links) costs at most GENERATOR_CHECK_SHARE of the plan's predicted call, at most
    GENERATOR_CHECK_EVERY. From the plan and the mesh alone, so every rank checks at the same calls (each check
    is collective). A rank that draws numbers its peers do not (rank 0 sampling for a log) is caught within
    that many calls: every call where a call takes seconds, every 1024th where it takes a millisecond."""
    check = sum(sum(link.alpha_beta(kind)[0] for kind in ("all_gather", "all_reduce"))
                for link, size in zip(mesh_spec.links, mesh_spec.shape) if size > 1)
    calls = check / max(GENERATOR_CHECK_SHARE * step_s, 1e-30)
    period = 1
    while period < min(calls, GENERATOR_CHECK_EVERY):
        period *= 2
    return period


def graph_backend(compile_graphs: bool | str | None) -> str | None:
    """The torch.compile backend `compile_graphs` asks for (None: run the graphs as they are)."""
    if compile_graphs is None or compile_graphs is False:
        return None
    if compile_graphs is True:
        return "inductor"
    if isinstance(compile_graphs, str) and compile_graphs:
        return compile_graphs
    raise SpmdError(f"compile_graphs must be True, False or the name of a torch.compile backend (\"inductor\"), "
                    f"got {compile_graphs!r}")


def _flagged(t, flag: bool):
    """`t` (an example input) requiring grad where `flag` says, as a detached tensor (a copy of an inference tensor,
    which cannot require grad); what is not a floating-point tensor as it is."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.requires_grad == flag:
        return t
    if t.is_inference():
        with torch.inference_mode(False):
            t = t.clone()
    return t.detach().requires_grad_(flag)


_DDP_OVER_PIECES = (
    "a compiled module inside torch's DistributedDataParallel, which manages its parameters: DDP broadcast rank 0's "
    "values over every rank's when it was built, but each rank holds its own piece, and DDP would average the "
    "gradients of different pieces. What to do: leave the compiled module out of DDP (its graphs keep its replicas "
    "in step: gradients are reduced over the mesh's data-parallel axes); wrap only the plain modules around it, or "
    "list its parameters in the holder's `_ddp_params_and_buffers_to_ignore` before building DDP "
    "(DistributedDataParallel._set_params_and_buffers_to_ignore_for_model).")


def _inside_ddp_construction() -> bool:
    """Whether torch's DistributedDataParallel is being built in a calling frame."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.replace("\\", "/").endswith("torch/nn/parallel/distributed.py"):
            return True
        frame = frame.f_back
    return False


def _module_ref(owner: str, path: str) -> str:
    """Python that reaches the submodule at `path` of `owner`: `model.blocks` or, where a name is not an
    identifier (a Sequential's `1`), `model.get_submodule("1")`."""
    return f"{owner}.{path}" if all(p.isidentifier() for p in path.split(".")) else f'{owner}.get_submodule("{path}")'


def _refuse_functorch() -> None:
    """A call under a torch.func transform (`grad`, `vmap`, `jacrev` of `functional_call(compiled, ...)`): the
    collectives and the ranks' checks get functorch's wrapped tensors, and the call failed deep inside spmd
    (found by a probe)."""
    raise SpmdError("a compiled module was called under a torch.func transform (grad, vmap, jacrev, ...), which its "
                    "collectives and rank graphs do not support. What to do: take gradients with loss.backward() or "
                    "torch.autograd.grad(loss, compiled.parameters()); per-sample work goes in the model's forward.")


def _warn_init_dtype(model: nn.Module) -> None:
    """Warn where a meta model's floating weights are in another dtype than torch's default and nothing says
    which build `init_weights` is to equal: it draws in the model's dtype, which is a build in that dtype (under
    `torch.set_default_dtype`, transformers' `torch_dtype=`), and not `Model(cfg).to(dtype)`, whose values are
    drawn in the default dtype and cast (a probe's `.double()` meta model: 0.79 off that, silently). The
    parameters decide: a buffer kept in its own dtype on purpose (transformers' float32 rotary `inv_freq` in a
    float64 build) is no sign of a cast (a docs probe was told to pass init_dtype for an exact build)."""
    import warnings

    default = torch.get_default_dtype()
    dtypes = {t.dtype for t in model.parameters() if t.is_floating_point()}
    config = getattr(model, "config", None)
    # (`torch_dtype` read only where `dtype` is not there: transformers warns on every read of the old name)
    built = getattr(config, "dtype", None) if hasattr(config, "dtype") else getattr(config, "torch_dtype", None)
    built = getattr(torch, built, None) if isinstance(built, str) else built
    other = sorted(str(d).replace("torch.", "") for d in dtypes - {default, built})
    if other:
        warnings.warn(
            f"init_weights: the model's weights are {', '.join(other)}, and its values are drawn in that dtype: "
            f"equal to a model built in it (under torch.set_default_dtype, or transformers' torch_dtype=), not to "
            f"one built in {str(default).replace('torch.', '')} and cast after (`Model(cfg).to(...)`), whose draws "
            f"differ. For that one, pass init_dtype={default} (the draws in {str(default).replace('torch.', '')}, "
            "cast to the model's dtype); init_dtype=<the model's dtype> silences this.", stacklevel=3)


def _runner(gm, backend: str):
    """`gm` through `torch.compile` with `backend`. The plan fixed every shape (dynamic=False).
    Inductor lowers the functional collectives the graphs call (core/collectives.py) as kernels of their
    own, fuses the element-wise chains, views and permutes between them, and may reorder compute around
    a collective's wait. The first call pays the compilation (seconds; inductor caches it on disk across
    runs); a collective failing inside compiled code raises torch's error, not one naming the value.
    Random ops (dropout, `randn_like`) draw from torch's generator as eager does (inductor's
    `fallback_random`): its own generator drew other masks than the single-device model and the eager rank
    graphs with the same seed (a loss 0.036 off), and left the generator elsewhere for what the loop draws
    next."""
    options = {"fallback_random": True} if backend == "inductor" else None
    return torch.compile(_drawn_as_eager(gm), backend=backend, dynamic=False, options=options)


def _drawn_as_eager(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`gm`, or a copy whose `aten.bernoulli.default` calls are `local_ops.bernoulli_as_eager`, which torch.compile
    runs as eager's kernel (its decomposition drew float32 numbers for a float64 tensor)."""
    def draws(graph):  # (with a generator of the user's: eager's op, as traced)
        return [n for n in graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.bernoulli.default
                and n.kwargs.get("generator") is None]

    if not draws(gm.graph):
        return gm
    graph = copy.deepcopy(gm.graph)
    for k, node in enumerate(draws(graph)):
        node.target, node.args, node.kwargs = local_ops.BERNOULLI_AS_EAGER, (node.args[0], k), {}
    return torch.fx.GraphModule(gm, graph)


def _emptying(gm: torch.fx.GraphModule) -> torch.fx.GraphModule | None:
    """A copy of `gm` that takes its arguments in one list and empties it at once (torch.fx's boxed calling
    convention, as AOTAutograd runs backward): each argument is then held by the graph's own variable alone,
    which the graph drops after its last reader. Called as `gm(*args)`, the call's argument tuple holds every
    one until the graph returns. None where this torch.fx has no such code generator (private to torch)."""
    boxed = getattr(torch.fx.graph, "_BoxedCodeGen", None)
    if boxed is None:
        return None
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    graph.set_codegen(boxed())
    since = fx_sources.mark()
    made = torch.fx.GraphModule(gm, graph)
    fx_sources.release_sources(since, [made])  # (its source goes with it: a process that compiles again and again)
    return made


class _InductorEmptying:
    """A rank graph through inductor, called with one list of arguments that it empties as it starts, as AOTAutograd
    runs a compiled backward: inductor's code takes its arguments so and drops each after its last reader. Through
    torch.compile, the call's frame held every argument until the graph returned, so backward kept every saved
    activation to its end (a training step's peak 1.19-1.22x the plan's; an MLP's backward 73 MiB against 47
    uncompiled). Compiled at the first call, where the graph's ATen ops are decomposed as inductor wants them
    (traced on fake tensors of the arguments) and lowered by inductor alone (`compile_fx_inner`); random ops
    draw from torch's generator as eager does (`_runner`). The code is for the strides of that call's arguments
    (an expanded one, stride 0, made contiguous first: a probe's `out.sum()` first made every later step fail):
    an argument laid out otherwise at a later call (an expanded incoming gradient, `loss = out.sum()` after
    `out.mean()`; a transposed input saved for backward) is copied into them first, as AOTAutograd does with
    gradients (inductor's code asserted them, and a review's second step failed there). Where torch fails to
    compile the graph, nothing has run yet: the graph runs uncompiled, emptying its list alike, with one warning
    (`_warn_uncompiled`)."""

    def __init__(self, gm: torch.fx.GraphModule, which: str):
        self.gm, self.which, self.compiled, self.failed, self.strides = gm, which, None, False, None

    def __call__(self, args: list):
        if self.compiled is None:
            from torch._prims_common import is_non_overlapping_and_dense_or_false as dense

            for k, arg in enumerate(args):  # (compiled for layouts a copy can take: an expanded gradient, stride 0,
                if isinstance(arg, torch.Tensor) and not dense(arg):  # made contiguous; a probe)
                    args[k] = arg.contiguous()
            self.strides = [tuple(a.stride()) if isinstance(a, torch.Tensor) else None for a in args]
            self.compiled = self._compile(args)
        elif not self.failed:
            for k, (arg, stride) in enumerate(zip(args, self.strides)):
                if stride is not None and tuple(arg.stride()) != stride:
                    args[k] = torch.empty_strided(arg.shape, stride, dtype=arg.dtype, device=arg.device).copy_(arg)
                    del arg
        return self.compiled(args)

    def _compile(self, args: list):
        from torch._inductor import config
        from torch._inductor.compile_fx import compile_fx_inner
        from torch._inductor.decomposition import select_decomp_table
        from torch.fx.experimental.proxy_tensor import make_fx

        try:
            since = fx_sources.mark()
            decomposed = make_fx(_drawn_as_eager(self.gm), decomposition_table=select_decomp_table(),
                                 tracing_mode="fake")(*args)
            fx_sources.release_sources(since, [decomposed])
            with config.patch(fallback_random=True):
                return compile_fx_inner(decomposed, list(args))
        except Exception as e:  # (compiling runs nothing: no collective was issued, no argument let go)
            self.failed = True
            _warn_uncompiled(self.which, e, "inductor")
            uncompiled = _emptying(self.gm)
            return uncompiled if uncompiled is not None else (lambda args: self.gm(*args))


def _warn_uncompiled(which: str, e: Exception, backend: str) -> None:
    """Warn, once per graph, that torch's `backend` could not compile this rank's `which` graph, which then runs
    uncompiled (a failure inside torch, not the user's)."""
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    warnings.warn(
        f"compile_graphs: {backend} could not compile this rank's {which!r} graph ({type(e).__name__}: {first[:300]}), "
        "a failure inside torch; it runs uncompiled, as with compile_graphs=False (the same results, without the "
        "backend's fusions). What to do: nothing for the results; for the fusions, try another backend "
        "(compile_graphs='aot_eager' checks the graph without inductor) or another torch version, and report the "
        "failure to PyTorch with the graph (`compiled.code`).", stacklevel=4)


class _OrUncompiled:
    """A rank graph through torch.compile, or, where the backend fails to compile it (a bug of torch's: inductor's
    C++ vectorizer failed on transformers' padding-mask lookup in a batch-split Llama graph, found by a probe, and
    the user got torch's raw `InductorError`), the graph itself, with one warning. The graph is one dynamo graph,
    so a failed compile has run nothing of it (no collective issued); the uncompiled graph computes the same."""

    def __init__(self, gm, compiled, which: str):
        self.gm, self.compiled, self.which, self.failed = gm, compiled, which, False

    def __call__(self, *args):
        if self.failed:
            return self.gm(*args)
        try:
            return self.compiled(*args)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            self.failed = True
            _warn_uncompiled(self.which, e, "torch.compile")
            return self.gm(*args)


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views share their base's; a tensor with no storage, the
    efficient zero tensor `torch.func.hessian`'s backward saves, holds none: a probe's first step failed on it)."""
    seen, total = set(), 0
    for t in tensors:
        if t._is_zerotensor():
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


_RANDOM_OPS = frozenset({"native_dropout", "bernoulli", "rand", "rand_like", "randn", "randn_like", "randint",
                         "randint_like", "randperm", "normal", "normal_functional", "uniform", "multinomial",
                         "exponential", "poisson", "rrelu_with_noise", "rrelu_with_noise_functional"})
_DROPOUT_OPS = frozenset({"native_dropout", "bernoulli"})  # (what dropout traces to in train mode)


def _draw_names(graph) -> list[str]:
    """The names of the ops of the graph that draw random numbers (dropout's, attention's inside its kernel, a custom
    op's), as the refusal where the ranks' generators differ names them (a diffusion step's randint and randn_like were
    told of dropout masks: found by a probe)."""
    def name(node) -> str:
        target = node.target
        if getattr(target, "__name__", "").startswith("auto_functionalized") and node.args:
            target = node.args[0]  # (a custom op that writes its input: the op itself, not its functional wrapper)
        return getattr(target, "_opname", None) or getattr(target, "__name__", "")

    return sorted(_op_names(graph) & _RANDOM_OPS | {name(n) for n in graph.nodes if n.op == "call_function" and may_draw(n)})


def _op_names(graph) -> set[str]:
    """The names of the ops the graph calls (`native_dropout` for aten.native_dropout.default)."""
    return {getattr(n.target, "_opname", None) or getattr(n.target, "__name__", "")
            for n in graph.nodes if n.op == "call_function"}


def _mode_dependent(ops: set[str], model: nn.Module) -> str | None:
    """What makes a graph traced in one mode wrong in the other: dropout (drawn in train mode, not in eval)
    and batch norm keeping running statistics (the batch's in train mode, the running ones in eval). Traced
    in train mode, the graph says whether it drops; traced in eval mode it cannot, so the model's dropout
    modules with p > 0 say it (a dropout called as `F.dropout(x, p, self.training)` is not seen here, but
    by `CompiledModule._ops_differ_by_mode`, which runs the forward in both modes). None
    when nothing depends on the mode (random draws that are not dropout, such as a VAE's noise, do not)."""
    found = []
    if model.training:
        dropout = bool(ops & _DROPOUT_OPS)
    else:
        dropout = any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules())
    if dropout:
        found.append("dropout")
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats for m in model.modules()):
        found.append("batch norm")
    return " and ".join(found) or None


def _no_jvp(ctx, *tangents):
    """Forward-mode AD (`torch.autograd.forward_ad`'s dual tensors) through a compiled module: torch said only
    "You must implement the jvp function for custom autograd.Function", naming neither spmd nor a way out."""
    raise SpmdError("a forward-mode derivative (torch.autograd.forward_ad's dual tensors) was asked of a compiled "
                    "module: its rank graphs compute values and, when compiled for training, reverse-mode gradients "
                    "(backward), and no forward-mode derivatives. What to do: pass plain tensors (unpack the dual "
                    "ones: forward_ad.unpack_dual(x).primal), and get the derivative from backward "
                    "(torch.autograd.grad), or compute it with the model outside spmd.")


class _ForwardOnly(torch.autograd.Function):
    """The outputs of a module compiled without training, where gradients were asked for (grad enabled, a
    parameter or an input requiring grad): they take part in autograd, and a backward through them fails,
    saying how to compile for training. The graph's collectives have no backward of their own: autograd went
    through them as through the identity (torch warns, "silently incorrect behavior"), so a gather's or a
    reduction's gradient came out wrong on every mesh larger than one device."""

    @staticmethod
    def forward(ctx, module: "CompiledModule", shapes: Shapes, anchor, *args):
        # (the graph runs here, where autograd records nothing: its outputs are its own, not views of the
        # Function's inputs, so a caller may still change them in place)
        return tuple(module._graph("graph", shapes)(*args))

    jvp = staticmethod(_no_jvp)

    @staticmethod
    def backward(ctx, *grads):
        raise SpmdError("this module was compiled without training (training=False, or no loss_fn), so it has "
                        "no backward. What to do: spmd.compile(..., training=True) (or with a loss_fn), or run "
                        "it under torch.no_grad() where no gradient is wanted.")


class _RankStep(torch.autograd.Function):
    """This rank's forward graph; autograd calls its backward graph. Gradients come out in each
    parameter's own placements, so `param.grad` is the local shard of the full gradient."""

    @staticmethod
    def forward(ctx, module: CompiledModule, shapes: Shapes, *args):
        split = shapes.split
        flat = module._graph("forward", shapes)(*args)
        n, updated = split.n_outputs, split.n_outputs + len(split.updates)
        outs, saved = flat[:n], flat[updated:]
        if split.updates:
            module._update_buffers(split.updates, flat[n:updated])
        ctx.module, ctx.shapes = module, shapes
        ctx.save_for_backward(*saved)
        # an output no loss used gets None, not zeros (`backward`): the gradients only it reaches stay None
        ctx.set_materialize_grads(False)
        ctx.tangent_like = [(outs[k].shape, outs[k].dtype, outs[k].device) for k in shapes.differentiable]
        ctx.mark_non_differentiable(*(t for k, t in enumerate(outs) if k not in shapes.differentiable and isinstance(
            t, torch.Tensor) and (k not in shapes.refused_grads or not t.is_floating_point())))
        if module._saved_bytes is None:  # parameters saved for backward are counted as parameters, not here
            params = {p.untyped_storage().data_ptr() for p in module.parameters()}
            module._saved_bytes = _storage_bytes(t for t in saved if isinstance(t, torch.Tensor) and not t._is_zerotensor()
                                                 and t.untyped_storage().data_ptr() not in params)
        return tuple(outs)

    jvp = staticmethod(_no_jvp)

    @staticmethod
    def backward(ctx, *grad_outputs):
        if torch.is_grad_enabled():  # (autograd runs a backward with grad on only for create_graph=True)
            raise SpmdError(
                "a gradient of a compiled module's gradients was asked for (torch.autograd.grad(..., "
                "create_graph=True), as a gradient penalty does): its backward graph runs as one step autograd "
                "does not see into, so the second-order gradients would be missing (no gradient reached the "
                "parameters, silently). Second-order gradients through a compiled module's call are not supported. "
                "What to do: compute the penalty inside the compiled forward, a module whose forward runs "
                "`torch.autograd.grad(critic(x).sum(), x, create_graph=True)` and returns the loss with the penalty "
                "(compiled with `loss_fn=lambda loss: loss`; the trace takes the second-order graph in), or compute it "
                "with the model outside spmd.")
        module, shapes = ctx.module, ctx.shapes
        # (a gradient of zeros, `out.loss + 0 * out.logits.sum()` as DDP's unused-parameter trick, changes nothing)
        reached = [name for k, name in shapes.refused_grads.items()
                   if grad_outputs[k] is not None and bool(grad_outputs[k].any())]
        if reached:
            raise SpmdError(
                f"a gradient reached {', '.join(reached)}, an output of a module compiled to differentiate the model's "
                "own loss alone (its `loss`: the model was given labels and spmd.compile no loss_fn), whose graph "
                "computes no gradient through its other outputs: that term of the loss would train nothing. What "
                "to do: compute the whole loss in a loss_fn given to spmd.compile (it receives the model's output, "
                "and its parameter names name the targets: `def loss_fn(out, labels): return F.cross_entropy(...) + "
                "z_loss(out.logits)`), or detach those outputs where no gradient is meant (`out.logits.detach()`).")
        tangents = [grad_outputs[k] for k in shapes.differentiable]
        unused = 0  # (bit k: the k-th tangent did not come, its output unused by the loss)
        for k, (g, (shape, dtype, device)) in enumerate(zip(tangents, ctx.tangent_like)):
            if g is None:
                unused |= 1 << k
                tangents[k] = torch.zeros(shape, dtype=dtype, device=device)
        try:
            saved = ctx.saved_tensors
        except RuntimeError as e:  # (torch's words name views made in no_grad mode: the graph's, not the user's)
            # (outputs the first backward reached reached again: the user's own second backward, as eager refuses)
            again = any(g is not None for k, g in enumerate(grad_outputs) if k in getattr(ctx, "reached", ()))
            if "second time" in str(e) and len(shapes.differentiable) > 1 and not again:
                raise SpmdError(
                    "a second backward reached this compiled call (torch: 'Trying to backward through the graph a "
                    "second time'): its outputs share one backward, which computes every output's gradients at once "
                    "and frees what the forward saved, so a backward from a second output of the same call finds it "
                    "gone, also where eager's graphs of the two are apart (an auxiliary head on detached features). "
                    "What to do: add the losses and call backward once (`(loss + aux_loss).backward()`), or pass "
                    "retain_graph=True to the first backward (it keeps the call's saved activations until the "
                    "second).") from e
            if "inplace" not in str(e):  # (a second backward through the graph: torch's words are the user's)
                raise
            raise SpmdError(
                "this backward reads tensors its forward saved, and one of them was modified in place since (an "
                "optimizer step, or another call's update, between this call's forward and its backward; or an "
                "in-place op on the output), as eager refuses with 'one of the variables needed for gradient "
                "computation has been modified by an inplace operation'. What to do: call backward before the "
                f"optimizer steps, and clone an output before writing into it. (torch: {e})") from e
        ctx.reached = {k for k, g in enumerate(grad_outputs) if g is not None}  # (for a second backward, above)
        # Each saved activation is let go of where backward last reads it, as the memory plan has it: autograd's
        # own hold is dropped (unless retain_graph), and the graph takes its arguments in a list it empties
        # (before, all were held until backward ended: a step's peak 21% over the plan's, found by measuring
        # the tensors a step holds).
        args = [*saved, *tangents]
        del saved, tangents
        ctx.maybe_clear_saved_tensors()
        with autocast_off():  # (a backward called inside the user's autocast block: the traced dtypes)
            grads = dict(zip(shapes.split.grads, module._run_emptying("backward", shapes, args)))
        if unused:  # one device leaves None where no used output reaches (an optimizer then skips the parameter:
            # zeros would move it by its momentum and weight decay)
            for name, needs in zip(shapes.split.grads, shapes.split.grad_tangents):
                if needs and needs & ~unused == 0:
                    grads[name] = None
        return (None, None) + tuple(grads.get(input_grad_key(name) if kind == "input" else name)  # (inputs': where traced)
                               for (kind, _), name in zip(module._order, module._order_names))
