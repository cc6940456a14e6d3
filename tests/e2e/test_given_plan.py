"""A plan solved before (`spmd.plan` with no processes, saved to a file) compiled with `plan=path` on gloo
ranks: no rank solves, the module runs that plan (its fingerprint, its solve), and trains equal to one
device; a batch of another size is solved afresh over the same pieces; a pin the plan does not meet is
refused on every rank."""
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
        refused = None
        try:
            spmd.compile(model, mesh, (tokens, targets), loss_fn=lm_loss, plan=path,
                         param_placements={"blocks.0.mlp.fc1.weight": [Replicate()]})
        except spmd.SpmdError as e:
            refused = str(e)
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
        assert "param_placements pins 'blocks.0.mlp.fc1.weight' to [R]; the plan lays it out [S(0)]" in r["refused"]
