"""Vocabulary parallelism on gloo ranks: the embedding table split by rows (masked lookups, Partial
output), its gradient computed per rank for the rows it holds, and the loss over logits split by
vocabulary (log-sum-exp over shards, masked target pick), equal to one device in training."""
import pytest


def _train(rank: int, world: int, mesh_shape: tuple, names: tuple, pins: dict, vocab: int = 512, steps: int = 3) -> dict:
    import copy

    import torch
    from torch.distributed.tensor import Replicate

    import spmd
    from spmd.core.specs import placement_from_text, placements_str
    from tests.models import GPT, GPTConfig
    from spmd.core.profiles import LinkProfile
    from tests.support import lm_loss, spec, train_side_by_side

    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab=vocab, seq=8, dim=32, heads=4, layers=1))
        reference = copy.deepcopy(model)
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, vocab, (4, 8), generator=g)
        targets = torch.randint(0, vocab, (4, 8), generator=g)
        mesh = spmd.init_mesh(mesh_shape, names)
        # links that move bytes slowly (100 MB/s, 1 us): moving the table costs more than reducing the
        # looked-up rows, which is what vocabulary parallelism does
        link = LinkProfile("test-narrow-link", 1e-6, 1e8)
        compiled = spmd.compile(model, mesh, (tokens, targets), loss_fn=lm_loss,
                                mesh_spec=spec(mesh_shape, names, link=link),
                                param_placements={k: [placement_from_text(p) for p in v] for k, v in pins.items()},
                                in_placements={"tokens": [Replicate()] * len(mesh_shape),
                                               "targets": [Replicate()] * len(mesh_shape)})
        losses, ref_losses, _ = train_side_by_side(compiled, reference, (tokens,), (targets,), lm_loss, steps,
                                                   optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
        full = compiled.full_state_dict()
        refused = []  # an id past the vocabulary, a target past the classes: one device raises (found by a probe:
        for bad_tokens, bad_targets in ((tokens.clone().fill_(vocab), targets), (tokens, targets.clone().fill_(-3))):
            try:  # the masked lookups read them as other ranks' rows, and every rank added zeros)
                compiled(*compiled.shard_inputs(bad_tokens, bad_targets)).backward()
            except IndexError as e:
                refused.append(str(e))
        param_err = max(float((full[k] - v).abs().max()) for k, v in reference.named_parameters())
        graph = compiled.plan.sources.graph
        ops = {n.name: str(n.target) for n in graph.nodes if n.op == "call_function"}
        return {"losses": losses, "ref_losses": ref_losses, "param_err": param_err, "refused": refused,
                "choices": {n: str(s) for n, s in compiled.plan.choices.items() if n in ops
                            and ("embedding" in ops[n] or "gather" in ops[n] or "nll" in ops[n])},
                "code": compiled.code, "table": placements_str(compiled._state_placements["tok_emb.weight"]),
                "gathered": [list(s.local_in_shape) for _, s in compiled.plan.collectives() if s.kind == "all_gather"]}
    finally:
        torch.set_default_dtype(torch.float32)


CASES = {
    "tp2": ((2,), ("tp",), {"tok_emb.weight": ["S(0)"]}),
    "dp2-tp2": ((2, 2), ("dp", "tp"), {"tok_emb.weight": ["R", "S(0)"]}),
    "rows-over-both": ((2, 2), ("dp", "tp"), {"tok_emb.weight": ["S(0)", "S(0)"]}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_vocab_parallel_embedding_trains_equal_to_one_device(ranks, name):
    mesh_shape, names, pins = CASES[name]
    results = ranks(2 * len(mesh_shape)).run(_train, mesh_shape, names, pins)
    for rank, r in enumerate(results):
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-9), f"rank {rank}: {r['losses']} {r['ref_losses']}"
        assert r["param_err"] < 1e-9, f"rank {rank}: {r['param_err']}"
        # the lookup runs on the rows this rank holds (the table is never gathered) ...
        assert "masked_embedding(" in r["code"], r["choices"]
        assert r["choices"]["embedding"].startswith(f"([{', '.join(pins['tok_emb.weight'])}]"), r["choices"]
        # ... and so does its gradient
        assert "masked_embedding_backward(" in r["code"], r["choices"]



LOSS_CASES = {
    "tp2": ((2,), ("tp",), {"tok_emb.weight": ["S(0)"], "lm_head.weight": ["S(0)"]}),
    "dp2-tp2": ((2, 2), ("dp", "tp"), {"tok_emb.weight": ["R", "S(0)"], "lm_head.weight": ["R", "S(0)"]}),
}


@pytest.mark.parametrize("name", list(LOSS_CASES))
def test_vocab_parallel_loss_never_gathers_the_logits(ranks, name):
    """The LM head split by vocabulary rows gives logits split on the vocab dim; the cross-entropy runs
    on them where they are: max and sum-of-exp all_reduced (a few bytes per token), the target's logit
    picked by the rank that holds it, the gradient of the logits made per rank."""
    mesh_shape, names, pins = LOSS_CASES[name]
    results = ranks(2 * len(mesh_shape)).run(_train, mesh_shape, names, pins)
    for rank, r in enumerate(results):
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-9), f"rank {rank}: {r['losses']} {r['ref_losses']}"
        assert r["param_err"] < 1e-9, f"rank {rank}: {r['param_err']}"
        code = r["code"]
        assert "reduce_op = 'max'" in code, r["choices"]  # the log-sum-exp's max, over the vocab shards
        assert "masked_gather(" in code and "masked_nll_loss_backward(" in code, r["choices"]
        # nothing gathered has the logits' vocab dim (512 split over tp): they stay split
        assert r["gathered"] and not [shape for shape in r["gathered"] if shape[-1] == 256], r["gathered"]
        assert r["refused"] == ["embedding: index 512 is out of bounds for size 512 (the dim is split over the ranks; "
                                "one device raises here too)", "gather: index -3 is out of bounds for size 512 (the "
                                "dim is split over the ranks; one device raises here too)"], r["refused"]
