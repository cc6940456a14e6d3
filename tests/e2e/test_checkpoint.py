"""torch.distributed.checkpoint on gloo ranks: a model and its optimizer saved under one plan resume under
another, equal to the run that did not stop; plain pieces, which it would save once for all ranks, are refused."""
from __future__ import annotations

import re

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import spmd
from examples.models import GPT, GPTConfig
from tests.support import spec


def _lm_loss(out, targets):
    return F.cross_entropy(out.flatten(0, 1), targets.flatten())


def _gpt(pins: dict):
    torch.manual_seed(0)
    tokens = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    mesh = spmd.init_mesh((2,), ("dp",))
    compiled = spmd.compile(GPT(GPTConfig(layers=1)), mesh, (tokens, tokens), loss_fn=_lm_loss,
                            mesh_spec=spec((2,), ("dp",)), param_placements=pins)
    return compiled, compiled.shard_inputs(tokens, tokens)


def _step(compiled, opt, inputs) -> None:
    compiled(*inputs).backward()
    opt.step()
    opt.zero_grad()


def _full(compiled) -> dict:
    return {k: v.clone() for k, v in compiled.full_state_dict().items()}


def _resume(rank: int, world: int, folder: str) -> dict:
    import torch.distributed.checkpoint as dcp

    # float64: the two plans sum in other orders, and AdamW's first steps magnify float32's rounding of a
    # near-zero gradient (5.5e-5 on one host, 0 on another)
    torch.set_default_dtype(torch.float64)
    compiled, inputs = _gpt({"blocks.0.mlp.fc1.weight": [Shard(0)]})  # each rank holds half of fc1
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-2)
    for _ in range(2):
        _step(compiled, opt, inputs)
    dcp.save({"model": compiled.state_dict(), "opt": compiled.optimizer_state_dict(opt)}, checkpoint_id=folder)
    saved = _full(compiled)
    _step(compiled, opt, inputs)
    went_on = _full(compiled)

    # another plan (fc1 whole, fc2 cut), another process's optimizer that has not stepped
    other, inputs = _gpt({"blocks.0.mlp.fc1.weight": [Replicate()], "blocks.0.mlp.fc2.weight": [Shard(1)]})
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    state = {"model": other.state_dict(), "opt": other.optimizer_state_dict(other_opt)}
    dcp.load(state, checkpoint_id=folder)
    other.load_state_dict(state["model"])
    other.load_optimizer_state_dict(other_opt, state["opt"])
    loaded = _full(other)
    _step(other, other_opt, inputs)
    resumed = _full(other)

    # the model alone, its optimizer afresh: the step after it must differ (the moments matter)
    fresh, inputs = _gpt({})
    fresh.load_state_dict(state["model"])
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    _step(fresh, fresh_opt, inputs)
    torch.set_default_dtype(torch.float32)
    return {"loaded": max(float((loaded[k] - v).abs().max()) for k, v in saved.items()),
            "resumed": max(float((resumed[k] - v).abs().max()) for k, v in went_on.items()),
            "fresh": max(float((_full(fresh)[k] - v).abs().max()) for k, v in went_on.items()),
            "placements": [str(other.sharded_state_dict()["blocks.0.mlp.fc1.weight"].placements),
                           str(compiled.sharded_state_dict()["blocks.0.mlp.fc1.weight"].placements)]}


def test_model_and_optimizer_resume_on_another_plan(ranks, tmp_path):
    """`compiled.state_dict()` (DTensors under the model's names) and `compiled.optimizer_state_dict(opt)`
    saved by torch.distributed.checkpoint under one plan load under another, and the next step equals the
    step of the run that went on. (Before, `state_dict()` gave plain pieces under `0__weight`-like names, and
    the checkpoint kept one rank's half of fc1 for both ranks: the other resumed with its values.)"""
    for r in ranks(2).run(_resume, str(tmp_path)):
        assert r["placements"] == ["(Replicate(),)", "(Shard(dim=0),)"], r["placements"]
        assert r["loaded"] == 0.0 and r["resumed"] < 1e-10, r
        assert r["fresh"] > 1e-4, r  # (without the optimizer's moments the step is another one)


def _resume_before_the_first_step(rank: int, world: int, folder: str) -> dict:
    """Saved before the optimizer's first step, resumed in another compile: the steps after equal the run's that
    went on, for AdamW (which counts its steps) and SGD with dampened momentum (which counts nothing)."""
    import torch.distributed.checkpoint as dcp

    torch.set_default_dtype(torch.float64)
    makers = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
              "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-1, momentum=0.9, dampening=0.5)}
    off = {}
    for name, make in makers.items():
        compiled, inputs = _gpt({"blocks.0.mlp.fc1.weight": [Shard(0)]})
        opt = make(compiled.parameters())
        dcp.save({"model": compiled.state_dict(), "opt": compiled.optimizer_state_dict(opt)},
                 checkpoint_id=f"{folder}/{name}")
        for _ in range(2):
            _step(compiled, opt, inputs)
        went_on = _full(compiled)
        other, inputs = _gpt({"blocks.0.mlp.fc2.weight": [Shard(1)]})
        other_opt = make(other.parameters())
        state = {"model": other.state_dict(), "opt": other.optimizer_state_dict(other_opt)}
        dcp.load(state, checkpoint_id=f"{folder}/{name}")
        other.load_state_dict(state["model"])
        other.load_optimizer_state_dict(other_opt, state["opt"])
        for _ in range(2):
            _step(other, other_opt, inputs)
        off[name] = max(float((_full(other)[k] - v).abs().max()) for k, v in went_on.items())
    torch.set_default_dtype(torch.float32)
    return off


def test_a_checkpoint_saved_before_the_first_step_resumes_as_the_run_went_on(ranks, tmp_path):
    """Found by a probe: the state `optimizer_state_dict` makes up for an optimizer that has not stepped (a step at
    rate 0: AdamW's count 1, SGD's momentum buffers of zeros) was saved as the optimizer's and loaded as real, so the
    resumed run took AdamW's bias corrections one step on (0.0165 off after 3 steps) and SGD's dampening on its first
    step (0.047). Now the optimizer resumes fresh, as the saved one was."""
    for off in ranks(2).run(_resume_before_the_first_step, str(tmp_path)):
        assert off["adamw"] < 1e-12 and off["sgd"] < 1e-12, off


def _plain_pieces(rank: int, world: int, folder: str) -> list[str]:
    import torch.distributed.checkpoint as dcp

    compiled, inputs = _gpt({"blocks.0.mlp.fc1.weight": [Shard(0)]})
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-2)
    _step(compiled, opt, inputs)
    piece = compiled.get_parameter("blocks.0.mlp.fc1.weight")
    dcp.save({"w": compiled.state_dict()["blocks.0.mlp.fc1.weight"]}, checkpoint_id=folder)  # (right: a DTensor)
    refused = []
    for what, call in (
            ("save the optimizer's own state_dict", lambda: dcp.save({"model": compiled.state_dict(),
                                                                      "opt": opt.state_dict()}, checkpoint_id=folder)),
            # (async_save stages copies before its planner sees them: a review found it saved them)
            ("async_save it", lambda: dcp.async_save({"opt": opt.state_dict()}, checkpoint_id=folder).result()),
            ("load into plain pieces", lambda: dcp.load({"w": piece}, checkpoint_id=folder))):
        try:
            call()
        except BaseException as e:  # (torch.distributed.checkpoint's CheckpointException is a BaseException)
            refused.append(f"{what}: {e}")
    return refused


def test_plain_pieces_are_refused(ranks, tmp_path):
    """The optimizer's own `state_dict()` holds plain pieces of fc1's moments: saved by
    torch.distributed.checkpoint, one rank's would have been kept for both. Refused on every rank, naming
    the entry and the way out; so is a load into a plain piece."""
    for refused in ranks(2).run(_plain_pieces, str(tmp_path)):
        assert len(refused) == 3, refused
        for r in refused[:2]:
            assert re.search(r"'opt\.state\.\d+\.exp_avg' \(this rank's piece of AdamW's 'exp_avg' of [\w.]+\.weight\)", r)
            assert "compiled.optimizer_state_dict(optimizer)" in r
        assert "asked to load plain pieces" in refused[2] and "piece of blocks.0.mlp.fc1.weight" in refused[2]


def _saved_by_rank_0(rank: int, world: int, folder: str) -> dict:
    import torch.distributed as dist

    compiled, inputs = _gpt({"blocks.0.mlp.fc1.weight": [Shard(0)]})  # each rank holds half of fc1
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-2)
    _step(compiled, opt, inputs)
    saved = {"model": compiled.state_dict(), "named": compiled.optimizer_state_dict(opt), "plain": opt.state_dict()}
    torch.save(saved, f"{folder}/own_{rank}.pt")
    if rank == 0:  # (the single-device habit: one file, saved by rank 0)
        torch.save(saved, f"{folder}/rank0.pt")
    dist.barrier()
    outcome = {}
    for file in ("own", "rank0"):
        checkpoint = torch.load(f"{folder}/own_{rank}.pt" if file == "own" else f"{folder}/rank0.pt", weights_only=False)
        other, inputs = _gpt({"blocks.0.mlp.fc1.weight": [Shard(0)]})
        named, plain = (torch.optim.AdamW(other.parameters(), lr=1e-2) for _ in range(2))
        # (each rank runs the same collectives whatever it refuses: a load raises before any, a step after them)
        for what, load in (("model", lambda: other.load_state_dict(checkpoint["model"])),
                           ("named", lambda: other.load_optimizer_state_dict(named, checkpoint["named"])),
                           ("plain", lambda: plain.load_state_dict(checkpoint["plain"]))):
            outcome[f"{file} {what}"] = _refused(load)
        other(*inputs).backward()
        if outcome[f"{file} plain"] == "ok":  # (a plain state is checked at the optimizer's first step)
            outcome[f"{file} plain"] = _refused(plain.step)
    # the optimizer's own state, saved by this rank, loaded under another plan (fc1 whole, fc2 cut)
    other, inputs = _gpt({"blocks.0.mlp.fc1.weight": [Replicate()], "blocks.0.mlp.fc2.weight": [Shard(1)]})
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    other_opt.load_state_dict(torch.load(f"{folder}/own_{rank}.pt", weights_only=False)["plain"])
    other(*inputs).backward()
    outcome["own plain, another plan"] = _refused(other_opt.step)
    return outcome


def _refused(call) -> str:
    try:
        call()
        return "ok"
    except spmd.SpmdError as e:
        return str(e)


def test_a_checkpoint_of_one_ranks_pieces_loaded_on_another_is_refused(ranks, tmp_path):
    """Found by a probe: `torch.save(...)` on rank 0 alone, then `torch.load` of that file on every rank (the
    single-device habit), handed rank 1 rank 0's pieces, of the same shapes, and every load took them as its
    own: the model's state_dict() 0.51 off after resuming, the optimizer's (its own state_dict() or
    optimizer_state_dict()) 0.025 off, silently. Each rank's own file loads; rank 0's loads on rank 0; the
    others are refused with the ways out, as is the optimizer's own state loaded under another plan."""
    for rank, outcome in enumerate(ranks(2).run(_saved_by_rank_0, str(tmp_path))):
        for what in ("model", "named", "plain"):
            assert outcome[f"own {what}"] == "ok", outcome
            if rank == 0 and what == "plain":  # (an optimizer's own state: checked at its step, rank by rank)
                assert outcome[f"rank0 {what}"] == "ok", outcome
        if rank == 0:  # (refused on every rank alike: rank 1 alone refusing left rank 0 loaded and the replicas apart)
            for what in ("model", "named"):
                assert "another rank of the mesh refused what it was given (its own message says why)" in \
                    outcome[f"rank0 {what}"] and "Where it was given another rank's pieces" in outcome[f"rank0 {what}"], \
                    outcome
        if rank == 1:
            assert re.search(r"the state dict's '[\w.]+' is the piece of the rank at mesh "
                             r"coordinate \(0,\).*this rank is at \(1,\).*full_state_dict", outcome["rank0 model"])
            assert "the piece of the rank at mesh coordinate (0,)" in outcome["rank0 named"], outcome
            assert re.search(r"AdamW was loaded with a state_dict\(\) saved by the rank at mesh coordinate \(0,\) "
                             r"\(of a mesh \(2,\)\), and this rank is at \(1,\).*optimizer_state_dict",
                             outcome["rank0 plain"])
        assert re.search(r"saved under another plan \([\w.]+: laid out (whole|\(Shard\(dim=\d\),\)) then, "
                         r"(whole|\(Shard\(dim=\d\),\)) now\)", outcome["own plain, another plan"]), \
            outcome["own plain, another plan"]


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.ln, self.fc2 = torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 10)

    def forward(self, x):
        return self.fc2(self.ln(torch.nn.functional.gelu(self.fc1(x))))


def _ema_resume(rank: int, world: int, folder: str, together: bool) -> dict:
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    torch.set_default_dtype(torch.float64)
    try:
        g = torch.Generator().manual_seed(1)
        xs, ys = [torch.randn(8, 16, generator=g) for _ in range(5)], [torch.randint(0, 10, (8,), generator=g)
                                                                       for _ in range(5)]
        mesh = spmd.init_mesh((2,), ("dp",))

        def build(seed, pins):
            torch.manual_seed(seed)
            c = spmd.compile(_Net(), mesh, (xs[0], ys[0]), loss_fn=F.cross_entropy, mesh_spec=spec((2,), ("dp",)),
                             param_placements=pins)
            opt = torch.optim.AdamW(c.parameters(), lr=2e-2)
            return c, opt, AveragedModel(c, multi_avg_fn=get_ema_multi_avg_fn(0.9))

        def train(c, opt, ema, steps):
            for i in steps:
                c(*c.shard_inputs(xs[i], ys[i])).backward()
                opt.step()
                opt.zero_grad()
                ema.update_parameters(c)

        c, opt, ema = build(0, {"fc1.weight": [Shard(0)]})
        train(c, opt, ema, range(2))
        dcp.save({"model": c.state_dict(), "optim": c.optimizer_state_dict(opt), "ema": ema.state_dict()},
                 checkpoint_id=folder)
        train(c, opt, ema, range(2, 5))
        want, want_ema = c.full_state_dict(), ema.module.full_state_dict()

        r, ropt, rema = build(1, {"fc1.weight": [Shard(1)], "fc2.weight": [Shard(0)]})
        state = {"model": r.state_dict(), "optim": r.optimizer_state_dict(ropt)}
        if together:  # (one load: the EMA's pieces settled beside the model's raised a KeyError)
            state["ema"] = rema.state_dict()
            dcp.load(state, checkpoint_id=folder)
        else:  # (the EMA after: its load made the module that trains "stale")
            dcp.load(state, checkpoint_id=folder)
        r.load_state_dict(state["model"])
        r.load_optimizer_state_dict(ropt, state["optim"])
        if not together:
            state["ema"] = rema.state_dict()
            dcp.load({"ema": state["ema"]}, checkpoint_id=folder)
        rema.load_state_dict(state["ema"])
        train(r, ropt, rema, range(2, 5))
        got, got_ema = r.full_state_dict(), rema.module.full_state_dict()
        return {"weights": max(float((got[k] - v).abs().max()) for k, v in want.items()),
                "ema": max(float((got_ema[k] - v).abs().max()) for k, v in want_ema.items())}
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("together", [True, False])
def test_an_ema_resumes_beside_the_model(ranks, tmp_path, together):
    """Found by a probe: an `AveragedModel(compiled)` checkpointed beside the model. Loaded in the same
    `dcp.load`, the resume stopped with a raw KeyError (two of spmd's tables shared one name); loaded after the
    model, the EMA's load made the module that trains "stale", and the advice trained the EMA's weights (0.046
    off). Both resume exactly as the run that went on, on another plan."""
    for r in ranks(2).run(_ema_resume, str(tmp_path), together):
        assert r["weights"] < 1e-12 and r["ema"] < 1e-12, r
