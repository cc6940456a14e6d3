"""Batches of other shapes than the compiled ones (an epoch's smaller last batch, bucketed sequence lengths) run
over the first plan's pieces: `shard_inputs` compiles for them, and training steps the same weights, equal to one
device (runtime/shapes.py)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

import spmd
from spmd.core.errors import SpmdError
from tests.models import GPT, MLP, GPTConfig, gpt2
from tests.support import lm_loss, spec


def _train_mlp_on_ragged_batches(rank: int, world: int) -> dict:
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = MLP(16, 64)
        reference = copy.deepcopy(model)
        g = torch.Generator().manual_seed(1)
        batches = {n: (torch.randn(n, 16, generator=g), torch.randn(n, 16, generator=g)) for n in (8, 5, 6)}
        mesh = spmd.init_mesh((2,), ("tp",))
        # (Megatron's MLP, and the batch split too: a batch of 5 cannot be, so its plan lays the input out otherwise)
        compiled = spmd.compile(model, mesh, batches[8], loss_fn=F.mse_loss, mesh_spec=spec((2,), ("tp",)),
                                param_placements={"fc1.weight": [Shard(0)], "fc1.bias": [Shard(0)],
                                                  "fc2.weight": [Shard(1)]},
                                in_placements={"x": [Shard(0)]})
        opt = torch.optim.SGD(compiled.parameters(), lr=0.1, momentum=0.9)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        losses, ref_losses = [], []
        for n in (8, 8, 5, 6, 8, 5):
            x, y = batches[n]
            loss = compiled(*compiled.shard_inputs(x, y))
            loss.backward()
            opt.step()
            opt.zero_grad()
            ref_loss = F.mse_loss(reference(x), y)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            losses.append(loss.item())
            ref_losses.append(ref_loss.item())
        # a data-parallel loader's last batch: each rank's slice, given to the call as it is (no shard_inputs)
        x, y = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)
        layouts = compiled.input_placements()
        loss = compiled(*(t.chunk(2)[rank] if layouts[name] == (Shard(0),) else t
                          for name, t in (("x", x), ("target", y))))
        losses.append(loss.item())
        ref_losses.append(F.mse_loss(reference(x), y).item())
        full = compiled.full_state_dict()
        err = max(float((full[k] - v).abs().max()) for k, v in reference.state_dict().items())
        try:  # (an empty batch: a probe met the trace's "float division by zero" and advice on torch.export)
            compiled.shard_inputs(torch.randn(0, 16), torch.randn(0, 16))
            empty = ""
        except spmd.SpmdError as e:
            empty = str(e)
        return {"losses": losses, "ref_losses": ref_losses, "err": err, "variants": sorted(compiled._variants),
                "empty": empty,
                "input_layouts": {k[0][0]: str(v.input_specs[0].placements) for k, v in compiled._variants.items()},
                "pieces": {k: tuple(p.shape) for k, p in compiled.named_parameters()},
                "optimizer_states": len(opt.state)}
    finally:
        torch.set_default_dtype(torch.float32)


def test_smaller_batches_train_the_same_weights_as_one_device(ranks):
    """An epoch's last, smaller batch (and one of 5 rows, which no layout of the batch splits on 2 ranks) runs
    through graphs compiled for it over the first plan's pieces: one set of weights, one optimizer, equal to one
    device; so does a data-parallel loader's last batch, each rank's slice given to the call. Before, any other
    batch size was refused."""
    for r in ranks(2).run(_train_mlp_on_ragged_batches):
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-9)
        assert r["err"] < 1e-9
        assert r["variants"] == [((4, 16), (4, 16)), ((5, 16), (5, 16)), ((6, 16), (6, 16))]  # (each compiled once)
        assert r["input_layouts"][6] == str((Shard(0),))  # (the first plan's layout, where it divides)
        assert r["input_layouts"][5] != str((Shard(0),))
        assert r["pieces"]["fc1.weight"] == (32, 16) and r["pieces"]["fc2.weight"] == (16, 32)
        assert r["optimizer_states"] == 4
        assert "'x', 'target' are empty (shape [0, 16])" in r["empty"] and "skip the empty batch" in r["empty"]


def _infer_gpt_on_buckets(rank: int, world: int) -> dict:
    from spmd.runtime import shapes

    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=1)).eval()
    mesh = spmd.init_mesh((2,), ("tp",))
    g = torch.Generator().manual_seed(1)
    compiled = spmd.compile(model, mesh, (torch.randint(0, 128, (4, 16), generator=g),), training=False,
                            mesh_spec=spec((2,), ("tp",)), param_placements={"lm_head.weight": [Shard(0)]})
    errors = {}
    with torch.no_grad():
        for shape in ((4, 16), (4, 8), (3, 16), (4, 8)):  # (sequence buckets, and a smaller batch)
            tokens = torch.randint(0, 128, shape, generator=g)
            out = compiled.gather_outputs(compiled(*compiled.shard_inputs(tokens)))
            errors[shape] = float((out - model(tokens)).abs().max())
    shapes.MAX_VARIANTS = 2
    try:
        compiled.shard_inputs(torch.randint(0, 128, (2, 16), generator=g))
        refused = ""
    except SpmdError as e:
        refused = str(e)
    finally:
        shapes.MAX_VARIANTS = 8
    try:  # (each rank its own batch size, none the compiled one)
        compiled.shard_inputs(torch.randint(0, 128, (1 + rank, 16), generator=g))
        apart = ""
    except SpmdError as e:
        apart = str(e)
    return {"errors": errors, "variants": len(compiled._variants), "refused": refused, "apart": apart}


def test_bucketed_shapes_infer_equal_to_one_device(ranks):
    """Sequence buckets and a smaller batch, each compiled at its first cut over the same pieces, gathered in its
    own output layout; past the limit on sets of shapes, a refusal that says to bucket or pad; ranks given batches
    of different sizes are told so before any compiling."""
    for r in ranks(2).run(_infer_gpt_on_buckets):
        assert max(r["errors"].values()) < 1e-5, r["errors"]
        assert r["variants"] == 2
        assert "compiled for 3 set(s) of input shapes" in r["refused"] and "bucket" in r["refused"]
        assert "ranks got inputs of different shapes (rank 0: [1, 16]; rank 1: [2, 16])" in r["apart"]


def _pinned_output_on_an_odd_batch(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = MLP(16, 32).eval()
    mesh = spmd.init_mesh((2,), ("dp",))
    compiled = spmd.compile(model, mesh, (torch.randn(8, 16),), training=False, mesh_spec=spec((2,), ("dp",)),
                            out_placements={0: [Shard(0)]})
    errors = {}
    with torch.no_grad():
        for batch in (8, 5, 6):  # (5 cannot be split over 2: the output pin is dropped for it, as an input's is)
            x = torch.randn(batch, 16)
            errors[batch] = float((compiled.gather_outputs(compiled(*compiled.shard_inputs(x))) - model(x)).abs().max())
    return {"errors": errors, "plans": [key for key in compiled.plans]}


def test_an_output_pin_that_does_not_divide_a_batch_of_other_shapes_is_dropped_for_it(ranks):
    """Found by a probe: `out_placements={0: [Shard(0)]}` made for a batch of 8 refused a batch of 5 with the pin's
    error, where an input's pin is dropped for shapes it does not divide."""
    for r in ranks(2).run(_pinned_output_on_an_odd_batch):
        assert max(r["errors"].values()) < 1e-6, r["errors"]
        assert r["plans"] == [((8, 16),), ((5, 16),), ((6, 16),)], r["plans"]


def _train_gpt2_last_batch(rank: int, world: int) -> dict:
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = gpt2().double().train()
        reference = copy.deepcopy(model)
        g = torch.Generator().manual_seed(1)
        mesh = spmd.init_mesh((2,), ("tp",))
        ids = torch.randint(0, 128, (4, 16), generator=g)
        compiled = spmd.compile(model, mesh, example_kwargs=dict(input_ids=ids, labels=ids), training=True,
                                mesh_spec=spec((2,), ("tp",)),
                                param_placements={"transformer.h.0.mlp.c_fc.weight": [Shard(1)],
                                                  "transformer.h.0.mlp.c_proj.weight": [Shard(0)]})
        opt = torch.optim.AdamW(compiled.parameters(), lr=1e-3)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
        losses, ref_losses = [], []
        for n in (4, 3, 4):
            ids = torch.randint(0, 128, (n, 16), generator=g)
            args, kwargs = compiled.shard_inputs(input_ids=ids, labels=ids)
            out = compiled(*args, **kwargs)
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            ref = reference(input_ids=ids, labels=ids)
            ref.loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            losses.append(out.loss.item())
            ref_losses.append(ref.loss.item())
        full = compiled.full_state_dict()
        err = max(float((full[k] - v).abs().max()) for k, v in reference.state_dict().items() if k in full)
        return {"losses": losses, "ref_losses": ref_losses, "err": err, "variants": len(compiled._variants)}
    finally:
        torch.set_default_dtype(torch.float32)


def test_a_transformers_model_takes_an_epochs_last_batch(ranks):
    """transformers' GPT-2 given its labels (its own loss, keyword inputs): a last batch of 3 trains the same
    weights as the batches of 4, equal to one device."""
    for r in ranks(2).run(_train_gpt2_last_batch):  # (transformers takes the loss of float32 logits)
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-6)
        assert r["err"] < 1e-6
        assert r["variants"] == 1


def _slices_of_a_replicated_input(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=64, seq=16, dim=32, heads=2, layers=1))
    ids = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(1))
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    pins = {"blocks.0.mlp.fc1.weight": [Shard(0)], "blocks.0.mlp.fc2.weight": [Shard(1)], "lm_head.weight": [Shard(0)]}
    compiled = spmd.compile(model, spmd.init_mesh((2,), ("tp",)), (x, y),
                            loss_fn=lm_loss, mesh_spec=spec((2,), ("tp",)), param_placements=pins,
                            in_placements={"targets": [Shard(0)]})
    layouts = {s.name: str(s.placements) for s in compiled._shapes.input_specs}
    compiled(*compiled.shard_inputs(x, y)).backward()
    try:  # (each rank's own slice of both, a data-parallel loader's habit, where tokens are taken whole)
        compiled(x.chunk(2)[rank], y.chunk(2)[rank]).backward()
        return {"refused": None, "layouts": layouts}
    except SpmdError as e:
        return {"refused": str(e), "layouts": layouts}


def test_a_ranks_slice_of_an_input_taken_whole_is_named_as_such(ranks):
    """Found by a probe: tokens taken whole (Replicate) and targets split on dp; each rank called with its own slice
    of both. The slices were read as pieces of a batch of 2 tokens beside 4 targets, and the user got the trace's
    "Expected input batch_size (32) to match target batch_size (64)" from inside their model. The refusal now says
    how the inputs were read, and which input the plan takes whole."""
    for r in ranks(2).run(_slices_of_a_replicated_input):
        assert "Replicate" in r["layouts"]["tokens"] and "Shard" in r["layouts"]["targets"], r
        assert r["refused"] and "were read as this rank's pieces of inputs laid out as compiled (tokens [2, 16] as a " \
            "piece of [2, 16] [R]; targets [2, 16] as a piece of [4, 16] [S(0)])" in r["refused"], r
        assert "The plan takes tokens whole on every rank" in r["refused"] and "batch_size" in r["refused"], r
