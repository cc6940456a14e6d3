"""A plan solved before (`spmd.plan` with no processes, saved to a file) compiled with `plan=path` on gloo
ranks: no rank solves, the module runs that plan (its fingerprint, its solve), and trains equal to one
device; a batch of another size is solved afresh over the same pieces; a pin the plan does not meet, a plan
given on one rank only, or a file one rank cannot read are refused on every rank."""
import pytest


def _model_and_batch():
    import torch

    from tests.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=2))
    g = torch.Generator().manual_seed(1)
    return model, torch.randint(0, 128, (4, 32), generator=g), torch.randint(0, 128, (4, 32), generator=g)


def _train_with(rank: int, world: int, path: str) -> dict:
    import copy

    import torch
    from torch.distributed.tensor import Replicate

    import spmd
    from tests.support import lm_loss, train_side_by_side

    torch.set_default_dtype(torch.float64)
    try:
        model, tokens, targets = _model_and_batch()
        reference = copy.deepcopy(model)
        mesh = spmd.init_mesh((2,), ("tp",))
        refused = {}
        for case, kwargs in {
                "pin": dict(plan=path, param_placements={"blocks.0.mlp.fc1.weight": [Replicate()]}),
                "rank 0 alone": dict(plan=path if rank == 0 else None),  # (none solves: no meeting skipped)
                "a file rank 1 lacks": dict(plan=path if rank == 0 else path + ".missing")}.items():
            try:
                spmd.compile(model, mesh, (tokens, targets), loss_fn=lm_loss, **kwargs)
            except spmd.SpmdError as e:
                refused[case] = str(e)
        compiled = spmd.compile(model, mesh, (tokens, targets), loss_fn=lm_loss, plan=path)
        losses, ref_losses, _ = train_side_by_side(compiled, reference, (tokens,), (targets,), lm_loss, 3,
                                                   optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
        full = compiled.full_state_dict()
        # a smaller batch: its own plan, solved here over the same pieces
        small = [t[:2] for t in (tokens, targets)]
        small_loss = compiled(*compiled.shard_inputs(*small)).detach().item()
        ref_small = lm_loss(reference(small[0]), small[1]).detach().item()
        return {"losses": losses, "ref_losses": ref_losses, "small": (small_loss, ref_small),
                "weights": max(float((full[k] - v.detach()).abs().max()) for k, v in reference.named_parameters()),
                "fingerprint": compiled.plan.fingerprint(), "solve_seconds": compiled.plan.solve_seconds,
                "collectives": sum(compiled.plan.collective_summary().values()), "refused": refused}
    finally:
        torch.set_default_dtype(torch.float32)


def test_a_saved_plan_compiles_and_trains_equal_to_one_device(ranks, tmp_path):
    import torch
    from torch.distributed.tensor import Shard

    import spmd
    from tests.support import lm_loss, spec

    torch.set_default_dtype(torch.float64)
    try:
        model, tokens, targets = _model_and_batch()
        # planned with no processes, Megatron's first MLP layer pinned so that the plan shards
        planned = spmd.plan(model, spec((2,), ("tp",)), (tokens, targets), loss_fn=lm_loss,
                            param_placements={"blocks.0.mlp.fc1.weight": [Shard(0)]})
    finally:
        torch.set_default_dtype(torch.float32)
    path = tmp_path / "plan.json"
    planned.save(path)
    for rank, r in enumerate(ranks(2).run(_train_with, str(path))):
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-9), f"rank {rank}"
        assert r["weights"] < 1e-9, f"rank {rank}: {r['weights']}"
        assert r["small"][0] == pytest.approx(r["small"][1], rel=1e-9), f"rank {rank}"
        # the plan as saved, not solved again (another solve takes other seconds)
        assert (r["fingerprint"], r["solve_seconds"]) == (planned.fingerprint(), planned.solve_seconds)
        assert r["collectives"] > 0
        refused = r["refused"]
        assert "param_placements pins 'blocks.0.mlp.fc1.weight' to [R]; the plan lays it out [S(0)]" in refused["pin"]
        # every rank raises, none is left waiting (before: raw TypeErrors from collectives paired apart)
        assert "the ranks did not compile the same thing" in refused["rank 0 alone"], refused
        assert "options: rank 1 differs from rank 0" in refused["rank 0 alone"], refused
        assert "plan.json.missing" in refused["a file rank 1 lacks"], refused
