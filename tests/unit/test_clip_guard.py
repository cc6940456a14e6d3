"""torch's clip_grad_norm_ over a compiled module's shards would clip each rank by its own norm (the replicas
drift apart, silently), and its get_total_norm over their gradients would log each rank's own norm: both
raise with the way out (runtime/clip_guard.py). Everything else clips as before."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Shard

import spmd
from spmd.compiler.options import PlanOptions, RankBinding
from spmd.compiler.pipeline import run_pipeline
from spmd.core.mesh import MeshSpec
from spmd.runtime.compiled import CompiledModule
from spmd.runtime.measure import builtin_cpu

_EARLY_CLIP = torch.nn.utils.clip_grad_norm_  # (as a training loop's `from torch.nn.utils import ...` holds it)


def _compiled(group: str, pins: dict):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    opts = PlanOptions(training=True, loss_fn=F.mse_loss, stamp_layers=False, param_placements=pins)
    with torch.enable_grad():
        c = run_pipeline(model, (x, y), MeshSpec((1,), ("dp",), device=builtin_cpu()), opts, RankBinding(0, (group,)),
                         quiet=True)
    compiled = CompiledModule(c, None, src_data_rank=None)
    compiled(x, y).backward()
    return compiled, model


def _with_a_cut_piece(group: str):
    """A compiled module whose `0.weight` the guard takes for a piece of a sharded parameter, as a rank of a larger
    mesh registers it (`CompiledModule._watch_pieces`; on one device nothing is cut: an axis of one device holds
    every tensor whole, Replicate; tests/e2e/test_clip.py checks the registration on 2 ranks)."""
    from spmd.runtime import clip_guard

    compiled, model = _compiled(group, {})
    clip_guard.watch({"0.weight": compiled.get_parameter("0.weight")})
    return compiled, model


def test_torchs_clip_over_sharded_pieces_raises_and_the_compiled_clip_runs(one_rank):
    compiled, _ = _with_a_cut_piece(one_rank)
    with pytest.raises(spmd.SpmdError, match=r"clip_grad_norm_ \(or get_total_norm, or clip_grads_with_norm_\) was "
                                             r"handed this rank's pieces of sharded parameters or their gradients "
                                             r"\(0.weight\).*What to do: call compiled.clip_grad_norm_"):
        torch.nn.utils.clip_grad_norm_(compiled.parameters(), 1.0)
    with pytest.raises(spmd.SpmdError, match="0.weight"):  # (under either of torch's names for it)
        torch.nn.utils.clip_grad.clip_grad_norm_(compiled.parameters(), 1.0)
    # imported before compiling (the function object torch had then): caught too, nothing scaled
    grads = [p.grad.clone() for p in compiled.parameters()]
    with pytest.raises(spmd.SpmdError, match="0.weight"):
        _EARLY_CLIP(compiled.parameters(), 1e-3)
    with pytest.raises(spmd.SpmdError, match="0.weight"):
        torch.nn.utils.clip_grads_with_norm_(compiled.parameters(), 1e-3, torch.tensor(5.0))
    assert all(torch.equal(p.grad, g) for p, g in zip(compiled.parameters(), grads))
    assert float(compiled.clip_grad_norm_(1.0)) > 0


def test_torchs_norm_of_sharded_gradients_raises_and_the_compiled_norm_is_the_full_one(one_rank):
    compiled, _ = _with_a_cut_piece(one_rank)
    grads = [p.grad for p in compiled.parameters()]
    for get_total_norm in (torch.nn.utils.get_total_norm, torch.nn.utils.clip_grad._get_total_norm):
        with pytest.raises(spmd.SpmdError, match=r"\(0.weight\).*or compiled.grad_norm\(norm_type\) for the norm"):
            get_total_norm(grads)
        with pytest.raises(spmd.SpmdError, match="0.weight"):
            get_total_norm(compiled.get_parameter("0.weight").grad)  # (a lone tensor)
    # the gradients of the parameters nobody shards, and any other tensors: as before
    assert float(torch.nn.utils.get_total_norm(grads[1:])) > 0
    assert float(torch.nn.utils.get_total_norm([torch.full((4,), 2.0)])) == pytest.approx(4.0)
    # (on a mesh of one, the piece is the whole: the full norm is torch's over the pieces)
    assert float(compiled.grad_norm()) == pytest.approx(float(torch.linalg.vector_norm(
        torch.cat([g.flatten() for g in grads]))), rel=1e-6)
    assert float(compiled.grad_norm(float("inf"))) == pytest.approx(max(float(g.abs().max()) for g in grads))


def test_replicated_parameters_and_other_models_clip_as_before(one_rank):
    compiled, _ = _compiled(one_rank, {})  # (on one device nothing is sharded)
    full = float(compiled.clip_grad_norm_(1e9))  # (a norm far under the limit: nothing scaled)
    assert float(torch.nn.utils.clip_grad_norm_(compiled.parameters(), 1e9)) == pytest.approx(full, rel=1e-6)
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    assert float(torch.nn.utils.clip_grad_norm_([p], 1.0)) == pytest.approx(12 ** 0.5)
    assert float(torch.nn.utils.clip_grad_norm_(p, 1.0)) == pytest.approx(1.0, rel=1e-5)  # (a lone tensor)


@pytest.mark.parametrize("foreach", [None, True, False])
def test_the_compiled_clip_takes_torchs_foreach_and_clips_as_torch_does(one_rank, foreach):
    """Found by a probe: a loop that passed `foreach=True`, as torch's clip_grad_norm_ takes it, got a raw
    TypeError from the compiled module's clip_grad_norm_ the refusal above points to."""
    compiled, model = _compiled(one_rank, {"0.weight": [Shard(0)]})
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    reference.load_state_dict(compiled.state_dict())
    compiled.zero_grad()
    compiled(x, y).backward()
    F.mse_loss(reference(x), y).backward()
    norm = compiled.clip_grad_norm_(0.1, 2.0, False, foreach)
    torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1, foreach=foreach))
    for (name, p), q in zip(compiled.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
