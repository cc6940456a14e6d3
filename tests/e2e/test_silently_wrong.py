"""Training on gloo ranks that used to come back silently wrong: tied weights (one tensor under every
name) and custom autograd Functions (their own backward), each equal to one device."""
from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import spmd
from tests.models import Quantized, tied_lm
from tests.support import spec, train_side_by_side


# ---- tied weights --------------------------------------------------------------------------------

def _logits_loss(out, labels):
    return F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())


def _train_tied(rank: int, world: int, name: str, mesh_shape: tuple, steps: int = 3) -> dict:
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = tied_lm(name)
        reference = copy.deepcopy(model)
        g = torch.Generator().manual_seed(1)
        ids, labels = torch.randint(0, 128, (4, 16), generator=g), torch.randint(0, 128, (4, 16), generator=g)
        names = ("dp", "tp")[-len(mesh_shape):]
        mesh = spmd.init_mesh(mesh_shape, names)
        compiled = spmd.compile(model, mesh, (ids, labels), loss_fn=_logits_loss, mesh_spec=spec(mesh_shape, names))
        losses, ref_losses, opt = train_side_by_side(compiled, reference, (ids,), (labels,), _logits_loss, steps)
        full = compiled.full_state_dict()
        expected = dict(reference.named_parameters(remove_duplicate=False))
        errors = {k: float((full[k] - v).abs().max()) for k, v in expected.items() if k in full}
        return {"losses": losses, "ref_losses": ref_losses, "errors": errors, "missing": sorted(set(expected) - set(full)),
                "n_params": len(list(compiled.parameters())), "ref_n_params": len(list(reference.parameters())),
                "n_optimizer_states": len(opt.state), "sharded": sorted(compiled.sharded_state_dict()),
                "aliases": dict(compiled._aliases)}
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("name,mesh_shape", [("gpt2", (2, 2)), ("bert", (2,)), ("gemma", (2,))])
def test_tied_weights_train_as_one_tensor_under_every_name(ranks, name, mesh_shape):
    """GPT-2, BERT and Gemma tie the output head to the input embedding: one tensor, one gradient (the
    sum over both uses), one optimizer state; every name in the state dicts equals one device's. (SGD with
    momentum: AdamW's first step turns gradients that are zero up to rounding into +-lr updates, so it
    compares rounding noise, not the plan.)"""
    world = 1
    for s in mesh_shape:
        world *= s
    for r in ranks(world).run(_train_tied, name, mesh_shape):
        assert r["aliases"], "the model ties weights"
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-9)
        assert not r["missing"], r["missing"]
        assert max(r["errors"].values()) < 1e-9, r["errors"]
        assert r["n_params"] == r["ref_n_params"] == r["n_optimizer_states"]
        assert set(r["aliases"]) <= set(r["sharded"])


def _train_custom(rank: int, world: int, steps: int = 3) -> dict:
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = Quantized()
        reference = copy.deepcopy(model)
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
        mesh = spmd.init_mesh((2,), ("tp",))
        compiled = spmd.compile(model, mesh, (x, y), loss_fn=F.mse_loss, mesh_spec=spec((2,), ("tp",)))
        losses, ref_losses, _ = train_side_by_side(compiled, reference, (x,), (y,), F.mse_loss, steps,
                                                   optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
        full = compiled.full_state_dict()
        err = max(float((full[k] - v).abs().max()) for k, v in reference.named_parameters())
        return {"losses": losses, "ref_losses": ref_losses, "param_err": err,
                "functions": compiled.plan.stats.get("custom_functions")}
    finally:
        torch.set_default_dtype(torch.float32)


def test_custom_autograd_functions_keep_their_backward_in_training(ranks):
    for r in ranks(2).run(_train_custom):
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-9)
        assert r["param_err"] < 1e-9, r




# ---- random generators that differ across ranks -------------------------------------------------------

def _dropout_step(rank: int, world: int, shape=(2,), names=("tp",), seed_of=lambda rank: rank) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 16)).train()
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    mesh = spmd.init_mesh(shape, names)
    compiled = spmd.compile(model, mesh, (x, y), loss_fn=F.mse_loss, mesh_spec=spec(shape, names))
    local = compiled.shard_inputs(x, y)
    torch.manual_seed(100 + seed_of(rank))  # per-rank seeds (for data order, say) left in the global generator
    try:
        compiled(*local)
        differs = None
    except spmd.SpmdError as e:
        differs = str(e)
    torch.manual_seed(7)  # seeded alike: the step runs, and every rank drew the same mask
    loss = float(compiled(*local))
    return {"differs": differs, "loss": loss}


def test_ranks_whose_random_generators_differ_stop_before_drawing_different_masks(ranks):
    """A graph with dropout draws each mask whole on every rank (rules/random.py). Ranks seeded apart drew
    different masks for one replicated value, and the replicas drifted apart without a word; every rank
    now raises at the first call, and seeded alike they run and agree."""
    results = ranks(2).run(_dropout_step)
    for r in results:
        assert r["differs"] and "random generators differ (along mesh axis 'tp', 2 states among 2 ranks: rank 0 | rank 1)" in r["differs"], r
        assert "What to do: seed every rank alike" in r["differs"]
        assert "draws random numbers (native_dropout): " in r["differs"], r  # (what it draws, by name)
    assert results[0]["loss"] == results[1]["loss"]


@torch.library.custom_op("spmd_e2e::noise", mutates_args=())
def _noise(x: torch.Tensor) -> torch.Tensor:
    """A library's op that draws inside, untagged (no rule: it runs whole on every rank)."""
    return x * (torch.rand_like(x) + 0.5)


@_noise.register_fake
def _(x):
    return torch.empty_like(x)


class _Noisy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.b(_noise(self.a(x)))


def _custom_noise_step(rank: int, world: int) -> dict:
    import warnings

    torch.manual_seed(0)
    x = torch.randn(8, 16)
    mesh = spmd.init_mesh((2,), ("tp",))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", spmd.UnknownOpWarning)
        compiled = spmd.compile(_Noisy(), mesh, (x,), mesh_spec=spec((2,), ("tp",)))
    local = compiled.shard_inputs(x)
    torch.manual_seed(100 + rank)
    try:
        compiled(*local)
        differs = None
    except spmd.SpmdError as e:
        differs = str(e)
    torch.manual_seed(7)
    out = compiled.gather_outputs(compiled(*local))
    return {"differs": differs, "sum": float(out.sum())}


def test_ranks_whose_generators_differ_stop_before_a_custom_op_draws_apart(ranks):
    """Found by a review: the ranks' generators were compared only for ops tagged as random; a
    `torch.library.custom_op` drawing inside (untagged, run whole on every rank) drew each rank's own numbers where
    the ranks were seeded apart. Such an op now counts as a draw: every rank raises, and seeded alike they agree."""
    results = ranks(2).run(_custom_noise_step)
    for r in results:
        assert r["differs"] and "random generators differ" in r["differs"], r
    assert results[0]["sum"] == results[1]["sum"]


def _seed_per_dp_row(rank: int) -> int:
    return rank // 2  # the (dp, tp) coordinate's dp: tp peers alike, dp peers apart


def test_generators_are_compared_along_each_mesh_axis(ranks):
    """On a (2, 2) mesh the digests are gathered over each axis's own group (no collective over the world):
    ranks alike along tp but apart along dp are caught, and the message names the axis and its ranks."""
    results = ranks(4).run(_dropout_step, (2, 2), ("dp", "tp"), _seed_per_dp_row)
    for rank, r in enumerate(results):
        peers = f"rank {rank % 2} | rank {rank % 2 + 2}"
        assert r["differs"] and f"along mesh axis 'dp', 2 states among 2 ranks: {peers}" in r["differs"], r
        assert "'tp'" not in r["differs"], r
    assert len({r["loss"] for r in results}) == 1


def _seed_apart_on_rank_3(rank: int) -> int:
    return int(rank == 3)


def test_every_rank_stops_when_one_rank_alone_is_seeded_apart(ranks):
    """Rank 0's own axes (ranks 0-1 on tp, 0-2 on dp) agree when rank 3 alone differs: it learns of it from
    a flag reduced over the mesh, and stops too, instead of running into a collective its peers left."""
    results = ranks(4).run(_dropout_step, (2, 2), ("dp", "tp"), _seed_apart_on_rank_3)
    assert "elsewhere in the mesh" in results[0]["differs"], results[0]
    for r in results[1:]:
        assert "along mesh axis" in r["differs"], r
    assert len({r["loss"] for r in results}) == 1


# ---- replicated inputs that differ across ranks -------------------------------------------------------

def _replicated_mlp():
    """(model, x, y, mesh, the model compiled on (2,) with both inputs whole on every rank)."""
    from torch.distributed.tensor import Replicate

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16))
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    mesh = spmd.init_mesh((2,), ("dp",))
    compiled = spmd.compile(model, mesh, (x, y), loss_fn=F.mse_loss, mesh_spec=spec((2,), ("dp",)),
                            in_placements={"input": [Replicate()], "target": [Replicate()]})
    return model, x, y, mesh, compiled


def _own_batches(rank: int, world: int) -> dict:
    _, x, y, _, compiled = _replicated_mlp()
    g = torch.Generator().manual_seed(rank)  # a data-parallel loader: a batch of this rank's own
    try:
        compiled(torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g))
        differs = None
    except spmd.SpmdError as e:
        differs = str(e)
    return {"differs": differs, "loss": float(compiled(*compiled.shard_inputs(x, y)))}


def test_ranks_fed_batches_of_their_own_for_a_replicated_input_stop_at_the_first_call(ranks):
    """A plan that takes the batch whole on every rank, fed by a data-parallel loader (each rank its own
    batch): each rank trained on other data with the weights it holds in common with its peers, and the
    replicas drifted apart, silently. The first call compares the replicated inputs' digests."""
    results = ranks(2).run(_own_batches)
    for r in results:
        assert r["differs"] and "inputs the plan replicates differ between ranks ('input' along 'dp', 'target' " \
            "along 'dp')" in r["differs"] and "compiled.shard_inputs" in r["differs"], r
    assert results[0]["loss"] == results[1]["loss"]


class _PerCount(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x, count):
        return self.fc(x).sum() / count


def _own_counts(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    x, count = torch.randn(8, 16), torch.tensor(8.0)
    compiled = spmd.compile(_PerCount(), spmd.init_mesh((2,), ("dp",)), (x, count), training=True,
                            mesh_spec=spec((2,), ("dp",)), in_placements={"x": [Shard(0)], "count": [Replicate()]})
    try:  # (each rank its own rows, as a data-parallel loader gives them, with its own count)
        compiled(x[4 * rank:4 * rank + 4], torch.tensor(4.0 + rank))
        return {}
    except spmd.SpmdError as e:
        return {"refused": str(e)}


def test_a_number_each_rank_counts_for_itself_is_told_it_cannot_be_split(ranks):
    """Found by a probe: transformers' `num_items_in_batch` counted on each rank was refused with the way out to pin
    it sharded, which a number cannot be."""
    for r in ranks(2).run(_own_counts):
        assert "inputs the plan replicates differ between ranks ('count' along 'dp')" in r["refused"], r
        assert "A number ('count') cannot be split: give every rank the whole batch's" in r["refused"], r


def _own_batches_after_a_warm_up(rank: int, world: int) -> dict:
    model, x, y, mesh, compiled = _replicated_mlp()
    g = torch.Generator().manual_seed(rank)
    own = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)  # (a loader's batch of this rank's own)
    seen = {}
    compiled(x, y)  # (a warm-up call on the example batch: the same on every rank)
    try:
        compiled(*own)  # (call 2)
    except spmd.SpmdError as e:
        seen["module"] = str(e)
    cut = spmd.compile(model, mesh, (x,), mesh_spec=spec((2,), ("dp",)), in_placements={"input": [Shard(0)]})
    for call in range(1, 5):  # (shard_inputs' calls 1, 2 and 4 are checked)
        try:
            cut.shard_inputs(own[0] if call == 4 else x)
        except spmd.SpmdError as e:
            seen[f"shard_inputs {call}"] = str(e)
    cut.shard_inputs(x)  # (call 5: checked, as the check at 4 failed; it passes)
    try:  # (call 6, not due: each rank's own slice of a batch, of new shapes, given as if whole; a probe)
        cut.shard_inputs(x[4 * rank:4 * rank + 4])
    except spmd.SpmdError as e:
        seen["shard_inputs 6, a slice"] = str(e)
    return seen


def test_batches_of_each_ranks_own_after_a_first_call_on_one_are_caught(ranks):
    """Found by a probe: after a warm-up call on one batch, a data-parallel loader fed each rank its own and nothing
    stopped it (the check ran at the first call only): half of each rank's rows were dropped at every step (loss
    4.55533, eager's on rows 0-1 of rank 0's batch and 2-3 of rank 1's). The inputs are compared again at the
    generators' calls (2, 4, 8, ..., then every k-th), and so are shard_inputs' full inputs, and at any call of
    shard_inputs that compiles for new shapes (each rank's slice given as if whole: trained on half of it, 0.021
    off after a step; a probe)."""
    for r in ranks(2).run(_own_batches_after_a_warm_up):
        assert "inputs the plan replicates differ between ranks at call 2 of this module ('input' along 'dp', " \
            "'target' along 'dp')" in r.get("module", ""), r
        assert list(r) == ["module", "shard_inputs 4", "shard_inputs 6, a slice"], r
        assert "shard_inputs's full inputs differ between ranks ('input' along 'dp')" in r["shard_inputs 4"], r
        # (a call the counts skip, compiling for new shapes: checked there, as every rank compiles together)
        assert "shard_inputs's full inputs differ between ranks ('input' along 'dp')" in r["shard_inputs 6, a slice"]


def _shards_of_own_batches(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16))
    x = torch.randn(8, 16)
    mesh = spmd.init_mesh((2,), ("dp",))
    compiled = spmd.compile(model, mesh, (x,), mesh_spec=spec((2,), ("dp",)))
    g = torch.Generator().manual_seed(rank)  # (each rank's own "global" batch, drawn unseeded alike)
    try:
        compiled.shard_inputs(torch.randn(8, 16, generator=g))
        differs = None
    except spmd.SpmdError as e:
        differs = str(e)
    out = compiled.gather_outputs(compiled(*compiled.shard_inputs(x)))
    return {"differs": differs, "error": float((out - model(x)).abs().max())}


def test_shard_inputs_given_another_batch_on_each_rank_stops_at_its_first_call(ranks):
    """Found by a probe: full inputs drawn unseeded on each rank went through shard_inputs, the call and
    gather_outputs without a word, and the output mixed the ranks' batches (0.56 and 0.79 off each rank's own
    eager result). Its first call compares the full inputs' digests, as verify does."""
    for r in ranks(2).run(_shards_of_own_batches):
        assert r["differs"] and "shard_inputs's full inputs differ between ranks ('input' along 'dp')" in \
            r["differs"] and "pass each rank's slice" in r["differs"], r
        assert r["error"] < 1e-6, r



def _refilled_buffer(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16))
    x, y = torch.zeros(8, 16), torch.zeros(8, 16)  # (static input buffers, refilled in place at every step)
    mesh = spmd.init_mesh((2,), ("dp",))
    compiled = spmd.compile(model, mesh, (x, y), loss_fn=F.mse_loss, mesh_spec=spec((2,), ("dp",)),
                            in_placements={"input": [Shard(0)], "target": [Shard(1)]})
    g = torch.Generator().manual_seed(1)
    b = [(torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)) for _ in range(2)]
    got, want = [], []

    def call(pieces, x_now, y_now):
        got.append(float(compiled(*pieces)))
        want.append(float(F.mse_loss(model(x_now), y_now)))

    with torch.no_grad():
        x.copy_(b[0][0])
        y.copy_(b[0][1])
        pieces = compiled.shard_inputs(x[:], y)  # (the input's rows: a view of x, through a view; the target's
        x.copy_(b[1][0])                         # columns: a copy of y)
        y.copy_(b[1][1])
        call(pieces, b[1][0], b[1][1])  # (both refilled: the call sees the new batch, the copy cut again)
        y.copy_(b[0][1])
        call(pieces, b[1][0], b[0][1])  # (only the copy's batch written)
        pieces[0][0] = 0.0  # (a view piece written: its batch with it)
        masked = b[1][0].clone()
        masked[[0, 4]] = 0.0  # (each rank's first row)
        call(pieces, masked, b[0][1])
        pieces[1][:, 0] = 1.0  # (a copy written itself, its batch not: its own values, as masking labels means)
        target = b[0][1].clone()
        target[:, [0, 8]] = 1.0  # (each rank's first column)
        call(pieces, masked, target)
        y.copy_(b[1][1])  # (the copy's batch written since the call that saw the piece's own values: followed)
        call(pieces, masked, b[1][1])
        pieces[1][:, 0] = 2.0  # (both the copy and its batch written since the last call: which is meant?)
        y.copy_(b[0][1])
        try:
            compiled(*pieces)
            refused = None
        except spmd.SpmdError as e:
            refused = str(e)
    return {"refused": refused, "losses": got, "want": want}


def test_pieces_follow_their_batch_written_in_place_after_the_cut(ranks):
    """Found by a probe: shard_inputs cuts a view of the batch where the slice is one (rows) and a copy elsewhere
    (columns), so a loop that cut once and refilled the batch in place trained on the new rows and the old
    columns, silently (a review: also where the batch came through a view, `x[:]`). A copy whose batch was written
    since the last call is now cut again, as a view follows; a piece written itself keeps its values; a copy
    written where its batch was too is refused."""
    for r in ranks(2).run(_refilled_buffer):
        assert r["refused"] and "input 'target' ([S(1)])" in r["refused"] and \
            "shard_inputs(...) again" in r["refused"], r
        assert len(r["losses"]) == 5, r
        for got, want in zip(r["losses"], r["want"]):
            assert abs(got - want) <= 1e-6 * abs(want), r


def _refilled_under_inference_mode(rank: int, world: int) -> dict:
    """A static buffer refilled under inference mode, its pieces cut once: rows (views), columns (copies), and
    columns cut by one module and passed to another compiled from the same model."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16)).eval()
    mesh = spmd.init_mesh((2,), ("dp",))
    rows, cols, other = (spmd.compile(model, mesh, (torch.zeros(8, 16),), mesh_spec=spec((2,), ("dp",)),
                                      in_placements={"input": [p]}) for p in (Shard(0), Shard(1), Shard(1)))
    g = torch.Generator().manual_seed(1)
    errors = []
    with torch.inference_mode():
        buf = torch.zeros(8, 16)
        pieces = {m: m.shard_inputs(buf) for m in (rows, cols)}
        for _ in range(3):
            buf.copy_(torch.randn(8, 16, generator=g))
            want = model(buf)
            for m, given in ((rows, pieces[rows]), (cols, pieces[cols]), (other, pieces[cols])):
                errors.append(float((m.gather_outputs(m(*given)) - want).abs().max()))
    return {"errors": errors}


def test_a_buffer_refilled_under_inference_mode(ranks):
    """Found by a review: views of inference tensors have no `_base`, so row pieces (views) were taken for copies
    and the refilled buffer refused, at 25x the call's time; and pieces one module cut, passed to another compiled
    from the same model, kept the old batch (0.19 off)."""
    for r in ranks(2).run(_refilled_under_inference_mode):
        assert len(r["errors"]) == 9 and max(r["errors"]) < 1e-6, r


def _generate_into_buffer(rank: int, world: int, mode: str) -> dict:
    """Greedy generation into a fixed token buffer cut once: the tokens split on the sequence are copies."""
    from tests.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(seq=16, layers=1)).eval()
    prompt = torch.randint(0, 128, (2, 4), generator=torch.Generator().manual_seed(1))
    buf = torch.zeros(2, 16, dtype=torch.long)
    mesh = spmd.init_mesh((2,), ("tp",))
    compiled = spmd.compile(model, mesh, (buf,), mesh_spec=spec((2,), ("tp",)), in_placements={"tokens": [Shard(1)]})
    grad_mode = torch.inference_mode if mode == "inference_mode" else torch.no_grad
    with grad_mode():
        tokens = buf.clone() if mode == "inference_mode" else buf  # (an inference tensor: no version counter)
        tokens[:, :4] = prompt
        want = tokens.clone()
        pieces = compiled.shard_inputs(tokens)
        errors = []
        for t in range(4, 12):
            logits = compiled.gather_outputs(compiled(*pieces))
            expected = model(want)
            errors.append(float((logits - expected).abs().max()))
            tokens[:, t] = logits[:, t - 1].argmax(-1)
            want[:, t] = expected[:, t - 1].argmax(-1)
    return {"errors": errors, "same_tokens": bool(torch.equal(tokens, want)), "copy": pieces[0]._base is None}


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_a_generation_loop_writing_its_token_buffer_after_one_cut(ranks, mode):
    """Found by a probe: a GPT-2 whose tokens the plan splits on the sequence (pieces that are copies) generated from
    the prompt alone when the loop cut its token buffer once and wrote each new token into it: the logits were
    0.53-0.67 off from the second token. Under inference mode, whose tensors keep no version counter, too."""
    for r in ranks(2).run(_generate_into_buffer, mode):
        assert r["copy"] and r["same_tokens"], r
        assert max(r["errors"]) < 1e-5, r


def _written_through_data(rank: int, world: int, on: str) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16))
    x = torch.randn(8, 16)
    mesh = spmd.init_mesh((2,), ("dp",))
    compiled = spmd.compile(model, mesh, (x,), mesh_spec=spec((2,), ("dp",)),
                            param_placements={"0.weight": [Shard(0)]})
    pretrained = torch.randn(16, 16, generator=torch.Generator().manual_seed(7))
    if on == "after a warm-up call":
        compiled(*compiled.shard_inputs(x))
    if on != "rank 0" or rank == 0:
        model[0].weight.data.copy_(pretrained)  # (the pieces were cut from rank 0's values: src_data_rank=0)
    refused = []
    for _ in range(2):
        try:
            compiled(*compiled.shard_inputs(x))
        except spmd.SpmdError as e:
            refused.append(str(e))
    model[0].weight.data.copy_(pretrained)
    compiled.load_state_dict(model.state_dict())
    out = compiled.gather_outputs(compiled(*compiled.shard_inputs(x)))
    return {"refused": refused, "error": float((out - model(x)).abs().max())}


@pytest.mark.parametrize("on", ["every rank", "rank 0", "after a warm-up call"])
def test_weights_written_through_data_are_refused_on_every_rank(ranks, on):
    """`p.data.copy_(pretrained)` after compiling moves no version counter: the first call compares the values
    on the rank the pieces were cut from (rank 0, src_data_rank), and every rank raises, at every call until the
    weights are given (a refusal on rank 0 alone left rank 1 waiting in the forward's collectives: a hang, seen
    in the first version of this check). After a warm-up call, the next checked call (the second) compares a
    sample of each parameter's rows (a probe found that load trained the old weights)."""
    for rank, r in enumerate(ranks(2).run(_written_through_data, on)):
        assert len(r["refused"]) == 2, r
        assert ("weights changed after it was compiled (0.weight: loaded" if rank == 0 else
                "weights changed after it was compiled on another rank of the mesh") in r["refused"][0], r
        assert r["error"] < 1e-6, r


def _lm_loss(out, targets):
    return F.cross_entropy(out.flatten(0, 1), targets.flatten())


def _average_in_a_copy(rank: int, world: int) -> dict:
    import copy

    from torch.distributed.tensor import Shard

    from examples.models import GPT, GPTConfig
    from tests.support import spec

    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=1))
    eager = copy.deepcopy(model)
    tokens = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    mesh = spmd.init_mesh((2,), ("dp",))
    trained = spmd.compile(model, mesh, (tokens, tokens), loss_fn=_lm_loss, mesh_spec=spec((2,), ("dp",)),
                           param_placements={"blocks.0.mlp.fc1.weight": [Shard(0)]})
    ema, eager_ema = copy.deepcopy(trained), copy.deepcopy(eager)
    opt, eager_opt = torch.optim.SGD(trained.parameters(), lr=0.1), torch.optim.SGD(eager.parameters(), lr=0.1)
    local = trained.shard_inputs(tokens, tokens)
    for _ in range(2):
        trained(*local).backward()
        _lm_loss(eager(tokens), tokens).backward()
        for o in (opt, eager_opt):
            o.step()
            o.zero_grad()
        with torch.no_grad():
            for mine, theirs in ((ema, trained), (eager_ema, eager)):
                for a, b in zip(mine.parameters(), theirs.parameters()):
                    a.lerp_(b, 0.5)
    full, want = ema.full_state_dict(), eager_ema.state_dict()
    return {"pieces": tuple(ema.get_parameter("blocks.0.mlp.fc1.weight").shape),
            "err": max(float((full[k] - v).abs().max()) for k, v in want.items())}


def test_a_copy_of_a_sharded_module_keeps_its_own_average(ranks):
    """`copy.deepcopy(compiled)` on gloo ranks: its own pieces (fc1 split on dp), the same mesh; updated in place
    as an average of the trained weights, it gathers to the eager average."""
    for r in ranks(2).run(_average_in_a_copy):
        assert r["pieces"] == (128, 64) and r["err"] < 1e-5, r


def _with_dropout(width: int, batch: int) -> tuple:
    """A Linear-Dropout-Linear stack compiled for training on (tp=2), seeded alike on every rank, and its inputs
    as this rank's pieces."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Dropout(0.5),
                                torch.nn.Linear(width, width)).train()
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    mesh = spmd.init_mesh((2,), ("tp",))
    compiled = spmd.compile(model, mesh, (x, y), loss_fn=F.mse_loss, mesh_spec=spec((2,), ("tp",)))
    return compiled, compiled.shard_inputs(x, y)


def _drawn_apart_later(rank: int, world: int) -> dict:
    compiled, local = _with_dropout(16, 8)
    compiled(*local)  # (agreed: seeded alike)
    if rank == 0:
        torch.rand(3)  # (rank 0 alone samples something for a log)
    said = []
    for _ in range(3):  # calls 2, 3, 4: checked at 2 and again at 4 after a failure
        try:
            compiled(*local)
        except spmd.SpmdError as e:
            said.append(str(e))
    return {"said": said}


def test_generators_drawn_apart_after_the_first_call_are_caught(ranks):
    """The generators were compared at the first call only: a rank that drew a number its peers did not later
    (rank 0 sampling for a log) dropped other elements of replicated values from then on, silently. They are
    compared again at calls 2, 4, 8, ... and then every k-th call (k <= 1024, below); a failed check is repeated
    at the next call."""
    for r in ranks(2).run(_drawn_apart_later):
        assert len(r["said"]) == 3, r
        assert "at call 2 of this module (they agreed before" in r["said"][0]
        assert "agreed before" not in r["said"][1]  # (the retry: they never agreed since)


def _drawn_apart_at_call_three(rank: int, world: int) -> dict:
    compiled, local = _with_dropout(32, 32)
    compiled(*local)
    compiled(*local)  # (checked at calls 1 and 2: agreed)
    if rank == 0:
        torch.rand(3)
    try:
        compiled(*local)
        said = None
    except spmd.SpmdError as e:
        said = str(e)
    return {"said": said, "period": compiled._generator_period,
            "step_s": compiled.plan.predicted_step_s}


def test_generators_drawn_apart_are_caught_at_the_next_call_where_a_check_is_cheap(ranks):
    """Past the powers of two, the check came every 1024th call whatever a call cost: a drift after call 2 ran
    to call 4 unseen. Where a check costs at most 1% of the plan's call (this mesh's 1 us links against a call
    of ~2 ms on its slow device), every call is checked, and call 3 is caught before its graph draws."""
    for r in ranks(2).run(_drawn_apart_at_call_three):
        assert r["period"] == 1, r
        assert r["said"] is not None and "at call 3 of this module (they agreed before" in r["said"], r


def _loss_outside(rank: int, world: int) -> dict:
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    eager = copy.deepcopy(model)
    F.mse_loss(eager(x), y).backward()
    mesh = spmd.init_mesh((2,), ("dp",))
    compiled = spmd.compile(model, mesh, (x,), training=True, in_placements={"input": [Shard(0)]},
                            out_placements={0: [Shard(0)]}, mesh_spec=spec((2,), ("dp",)))
    errs = {}
    for how in ("gathered", "own piece"):
        out = compiled(*compiled.shard_inputs(x))
        if how == "gathered":  # (one loss of the full outputs, the same on every rank)
            loss = F.mse_loss(compiled.gather_outputs(out), y)
        else:  # (DDP's way: each rank's own piece, the mean over the 2 pieces as DDP's average of gradients)
            loss = F.mse_loss(out, y[4 * rank:4 * rank + 4]) / 2
        loss.backward()
        grads = {n: compiled._as_whole(n, p.grad).full_tensor() for n, p in compiled.named_parameters()}
        errs[how] = max(float((grads[n] - p.grad).abs().max()) for n, p in eager.named_parameters())
        compiled.zero_grad()
    torch.set_default_dtype(torch.float32)
    return errs


def test_a_loss_of_the_gathered_outputs_gets_one_devices_gradients(ranks):
    """Found by a probe: compiled for training without a loss_fn, with the batch split over dp, a loss of
    `compiled.gather_outputs(out)` (the full outputs on every rank) got gradients 2x one device's, silently: the
    gather's backward summed the ranks' copies of one gradient. It now takes this rank's piece of it, as
    DTensor's full_tensor() does. A loss of each rank's own piece is the sum over the pieces (docs/training.md)."""
    for r in ranks(2).run(_loss_outside):
        assert r["gathered"] < 1e-12 and r["own piece"] < 1e-12, r


def _input_gradient_and_optimizer_state(rank: int, world: int) -> dict:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
        x, y = torch.randn(8, 8), torch.randn(8, 8)
        reference = copy.deepcopy(model)
        mesh = spmd.init_mesh((2,), ("dp",))
        # an input's gradient (adversarial training, saliency): the whole batch's, on every rank
        xg, wanted = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        compiled = spmd.compile(model, mesh, (xg, y), loss_fn=F.mse_loss, in_placements={"input": [Shard(0)]},
                                param_placements={"0.weight": [Shard(0)]}, mesh_spec=spec((2,), ("dp",)))
        compiled(*compiled.shard_inputs(xg, y)).backward()
        F.mse_loss(reference(wanted), y).backward()
        input_grad = float((xg.grad - wanted.grad).abs().max())
        compiled.zero_grad(), reference.zero_grad()
        # a single-device optimizer's state, loaded as it is, then as the error says
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
        F.mse_loss(reference(x), y).backward()
        ref_opt.step(), ref_opt.zero_grad()
        compiled.load_state_dict(reference.state_dict())
        opt = torch.optim.AdamW(compiled.parameters(), lr=0.01)
        opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
        compiled(*compiled.shard_inputs(x, y)).backward()
        try:
            opt.step()
            said = None
        except spmd.SpmdError as e:
            said = str(e)
        opt = torch.optim.AdamW(compiled.parameters(), lr=0.01)
        try:  # (an optimizer's own state_dict, keyed by position, given to spmd's loader)
            compiled.load_optimizer_state_dict(opt, copy.deepcopy(ref_opt.state_dict()))
            positional = None
        except spmd.SpmdError as e:
            positional = str(e)
        try:  # (spmd's DTensor form given to torch's loader: torch's own error at the step, where all replicated)
            opt.load_state_dict(compiled.optimizer_state_dict(opt))
            opt.step()
            dtensors = None
        except spmd.SpmdError as e:
            dtensors = str(e)
        opt = torch.optim.AdamW(compiled.parameters(), lr=0.01)
        compiled.load_optimizer_state_dict(opt, copy.deepcopy(get_optimizer_state_dict(reference, ref_opt)))
        # (pieces of their own: a view of each whole moment kept it alive on every rank, and shared it)
        own = all(v.untyped_storage().nbytes() == v.numel() * v.element_size()
                  for state in opt.state.values() for v in state.values() if torch.is_tensor(v) and v.dim())
        opt.step()
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
        full = compiled.full_state_dict()
        return {"input_grad": input_grad, "scale": float(wanted.grad.abs().max()), "said": said, "own": own,
                "positional": positional, "dtensors": dtensors,
                "after_load": max(float((full[n] - p).abs().max()) for n, p in reference.named_parameters())}
    finally:
        torch.set_default_dtype(torch.float32)


def test_an_inputs_gradient_is_the_whole_and_a_single_device_optimizer_state_is_refused(ranks):
    """Found by a probe: `x.requires_grad_()` on the full batch, cut by `shard_inputs`, got only this rank's
    rows of its gradient (zeros elsewhere, silently); the cut's backward now gathers the pieces' gradients, as
    DTensor's redistribute from Replicate does. A single-device AdamW's `state_dict()` loaded with
    `opt.load_state_dict` failed at the step with a shape error naming nothing; now the step names the way out,
    `compiled.load_optimizer_state_dict` of the state under the model's names, which trains equal, each piece a
    tensor of its own (a probe found them views of the whole moments)."""
    for r in ranks(2).run(_input_gradient_and_optimizer_state):
        assert r["input_grad"] < 1e-12 < r["scale"], r
        assert r["said"] is not None and "compiled.load_optimizer_state_dict(optimizer, state)" in r["said"], r
        assert r["after_load"] < 1e-12 and r["own"], r
        # (found by a probe: "state for 0, which this optimizer does not step", and torch's "mixed torch.Tensor and
        # DTensor" at the step)
        assert r["positional"] and "param groups list parameters by position" in r["positional"] and \
            "get_optimizer_state_dict(model, single_device_optimizer)" in r["positional"], r
        assert r["dtensors"] and "AdamW holds DTensors as state" in r["dtensors"] and \
            "compiled.load_optimizer_state_dict(optimizer, state)" in r["dtensors"], r


class _ViewOutputs(torch.nn.Module):
    """Returns a view of its first output, or of its weight, next to it."""

    def __init__(self, which: str):
        super().__init__()
        self.lin, self.which = torch.nn.Linear(8, 8), which

    def forward(self, x):
        y = self.lin(x)
        return y, {"t": y.t(), "rows": y[:2], "weight": self.lin.weight.t(), "bias": self.lin.bias, "x": x,
                   "x rows": x[:2]}[self.which]


def _loss_on_a_view_output(rank: int, world: int, which: str) -> dict:
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model, x = _ViewOutputs(which), torch.randn(4, 8)
    x_eager, x_compiled = x.clone().requires_grad_(), x.clone().requires_grad_()
    eager = copy.deepcopy(model)
    out = eager(x_eager)
    (out[1].square().sum() + out[0].sum()).backward()
    mesh = spmd.init_mesh((2,), ("dp",))
    compiled = spmd.compile(model, mesh, (x_compiled,), training=True, mesh_spec=spec((2,), ("dp",)))
    out = compiled.gather_outputs(compiled(*compiled.shard_inputs(x_compiled)))
    (out[1].square().sum() + out[0].sum()).backward()
    grads = {n: compiled._as_whole(n, p.grad).full_tensor() for n, p in compiled.named_parameters() if p.grad is not None}
    torch.set_default_dtype(torch.float32)
    return {"missing": sorted(n for n, _ in eager.named_parameters() if n not in grads),
            "error": max(float((grads[n] - p.grad).abs().max()) for n, p in eager.named_parameters() if n in grads),
            "input error": float((x_compiled.grad - x_eager.grad).abs().max())}


@pytest.mark.parametrize("which", ["t", "rows", "weight", "bias", "x", "x rows"])
def test_a_loss_on_an_output_that_views_another_reaches_the_parameters(ranks, which):
    """Found by probes: with `return y, y.t()` (or a slice of y, or a view of a weight), a loss on the view
    reached no parameter, silently: AOTAutograd gives such an alias no incoming gradient (it regenerates it
    outside its graph), and the compiled module returned it as a plain tensor. So did a parameter returned
    as it is (SigLIP's logit_bias never trained) and an input returned, or a view of it (a block's residual:
    its share of the input's gradient was dropped, 7.41 off). The trace now copies those outputs, so each
    gets its gradient."""
    for r in ranks(2).run(_loss_on_a_view_output, which):
        assert r["missing"] == [] and r["error"] < 1e-12 and r["input error"] < 1e-12, r


def _load_wrong_shapes(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model, x = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8)), torch.randn(4, 8)
    mesh = spmd.init_mesh((2,), ("tp",))
    compiled = spmd.compile(model, mesh, (x,), mesh_spec=spec((2,), ("tp",)),
                            param_placements={"0.weight": [Shard(0)], "0.bias": [Shard(0)]})
    said = {}
    for name, value in (("0.bias", torch.zeros(8)), ("2.bias", torch.ones(1)), ("0.weight", torch.zeros(8, 8)),
                        ("2.weight", torch.arange(16.0)), ("0.weight ", torch.tensor(3.0))):
        state = {**model.state_dict(), name.strip(): value}
        try:
            compiled.load_state_dict(state)
        except spmd.SpmdError as e:
            said[name] = str(e)
    state = {k: v + 1 for k, v in model.state_dict().items()}  # whole tensors of the right shapes: taken
    compiled.load_state_dict(state)
    errors = {k: float((compiled.full_state_dict()[k] - v).abs().max()) for k, v in state.items()}
    return {"said": said, "errors": errors}


def test_a_state_dict_entry_of_another_shape_is_refused(ranks):
    """Found by a probe: an entry shaped like this rank's piece (half a Shard(0) bias: a checkpoint of a
    smaller configuration) was taken for the piece on every rank, and a tensor of one broadcast over a whole
    bias, silently; so were a vector of another number of dims and a number, broadcast over a whole weight (a
    second probe). Every entry must now have the parameter's whole shape, as torch's load requires."""
    for r in ranks(2).run(_load_wrong_shapes):
        assert set(r["said"]) == {"0.bias", "2.bias", "0.weight", "2.weight", "0.weight "}, r
        assert "copying a tensor of shape [] from the state dict, the model's is [16, 8]" in r["said"]["0.weight "]
        assert "size mismatch for 0.bias: copying a tensor of shape [8] from the state dict, the model's is [16]" \
            in r["said"]["0.bias"]
        assert max(r["errors"].values()) == 0.0, r


class _DroppedAttention(torch.nn.Module):
    """Attention with dropout left on for inference (MC dropout): the graph keeps the kernel whole."""

    def __init__(self, d: int = 16, heads: int = 4):
        super().__init__()
        self.qkv, self.heads = torch.nn.Linear(d, 3 * d), heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.5 if self.training else 0.0)


def _attention_dropout_in_inference(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = _DroppedAttention().train()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(1))
    mesh = spmd.init_mesh((2,), ("tp",))
    compiled = spmd.compile(model, mesh, (x,), mesh_spec=spec((2,), ("tp",)), in_placements={"x": [Shard(0)]})
    torch.manual_seed(5)
    out = compiled.gather_outputs(compiled(*compiled.shard_inputs(x)))
    torch.manual_seed(5)
    return {"error": float((out - reference(x)).abs().max()), "checks_generators": compiled._draws}


def test_attention_dropout_in_an_inference_graph_draws_the_single_device_mask(ranks):
    """Found by a probe: the kernel draws its mask inside, and a rank holding half the batch drew the first
    half's mask for its own rows (1.51 off), with the generator check off (no dropout op in the graph). It now
    runs whole on every rank, and the ranks' generators are compared."""
    for r in ranks(2).run(_attention_dropout_in_inference):
        assert r["error"] < 1e-6 and r["checks_generators"], r


class _Sampled(torch.nn.Module):
    """Draws no rule of spmd's covers: tokens sampled by `multinomial`, integers by `randint_like(x, low, high)`."""

    def __init__(self):
        super().__init__()
        self.lin, self.out = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        picked = torch.multinomial(torch.softmax(h.detach(), -1), 4, replacement=True)
        h = h * torch.zeros_like(h).scatter_add(1, picked, torch.ones(picked.shape, dtype=h.dtype))
        return self.out(h * torch.randint_like(h, 1, 5))


def _sampled_on_a_batch_split(rank: int, world: int) -> dict:
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = _Sampled()
        reference = copy.deepcopy(model)
        x, y = torch.randn(4, 8), torch.randn(4, 8)
        mesh = spmd.init_mesh((2,), ("dp",))
        compiled = spmd.compile(model, mesh, (x, y), loss_fn=F.mse_loss, mesh_spec=spec((2,), ("dp",)),
                                in_placements={"x": [Shard(0)]})
        opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (compiled, reference))
        local = compiled.shard_inputs(x, y)
        losses, generators = [], []
        for step in range(2):
            for run, o in ((lambda: compiled(*local), opt), (lambda: F.mse_loss(reference(x), y), ref_opt)):
                torch.manual_seed(5 + step)
                loss = run()
                loss.backward()
                o.step()
                o.zero_grad()
                losses.append(float(loss))
                generators.append(torch.get_rng_state())
        full = compiled.full_state_dict()
        return {"losses": losses, "generators_equal": torch.equal(generators[-2], generators[-1]),
                "errors": {k: float((full[k] - v).abs().max()) for k, v in reference.state_dict().items()}}
    finally:
        torch.set_default_dtype(torch.float32)


def test_draws_without_a_rule_are_drawn_whole_on_a_batch_split(ranks):
    """Found by a probe: `multinomial` and `randint_like(x, low, high)` had no rule of spmd's and took DTensor's,
    which cut them on the batch (DTensor offsets a CUDA generator per piece); each rank drew the first rows'
    numbers for its own rows (a loss 0.501 where eager gives 0.539, sampled tokens equal to eager's in 0 of 20
    calls), and `verify()` said OK. A draw no rule covers now runs whole on every rank, as one device draws."""
    for r in ranks(2).run(_sampled_on_a_batch_split):
        compiled_losses, eager_losses = r["losses"][0::2], r["losses"][1::2]
        assert compiled_losses == pytest.approx(eager_losses, rel=1e-12), r
        assert max(r["errors"].values()) < 1e-12 and r["generators_equal"], r


# ---- whole tensors where the pieces were ---------------------------------------------------------

def _whole_for_pieces(rank: int, world: int, how: str) -> str:
    from torch.func import functional_call

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16))
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    mesh = spmd.init_mesh((2,), ("tp",))
    compiled = spmd.compile(model, mesh, (x, y), loss_fn=F.mse_loss, mesh_spec=spec((2,), ("tp",)),
                            param_placements={"0.weight": [Shard(0)], "2.weight": [Shard(1)]})
    local = compiled.shard_inputs(x, y)
    try:
        if how == "data":
            for p, whole in zip(compiled.parameters(), model.parameters()):
                p.data = whole.detach().clone()
            compiled(*local)
        else:
            functional_call(compiled, dict(model.named_parameters()), local)
    except spmd.SpmdError as e:
        return str(e)
    return "ran"


@pytest.mark.parametrize("how", ["data", "functional_call"])
def test_whole_tensors_where_the_pieces_were_are_refused(ranks, how):
    """`p.data = whole` on every piece, or `torch.func.functional_call(compiled, model's parameters)`: the graph
    ran on the whole weights where their shapes fit its ops, and computed something else (a loss 0.22 and 127
    off), silently."""
    for said in ranks(2).run(_whole_for_pieces, how):
        assert "are not this rank's pieces (0.weight is (32, 16), its piece (16, 16)" in said, said
        assert "load_state_dict" in said and "functional_call" in said, said


def _mask_changed_in_one_ranks_rows(rank: int, world: int) -> dict:
    import torch.nn.utils.prune as prune

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16))
    prune.l1_unstructured(model[0], "weight", 0.3)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    mesh = spmd.init_mesh((2,), ("tp",))
    compiled = spmd.compile(model, mesh, (x, y), loss_fn=F.mse_loss, mesh_spec=spec((2,), ("tp",)),
                            param_placements={"0.weight_orig": [Shard(0)], "0.weight_mask": [Shard(0)]})
    local = compiled.shard_inputs(x, y)
    compiled(*local)
    with torch.no_grad():
        model[0].weight_mask[:5] = 0  # (rows 0-4: rank 0's piece alone)
    try:
        compiled(*local)
        said = "ran"
    except spmd.SpmdError as e:
        said = str(e)
    compiled.load_state_dict(model.state_dict())  # (into both: then every rank runs with the new mask)
    loss = float(compiled(*local))
    return {"said": said, "loss": loss, "eager": float(F.mse_loss(model(x), y))}


def test_a_sharded_buffer_changed_in_one_ranks_rows_is_refused_on_every_rank(ranks):
    """A pruning mask changed on the model in rows rank 0 holds: rank 0 refused, rank 1's piece was unchanged
    and it went on into the step's collectives, where it waited for good (found by a probe)."""
    for r in ranks(2).run(_mask_changed_in_one_ranks_rows):
        assert "`0.weight_mask` changed after it was compiled" in r["said"], r
        assert abs(r["loss"] - r["eager"]) < 1e-5, r


# ---- weights given in place between modules of other plans ---------------------------------------------

def _given_in_place_across_plans(rank: int, world: int) -> dict:
    from torch.distributed.tensor import Replicate

    from tests.models import MLP

    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = MLP(16, 32)
        x, y = torch.randn(8, 16), torch.randn(8, 16)
        mesh = spmd.init_mesh((2, 2), ("dp", "tp"))
        names = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
        pins = {layout: {n: list(layout) for n in names}
                for layout in ((Shard(0), Replicate()), (Replicate(), Shard(0)))}
        trained = spmd.compile(model, mesh, (x, y), loss_fn=F.mse_loss, mesh_spec=spec((2, 2), ("dp", "tp")),
                               param_placements=pins[Shard(0), Replicate()])
        evaluate = spmd.compile(model, mesh, (x,), mesh_spec=spec((2, 2), ("dp", "tp")),
                                param_placements=pins[Replicate(), Shard(0)])
        opt = torch.optim.SGD(trained.parameters(), lr=0.1)
        trained(*trained.shard_inputs(x, y)).backward()
        opt.step()
        same_shapes = all(a.shape == b.shape for a, b in zip(evaluate.parameters(), trained.parameters()))
        with torch.no_grad():
            for a, b in zip(evaluate.parameters(), trained.parameters()):
                a.copy_(b)  # (as an EMA or "given in place" does: this rank's pieces of other parts)
            try:
                evaluate(*evaluate.shard_inputs(x))
                refused = None
            except spmd.SpmdError as e:
                refused = str(e)
        evaluate.load_state_dict(trained.state_dict())  # (across plans: the way out)
        with torch.no_grad():
            out = evaluate.gather_outputs(evaluate(*evaluate.shard_inputs(x)))
            want = MLP(16, 32)
            want.load_state_dict(trained.full_state_dict())
            error = float((out - want(x)).abs().max())
        return {"same_shapes": same_shapes, "refused": refused, "error": error}
    finally:
        torch.set_default_dtype(torch.float32)


def test_weights_given_in_place_from_a_module_of_another_plan_are_refused(ranks):
    """Found by a probe of several compiled modules in one program: an evaluation module given the trained
    module's weights in place (`a.copy_(b)` over both modules' parameters, the way an EMA updates a teacher),
    with the two laid out differently on (2, 2) (`[S(0), R]` against `[R, S(0)]`: pieces of the same shapes),
    took every rank's piece of other rows, and its output was 2.3 off, silently. It is refused naming the
    layouts; `load_state_dict` across plans gives one device's output."""
    for r in ranks(4).run(_given_in_place_across_plans):
        assert r["same_shapes"]
        assert r["refused"] and "the two lay them out differently (fc1.weight: [R, S(0)] here, [S(0), R] there" \
            in r["refused"], r["refused"]
        assert r["error"] < 1e-12, r



def _teacher_compiled_from_its_own_copy(rank: int, world: int) -> dict:
    from tests.models import MLP

    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = MLP(16, 32)
        teacher_model = copy.deepcopy(model)  # (a mean teacher compiled apart from its student)
        x, y = torch.randn(8, 16), torch.randn(8, 16)
        mesh = spmd.init_mesh((2, 2), ("dp", "tp"))
        names = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
        student = spmd.compile(model, mesh, (x, y), loss_fn=F.mse_loss, mesh_spec=spec((2, 2), ("dp", "tp")),
                               param_placements={n: [Shard(0), Replicate()] for n in names})
        teacher = spmd.compile(teacher_model, mesh, (x,), mesh_spec=spec((2, 2), ("dp", "tp")),
                               param_placements={n: [Replicate(), Shard(0)] for n in names})
        same = spmd.compile(copy.deepcopy(model), mesh, (x,), mesh_spec=spec((2, 2), ("dp", "tp")),
                            param_placements={n: [Shard(0), Replicate()] for n in names})
        # (an evaluation module laid out as the teacher is: no source of given weights, so no excuse; a review)
        evaluate = spmd.compile(copy.deepcopy(model), mesh, (x,), mesh_spec=spec((2, 2), ("dp", "tp")),
                                param_placements={n: [Replicate(), Shard(0)] for n in names})
        opt = torch.optim.SGD(student.parameters(), lr=0.1)
        student(*student.shard_inputs(x, y)).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():  # (the student's own writes, gradients cleared: a clamp after the step; a review)
            for p in student.parameters():
                p.clamp_(-10.0, 10.0)
        student(*student.shard_inputs(x, y)).backward()  # (runs)
        opt.step()
        with torch.no_grad():
            for t, s, u in zip(teacher.parameters(), student.parameters(), same.parameters()):
                t.lerp_(s, 0.5)  # (this rank's pieces of other rows, where the layouts differ)
                u.lerp_(s, 0.5)
            try:
                teacher(*teacher.shard_inputs(x))
                refused = None
            except spmd.SpmdError as e:
                refused = str(e)
            out = same.gather_outputs(same(*same.shard_inputs(x)))  # (the same layouts: right)
            want = copy.deepcopy(teacher_model)
            for w, a, b in zip(want.parameters(), teacher_model.parameters(), model.parameters()):
                w.copy_(torch.lerp(a, student.full_state_dict()[[n for n, q in model.named_parameters()
                                                                   if q is b][0]], 0.5))
            error = float((out - want(x)).abs().max())
        del evaluate
        return {"refused": refused, "error": error}
    finally:
        torch.set_default_dtype(torch.float32)


def test_a_teacher_compiled_from_its_own_copy_given_weights_of_another_layout_is_refused(ranks):
    """Known since session 84: a mean teacher compiled from its own copy of the model, with another plan than
    its student (the teacher compiled for inference, the student for training), updated by hand over
    `zip(teacher.parameters(), student.parameters())`. Where the two lay a parameter out differently with
    pieces of one shape (on (2, 2), `[R, S(0)]` against `[S(0), R]`), each rank averaged pieces of other rows,
    silently. It is refused at the teacher's next call; a teacher with the student's layouts is right."""
    for r in ranks(4).run(_teacher_compiled_from_its_own_copy):
        assert r["refused"] and "fc1.weight: [R, S(0)] here, [S(0), R] in" in r["refused"], r["refused"]
        assert r["error"] < 1e-12, r

# ---- checkpoints and modules compiled from one model ---------------------------------------------------------

def _refused(call) -> str | None:
    """The message of the SpmdError `call()` raises, or None where it runs."""
    try:
        call()
    except spmd.SpmdError as e:
        return str(e)
    return None


def _checkpoints_beside_a_sibling(rank: int, world: int, folder: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Replicate

    from tests.models import MLP

    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = MLP(16, 32)
        x, y = torch.randn(8, 16), torch.randn(8, 16)
        mesh = spmd.init_mesh((2,), ("tp",))
        names = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
        trained = spmd.compile(model, mesh, (x, y), loss_fn=F.mse_loss, mesh_spec=spec((2,), ("tp",)),
                               param_placements={n: [Shard(0)] for n in names})
        evaluate = spmd.compile(model, mesh, (x,), mesh_spec=spec((2,), ("tp",)),
                                param_placements={n: [Replicate()] for n in names})
        opt = torch.optim.SGD(trained.parameters(), lr=0.1)
        trained(*trained.shard_inputs(x, y)).backward()
        opt.step()
        out = {"saved_stale": _refused(lambda: dcp.save({"model": evaluate.state_dict()}, checkpoint_id=folder))}
        dcp.save({"model": trained.state_dict()}, checkpoint_id=folder)  # (the module that trained: saved)
        checkpoint = MLP(16, 32)
        checkpoint.load_state_dict(trained.full_state_dict())
        evaluate.load_state_dict(trained.state_dict())
        trained(*trained.shard_inputs(x, y)).backward()  # (on past the checkpoint)
        opt.step()
        evaluate.load_state_dict(trained.state_dict())
        state = {"model": trained.state_dict()}  # (a resumed run: loaded in place, then into the module)
        dcp.load(state, checkpoint_id=folder)
        trained.load_state_dict(state["model"])
        out["resumed_stale"] = _refused(lambda: evaluate(*evaluate.shard_inputs(x)))
        evaluate.load_state_dict(trained.state_dict())
        with torch.no_grad():
            got = evaluate.gather_outputs(evaluate(*evaluate.shard_inputs(x)))
            out["error"] = float((got - checkpoint(x)).abs().max())
        return out
    finally:
        torch.set_default_dtype(torch.float32)


def test_checkpoints_of_old_weights_and_beside_them_are_refused(ranks, tmp_path):
    """Found by reviews of the sibling guard: the evaluation module's `state_dict()` saved with `dcp.save`
    after its sibling trained saved the untrained weights; a checkpoint loaded into the training module through
    torch.distributed.checkpoint (a resumed run) left the evaluation module beside it on the weights it had,
    silently. Both refused on every rank; given the weights, it computes the checkpoint's output."""
    for r in ranks(2).run(_checkpoints_beside_a_sibling, str(tmp_path)):
        assert r["saved_stale"] and "another module compiled from the same model has trained" in r["saved_stale"], r
        assert r["resumed_stale"] and "given weights from elsewhere" in r["resumed_stale"], r
        assert r["error"] < 1e-12, r


def _loaded_in_place_only(rank: int, world: int, folder: str) -> dict:
    """FSDP2's way to resume: `dcp.load` into the module's `state_dict()` and `optimizer_state_dict(...)`, with no
    `load_state_dict` after."""
    import torch.distributed.checkpoint as dcp

    from tests.models import MLP

    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        x, y = torch.randn(8, 16), torch.randn(8, 16)
        mesh = spmd.init_mesh((2,), ("tp",))
        pins = {n: [Shard(0)] for n in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")}
        first = spmd.compile(MLP(16, 32), mesh, (x, y), loss_fn=F.mse_loss, mesh_spec=spec((2,), ("tp",)),
                             param_placements=pins)
        opt = torch.optim.AdamW(first.parameters(), lr=0.1)
        first(*first.shard_inputs(x, y)).backward()
        opt.step()
        dcp.save({"model": first.state_dict(), "optim": first.optimizer_state_dict(opt)}, checkpoint_id=folder)
        checkpoint = MLP(16, 32)
        checkpoint.load_state_dict(first.full_state_dict())

        model = MLP(16, 32)  # (the resumed run: a fresh model, its modules, a fresh optimizer)
        resumed = spmd.compile(model, mesh, (x, y), loss_fn=F.mse_loss, mesh_spec=spec((2,), ("tp",)),
                               param_placements=pins)
        evaluate = spmd.compile(model, mesh, (x,), mesh_spec=spec((2,), ("tp",)))
        fresh = torch.optim.AdamW(resumed.parameters(), lr=0.1)
        state = {"model": resumed.state_dict(), "optim": resumed.optimizer_state_dict(fresh)}
        dcp.load(state, checkpoint_id=folder)
        out = {"evaluate": _refused(lambda: evaluate(*evaluate.shard_inputs(x))),
               "model": _refused(lambda: model(x))}
        loss = resumed(*resumed.shard_inputs(x, y))
        out["loss_error"] = abs(float(loss) - float(F.mse_loss(checkpoint(x), y)))
        loss.backward()
        out["step"] = _refused(fresh.step)
        resumed.load_optimizer_state_dict(fresh, state["optim"])
        fresh.step()
        opt.zero_grad()  # (the first run's second step: the same, from the same state)
        first(*first.shard_inputs(x, y)).backward()
        opt.step()
        out["error"] = max(float((a - b).abs().max()) for a, b in zip(resumed.full_state_dict().values(),
                                                                      first.full_state_dict().values()))
        return out
    finally:
        torch.set_default_dtype(torch.float32)


def test_a_checkpoint_loaded_in_place_only_counts_as_loaded(ranks, tmp_path):
    """Found by a probe: `dcp.load` into `compiled.state_dict()` alone (FSDP2's way) filled the pieces, and nothing
    said the module had been given a checkpoint: an evaluation module compiled beside it, and the model, went on
    with the old weights, silently. Into `optimizer_state_dict(fresh)` alone, the optimizer started fresh (0.034
    off after 2 steps). Both refused now, naming the way out; loaded, the resumed step is the first run's."""
    for r in ranks(2).run(_loaded_in_place_only, str(tmp_path)):
        assert r["evaluate"] and "given weights from elsewhere" in r["evaluate"], r
        assert r["model"] and "given weights from elsewhere" in r["model"], r
        assert r["step"] and "compiled.load_optimizer_state_dict(optimizer, state)" in r["step"], r
        assert r["error"] < 1e-12 and r["loss_error"] < 1e-12, r


def _parts_of_a_sharded_model(rank: int, world: int) -> dict:
    from torch.distributed.tensor import Replicate

    from tests.models import MLP

    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = MLP(16, 32)
        x, y = torch.randn(8, 16), torch.randn(8, 16)
        mesh = spmd.init_mesh((2,), ("tp",))
        compiled = spmd.compile(model, mesh, (x, y), loss_fn=F.mse_loss, mesh_spec=spec((2,), ("tp",)),
                                param_placements={"fc1.weight": [Shard(0)], "fc1.bias": [Shard(0)],
                                                  "fc2.weight": [Shard(1)], "fc2.bias": [Replicate()]})
        features = torch.nn.Sequential(model.fc1, torch.nn.ReLU())  # (another model over the same layer)
        before = features(x)
        opt = torch.optim.SGD(compiled.parameters(), lr=0.1)
        compiled(*compiled.shard_inputs(x, y)).backward()
        opt.step()
        out = {"part": _refused(lambda: model.fc1(x)), "other": _refused(lambda: features(x)),
               "pieces": tuple(compiled.get_parameter("fc1.weight").shape)}
        trained = compiled.full_state_dict(persistent_only=True)
        model.fc1.load_state_dict({"weight": trained["fc1.weight"], "bias": trained["fc1.bias"]})
        out["given"] = _refused(lambda: features(x))
        out["moved"] = float((features(x) - before).abs().max())
        out["model"] = _refused(lambda: model(x))  # (fc2 is still the old one)
        model.load_state_dict(trained)
        out["error"] = float((F.mse_loss(model(x), y) - compiled(*compiled.shard_inputs(x, y))).abs())
        return out
    finally:
        torch.set_default_dtype(torch.float32)


def test_a_part_of_a_sharded_model_is_refused_until_given_its_trained_weights(ranks):
    """The part guard on gloo ranks, with the part's weights cut across them: after a step, the layer called on
    its own, and another model over it, are refused on every rank; given the layer's trained weights (gathered
    by `full_state_dict`), the other model computes with them, while the model (its second layer still old) stays
    refused until the whole copy back."""
    for r in ranks(2).run(_parts_of_a_sharded_model):
        assert r["pieces"] == (16, 16), r
        assert r["part"] and "Linear `fc1` is a part of MLP" in r["part"] and "`fc1.weight`" in r["part"], r
        assert r["other"] and "Linear `fc1` is a part of MLP" in r["other"], r
        assert r["given"] is None and r["moved"] > 0, r
        assert r["model"] and "has trained since" in r["model"], r
        assert r["error"] < 1e-12, r


def _verify_then_generator(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 4))
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    mesh = spmd.init_mesh((2,), ("dp",))
    compiled = spmd.compile(model, mesh, (x, y), loss_fn=F.cross_entropy, mesh_spec=spec((2,), ("dp",)),
                            in_placements={"input": [Shard(0)], "target": [Shard(0)]})
    torch.manual_seed(5)
    before = torch.get_rng_state()
    ok = compiled.verify(x, y).ok
    return {"ok": ok, "same": torch.equal(torch.get_rng_state(), before)}


def test_verify_leaves_the_random_generators_as_they_were(ranks):
    """Found by a probe: `verify` of a model with dropout drew from the global generator, so the training after it
    drew other masks than the same run without the check."""
    for r in ranks(2).run(_verify_then_generator):
        assert r == {"ok": True, "same": True}, r


def _zero_over_pieces(rank: int, world: int) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    mesh = spmd.init_mesh((2,), ("tp",))
    compiled = spmd.compile(model, mesh, (x, y), loss_fn=F.mse_loss, mesh_spec=spec((2,), ("tp",)),
                            param_placements={"0.weight": [Shard(0)]})
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    out = {}
    for name, opt in [
            ("zero", ZeroRedundancyOptimizer(compiled.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)),
            ("local", PostLocalSGDOptimizer(torch.optim.SGD(compiled.parameters(), lr=0.1),
                                            PeriodicModelAverager(period=2, warmup_steps=0)))]:
        compiled(*compiled.shard_inputs(x, y)).backward()
        before = compiled.get_parameter("0.weight").detach().clone()
        try:
            opt.step()
            refused = None
        except spmd.SpmdError as e:
            refused = str(e)
        out[name] = {"refused": refused, "untouched": torch.equal(before, compiled.get_parameter("0.weight").detach())}
        compiled.zero_grad()
    return out


def test_zero_redundancy_and_post_local_sgd_optimizers_over_sharded_pieces_are_refused(ranks):
    """Found by probes: ZeroRedundancyOptimizer broadcasts each parameter from the rank that steps it, so a piece
    was overwritten with another rank's part of the parameter (the loss rose, 0.95 -> 1.20, where one device's fell
    to 0.86; parameters 0.67 off), with only a warning that advised filtering it; PostLocalSGDOptimizer's model
    averager all_reduced the pieces, averaging different parts of a parameter (0.33 off, silently). Both are
    refused before their first step."""
    for r in ranks(2).run(_zero_over_pieces):
        for name, what in [("zero", "ZeroRedundancyOptimizer"), ("local", "PostLocalSGDOptimizer")]:
            assert r[name]["refused"] and f"{what} steps pieces of sharded parameters (0.weight" in r[name]["refused"], r
            assert r[name]["untouched"], r


# ---- gather_outputs of a part of the output ------------------------------------------------------

class _SummaryAndBatch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.register_buffer("center", torch.zeros(16))

    def forward(self, x):
        h = self.lin(x) - self.center
        return h.mean(), h, self.center


def _gather_parts(rank: int, world: int) -> dict:
    import warnings

    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = _SummaryAndBatch()
        x = torch.randn(8, 16)
        _, want, _ = copy.deepcopy(model)(x)
        mesh = spmd.init_mesh((2,), ("dp",))
        compiled = spmd.compile(model, mesh, (x,), in_placements={"x": [Shard(0)]}, mesh_spec=spec((2,), ("dp",)),
                                out_placements={0: [Replicate()], 1: [Shard(0)], 2: [Shard(0)]})
        out = compiled(*compiled.shard_inputs(x))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            errors = {"alone": compiled.gather_outputs(out[1]),
                      "own structure": compiled.gather_outputs({"h": out[1]})["h"],
                      "whole": compiled.gather_outputs(out)[1],
                      "detached": compiled.gather_outputs(out[1].detach())}
            center = compiled.gather_outputs(out[2])
        said = [str(w.message) for w in caught if "gather_outputs" in str(w.message)]
        errors = {k: float((v - want).abs().max()) if v.shape == want.shape else f"shape {tuple(v.shape)}"
                  for k, v in errors.items()}
        try:
            compiled.gather_outputs(out[1][:2])
            view = None
        except spmd.SpmdError as e:
            view = str(e)
        with torch.no_grad():  # (the gathered copy of the buffer written into: refused at the next call)
            center.add_(1.0)
        try:
            compiled(*compiled.shard_inputs(x))
            state = said
        except spmd.SpmdError as e:
            state = [*said, str(e)]
        # pinned Replicate, the gathered output is the buffer's own piece: writes into it reach the model
        replicated = spmd.compile(copy.deepcopy(model), mesh, (x,), in_placements={"x": [Shard(0)]},
                                  mesh_spec=spec((2,), ("dp",)), out_placements={2: [Replicate()]})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            center = replicated.gather_outputs(replicated(*replicated.shard_inputs(x)))[2]
        with torch.no_grad():
            center.add_(1.0)
        state_replicated = ([str(w.message) for w in caught if "gather_outputs" in str(w.message)],
                            float(replicated.piece("center").sum()))
        return {"errors": errors, "view": view, "state": state, "replicated": state_replicated}
    finally:
        torch.set_default_dtype(torch.float32)


def test_gather_outputs_of_a_part_of_the_output_gathers_it_in_its_own_layout(ranks):
    """Found by a probe: `gather_outputs(out[1])` (or `out.logits` of a transformers model with its own loss)
    gathered the tensor in output 0's layout, so it came back as this rank's rows (GPT-2's logits with half the
    vocabulary: an accuracy of 0.59 and 0.00 on the two ranks where one device gives 0.91). The last call's outputs
    are now found by identity, or by the memory they read (`out.logits.detach()`); a slice of one is refused. An
    output that is the model's buffer itself, gathered into a copy and written into there (a DINO center updated in
    place there was lost), is refused at the next call."""
    for r in ranks(2).run(_gather_parts):
        assert all(isinstance(e, float) and e < 1e-12 for e in r["errors"].values()), r
        assert r["view"] is not None and "is not one of the last call's outputs" in r["view"], r
        assert len(r["state"]) == 1 and "output 2 of a call, the model's 'center'" in r["state"][0] and \
            "after gather_outputs" in r["state"][0] and "compiled.get_buffer('center')" in r["state"][0], r
        assert r["replicated"] == ([], 16.0), r


def _loaded_apart(rank: int, world: int) -> dict:
    from tests.models import MLP

    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    mesh = spmd.init_mesh((2,), ("dp",))
    compiled = spmd.compile(MLP(16, 32), mesh, (x, y), loss_fn=F.mse_loss, mesh_spec=spec((2,), ("dp",)),
                            param_placements={"fc1.weight": [Shard(0)]})
    torch.manual_seed(rank)  # (a head re-drawn with each rank's own seed)
    head = torch.nn.Linear(32, 16)
    try:
        compiled.load_state_dict({"fc2.weight": head.weight, "fc2.bias": head.bias}, strict=False)
        refused = None
    except spmd.SpmdError as e:
        refused = str(e)
    try:  # (other entries on each rank: refused on both, not out of step; a review)
        compiled.load_state_dict({"fc2.bias": head.bias} if rank == 0 else {}, strict=False)
        entries = None
    except spmd.SpmdError as e:
        entries = str(e)
    torch.manual_seed(9)
    whole = {k: v.detach() for k, v in MLP(16, 32).state_dict().items()}
    try:  # (a strict load refused on one rank alone, an extra key: both refuse, neither waits; a review)
        compiled.load_state_dict({**whole, "extra": torch.zeros(1)} if rank == 1 else whole)
        strict = None
    except spmd.SpmdError as e:
        strict = str(e)
    torch.manual_seed(5)  # (the same on every rank: loads)
    head, first = torch.nn.Linear(32, 16), torch.nn.Linear(16, 32)
    compiled.load_state_dict({"fc2.weight": head.weight, "fc1.weight": first.weight}, strict=False)
    full = compiled.full_state_dict()
    # optimizer state given whole, apart on the ranks (per-rank files, state made by hand): refused on both
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    torch.manual_seed(3)
    one = MLP(16, 32)
    one_opt = torch.optim.AdamW(one.parameters(), lr=0.1)
    F.mse_loss(one(x), y).backward()
    one_opt.step()
    state = get_optimizer_state_dict(one, one_opt)
    opt = torch.optim.AdamW(compiled.parameters(), lr=0.1)
    apart = {**state, "state": {**state["state"], "fc2.bias": {
        **state["state"]["fc2.bias"], "exp_avg": state["state"]["fc2.bias"]["exp_avg"] + rank}}}
    try:
        compiled.load_optimizer_state_dict(opt, apart)
        optimizer = None
    except spmd.SpmdError as e:
        optimizer = str(e)
    steps = {**state, "state": {n: {**e, "step": float(1 + 5 * rank)} for n, e in state["state"].items()}}
    try:  # (a `step` kept as a Python number, apart: compared too; a review)
        compiled.load_optimizer_state_dict(opt, steps)
        numbers = None
    except spmd.SpmdError as e:
        numbers = str(e)
    compiled.load_optimizer_state_dict(opt, state)  # (the same on every rank: loads)
    moments = compiled.optimizer_state_dict(opt)["state"]["fc1.weight"]["exp_avg"].full_tensor()
    return {"refused": refused, "entries": entries, "strict": strict, "loaded": bool(torch.equal(full["fc2.weight"], head.weight)
                                               and torch.equal(full["fc1.weight"], first.weight)),
            "optimizer": optimizer, "numbers": numbers, "moments": bool(torch.equal(moments, state["state"]["fc1.weight"]["exp_avg"]))}


def test_whole_tensors_loaded_apart_on_the_ranks_are_refused(ranks):
    """Found by a probe: each rank cut its piece of the whole tensor it was given, so a head re-drawn with each
    rank's own seed left the replicas 0.11 apart after 3 steps, silently; and so did optimizer state."""
    for r in ranks(2).run(_loaded_apart):
        assert r["refused"] and "were given differs ('fc2.bias' along 'dp', 'fc2.weight' along 'dp')" in \
            r["refused"], r
        assert r["entries"] and "were given differs ('fc2.bias' along 'dp')" in r["entries"], r
        assert r["strict"] and "(\"keys that are not the model's\" along 'dp')" in r["strict"], r
        assert r["loaded"], r
        # (optimizer state likewise: found by a probe, a replicated bias's replicas 12.7 apart after 2 AdamW steps)
        assert r["optimizer"] and "load_optimizer_state_dict: the optimizer state the ranks were given differs " \
            "('fc2.bias' along 'dp')" in r["optimizer"], r
        assert r["numbers"] and "the optimizer state the ranks were given differs" in r["numbers"], r
        assert r["moments"], r


def _loaded_across_meshes(rank: int, world: int) -> dict:
    from tests.models import MLP

    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        x, y = torch.randn(8, 16), torch.randn(8, 16)
        first = spmd.compile(MLP(16, 32), spmd.init_mesh((2,), ("dp",)), (x, y), loss_fn=F.mse_loss,
                             mesh_spec=spec((2,), ("dp",)), param_placements={"fc1.weight": [Shard(0)]})
        opt = torch.optim.AdamW(first.parameters(), lr=0.1)
        first(*first.shard_inputs(x, y)).backward()
        opt.step()
        other = spmd.compile(MLP(16, 32), spmd.init_mesh((2,), ("tp",)), (x, y), loss_fn=F.mse_loss,
                             mesh_spec=spec((2,), ("tp",)), param_placements={"fc1.weight": [Shard(1)]})
        other_opt = torch.optim.AdamW(other.parameters(), lr=0.1)
        other.load_state_dict(first.state_dict())  # (DTensors over another mesh)
        other.load_optimizer_state_dict(other_opt, first.optimizer_state_dict(opt))
        for module, o in ((first, opt), (other, other_opt)):
            o.zero_grad()
            module(*module.shard_inputs(x, y)).backward()
            o.step()
        a, b = first.full_state_dict(), other.full_state_dict()
        return {"error": max(float((a[k] - b[k]).abs().max()) for k in a)}
    finally:
        torch.set_default_dtype(torch.float32)


def test_a_state_dict_of_a_module_on_another_mesh_loads(ranks):
    """Found by a probe: DTensors of a module on another mesh failed with torch's raw `NotImplementedError: Cross
    device mesh comm not supported yet!` (on 4 ranks, (2, 2) into (4,), with a message blaming a file saved by one
    rank)."""
    for r in ranks(2).run(_loaded_across_meshes):
        assert r["error"] < 1e-12, r


class _Holder(torch.nn.Module):
    """A plain module around a compiled one, whose forward cuts an activation for it (a layer before it)."""

    def __init__(self, pre, core):
        super().__init__()
        self.pre, self.core = pre, core

    def forward(self, x, y):
        return self.core(*self.core.shard_inputs(self.pre(x), y))


def _three_steps_each(holder, eager, x, y) -> list[float]:
    """The losses of 3 SGD steps of `holder` (its loss), then of `eager` (its mse against `y`)."""
    losses = []
    for model in (holder, eager):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            loss = model(x, y) if model is holder else F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses


def _in_ranks_of_its_own(ranks, fn) -> list:
    """`fn` on 2 ranks that are closed after it: what it leaves in native code (dynamo's caches, DDP's reducers)
    does not reach later tests."""
    pool = ranks(2)
    try:
        return pool.run(fn)
    finally:
        pool.close()



def _one_rank_evaluates_alone(rank: int, world: int, meta: bool = False) -> dict:
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        with torch.device("meta" if meta else "cpu"):
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
        x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
        c = spmd.compile(model, spmd.init_mesh((2,), ("dp",)), (x, y), loss_fn=F.cross_entropy,
                         mesh_spec=spec((2,), ("dp",)), param_placements={"0.weight": [Shard(0)]})
        if meta:  # (a module built on meta is not watched as the model's: its steps are counted all the same)
            c.init_weights(seed=0)
        opt = torch.optim.SGD(c.parameters(), lr=0.1)
        local = c.shard_inputs(x, y)
        for step in range(6):
            try:
                c(*local).backward()
            except spmd.SpmdError as e:
                return {"refused": str(e), "step": step}
            opt.step()
            opt.zero_grad()
            if step == 1 and rank == 0:  # (an evaluation on rank 0 alone)
                with torch.no_grad():
                    c(*local)
        return {"refused": None}
    finally:
        torch.set_default_dtype(torch.float32)


def test_a_module_called_on_one_rank_alone_while_the_others_train_is_refused(ranks):
    """Found by a probe: rank 0 alone evaluated a tensor-parallel module once between steps; its forward's
    all_reduce paired with rank 1's next training call, and from then on every collective paired one call apart:
    both ranks trained 0.02 off one device, without an error. The checked calls (1, 2, 4, 8, ..., then every
    few) now compare the call on every rank: the optimizer steps taken over the module, and the grad, inference
    and train/eval modes. Here both ranks stop at call 4."""
    for fn in (_one_rank_evaluates_alone, _one_rank_evaluates_alone_built_on_meta):
        for r in _in_ranks_of_its_own(ranks, fn):
            assert r["refused"] and "the ranks made different calls of this module at its call 4" in r["refused"], r


def _one_rank_evaluates_alone_built_on_meta(rank: int, world: int) -> dict:
    return _one_rank_evaluates_alone(rank, world, meta=True)


def _uneven_last_batch_cut_by_hand(rank: int, world: int) -> dict:
    torch.set_default_dtype(torch.float64)
    try:
        from tests.models import MLP

        torch.manual_seed(0)
        model = MLP(12, 24)
        reference = copy.deepcopy(model)
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(6, 12, generator=g), torch.randn(6, 12, generator=g)
        compiled = spmd.compile(model, spmd.init_mesh((3,), ("dp",)), (x, y), loss_fn=F.mse_loss,
                                mesh_spec=spec((3,), ("dp",)), in_placements={"x": [Shard(0)], "target": [Shard(0)]})
        opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (compiled, reference))
        errors = []
        for rows in (6, 3, 5):  # (3: a variant of 1 row per rank; 5: a loader's last batch, chunked 2, 2 and 1)
            a, b = torch.randn(rows, 12, generator=g), torch.randn(rows, 12, generator=g)
            local = compiled.shard_inputs(a, b) if rows != 5 else (a.chunk(3)[rank], b.chunk(3)[rank])
            try:
                loss = compiled(*local)
            except spmd.SpmdError as e:
                return {"refused": str(e), "errors": errors}
            loss.backward()
            want = F.mse_loss(reference(a), b)
            want.backward()
            errors.append(abs(loss.item() - want.item()))
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
        return {"refused": None, "errors": errors}
    finally:
        torch.set_default_dtype(torch.float32)


def test_pieces_of_other_shapes_on_one_rank_are_refused_where_the_module_has_graphs_for_them(ranks):
    """Found by a probe on 3 ranks: compiled for a batch of 6 split on dp, and for a batch of 3 once (1 row per
    rank), a data-parallel loader's last batch of 5 cut by hand (2, 2 and 1 rows) had rank 2 run the batch-3 graphs
    while its peers ran the compiled ones. Their collectives paired, and all three trained 5.4% off one device,
    without an error. Once a module has graphs for more than one set of shapes, each call now compares the pieces'
    shapes over the mesh, and every rank stops naming them."""
    pool = ranks(3)
    try:
        results = pool.run(_uneven_last_batch_cut_by_hand)
    finally:
        pool.close()
    for r in results:
        assert len(r["errors"]) == 2 and max(r["errors"]) < 1e-12, r  # (the even batches: equal to one device)
        assert r["refused"] and "with pieces of different shapes (rank 0: [2, 12], [2, 12]; rank 1: [2, 12], " \
            "[2, 12]; rank 2: [1, 12], [1, 12])" in r["refused"] and "shard_inputs" in r["refused"], r


def _compiled_holder_cutting_an_activation(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    core = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16))
    pre = torch.nn.Linear(16, 16)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    eager = torch.nn.Sequential(copy.deepcopy(pre), copy.deepcopy(core))
    compiled = spmd.compile(core, spmd.init_mesh((2,), ("tp",)), (x.clone().requires_grad_(), y), loss_fn=F.mse_loss,
                            mesh_spec=spec((2,), ("tp",)), in_placements={"input": [Replicate()]})

    return {"losses": _three_steps_each(torch.compile(_Holder(pre, compiled), backend="eager"), eager, x, y)}


def test_shard_inputs_inside_a_torch_compiled_forward(ranks):
    """Found by a probe: a holder compiled by torch.compile, whose forward cuts an activation that requires grad with
    shard_inputs, failed at its second call with a raw TypeError (dynamo's stand-in for the cut's record)."""
    for r in _in_ranks_of_its_own(ranks, _compiled_holder_cutting_an_activation):
        assert r["losses"][:3] == pytest.approx(r["losses"][3:], rel=1e-5), r


def _inside_ddp(rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    core, pre = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()), torch.nn.Linear(16, 16)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    eager = torch.nn.Sequential(copy.deepcopy(pre), copy.deepcopy(core))
    compiled = spmd.compile(core, spmd.init_mesh((2,), ("tp",)), (x.clone().requires_grad_(), y), loss_fn=F.mse_loss,
                            mesh_spec=spec((2,), ("tp",)), param_placements={"0.weight": [Shard(0)]})

    refused, ddp = None, DDP(compiled)
    try:
        ddp(*compiled.shard_inputs(x, y))
    except spmd.SpmdError as e:
        refused = str(e)
    del ddp  # (its reducer, prepared for a backward that never comes, is gone before the next DDP: every rank alike)
    gc.collect()
    compiled.load_state_dict(core.state_dict())  # (the broadcast wrote rank 0's pieces over rank 1's)
    holder = _Holder(pre, compiled)
    DDP._set_params_and_buffers_to_ignore_for_model(holder, [f"core.{n}" for n, _ in compiled.named_parameters()])
    losses = _three_steps_each(DDP(holder), eager, x, y)
    # a model with an embedding: DDP's constructor asks it `sparse`, refused with DDP's words, not the read's (found
    # by a probe: transformers' Trainer, through accelerate, got "read values from the model")
    ids = torch.randint(0, 16, (8, 4))
    lm = spmd.compile(torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16)),
                      spmd.init_mesh((2,), ("tp",)), (ids,), training=True, mesh_spec=spec((2,), ("tp",)))
    try:
        DDP(lm)
        at_build = None
    except spmd.SpmdError as e:
        at_build = str(e)
    return {"refused": refused, "losses": losses, "at_build": at_build}


def test_a_compiled_module_inside_ddp(ranks):
    """Found by a probe: DDP around a compiled module broadcast rank 0's pieces over rank 1's and averaged the
    gradients of different pieces (weights 0.48 off after 3 steps, silently). Refused; DDP over the plain modules
    around it, the compiled module's parameters ignored, trains as one device."""
    for r in _in_ranks_of_its_own(ranks, _inside_ddp):
        assert "inside torch's DistributedDataParallel" in r["refused"], r
        assert r["losses"][:3] == pytest.approx(r["losses"][3:], rel=1e-5), r
        assert r["at_build"] and "inside torch's DistributedDataParallel" in r["at_build"] and \
            "_is_accelerate_prepared" in r["at_build"], r["at_build"]


def _pieces_handed_over(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    body, head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)
    x, wide = torch.randn(8, 8), torch.randn(4, 16)
    mesh, ms = spmd.init_mesh((2,), ("tp",)), spec((2,), ("tp",))
    b = spmd.compile(body, mesh, (x,), mesh_spec=ms, in_placements={"input": [Shard(0)]},
                     out_placements=[[Shard(0)]])
    h_rows = spmd.compile(head, mesh, (x,), mesh_spec=ms, in_placements={"input": [Shard(0)]})
    out = b(*b.shard_inputs(x))
    same = h_rows.gather_outputs(h_rows(out))
    refused = None
    try:  # (a [4, 16] input split on its columns: the same local shape [4, 8] as `out`)
        h_wide = spmd.compile(torch.nn.Sequential(torch.nn.Flatten(0), torch.nn.Unflatten(0, (4, 16))), mesh, (wide,),
                              mesh_spec=ms, in_placements={"input": [Shard(1)]})
        h_wide(out)
    except spmd.SpmdError as e:
        refused = str(e)
    other_shape = None
    import logging

    logged = []  # (torch's fake tensors logged each failing meta op's traceback ahead of the refusal; a probe)
    handler = logging.Handler(logging.ERROR)
    handler.emit = logged.append
    logging.getLogger("torch._subclasses.fake_tensor").addHandler(handler)
    try:  # (a [8, 8] input split on its columns: another local shape, [8, 4], than `out`'s [4, 8])
        h_cols = spmd.compile(torch.nn.Linear(8, 8), mesh, (x,), mesh_spec=ms, in_placements={"input": [Shard(1)]})
        h_cols(out)
    except spmd.SpmdError as e:
        other_shape = str(e)
    finally:
        logging.getLogger("torch._subclasses.fake_tensor").removeHandler(handler)
    return {"error": float((same - head(body(x))).abs().max()), "refused": refused, "other_shape": other_shape,
            "logged": len(logged)}


def test_a_piece_handed_to_a_module_that_takes_another_layout(ranks):
    """Found by a probe: one module's output piece passed as it is to a module that takes that input in another
    layout of the same local shape ([S(0), S(1)] into [S(1), S(0)] on (2, 2)): each rank read its piece of another
    part of the tensor (losses 1.0056 where eager gave 1.0118). Refused; the same layout runs as one device."""
    for r in ranks(2).run(_pieces_handed_over):
        assert r["error"] < 1e-6, r
        assert ("a compiled module returned (this one or another), laid out as [S(0)], and this module takes it as "
                "[S(1)]") in r["refused"], r
        # (of another local shape: the same words, not what the trace of a variant for its shape met; a probe)
        assert "laid out as [S(0)], and this module takes it as [S(1)]" in r["other_shape"], r
        assert r["logged"] == 0, r



def _pieces_handed_across_meshes(rank: int, world: int) -> dict:
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        body, head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)
        x = torch.randn(8, 8)
        square = spmd.init_mesh((2, 2), ("dp", "tp"))
        b = spmd.compile(body, square, (x,), mesh_spec=spec((2, 2), ("dp", "tp")),
                         out_placements={0: [Shard(0), Shard(1)]})
        out = b(*b.shard_inputs(x))
        refused = None
        try:  # (a (2, 2) mesh of its own groups, the input taken [S(1), S(0)]: pieces of the same shape)
            other = spmd.init_mesh((2, 2), ("a", "b"))
            h = spmd.compile(head, other, (x,), mesh_spec=spec((2, 2), ("a", "b")),
                             in_placements={"input": [Shard(1), Shard(0)]})
            h(out)
        except spmd.SpmdError as e:
            refused = str(e)
        # (the same pieces on a mesh of another shape over the same ranks: [S(0), S(0)] on (2, 2) is [S(0)] on (4,))
        rows = spmd.compile(body, square, (x,), mesh_spec=spec((2, 2), ("dp", "tp")),
                            out_placements={0: [Shard(0), Shard(0)]})
        line = spmd.compile(head, spmd.init_mesh((4,), ("all",)), (x,), mesh_spec=spec((4,), ("all",)),
                            in_placements={"input": [Shard(0)]})
        got = line.gather_outputs(line(rows(*rows.shard_inputs(x))))
        return {"refused": refused, "error": float((got - head(body(x))).abs().max())}
    finally:
        torch.set_default_dtype(torch.float32)


def test_a_piece_handed_to_a_module_on_another_mesh_is_checked(ranks):
    """Found by a probe: a piece handed to a module compiled on another (2, 2) mesh (its own axis names and process
    groups) was not checked, since the check compared the meshes' groups: `[S(0), S(1)]` taken as `[S(1), S(0)]`
    trained 0.13 off one device in 3 steps, silently. Each rank's part of the tensor is now compared under both
    layouts; the same pieces on a mesh of another shape over the same ranks run as one device."""
    for r in ranks(4).run(_pieces_handed_across_meshes):
        assert r["refused"] and "laid out as [S(0), S(1)] on mesh (2, 2), and this module takes it as [S(1), S(0)]" \
            in r["refused"], r["refused"]
        assert r["error"] < 1e-12, r

def _evaluation_module_given_weights_in_place_before_its_first_call(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16))
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    mesh, ms = spmd.init_mesh((2,), ("tp",)), spec((2,), ("tp",))
    train = spmd.compile(model, mesh, (x, y), loss_fn=F.mse_loss, mesh_spec=ms)
    evaluate = spmd.compile(model, mesh, (x, y), loss_fn=F.mse_loss, mesh_spec=ms)
    opt = torch.optim.SGD(train.parameters(), lr=0.1)
    train(*train.shard_inputs(x, y)).backward()
    opt.step()
    with torch.no_grad():
        for p, q in zip(train.parameters(), evaluate.parameters()):
            q.copy_(p)
        return {"evaluated": evaluate(*evaluate.shard_inputs(x, y)).item(),
                "trained": train(*train.shard_inputs(x, y)).item()}


def test_an_evaluation_module_given_the_trained_weights_in_place_before_its_first_call(ranks):
    """Found by a probe: given the trained pieces in place (the same plan) before its first call, an evaluation
    module was refused as if the model had been loaded after compiling (its replicated pieces share the model's
    tensors, which the sibling's steps moved), with a way out that was refused in turn; after a first call it ran."""
    for r in ranks(2).run(_evaluation_module_given_weights_in_place_before_its_first_call):
        assert r["evaluated"] == pytest.approx(r["trained"], rel=1e-6), r


def _loss_outside_on_the_output(rank: int, world: int, steps: int = 3) -> dict:
    """A GPT compiled with training=True and no loss_fn, its head pinned column-parallel (split on the vocabulary),
    and a cross-entropy of the output taken outside, as a loop written for DDP does; against one device."""
    from tests.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=64, seq=8, dim=32, heads=4, layers=2)).double()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    tokens, targets = torch.randint(0, 64, (4, 7), generator=g), torch.randint(0, 32, (4, 7), generator=g)
    mesh = spmd.init_mesh((2,), ("tp",))
    compiled = spmd.compile(model, mesh, (tokens,), training=True, mesh_spec=spec((2,), ("tp",)),
                            param_placements={"lm_head.weight": [Shard(0)]})
    opt, ref_opt = torch.optim.SGD(compiled.parameters(), lr=0.5), torch.optim.SGD(reference.parameters(), lr=0.5)
    widths = set()
    for _ in range(steps):
        out = compiled(*compiled.shard_inputs(tokens))
        widths.add(out.shape[-1])
        pieces, rows = 4 // out.shape[0], out.shape[0]  # (a piece of the batch: its rows' loss, DDP's way)
        mine = targets[rank * rows:(rank + 1) * rows] if pieces > 1 else targets
        (F.cross_entropy(out.flatten(0, 1), mine.flatten()) / pieces).backward()
        F.cross_entropy(reference(tokens).flatten(0, 1), targets.flatten()).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    full = compiled.full_state_dict()
    return {"widths": widths, "apart": max(float((full[k] - v).abs().max()) for k, v in reference.named_parameters())}


def test_a_loss_outside_on_the_output_equals_one_device(ranks):
    """Found by a probe: the solver left the output split on the vocabulary (behind a head pinned Shard(0)), and a
    cross-entropy of each rank's piece ran on half the classes: 4.93 against 6.17, parameters 0.22 off after 3
    steps, no error. An output a loss outside differentiates comes back whole or split on dim 0."""
    for r in ranks(2).run(_loss_outside_on_the_output):
        assert r["widths"] == {64} and r["apart"] < 1e-12, r


class _Spectral(torch.nn.Module):
    """An FNO-like spectral layer: a complex weight on the lowest Fourier modes."""

    def __init__(self, ch: int = 4, modes: int = 4):
        super().__init__()
        self.modes = modes
        self.w = torch.nn.Parameter(torch.randn(modes, ch, ch, dtype=torch.complex128) * 0.3)
        self.lin = torch.nn.Linear(ch, ch)

    def forward(self, x):
        xf = torch.fft.rfft(x, dim=1)
        yf = torch.zeros_like(xf)
        yf[:, :self.modes] = torch.einsum("bmc,mcd->bmd", xf[:, :self.modes], self.w)
        return torch.relu(torch.fft.irfft(yf, n=x.shape[1], dim=1) + self.lin(x))


def _spectral_steps(rank: int, world: int) -> dict:
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model, x, y = _Spectral(), torch.randn(4, 16, 4), torch.randn(4, 16, 4)
    eager = copy.deepcopy(model)
    mesh = spmd.init_mesh((2,), ("dp",))
    compiled = spmd.compile(model, mesh, (x, y), loss_fn=F.mse_loss, mesh_spec=spec((2,), ("dp",)),
                            param_placements={"w": [Shard(0)]})
    opt, eager_opt = torch.optim.SGD(compiled.parameters(), lr=0.1), torch.optim.SGD(eager.parameters(), lr=0.1)
    losses = []
    for _ in range(2):
        loss = compiled(*compiled.shard_inputs(x, y))
        loss.backward()
        norm = compiled.clip_grad_norm_(0.1)
        opt.step()
        opt.zero_grad()
        eager_loss = F.mse_loss(eager(x), y)
        eager_loss.backward()
        eager_norm = torch.nn.utils.clip_grad_norm_(eager.parameters(), 0.1)
        eager_opt.step()
        eager_opt.zero_grad()
        assert norm.dtype == eager_norm.dtype == torch.float64, (norm, eager_norm)
        losses += [abs(float(loss) - float(eager_loss)), abs(float(norm) - float(eager_norm))]
    full = compiled.full_state_dict()
    errors = {n: float((full[n] - p.detach()).abs().max()) for n, p in eager.named_parameters()}
    report = compiled.verify(x, y)  # (complex gradients are conjugate views: view_as_real refused them)

    class Conjugate(torch.nn.Module):  # (an output that is a conjugate view, split on the batch)
        def forward(self, x):
            return torch.fft.rfft(x, dim=1).conj()

    spectrum = spmd.compile(Conjugate(), mesh, (x,), mesh_spec=spec((2,), ("dp",)), in_placements={"x": [Shard(0)]},
                            out_placements={0: [Shard(0)]})
    gathered = spectrum.gather_outputs(spectrum(*spectrum.shard_inputs(x)))
    torch.set_default_dtype(torch.float32)
    return {"losses": losses, "errors": errors, "verified": report.ok,
            "conj": float((gathered - torch.fft.rfft(x, dim=1).conj()).abs().max())}


def test_complex_values_go_through_every_collective(ranks):
    """Found by a probe: a complex weight split on its modes (an FNO's spectral layer) failed its first step, the
    all_to_all saying "Invalid scalar type" (gloo's refuses complex tensors, and NCCL has no complex types at all),
    and the error said a rank had died; `full_state_dict` of such a weight failed alike, and `clip_grad_norm_` (a
    complex norm: clamp refused it). Complex values now travel as real pairs, as torch.distributed's own API sends
    them, and the norm is real. A conjugate view (a complex gradient, `z.conj()`) is made plain before it goes:
    `verify` and `gather_outputs` of one failed, said to be a dead peer (a probe)."""
    for r in ranks(2).run(_spectral_steps):
        assert max(r["losses"]) < 1e-12 and max(r["errors"].values()) < 1e-12, r
        assert r["verified"] and r["conj"] == 0.0, r


# ---- a loss_fn that returns one loss per example ---------------------------------------------------

def _per_example(out, target):
    return F.mse_loss(out, target, reduction="none").mean(1)


def _train_per_example_loss(rank: int, world: int, steps: int = 3) -> dict:
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        reference = copy.deepcopy(model)
        g = torch.Generator().manual_seed(1)
        x, y, w = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g), torch.rand(8, generator=g)
        mesh = spmd.init_mesh((2,), ("dp",))
        compiled = spmd.compile(model, mesh, (x, y), loss_fn=_per_example, mesh_spec=spec((2,), ("dp",)),
                                in_placements={"input": [Shard(0)]})
        opt, ref_opt = torch.optim.SGD(compiled.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
        losses, ref_losses = [], []
        for _ in range(steps):
            per_example = compiled(*compiled.shard_inputs(x, y))
            loss = (per_example * w).sum()  # (sample weights, applied by the loop)
            loss.backward()
            opt.step()
            opt.zero_grad()
            ref_loss = (_per_example(reference(x), y) * w).sum()
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            losses.append(float(loss))
            ref_losses.append(float(ref_loss))
        full = compiled.full_state_dict()
        return {"losses": losses, "ref_losses": ref_losses, "shape": tuple(per_example.shape),
                "error": max(float((full[k] - v).abs().max()) for k, v in reference.state_dict().items())}
    finally:
        torch.set_default_dtype(torch.float32)


def test_a_loss_fn_of_one_loss_per_example_comes_back_whole(ranks):
    """Found by a probe: a loss_fn with `reduction="none"`, reduced by the loop, came back as each rank's piece
    of the batch split, so each rank reduced its own examples (0.864 and 1.019 where one device gave 0.942) and
    the gradients came out twice on two ranks (0.03 off after 3 steps). A loss_fn's output that is not one
    number now comes back whole (enumerate_strategies._replicated)."""
    for r in ranks(2).run(_train_per_example_loss):
        assert r["shape"] == (8,)
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-12)
        assert r["error"] < 1e-12


class _GradModeBranch(torch.nn.Module):
    """A forward that computes otherwise with grad on, with grad off, and under inference mode."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 16)

    def forward(self, x):
        y = self.fc(x)
        if torch.is_inference_mode_enabled():
            return y * 5
        return y * 2 if torch.is_grad_enabled() else y


def _grad_mode_calls(rank: int, world: int) -> dict:
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = _GradModeBranch()
        g = torch.Generator().manual_seed(1)
        x, smaller = torch.randn(8, 8, generator=g), torch.randn(6, 8, generator=g)
        mesh = spmd.init_mesh((2,), ("tp",))
        compiled = spmd.compile(model, mesh, (x,), training=False, mesh_spec=spec((2,), ("tp",)),
                                param_placements={"fc.weight": [Shard(0)]})
        errors = {}
        for batch in (x, smaller, x):
            for mode in (torch.no_grad, torch.inference_mode, torch.enable_grad):
                with mode():
                    out = compiled.gather_outputs(compiled(*compiled.shard_inputs(batch)))
                    errors[mode.__name__, len(batch)] = float((out - model(batch)).abs().max().detach())
        return {"errors": errors, "piece": tuple(dict(compiled.named_parameters())["fc.weight"].shape)}
    finally:
        torch.set_default_dtype(torch.float32)


def test_an_inference_module_runs_the_grad_off_branch_under_no_grad_and_inference_mode(ranks):
    """A forward that asks `torch.is_grad_enabled()` (or inference mode) was traced with grad on, so an inference
    module called under `torch.no_grad()` / `torch.inference_mode()`, its usual use, was refused at every call.
    Such calls now run graphs traced in their mode (compiled once per mode and input shapes, over the same
    pieces), each equal to one device, a smaller batch too."""
    for r in ranks(2).run(_grad_mode_calls):
        assert r["piece"] == (8, 8)  # (the weight split in two on the ranks)
        assert max(r["errors"].values()) < 1e-12, r["errors"]


# ---- an embedding's max_norm -----------------------------------------------------------------------

class _Lookup(torch.nn.Module):
    def __init__(self, max_norm=None):
        super().__init__()
        self.e, self.l = torch.nn.Embedding(10, 6, max_norm=max_norm), torch.nn.Linear(6, 6)

    def forward(self, ids):
        return self.l(self.e(ids))


def _renormed_training(rank: int, world: int, pins: dict) -> dict:
    torch.set_default_dtype(torch.float64)
    try:
        def build(max_norm=None):
            torch.manual_seed(0)
            model = _Lookup(max_norm)
            with torch.no_grad():
                model.e.weight.mul_(3)  # (every row past the norm)
            return model

        reference, model = build(max_norm=1.0), build()
        g = torch.Generator().manual_seed(1)
        # (each half of the batch looks up rows of its own, and rows 8 and 9 none: a rank renormalizing only the
        # rows its own ids look up, or all of its rows, differs from one device)
        ids = torch.cat([torch.randint(0, 4, (2, 5), generator=g), torch.randint(4, 8, (2, 5), generator=g)])
        target = torch.randn(4, 5, 6, generator=g)
        mesh = spmd.init_mesh((2,), ("dp",))
        compiled = spmd.compile(model, mesh, (ids, target), loss_fn=F.mse_loss, mesh_spec=spec((2,), ("dp",)), **pins)
        losses, ref_losses, _ = train_side_by_side(
            compiled, reference, (ids,), (target,), F.mse_loss, 3, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
            before=lambda local: compiled.embedding_renorm_("e.weight", local[0], max_norm=1.0))  # (as refused)
        local_ids = compiled.shard_inputs(ids, target)[0]
        full = compiled.full_state_dict()
        return {"losses": losses, "ref_losses": ref_losses, "local_ids": tuple(local_ids.shape),
                "piece": tuple(compiled.piece("e.weight").shape),
                "errors": {k: float((full[k] - v).abs().max()) for k, v in reference.state_dict().items()}}
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("pins,ids,piece", [
    (dict(in_placements={"ids": [Shard(0)], "target": [Shard(0)]}, param_placements={"e.weight": [Replicate()]}),
     (2, 5), (10, 6)),
    (dict(param_placements={"e.weight": [Shard(0)]}), None, (5, 6)),
])
def test_an_embeddings_max_norm_applied_by_the_refusals_way_out_trains_as_on_one_device(ranks, pins, ids, piece):
    """Found by a probe: the refusal of an Embedding with max_norm said to renormalize the compiled module's piece
    after the optimizer's step: 3 steps gave losses 3.698, 1.185, 1.179 against one device's 1.264, 1.252, 1.241.
    Its way out now is `compiled.embedding_renorm_` before each call, which renormalizes the rows any rank looks
    up: with the batch split over the ranks (each its own rows) and the weight replicated, and with the weight
    split by rows, training equals one device's with max_norm."""
    for r in ranks(2).run(_renormed_training, pins):
        assert r["piece"] == piece
        if ids is not None:
            assert r["local_ids"] == ids
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-12)
        assert max(r["errors"].values()) < 1e-12, r["errors"]


def _renorm_refused(rank: int, world: int) -> str:
    mesh = spmd.init_mesh((2,), ("dp",))
    compiled = spmd.compile(_Lookup(), mesh, (torch.randint(0, 10, (4, 5)),), mesh_spec=spec((2,), ("dp",)),
                            param_placements={"e.weight": [Shard(1)]})
    with pytest.raises(spmd.SpmdError) as e:
        compiled.embedding_renorm_("e.weight", torch.tensor([1, 2]), max_norm=1.0)
    return str(e.value)


def test_renormalizing_an_embedding_cut_across_its_rows_is_refused_with_the_pin(ranks):
    for said in ranks(2).run(_renorm_refused):
        assert "cut across its rows on mesh axis dp" in said
        assert "param_placements={'e.weight': [Shard(0)]}" in said


# ---- an eager layer between two compiled modules ---------------------------------------------------

def _sandwich(rank: int, world: int, summed: bool) -> dict:
    import warnings

    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        enc, mid, dec = torch.nn.Linear(6, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 6)
        ref = [copy.deepcopy(m) for m in (enc, mid, dec)]
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)
        mesh, split = spmd.init_mesh((2,), ("dp",)), [Shard(0)]
        ec = spmd.compile(enc, mesh, (x,), training=True, mesh_spec=spec((2,), ("dp",)), in_placements={"input": split},
                          out_placements=[split])
        dc = spmd.compile(dec, mesh, (torch.randn(8, 8).requires_grad_(), y), loss_fn=F.mse_loss,
                          mesh_spec=spec((2,), ("dp",)),
                          in_placements={"input": split, "target": split})
        params = [*ec.parameters(), *mid.parameters(), *dc.parameters()]
        opt = torch.optim.SGD(params, lr=0.5)
        ref_opt = torch.optim.SGD([p for m in ref for p in m.parameters()], lr=0.5)
        said, refused = [], None
        for step in range(3):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                loss = dc(mid(ec(*ec.shard_inputs(x))), dc.shard_inputs(torch.zeros(8, 8), y)[1])
            said += [str(w.message) for w in caught if "plain parameter" in str(w.message)]
            loss.backward()
            if summed:  # (the warning's way out)
                for p in mid.parameters():
                    torch.distributed.all_reduce(p.grad)
            try:
                dc.clip_grad_norm_(100.0, also=(ec, mid))
            except spmd.SpmdError as e:
                refused = str(e)
            opt.step()
            opt.zero_grad()
            ref_loss = F.mse_loss(ref[2](ref[1](ref[0](x))), y)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
        return {"said": said, "refused": refused,
                "mid": max(float((a - b).abs().max()) for a, b in zip(mid.parameters(), ref[1].parameters())),
                "dec": max(float((a - b).abs().max()) for a, b in zip(dc.full_state_dict().values(),
                                                                       ref[2].state_dict().values()))}
    finally:
        torch.set_default_dtype(torch.float32)


def test_an_eager_layer_on_a_compiled_modules_output_piece_is_named_and_its_way_out_trains_as_on_one_device(ranks):
    """Found by a probe: a plain layer run on each rank's piece between two compiled modules got gradients from that
    piece alone (0.016 off one device after 3 steps, the ranks' replicas 0.038 apart), and DDP around it averaged
    them, half of one device's; `clip_grad_norm_(also=layer)` clipped each rank by its own norm, moving even the
    compiled modules apart. The call warns once, naming the way out; summing the layer's gradients over the ranks
    trains equal to one device; the clip refuses gradients that differ between the ranks."""
    for r in ranks(2).run(_sandwich, False):
        assert len(r["said"]) == 1 and "input 'input' of this training call is this rank's piece ([S(0)], split " \
            "over dp), computed from 2 plain parameter(s) of shape (8, 8), (8,)" in r["said"][0]
        assert "torch.distributed.all_reduce(p.grad, group=mesh.get_group('dp'))" in r["said"][0]
        assert r["refused"] and "the plain parameters' gradients differ between the ranks" in r["refused"]
    for r in ranks(2).run(_sandwich, True):
        assert r["refused"] is None
        assert r["mid"] < 1e-12 and r["dec"] < 1e-12, r


def _head_on_piece(rank: int, world: int, gathered: bool, how: str = "SGD") -> dict:
    import warnings

    from torch.distributed.optim import ZeroRedundancyOptimizer

    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        body, head, scale = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3), torch.nn.Parameter(torch.tensor(1.5))
        ref = [copy.deepcopy(m) for m in (body, head, scale)]
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        mesh = spmd.init_mesh((2,), ("dp",))  # (a hang fails by the rank pool's own timeout)
        compiled = spmd.compile(body, mesh, (x,), training=True, mesh_spec=spec((2,), ("dp",)),
                                in_placements={"input": [Shard(0)]}, out_placements=[[Shard(0)]])
        params = [*compiled.parameters(), *head.parameters(), scale]
        # (ZeRO's inner optimizer holds each rank's share alone, other on each rank: checked through the wrapper, or
        # the ranks met apart in the check's collective, a hang; found by a review)
        opt = ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.5) if how == "ZeRO" else \
            torch.optim.LBFGS(params, lr=0.5, max_iter=2) if how == "LBFGS" else torch.optim.SGD(params, lr=0.5)
        ref_opt = torch.optim.SGD([*ref[0].parameters(), *ref[1].parameters(), ref[2]], lr=0.5)
        said = []

        def closure():
            opt.zero_grad()
            out = compiled(*compiled.shard_inputs(x))
            if gathered:  # (the way out: the head on the whole output, the same on every rank)
                loss = F.mse_loss(head(compiled.gather_outputs(out)) * scale, y)
            else:  # each rank its piece's rows, a loss whose sum over the ranks is the batch's (DDP's way)
                loss = F.mse_loss(head(out) * scale, y[4 * rank:4 * rank + 4], reduction="sum") / y.numel()
            loss.backward()
            return loss

        for step in range(3):
            if how != "LBFGS":
                closure()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                opt.step(*[closure] if how == "LBFGS" else [])
            said += [str(w.message) for w in caught if "plain parameter" in str(w.message)]
            F.mse_loss(ref[1](ref[0](x)) * ref[2], y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        return {"said": said, "head": max(float((a - b).abs().max()) for a, b in
                                          zip([*head.parameters(), scale], [*ref[1].parameters(), ref[2]]))}
    finally:
        torch.set_default_dtype(torch.float32)


def test_plain_parameters_trained_on_an_output_piece_are_named_at_the_first_step(ranks):
    """Found by a probe: an eager head and a learnable scale after the last compiled module, on each rank's piece
    of its batch-split output, got gradients from that piece alone (a head 0.083 off one device after 3 steps, its
    replicas 0.23 apart), without a word: no compiled call comes after them. The optimizer's first step compares the
    plain parameters' gradients over the mesh and warns once; on the gathered output they agree, nothing is said,
    and training equals one device."""
    for r in ranks(2).run(_head_on_piece, False):
        assert len(r["said"]) == 1 and "SGD.step(): 3 plain parameter(s) beside the compiled module's (shapes (3, 8), " \
            "(3,), ()) have gradients that differ between its ranks" in r["said"][0], r["said"]
        assert r["head"] > 1e-3, r
    for r in ranks(2).run(_head_on_piece, True):
        assert r["said"] == [] and r["head"] < 1e-12, r
    for r in ranks(2).run(_head_on_piece, False, "ZeRO"):  # (the body's pieces are whole: ZeRO may step them)
        assert len(r["said"]) == 1 and r["said"][0].startswith("ZeroRedundancyOptimizer.step(): 3 plain"), r["said"]
    # (a closure computes the gradients inside the step: compared after it; before, none were there yet)
    for r in ranks(2).run(_head_on_piece, False, "LBFGS"):
        assert len(r["said"]) == 1 and r["said"][0].startswith("LBFGS.step(): 3 plain"), r["said"]


class _ReturnsItsWeight(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 8)

    def forward(self, u):
        return self.a(u), self.a.weight


def _clamp_the_gathered_weight(rank: int, world: int) -> str | None:
    """A forward that returns its weight, split on tp: the loop gathers the outputs and clamps the weight."""
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    compiled = spmd.compile(_ReturnsItsWeight(), spmd.init_mesh((2,), ("tp",)), (x,), training=True,
                            mesh_spec=spec((2,), ("tp",)), param_placements={"a.weight": [Shard(0)]})
    full = compiled.gather_outputs(compiled(*compiled.shard_inputs(x)))
    compiled(*compiled.shard_inputs(x))  # (gathered, read, not written: nothing said)
    full = compiled.gather_outputs(compiled(*compiled.shard_inputs(x)))
    with torch.no_grad():
        full[1].clamp_(-0.05, 0.05)
    try:
        compiled(*compiled.shard_inputs(x))
    except spmd.SpmdError as e:
        return str(e)
    return None


def test_a_write_into_a_gathered_returned_weight_is_refused(ranks):
    """Found by a probe: `gather_outputs(out)[1].clamp_(...)` on a returned weight split over the ranks wrote into
    a new tensor, and the model's weight stayed as it was (0.19 off after 3 steps; a warning at most, where the same
    write into the returned output itself is refused). Refused at the next call, with the way out."""
    for said in ranks(2).run(_clamp_the_gathered_weight):
        assert said is not None and "'a.weight'" in said and "after gather_outputs" in said and \
            "compiled.get_parameter('a.weight')" in said, said
