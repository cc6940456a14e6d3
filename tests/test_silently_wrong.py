"""Results that used to come back silently wrong: tied weights, custom autograd Functions, ops with several
outputs and no rule of their own. Each trains (or runs) equal to one device."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd
from spmd.pipeline import Compilation, run_pipeline
from spmd.runtime.simulate import simulate
from spmd.specs import Pins
from tests.cases import check_simulated_training, spec


# ---- tied weights --------------------------------------------------------------------------------

def _tied(name: str):
    from transformers import BertConfig, BertForMaskedLM, GemmaConfig, GemmaForCausalLM, GPT2Config, GPT2LMHeadModel

    if name == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
                                          use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    if name == "bert":
        return BertForMaskedLM(BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                          attention_probs_dropout_prob=0.0))
    return GemmaForCausalLM(GemmaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        max_position_embeddings=64, use_cache=False))


def _logits_loss(out, labels):
    return F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())


def _train_tied(rank: int, world: int, name: str, mesh_shape: tuple, steps: int = 3) -> dict:
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = _tied(name)
        reference = copy.deepcopy(model)
        g = torch.Generator().manual_seed(1)
        ids, labels = torch.randint(0, 128, (4, 16), generator=g), torch.randint(0, 128, (4, 16), generator=g)
        names = ("dp", "tp")[-len(mesh_shape):]
        mesh = spmd.init_mesh(mesh_shape, names)
        compiled = spmd.compile(model, mesh, (ids, labels), loss_fn=_logits_loss, mesh_spec=spec(mesh_shape, names))
        opt = torch.optim.SGD(compiled.parameters(), lr=0.1, momentum=0.9)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        local = compiled.shard_inputs(ids, labels)
        losses, ref_losses = [], []
        for _ in range(steps):
            loss = compiled(*local)
            loss.backward()
            opt.step()
            opt.zero_grad()
            ref_loss = _logits_loss(reference(ids), labels)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            losses.append(loss.item())
            ref_losses.append(ref_loss.item())
        full = compiled.full_state_dict()
        expected = dict(reference.named_parameters(remove_duplicate=False))
        errors = {k: float((full[k] - v).abs().max()) for k, v in expected.items() if k in full}
        return {"losses": losses, "ref_losses": ref_losses, "errors": errors, "missing": sorted(set(expected) - set(full)),
                "n_params": len(list(compiled.parameters())), "ref_n_params": len(list(reference.parameters())),
                "n_optimizer_states": len(opt.state), "sharded": sorted(compiled.sharded_state_dict()),
                "aliases": dict(compiled._aliases)}
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.distributed
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


# ---- custom autograd Functions -------------------------------------------------------------------

class RoundSTE(torch.autograd.Function):
    """Straight-through estimator: rounds in forward, passes the gradient through unchanged."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class ScaleGrad(torch.autograd.Function):
    """Identity in forward, the gradient times 3 in backward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return 3 * grad


class Quantized(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.fc2(ScaleGrad.apply(RoundSTE.apply(self.fc1(x) * 4) / 4))


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
        opt, ref_opt = torch.optim.SGD(compiled.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
        local = compiled.shard_inputs(x, y)
        losses, ref_losses = [], []
        for _ in range(steps):
            loss = compiled(*local)
            loss.backward()
            opt.step()
            opt.zero_grad()
            ref_loss = F.mse_loss(reference(x), y)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            losses.append(loss.item())
            ref_losses.append(ref_loss.item())
        full = compiled.full_state_dict()
        err = max(float((full[k] - v).abs().max()) for k, v in reference.named_parameters())
        return {"losses": losses, "ref_losses": ref_losses, "param_err": err,
                "functions": compiled.plan.stats.get("custom_functions")}
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.distributed
def test_custom_autograd_functions_keep_their_backward_in_training(ranks):
    for r in ranks(2).run(_train_custom):
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-9)
        assert r["param_err"] < 1e-9, r


def test_custom_backward_is_what_the_joint_graph_computes():
    """Simulated on a 2x2 mesh: the gradients are the Functions' own (x1 through the rounding, x3 after)."""
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = Quantized()
        x, y = torch.randn(8, 16), torch.randn(8, 16)
        c = run_pipeline(Compilation(model, (x, y), spec((2, 2), ("dp", "tp")), Pins(), None, training=True,
                                     loss_fn=F.mse_loss))
        assert c.traced.custom_functions == ("RoundSTE", "ScaleGrad")
        loss = F.mse_loss(model(x), y)
        loss.backward()
        assert check_simulated_training(c, simulate(c, (x, y, torch.ones(()))), loss, model) == 5
        # the user's source line survives the other road through AOTAutograd
        node = next(n for n in c.traced.graph.nodes if n.op == "call_function" and "round" in str(n.target))
        from spmd.errors import user_source_line
        assert "test_silently_wrong.py" in user_source_line(node) and "torch.round" in user_source_line(node)
    finally:
        torch.set_default_dtype(torch.float32)


# ---- ops with several outputs and no sharding rule of their own ---------------------------------

class _Linalg(nn.Module):
    def __init__(self, op: str):
        super().__init__()
        self.op, self.fc = op, nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        if self.op == "svd":
            return torch.linalg.svd(h)[1]
        if self.op == "svdvals":
            return torch.linalg.svdvals(h)
        if self.op == "qr":
            return torch.linalg.qr(h)[1]
        if self.op == "eigh":
            return torch.linalg.eigh(h @ h.mT)[0]
        return torch.linalg.inv(h @ h.mT + torch.eye(8))


@pytest.mark.parametrize("op", ["svd", "svdvals", "qr", "eigh", "inv"])
@pytest.mark.parametrize("training", [False, True])
def test_linear_algebra_without_rules_runs_replicated_and_equal(op, training):
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = _Linalg(op)
        x = torch.randn(4, 8, 8)
        y = torch.randn_like(model(x))
        mesh = spec((2, 2), ("dp", "tp"))
        loss_fn = (lambda out, target: ((out - target) ** 2).mean()) if training else None
        c = run_pipeline(Compilation(model, (x, y) if training else (x,), mesh, Pins(), None, training=training,
                                     loss_fn=loss_fn))
        if training:
            loss = loss_fn(model(x), y)
            loss.backward()
            assert check_simulated_training(c, simulate(c, (x, y, torch.ones(()))), loss, model) == 3
        else:
            from spmd.runtime.distribute import local_shard
            want = model(x).detach()
            ps = c.plan.choices["output_0"].inputs[0]
            for rank, out in enumerate(simulate(c, (x,))):
                torch.testing.assert_close(out[0], local_shard(want, ps, mesh.shape, mesh.coordinate(rank)))
    finally:
        torch.set_default_dtype(torch.float32)


def test_data_dependent_shape_names_the_node_and_the_way_out():
    class NonZero(nn.Module):
        def forward(self, x):
            return torch.nonzero(x > 0)

    with pytest.raises(spmd.SpmdError, match=r"node 'nonzero' \(aten.nonzero.default\) at .*test_silently_wrong.py:\d+"
                                             r".*depends on the data.*What to do: .*torch.where"):
        spmd.plan(NonZero(), spec((2,), ("tp",)), (torch.randn(4, 8),))
