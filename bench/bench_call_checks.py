"""What the checks at the start of each call of a compiled module cost (no processes): transformers Llama
models of 2, 8 and 32 layers (64 wide, random weights), compiled for training on a mesh of one device.

- the attribute guard: the plain attributes each module's forward reads, compared with their values when
  compiled (`compiler/attribute_reads.AttributeGuard.check`);
- the sibling check: another module compiled from the same model trained (`runtime/source_guard.stale`);
- requires_grad followed from the model's parameters (`CompiledModule._follow_requires_grad`);
- the autocast state the module was compiled under (`runtime/autocast_guard.AutocastGuard.check`);
- the model's weights changed after compiling, before the module trained (`runtime/source_guard.model_changed`:
  one version counter per parameter at a call that is not a checked one; nothing once it has trained);
- hooks registered on the model after compiling, or removed (`runtime/source_guard.hooks_changed`): one
  integer compare and a look in the tables of the hooks traced (none here), and after a hook registration
  anywhere (a backward hook on an eager module at every step) a read of the model's hook tables, against the
  walk of the module tree it was before session 60;
- the model's buffers set after compiling (`runtime/source_guard.buffers_changed`: one version counter per
  buffer the compiled module holds a copy of; transformers' Llama: each layer's rotary `inv_freq`);
- modules switched to the other mode alone (`CompiledModule._modes`: each module whose forward reads its mode,
  the model's and the compiled module's holder; transformers' Llama: each layer's attention);
- the shapes of the parameters and buffers the graph takes, against this rank's pieces' (`p.data = whole`,
  `functional_call` with whole tensors: `CompiledModule._state_shapes`).
Then, once per module: the first call's read of the model's values against its pieces (`p.data.copy_(w)` after
compiling moves no counter: `runtime/source_guard._written_unseen`), on transformers' GPT-2 small (124M), and
the sampled read of the checked calls after it (2, 4, 8, ... before the first optimizer step).

Last, a train-mode forward that moves buffers beside an evaluation module compiled from the same model
(`runtime/source_guard.buffers_moved`, session 72); the watch of a transformers configuration whole (session 73);
and the record of each call's outputs that `gather_outputs` reads (session 74); last, the digests a
`load_state_dict` of whole tensors compares over the mesh (session 75); and the layout record of each call's output
pieces, looked up for each input (session 76).

Under torchrun (2 or more ranks), it measures instead the agreement on the pieces' shapes at each call of a
module compiled for more than one set of input shapes (`CompiledModule._agree_on_shapes`, session 86), beside a
whole call of the same module.

    python bench/bench_call_checks.py      # prints the rows of bench/results_call_checks.md
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 bench/bench_call_checks.py   # the shapes' agreement
"""
from __future__ import annotations

import os
import statistics
import time

import torch


def _compiled(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    from spmd.compiler.call import positional_call
    from spmd.compiler.options import PlanOptions, RankBinding
    from spmd.compiler.pipeline import run_pipeline
    from spmd.core.mesh import MeshSpec
    from spmd.runtime.compiled import CompiledModule
    from spmd.runtime.measure import builtin_cpu

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 128, (2, 16))
    view, flat, call = positional_call(model, (), dict(input_ids=ids, labels=ids), loss_only=True)
    c = run_pipeline(view, flat, MeshSpec((1,), ("dp",), device=builtin_cpu()), PlanOptions(training=True),
                     RankBinding(0, ("",)), quiet=True)
    return CompiledModule(c, None, src_data_rank=None, source_model=model, call=call)


def _us(fn, calls: int = 2000, rounds: int = 5) -> float:
    """Median over rounds of the mean time of one call, in microseconds."""
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def main() -> None:
    from spmd.runtime import source_guard

    print("| layers | attributes watched | attribute guard, us | sibling check, us | parameters followed | "
          "requires_grad followed, us | autocast, us | model's weights (before training), us | hooks, us | "
          "buffers watched | buffers, us | modules' modes watched | modes, us | pieces' shapes, us | all, us | hooks after a "
          "registration elsewhere, us | (the tree walk instead, us) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for layers in (2, 8, 32):
        compiled = _compiled(layers)
        guard = _us(compiled._attributes.check)
        sibling = _us(lambda: source_guard.stale(compiled))
        flags = _us(compiled._follow_requires_grad)
        autocast = _us(compiled._autocast.check)
        # (a call that is not a checked one: 2, 4, 8, ... read a sample of the values, `first_call_read` below)
        compiled._calls, calls = 2, compiled._calls
        weights = _us(lambda: source_guard.model_changed(compiled))
        compiled._calls = calls
        hooks = _us(lambda: source_guard.hooks_changed(compiled))
        buffers = _us(lambda: source_guard.buffers_changed(compiled))
        modes = _us(lambda: any(m.training is not was for m, _, was in compiled._modes))
        args = compiled._graph_args([torch.zeros(2, 16, dtype=torch.long)] * 2)
        shapes = _us(lambda: tuple(t.shape for t in compiled._state_at(args)) != compiled._state_shapes)

        def after_a_registration():
            compiled.__dict__["_hooks_at"] = -1
            source_guard.hooks_changed(compiled)
        walk = _us(after_a_registration, calls=200)
        model = compiled._source_model
        tree = _us(lambda: source_guard._hooks(model.named_modules(remove_duplicate=False),
                                               model.named_parameters(remove_duplicate=False)), calls=200)
        total = guard + sibling + flags + autocast + weights + hooks + buffers + modes + shapes
        print(f"| {layers} | {len(compiled._attributes)} | {guard:.1f} | {sibling:.2f} | {len(compiled._flags)} | "
              f"{flags:.1f} | {autocast:.2f} | {weights:.1f} | {hooks:.2f} | "
              f"{len(compiled.__dict__.get('_buffer_marks', {}))} | {buffers:.2f} | {len(compiled._modes)} | "
              f"{modes:.2f} | {shapes:.1f} | {total:.1f} | {walk:.0f} | "
              f"{tree:.0f} |", flush=True)

def first_call_read() -> None:
    """The first call's compare of every weight value with its piece, on GPT-2 small (124M) on one device."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from spmd.compiler.options import PlanOptions, RankBinding
    from spmd.compiler.pipeline import run_pipeline
    from spmd.core.mesh import MeshSpec
    from spmd.runtime import source_guard
    from spmd.runtime.compiled import CompiledModule
    from spmd.runtime.measure import builtin_cpu

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=12, use_cache=False))
    c = run_pipeline(model, (torch.randint(0, 50257, (1, 16)),), MeshSpec((1,), ("dp",), device=builtin_cpu()),
                     PlanOptions(stamp_layers=False), RankBinding(0, ("",)), quiet=True)
    compiled = CompiledModule(c, None, src_data_rank=None, source_model=model)
    params = sum(p.numel() for p in model.parameters())
    source_guard._mark_pieces(compiled)  # (as a compiled module's pieces are marked when given values)
    source_guard._keep_rows(compiled)
    for read, what in ((source_guard._written_unseen, "first call's value read"),
                       (source_guard._rows_moved, "a checked call's read of 256 values each")):
        ms = [_us(lambda: read(compiled), calls=1, rounds=1) / 1e3 for _ in range(5)]
        print(f"{what}, GPT-2 small ({params / 1e6:.1f}M parameters): median {statistics.median(ms):.2f} "
              f"ms of 5 ({min(ms):.2f}-{max(ms):.2f})", flush=True)


def buffers_moved_cost() -> None:
    """A train-mode forward that moves buffers (batch norm), beside an evaluation module compiled from the same
    model (`runtime/source_guard.buffers_moved`): the steady call, where this module moved last and nothing was
    given to the sibling since, and the call after the sibling was given its state (the clock ticks and the
    sibling's marks are redone), on 1 and 40 (Linear, BatchNorm1d) layers."""
    from spmd.compiler.options import PlanOptions, RankBinding
    from spmd.compiler.pipeline import run_pipeline
    from spmd.core.mesh import MeshSpec
    from spmd.runtime import source_guard
    from spmd.runtime.compiled import CompiledModule
    from spmd.runtime.measure import builtin_cpu

    def compiled(model, x):
        c = run_pipeline(model, (x,), MeshSpec((1,), ("dp",), device=builtin_cpu()), PlanOptions(stamp_layers=False),
                         RankBinding(0, ("",)), quiet=True)
        return CompiledModule(c, None, src_data_rank=None)

    for layers in (1, 40):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))])
        x = torch.randn(4, 8)
        train = compiled(model.train(), x)
        evaluate = compiled(model.eval(), x)
        model.train()
        names = [n for n, _ in model.named_buffers()]
        source_guard.buffers_moved(train, names)
        steady = _us(lambda: source_guard.buffers_moved(train, names))

        def after_a_load():
            evaluate.__dict__["_given"] = {"0.weight"}  # (as a partial load into the sibling leaves it)
            source_guard.buffers_moved(train, names)
        ticking = _us(after_a_load, calls=500)
        whole = _us(lambda: train(x), calls=500)
        print(f"buffers_moved, {layers} layer(s), {len(names)} buffers, one sibling: steady {steady:.2f} us, after a "
              f"load into the sibling {ticking:.1f} us; the whole forward call {whole:.0f} us", flush=True)


def config_watch_cost() -> None:
    """The attribute guard with and without its watch of the transformers configuration whole (every entry of
    `model.config`, one dict compare when nothing changed), on the transformers Llama of `main`."""
    for layers in (2, 32):
        compiled = _compiled(layers)
        guard = compiled._attributes
        entries = sum(len(vars(config)) for config, _, _ in guard._configs)
        with_configs = _us(guard.check, calls=20000)
        held, guard._configs = guard._configs, []
        without = _us(guard.check, calls=20000)
        guard._configs = held
        print(f"attribute guard, {layers} layers: {with_configs:.2f} us with the configuration watched whole "
              f"({len(held)} configuration(s), {entries} entries), {without:.2f} us without", flush=True)


def outputs_record_cost() -> None:
    """The record of each call's output tensors that `gather_outputs` reads (`runtime/compiled._OutputsMade`), for
    outputs of 1 and 8 tensors, each call's new: dropped at once (a training loop), or all kept alive (an
    evaluation loop gathering them after), 20,000 calls."""
    from spmd.runtime.compiled import _OutputsMade

    for tensors in (1, 8):
        for kept in (False, True):
            made, held, calls = _OutputsMade(), [], 20000
            flats = [[torch.empty(4) for _ in range(tensors)] for _ in range(calls)]
            t0 = time.perf_counter()
            for i in range(calls):
                flat, flats[i] = flats[i], None  # (the loop's own reference alone: freed at the next call unless kept)
                made.record(flat)
                if kept:
                    held.append(flat)
            us = (time.perf_counter() - t0) / calls * 1e6
            del flats, held
            print(f"outputs record, {tensors} tensor(s) per call, {'all kept alive' if kept else 'dropped'}: "
                  f"{us:.2f} us per call", flush=True)


def load_agreement_cost() -> None:
    """What `load_state_dict` of whole tensors adds (`CompiledModule._agree_on_loaded`, session 75): one sampled
    digest per parameter and buffer (`_digest(v, sampled=True)`: at most 65,536 values spread over each), then
    one all_gather of 8 bytes per entry per mesh axis and a flag reduced over the mesh. Timed here: the
    digests, on transformers' GPT-2 small and on one 12.6M-value tensor alone; the collectives are two small
    ones per mesh axis, as the other checks of a first call."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from spmd.runtime.compiled import _digest

    torch.manual_seed(0)
    state = GPT2LMHeadModel(GPT2Config(n_layer=12, use_cache=False)).state_dict()
    values = sum(v.numel() for v in state.values())
    for what, entries in ((f"GPT-2 small's state dict ({len(state)} entries, {values / 1e6:.1f}M values)",
                           list(state.values())),
                          ("one 12.6M-value tensor", [torch.randn(3072, 4096)])):
        ms = [_us(lambda: [_digest(v, sampled=True) for v in entries], calls=1, rounds=1) / 1e3 for _ in range(5)]
        print(f"load agreement's digests, {what}: median {statistics.median(ms):.2f} ms of 5 "
              f"({min(ms):.2f}-{max(ms):.2f})", flush=True)



def safetensors_digest_cost() -> None:
    """What `load_safetensors` adds for the ranks' comparison of the files (session 77): `headers_digest`, each
    file's header, size and samples of its contents (64 blocks of 4 KiB spread over it and each tensor's first 256
    bytes), computed once per load (the ranks compare it before the pieces are read, and again after), then two
    small collectives each time. Timed
    here on transformers' GPT-2 small written to one file (page-cached: a cold or network disk pays seeks)."""
    import tempfile

    from safetensors.torch import save_file
    from transformers import GPT2Config, GPT2LMHeadModel

    from spmd.runtime.checkpoint import checkpoint_files, headers_digest

    torch.manual_seed(0)
    state = GPT2LMHeadModel(GPT2Config(n_layer=12, use_cache=False)).state_dict()
    state = {k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"}
    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/model.safetensors"
        save_file(state, path)
        files = checkpoint_files(path)
        ms = [_us(lambda: headers_digest(files), calls=1, rounds=1) / 1e3 for _ in range(5)]
    print(f"safetensors digest, GPT-2 small in one file ({len(state)} tensors): median {statistics.median(ms):.2f} ms "
          f"of 5 ({min(ms):.2f}-{max(ms):.2f}), once per load", flush=True)

def layout_record_cost() -> None:
    """What each call pays for the layouts of the pieces handed between compiled modules (session 76): the record of
    each output piece by the memory it reads (`compiled._LaidOut.record`), and the look-up of each input
    (`_LaidOut.get`), with 1 and 8 tensors, 20,000 calls, each call's outputs new and dropped."""
    from torch.distributed.tensor import Replicate

    from spmd.runtime.compiled import _LaidOut

    for tensors in (1, 8):
        laid, calls, layout = _LaidOut(), 20000, (("0",), (Replicate(),))
        inputs = [torch.empty(4, 8) for _ in range(tensors)]
        flats = [[torch.empty(4, 8) for _ in range(tensors)] for _ in range(calls)]
        t0 = time.perf_counter()
        for i in range(calls):
            for t in inputs:
                laid.get(t)
            flat, flats[i] = flats[i], None
            for t in flat:
                laid.record(t, layout)
        us = (time.perf_counter() - t0) / calls * 1e6
        print(f"layout record, {tensors} input(s) looked up and {tensors} output(s) recorded per call: {us:.2f} us per "
              "call", flush=True)


def shapes_agreement_cost() -> None:
    """The shapes' agreement of each call (`_agree_on_shapes`) of an MLP compiled on (world,) for a batch of 8
    split on dp, with a variant for a batch of 4 (so that every call checks), against a whole training call."""
    import torch.nn.functional as F
    from torch.distributed.tensor import Shard

    import spmd
    from tests.models import MLP
    from tests.support import spec

    world = int(os.environ["WORLD_SIZE"])
    mesh = spmd.init_mesh((world,), ("dp",))
    torch.manual_seed(0)
    x, y = torch.randn(8 * world, 64), torch.randn(8 * world, 64)
    compiled = spmd.compile(MLP(64, 256), mesh, (x, y), loss_fn=F.mse_loss, mesh_spec=spec((world,), ("dp",)),
                            in_placements={"x": [Shard(0)], "target": [Shard(0)]})
    compiled.shard_inputs(x[: 4 * world], y[: 4 * world])  # (a variant: from now on every call agrees on shapes)
    local = compiled.shard_inputs(x, y)
    agree = _us(lambda: compiled._agree_on_shapes(local), calls=500)
    step = _us(lambda: compiled(*local).backward(), calls=100)
    if torch.distributed.get_rank() == 0:
        print(f"shapes' agreement on {world} gloo ranks: {agree:.1f} us per call; a training call of the MLP "
              f"(64 -> 256 -> 64, batch {8 * world}): {step:.0f} us", flush=True)


if __name__ == "__main__" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
    shapes_agreement_cost()
elif __name__ == "__main__":
    main()
    first_call_read()
    buffers_moved_cost()
    config_watch_cost()
    outputs_record_cost()
    load_agreement_cost()
    safetensors_digest_cost()
    layout_record_cost()
