"""Big models for real: no rank holds the whole model, one source of truth for the weights."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.distributed.tensor import Shard

import spmd
from tests.models import GPT, GPTConfig
from tests.support import lm_loss, spec, train_side_by_side


def _train_with_rank_seeds(rank: int, world: int, src_data_rank, steps: int = 3) -> dict:
    """Every rank builds the model with its own seed; rank 0's is the one trained (one source of truth)."""
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        reference = GPT(GPTConfig(layers=2))  # what rank 0 builds
        torch.manual_seed(rank)
        model = GPT(GPTConfig(layers=2))
        g = torch.Generator().manual_seed(1)
        tokens, targets = torch.randint(0, 128, (4, 31), generator=g), torch.randint(0, 128, (4, 31), generator=g)
        mesh = spmd.init_mesh((2, 2), ("dp", "tp"))
        compiled = spmd.compile(model, mesh, (tokens, targets), loss_fn=lm_loss, mesh_spec=spec((2, 2), ("dp", "tp")),
                                src_data_rank=src_data_rank)
        losses, ref_losses, _ = train_side_by_side(compiled, reference, (tokens,), (targets,), lm_loss, steps)
        full = compiled.full_state_dict()
        err = max(float((full[k] - v).abs().max()) for k, v in reference.named_parameters())
        return {"losses": losses, "ref_losses": ref_losses, "param_err": err}
    finally:
        torch.set_default_dtype(torch.float32)


def test_ranks_built_with_different_seeds_train_rank_0s_model(ranks):
    for r in ranks(4).run(_train_with_rank_seeds, 0):
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-9), r
        assert r["param_err"] < 1e-9, r


def _own_weights(rank: int, world: int, seed_of_rank) -> str:
    torch.manual_seed(seed_of_rank(rank))
    model = GPT(GPTConfig(layers=2))
    tokens = torch.randint(0, 128, (4, 32))
    mesh = spmd.init_mesh((2,), ("dp",))
    try:
        spmd.compile(model, mesh, (tokens,), mesh_spec=spec((2,), ("dp",)), src_data_rank=None)
    except spmd.SpmdError as e:
        return str(e)
    return ""


def _same_seed(rank):
    return 0


def _seed_is_rank(rank):
    return rank


def test_without_a_source_rank_the_ranks_weights_must_agree(ranks):
    """src_data_rank=None is for ranks that all loaded the same weights; a checksum per tensor proves it,
    and ranks that built different weights all stop, naming the first tensor that differs."""
    assert ranks(2).run(_own_weights, _same_seed) == ["", ""]
    for message in ranks(2).run(_own_weights, _seed_is_rank):
        assert "weights: rank 1 differs from rank 0; 'tok_emb.weight:" in message, message


def _meta_compile_refuses_to_run_uninitialized(rank: int, world: int) -> str:
    with torch.device("meta"):
        model = GPT(GPTConfig(layers=2))
    tokens = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))  # (the same on every rank)
    mesh = spmd.init_mesh((2,), ("dp",))
    compiled = spmd.compile(model, mesh, (tokens,), mesh_spec=spec((2,), ("dp",)))
    assert all(p.device.type == "cpu" and not p.is_meta for p in compiled.parameters())
    try:
        compiled(*compiled.shard_inputs(tokens))
    except spmd.SpmdError as e:
        return str(e)
    return ""


def test_a_meta_compile_allocates_shards_and_refuses_to_run_before_init(ranks):
    for message in ranks(2).run(_meta_compile_refuses_to_run_uninitialized):
        assert "compiled from the meta device" in message and "compiled.init_weights(seed=...)" in message


def _checkpoint_round_trip(rank: int, world: int, folder: str) -> dict:
    """A transformers GPT-2 (tied embeddings) saved by safetensors on one device, single file and an index
    of two shards; loaded into a model compiled from the meta device, each rank reading its slices;
    written back by rank 0 one tensor at a time."""
    import json
    import os

    import torch.distributed as dist
    from safetensors import safe_open
    from safetensors.torch import save_file, save_model

    from tests.models import gpt2

    torch.manual_seed(0)
    reference = gpt2()
    expected = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    single, sharded = os.path.join(folder, "model.safetensors"), os.path.join(folder, "sharded")
    if rank == 0:
        save_model(reference, single)  # as transformers writes it: one name per tied tensor
        os.makedirs(sharded, exist_ok=True)
        names = sorted(k for k in expected if k != "lm_head.weight")
        halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
        for file, part in halves.items():
            save_file({k: expected[k].contiguous() for k in part}, os.path.join(sharded, file))
        with open(os.path.join(sharded, "model.safetensors.index.json"), "w") as f:
            json.dump({"weight_map": {k: file for file, part in halves.items() for k in part}}, f)
    dist.barrier()
    with torch.device("meta"):
        model = gpt2()
    tokens = torch.randint(0, 128, (4, 32))
    mesh = spmd.init_mesh((2, 2), ("dp", "tp"))
    errors = {}
    for source in (single, sharded):
        compiled = spmd.compile(model, mesh, (tokens,), mesh_spec=spec((2, 2), ("dp", "tp")))
        compiled.load_safetensors(source)
        full = compiled.full_state_dict()
        errors[os.path.basename(source)] = max(float((full[k] - v).abs().max()) for k, v in expected.items())
        out = compiled.gather_outputs(compiled(*compiled.shard_inputs(tokens)))
        errors["logits"] = float((out.logits - reference(tokens).logits).abs().max())
    written = os.path.join(folder, "written.safetensors")
    compiled.save_safetensors(written)
    dist.barrier()
    with safe_open(written, "pt") as f:
        back = {k: f.get_tensor(k) for k in f.keys()}
    errors["written"] = max(float((back[k] - v).abs().max()) for k, v in expected.items())
    return {"errors": errors, "written_names": sorted(back), "expected_names": sorted(expected),
            "sharded": sum(1 for p in compiled.parameters() if p.numel() < 10**9)}


def test_safetensors_in_and_out_equal_one_device(ranks, tmp_path):
    for r in ranks(4).run(_checkpoint_round_trip, str(tmp_path)):
        assert max(r["errors"].values()) == 0.0, r["errors"]
        assert r["written_names"] == r["expected_names"]  # every name, the tied head included


class _Layouts(torch.nn.Module):
    """Parameters and buffers of several dtypes, pinned to every kind of layout on a (2, 2) mesh."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(8, 6))
        self.b = torch.nn.Parameter(torch.randn(8, 6))
        self.c = torch.nn.Parameter(torch.randn(8, 6))
        self.d = torch.nn.Parameter(torch.randn(8, 6))
        self.h = torch.nn.Parameter(torch.randn(8, 6).to(torch.bfloat16))
        self.register_buffer("mask", torch.rand(8, 6) > 0.5)
        self.register_buffer("count", torch.arange(48, dtype=torch.int64).view(8, 6))

    def forward(self, x):
        w = self.a + self.b + self.c + self.d + self.h.float() + self.mask + self.count
        return x @ w


def _save_pinned_layouts(rank: int, world: int, folder: str) -> dict:
    """save_safetensors of pieces split on each axis, on both, twice along one dim, and whole, against
    full_state_dict; and what each rank held beside its pieces while saving (only rank 0 gathers)."""
    import os

    import torch.distributed as dist
    from safetensors import safe_open
    from torch.distributed.tensor import Replicate

    torch.manual_seed(0)
    model = _Layouts()
    mesh = spmd.init_mesh((2, 2), ("dp", "tp"))
    x = torch.randn(4, 8)
    pins = {"a": [Shard(0), Shard(1)], "b": [Replicate(), Shard(0)], "c": [Shard(1), Replicate()],
            "d": [Shard(0), Shard(0)], "h": [Shard(1), Shard(0)], "mask": [Shard(0), Replicate()],
            "count": [Replicate(), Shard(1)]}
    compiled = spmd.compile(model, mesh, (x,), mesh_spec=spec((2, 2), ("dp", "tp")), param_placements=pins)
    path = os.path.join(folder, "layouts.safetensors")
    compiled.save_safetensors(path)
    dist.barrier()
    with safe_open(path, "pt") as f:
        back = {k: f.get_tensor(k) for k in f.keys()}
    want = compiled.full_state_dict()
    return {"equal": sorted(k for k in want if torch.equal(back.get(k), want[k]) and back[k].dtype == want[k].dtype),
            "names": sorted(want),
            "pieces": {n: tuple(compiled.piece(n).shape) for n in pins}}


def test_safetensors_saved_from_every_layout_equal_the_full_state(ranks, tmp_path):
    """Each part is sent to rank 0 once, point to point (`gather_to_first`): pieces split on one axis, on both,
    twice along one dim, whole; bfloat16, bool and int64 values."""
    for r in ranks(4).run(_save_pinned_layouts, str(tmp_path)):
        assert r["equal"] == r["names"], r
        assert r["pieces"]["a"] == (4, 3) and r["pieces"]["d"] == (2, 6) and r["pieces"]["b"] == (4, 6), r


def _dcp_save(rank: int, world: int, folder: str) -> None:
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=2))
    mesh = spmd.init_mesh((2,), ("dp",))
    tokens = torch.randint(0, 128, (4, 32))
    compiled = spmd.compile(model, mesh, (tokens,), mesh_spec=spec((2,), ("dp",)),
                            param_placements={"blocks.0.mlp.fc1.weight": [torch.distributed.tensor.Shard(0)]})
    dcp.save(compiled.sharded_state_dict(), checkpoint_id=folder)


def _dcp_load(rank: int, world: int, folder: str) -> float:
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    reference = GPT(GPTConfig(layers=2))
    with torch.device("meta"):
        model = GPT(GPTConfig(layers=2))
    mesh = spmd.init_mesh((2, 2), ("dp", "tp"))
    tokens = torch.randint(0, 128, (4, 32))
    compiled = spmd.compile(model, mesh, (tokens,), mesh_spec=spec((2, 2), ("dp", "tp")))
    # (saved before it has values, the pieces' memory would be written: refused on every rank, before any collective;
    # so is a state_dict() taken then and saved after init_weights put the pieces in new memory)
    early = compiled.state_dict()
    with pytest.raises(spmd.SpmdError, match="no values yet"):
        dcp.save(early, checkpoint_id=folder + "/never")
    compiled.init_weights(seed=1)
    with pytest.raises(spmd.SpmdError, match="before its pieces were put in new memory"):
        dcp.save(early, checkpoint_id=folder + "/never")
    state = compiled.sharded_state_dict()
    dcp.load(state, checkpoint_id=folder)
    compiled.load_sharded_state_dict(state)
    full = compiled.full_state_dict()
    return max(float((full[k] - v).abs().max()) for k, v in reference.state_dict().items())


def test_dcp_saved_on_one_mesh_loads_on_another(ranks, tmp_path):
    """torch.distributed.checkpoint: saved on (dp=2), loaded on (dp=2, tp=2) into a meta compile."""
    ranks(2).run(_dcp_save, str(tmp_path))
    assert ranks(4).run(_dcp_load, str(tmp_path)) == [0.0] * 4


BIG = dict(vocab=32000, seq=16, dim=2048, heads=16, layers=8)  # 466M parameters: 1.86 GB in fp32


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _big_meta_training(rank: int, world: int) -> dict:
    """Built on meta, compiled with every weight sharded over the 4 ranks (FSDP), initialized on shards,
    two SGD steps. Peak RSS growth over compile + init_weights, measured in this rank."""
    import gc

    from torch.distributed.tensor import Replicate, Shard

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM: the peak from here on
    before = _rss("VmRSS")
    with torch.device("meta"):
        model = GPT(GPTConfig(**BIG))
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    pins = {n: [Shard(0) if p.shape[0] % world == 0 else Replicate()] for n, p in model.named_parameters()}
    tokens = torch.randint(0, BIG["vocab"], (world, BIG["seq"]), generator=torch.Generator().manual_seed(1))
    mesh = spmd.init_mesh((world,), ("dp",))
    compiled = spmd.compile(model, mesh, (tokens, tokens), loss_fn=lm_loss, in_placements={"tokens": [Shard(0)]},
                            param_placements=pins, optimizer_state_factor=0)
    compiled.init_weights(seed=0)
    peak_growth = _rss("VmHWM") - before
    # (lists: tensors through the pool's queue would go through shared memory, which outlives no rank)
    samples = {name: compiled.get_parameter(name)[:3].tolist()
               for name in ("tok_emb.weight", "blocks.3.attn.q_proj.weight", "blocks.7.mlp.fc2.weight", "lm_head.weight")}
    # (SGD, without momentum: no state, so compiled with optimizer_state_factor=0; AdamW's first step spent 16 s
    # of this test's 69 faulting in its state's 3.7 GB over the four ranks)
    opt = torch.optim.SGD(compiled.parameters(), lr=0.5)
    local = compiled.shard_inputs(tokens, tokens)
    losses = []
    for _ in range(2):
        loss = compiled(*local)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"peak_growth": peak_growth, "full_bytes": full_bytes, "samples": samples, "losses": losses,
            "local_bytes": sum(p.numel() * p.element_size() for p in compiled.parameters())}


def test_a_model_no_rank_holds_trains_after_init_on_shards(ranks):
    """The big-model path: a 1.86 GB model, 4 gloo ranks; each rank's peak memory growth over compile and
    init stays under half the model, and the shards hold the single-device init (sampled rows)."""
    results = ranks(4).run(_big_meta_training)
    for rank, r in enumerate(results):
        assert r["full_bytes"] >= 1.5e9
        assert r["local_bytes"] <= r["full_bytes"] / 4 * 1.01, r["local_bytes"]
        assert r["peak_growth"] < 0.5 * r["full_bytes"], (rank, r["peak_growth"] / r["full_bytes"])
        assert all(math.isfinite(x) for x in r["losses"]) and r["losses"][1] < r["losses"][0], r["losses"]
    torch.manual_seed(0)
    reference = GPT(GPTConfig(**BIG))
    rows = BIG["vocab"] // 4, BIG["dim"] // 4  # each rank's first 3 rows of its dim-0 piece
    for name, param in reference.named_parameters():
        for rank, r in enumerate(results):
            if name in r["samples"]:
                per_rank = rows[0] if name in ("tok_emb.weight", "lm_head.weight") else param.shape[0] // 4
                start = rank * per_rank
                assert torch.equal(torch.tensor(r["samples"][name]), param.detach()[start:start + 3]), (name, rank)


def _deferred_nanogpt(rank: int, world: int) -> dict:
    from tests.models import NanoGPT

    torch.manual_seed(0)
    reference = NanoGPT()
    x = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    mesh = spmd.init_mesh((2,), ("tp",))
    compiled = spmd.compile(spmd.deferred_init(NanoGPT), mesh, (x,), mesh_spec=spec((2,), ("tp",)))
    compiled.init_weights(seed=0)
    full = compiled.full_state_dict()
    errors = {k: float((full[k] - v).abs().max()) for k, v in reference.state_dict().items()}
    out = float((compiled.gather_outputs(compiled(*compiled.shard_inputs(x))) - reference(x)).abs().max())
    return {"errors": errors, "out": out, "tied": compiled.get_parameter("wte.weight") is compiled.get_parameter(
        "lm_head.weight")}


def test_a_deferred_model_initializes_as_its_constructor_does(ranks):
    """nanoGPT's construction (its tie made as `wte.weight = lm_head.weight`, `self.apply(self._init_weights)`,
    a scaled normal_ on each c_proj) recorded by spmd.deferred_init and replayed on each rank's shards: bit
    for bit the single-device model's values, and its output."""
    for r in ranks(2).run(_deferred_nanogpt):
        assert max(r["errors"].values()) == 0.0, r["errors"]
        assert r["out"] < 1e-6 and r["tied"], r


def _one_rank_late(rank: int, world: int) -> dict:
    import io
    import os
    import sys
    import time

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    mesh = spmd.init_mesh((2,), ("tp",))
    compiled = spmd.compile(model, mesh, (torch.randn(4, 8),), mesh_spec=spec((2,), ("tp",)),
                            param_placements={"0.weight": [Shard(0)]})
    os.environ["SPMD_WAIT_WARN_S"] = "0.5"
    if rank == 1:
        time.sleep(2.5)  # (rank 0 alone in the gather: as under `if rank == 0:`, but this one comes at last)
    said, stderr = io.StringIO(), sys.stderr
    sys.stderr = said
    try:
        full = compiled.full_state_dict()
    finally:
        sys.stderr = stderr
        del os.environ["SPMD_WAIT_WARN_S"]
    return {"said": said.getvalue(), "equal": all(torch.equal(full[k], v) for k, v in model.state_dict().items())}


def test_a_rank_waiting_alone_in_a_collective_call_says_so(ranks):
    """Found by a probe: `full_state_dict()` called on rank 0 only waited forever without a word. A rank that
    waits in a call every rank must make now names the call and the way out (and the call still completes
    when the others come)."""
    first, second = ranks(2).run(_one_rank_late)
    assert "spmd: rank 0 has waited 0.5 s in full_state_dict() for the other ranks. full_state_dict() is " \
           "collective: every rank must call it" in first["said"], first["said"]
    assert "What to do: call it on every rank, and keep only what one rank does alone to that rank: " \
           "`state = compiled.full_state_dict(); if rank == 0: torch.save(state, path)`" in first["said"]
    assert second["said"] == "" and first["equal"] and second["equal"]


def _loads_that_ranks_must_make_together(rank: int, world: int, folder: str) -> dict:
    import os

    import torch.distributed as dist
    from safetensors.torch import save_model

    from tests.models import gpt2

    torch.manual_seed(0)
    path = os.path.join(folder, "model.safetensors")
    if rank == 0:
        save_model(gpt2(), path)
        with open(path, "rb+") as f:  # (cut short: only the ranks whose slices lie in the lost bytes fail)
            f.truncate(os.path.getsize(path) - 4096)
    dist.barrier()
    with torch.device("meta"):
        model = gpt2()
    tokens = torch.randint(0, 128, (4, 32))
    compiled = spmd.compile(model, spmd.init_mesh((2,), ("tp",)), (tokens,), mesh_spec=spec((2,), ("tp",)),
                            param_placements={"lm_head.weight": [Shard(1)]})
    refused = []
    torch.manual_seed(1000 + rank)  # (a data loader's habit: each rank its own seed)
    for load in (lambda: compiled.init_weights(), lambda: compiled.load_safetensors(path)):
        try:
            load()
        except spmd.SpmdError as e:
            refused.append(str(e))
    compiled.init_weights(seed=0)
    for where in (folder, os.path.join(folder, "no", "model.safetensors")):  # (a folder; a folder not there)
        try:
            compiled.save_safetensors(where)
        except spmd.SpmdError as e:
            refused.append(str(e))
    good = os.path.join(folder, "good.safetensors")
    compiled.save_safetensors(good)  # (on every rank, it returns once the file is whole)
    compiled.load_safetensors(good)
    with warnings.catch_warnings(record=True) as caught:  # (init after a load: the checkpoint overwritten)
        warnings.simplefilter("always")
        compiled.init_weights(seed=1)
    return {"refused": refused, "warned": [str(w.message) for w in caught if "init_weights replays" in str(w.message)]}


def test_loads_each_rank_would_make_apart_are_refused_on_every_rank(ranks, tmp_path):
    """Found by a probe: `init_weights()` with no seed after per-rank seeding drew each rank's own replicas (0.108
    off rank 0's, silently), and a truncated checkpoint failed on the rank whose slice lay in the lost bytes alone
    while the others waited out the mesh's timeout; save_safetensors to a folder failed on rank 0 alone, after
    gathering the whole model."""
    results = ranks(2).run(_loads_that_ranks_must_make_together, str(tmp_path))
    for rank, r in enumerate(results):
        assert len(r["refused"]) == 4, r
        assert len(r["warned"]) == 1 and "were loaded" in r["warned"][0] and "call init_weights first" in \
            r["warned"][0], r
        assert ("is a folder" if rank == 0 else "cannot write") in r["refused"][2], r
        assert ("does not exist" if rank == 0 else "cannot write") in r["refused"][3], r
        assert "ranks' generators differ along 'tp'" in r["refused"][0] and "init_weights(seed=...)" in r["refused"][0]
    truncated = [r["refused"][1] for r in results]
    assert any("truncated checkpoint" in t for t in truncated), truncated
    assert all("truncated checkpoint" in t or "failed on another rank of the mesh" in t for t in truncated), truncated


def _stale_copy_on_another_machine(rank: int, world: int, folder: str) -> dict:
    import os

    import torch.distributed as dist

    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=1, dim=32, heads=4, vocab=64, seq=16))
    tokens = torch.randint(0, 64, (2, 16))
    mesh = spmd.init_mesh((2,), ("dp",))
    compiled = spmd.compile(model, mesh, (tokens,), mesh_spec=spec((2,), ("dp",)))
    own = os.path.join(folder, f"machine{rank}")  # (each rank's "machine" has its own disk)
    os.makedirs(own, exist_ok=True)
    path = os.path.join(own, "ckpt.safetensors")
    compiled.save_safetensors(os.path.join(folder, "old.safetensors"))
    dist.barrier()
    if rank == 1:  # an older checkpoint of the same model under the same name, on this machine only
        os.replace(os.path.join(folder, "old.safetensors"), path)
    dist.barrier()
    with torch.no_grad():
        for p in compiled.parameters():
            p.add_(0.5)  # (trained since)
    compiled.save_safetensors(os.path.join(folder, "machine0", "ckpt.safetensors"))  # (rank 0 writes, on its disk)
    before = {k: v.clone() for k, v in compiled.state_dict().items()}
    try:
        compiled.load_safetensors(path)
        message = "loaded"
    except spmd.SpmdError as e:
        message = str(e)
    untouched = all(torch.equal(v, before[k]) for k, v in compiled.state_dict().items())
    return {"message": message, "untouched": untouched}


def test_a_checkpoint_each_machine_holds_its_own_copy_of_is_refused_on_every_rank(ranks, tmp_path):
    """Found by a probe: save_safetensors writes on the mesh's first rank only, on its own machine's disk; another
    machine holding an older file under the same name loaded it (the ranks compared headers and sizes, which any
    checkpoint of the model shares), and its replicas trained from the old weights (0.0103 off), silently. The
    ranks now compare samples of the files' contents, before any piece is written."""
    for r in ranks(2).run(_stale_copy_on_another_machine, str(tmp_path)):
        assert "the ranks read different checkpoints" in r["message"] and r["untouched"], r


def _cut_shard_on_one_machine(rank: int, world: int, folder: str) -> str:
    import json
    import os
    import shutil

    import torch.distributed as dist
    from safetensors import safe_open

    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=1, dim=32, heads=4, vocab=64, seq=16))
    tokens = torch.randint(0, 64, (2, 16))
    compiled = spmd.compile(model, spmd.init_mesh((2,), ("dp",)), (tokens,), mesh_spec=spec((2,), ("dp",)))
    whole = os.path.join(folder, "whole.safetensors")
    compiled.save_safetensors(whole)
    own = os.path.join(folder, f"machine{rank}")
    os.makedirs(own, exist_ok=True)
    shard = os.path.join(own, "model-00001-of-00001.safetensors")
    shutil.copy(whole, shard)
    with safe_open(whole, "pt") as f:
        names = list(f.keys())
    with open(os.path.join(own, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {n: os.path.basename(shard) for n in names}}, f)
    if rank == 1:
        with open(shard, "r+b") as f:
            f.truncate(100)  # (its header cut)
    dist.barrier()
    try:
        compiled.load_safetensors(own)
    except spmd.SpmdError as e:
        return str(e)
    return "loaded"


def test_a_shard_cut_on_one_machine_is_refused_on_every_rank_at_once(ranks, tmp_path):
    """Found by a review: the ranks' comparison before the load read the shards' headers, and one cut on one
    machine raised there alone, while the others waited out the mesh's timeout."""
    first, second = ranks(2).run(_cut_shard_on_one_machine, str(tmp_path))
    assert "failed on another rank of the mesh" in first and "nothing was loaded on any rank" in first, first
    assert "could not be read whole" in second, second
