"""The optimizer a training plan assumed (`optimizer_state_factor`, AdamW's 2 by default) against the one
the user steps: one of torch's that keeps another amount of state warns at its first step, naming the
option to re-plan with (runtime/optimizer_guard.py)."""
import warnings

import pytest
import torch

from spmd.compiler.options import PlanOptions, RankBinding
from spmd.compiler.pipeline import run_pipeline
from spmd.core.mesh import MeshSpec
from spmd.runtime import optimizer_guard
from spmd.runtime.compiled import CompiledModule
from spmd.runtime.measure import builtin_cpu


def compiled_mlp(training: bool = True, **options) -> CompiledModule:
    """A Linear + tanh stack compiled on a mesh of one device (no process group needed)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    inputs = (torch.randn(4, 8), torch.randn(4, 8)) if training else (torch.randn(4, 8),)
    loss = torch.nn.functional.mse_loss if training else None
    opts = PlanOptions(training=training, loss_fn=loss, stamp_layers=False, **options)
    with torch.enable_grad():
        c = run_pipeline(model, inputs, MeshSpec((1,), ("dp",), device=builtin_cpu()), opts, RankBinding(0, ("",)),
                         quiet=True)
    return CompiledModule(c, None, src_data_rank=None), inputs


def first_step(compiled, inputs, optimizer) -> list[warnings.WarningMessage]:
    compiled(*inputs).backward()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        optimizer.step()
    return [w for w in seen if "optimizer_state_factor" in str(w.message)]


@pytest.mark.parametrize("make, keeps", [
    (lambda ps: torch.optim.SGD(ps, lr=0.1), 0),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 1),
    (lambda ps: torch.optim.Adam(ps, amsgrad=True), 3),
    (lambda ps: torch.optim.RMSprop(ps, momentum=0.9, centered=True), 3),
])
def test_an_optimizer_keeping_other_state_than_planned_warns_with_the_way_out(make, keeps):
    compiled, inputs = compiled_mlp()
    (w,) = first_step(compiled, inputs, make(compiled.parameters()))
    text = str(w.message)
    assert f"keeps {keeps} parameter size(s)" in text and "planned for optimizer_state_factor=2" in text
    assert f"spmd.compile(..., optimizer_state_factor={keeps})" in text


def test_the_planned_optimizer_steps_quietly_and_later_steps_are_not_checked_again():
    compiled, inputs = compiled_mlp()
    assert first_step(compiled, inputs, torch.optim.AdamW(compiled.parameters())) == []
    planned_sgd, inputs = compiled_mlp(optimizer_state_factor=1.0)
    opt = torch.optim.SGD(planned_sgd.parameters(), lr=0.1, momentum=0.9)
    assert first_step(planned_sgd, inputs, opt) == []
    mismatched, inputs = compiled_mlp()
    opt = torch.optim.SGD(mismatched.parameters(), lr=0.1)
    assert len(first_step(mismatched, inputs, opt)) == 1
    assert first_step(mismatched, inputs, opt) == []  # once per optimizer


def test_optimizers_it_does_not_know_and_inference_modules_are_left_alone():
    class Mine(torch.optim.SGD):  # a subclass may keep anything (master weights, factored moments)
        pass
    compiled, inputs = compiled_mlp()
    assert first_step(compiled, inputs, Mine(compiled.parameters(), lr=0.1)) == []
    forward, inputs = compiled_mlp(training=False)
    opt = torch.optim.SGD(forward.parameters(), lr=0.1)
    for p in forward.parameters():  # (gradients by hand: an inference plan assumed no optimizer, and has no
        p.grad = torch.ones_like(p)  # backward)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opt.step()
    assert not [w for w in seen if "optimizer_state_factor" in str(w.message)]


def test_state_factors_of_torchs_optimizers():
    p = [torch.nn.Parameter(torch.zeros(2))]
    assert optimizer_guard.state_factor(torch.optim.AdamW(p)) == 2.0
    assert optimizer_guard.state_factor(torch.optim.Adagrad(p)) == 1.0
    assert optimizer_guard.state_factor(torch.optim.RMSprop(p)) == 1.0
    assert optimizer_guard.state_factor(torch.optim.LBFGS(p)) is None
