"""Activation recomputation on gloo ranks: every layer's forward runs again in backward (its
activations are not saved), whole or selectively (all but its matmuls and attention), and training
stays equal to one device."""
import pytest


def _train(rank: int, world: int, mesh_shape: tuple, names: tuple, mode, steps: int = 3) -> dict:
    import copy

    import torch

    import spmd
    from tests.models import GPT, GPTConfig
    from tests.support import lm_loss, spec, train_side_by_side

    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab=64, seq=8, dim=32, heads=4, layers=2))
        reference = copy.deepcopy(model)
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, 64, (4, 8), generator=g)
        targets = torch.randint(0, 64, (4, 8), generator=g)
        mesh = spmd.init_mesh(mesh_shape, names)
        saved = {}
        for recompute in (False, mode):
            compiled = spmd.compile(copy.deepcopy(model), mesh, (tokens, targets), loss_fn=lm_loss,
                                    mesh_spec=spec(mesh_shape, names), recompute=recompute, tie_blocks=True)
            compiled(*compiled.shard_inputs(tokens, targets)).backward()
            saved[recompute] = compiled.last_saved_bytes
        compiled = spmd.compile(model, mesh, (tokens, targets), loss_fn=lm_loss, mesh_spec=spec(mesh_shape, names),
                                recompute=mode, tie_blocks=True)
        losses, ref_losses, _ = train_side_by_side(compiled, reference, (tokens,), (targets,), lm_loss, steps,
                                                   optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
        full = compiled.full_state_dict()
        param_err = max(float((full[k] - v).abs().max()) for k, v in reference.named_parameters())
        recomputed = [n.meta["spmd_recomputes"] for n in compiled.split.backward.graph.nodes
                      if "spmd_recomputes" in n.meta]
        return {"losses": losses, "ref_losses": ref_losses, "param_err": param_err, "saved": saved,
                "layers": compiled.plan.recompute, "selective": compiled.plan.recompute_selective,
                "recomputed": recomputed,
                "plan_freed": compiled.plan.recomputed_bytes}
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("mesh_shape,names,mode", [((2,), ("tp",), True), ((2, 2), ("dp", "tp"), True),
                                                   ((2,), ("tp",), "selective")],
                         ids=["tp2", "dp2-tp2", "tp2-selective"])
def test_recomputed_layers_train_equal_to_one_device(ranks, mesh_shape, names, mode):
    results = ranks(2 * len(mesh_shape)).run(_train, mesh_shape, names, mode)
    blocks = ("model.blocks.0", "model.blocks.1")
    for rank, r in enumerate(results):
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-9), f"rank {rank}: {r['losses']} {r['ref_losses']}"
        assert r["param_err"] < 1e-9, f"rank {rank}: {r['param_err']}"
        assert (r["layers"], r["selective"]) == ((blocks, ()) if mode is True else ((), blocks))
        ops = " ".join(r["recomputed"])
        assert "native_layer_norm" in ops and "gelu" in ops, ops
        # selectively: the matmuls and attention stay saved, the ops between them run again
        assert ("addmm" in ops and "scaled_dot_product" in ops) == (mode is True), ops
        # backward rebuilds the blocks' activations: forward hands it fewer bytes
        assert r["saved"][mode] < (0.75 if mode is True else 0.8) * r["saved"][False], r["saved"]
        assert r["plan_freed"] > 0
