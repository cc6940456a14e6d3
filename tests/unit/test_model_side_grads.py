"""Found by a probe: the model spmd.compile compiled keeps its own parameters, which no backward of the compiled
module reaches. A loop's `model.zero_grad()` zeroed nothing (the pieces' gradients summed over steps: a Llama
0.078 off after 3 steps) and `clip_grad_norm_(model.parameters(), ...)` found no gradient (norm 0, nothing
clipped: 0.10 off), both silently."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import spmd
from tests.support import one_device


def _pair():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    ref = copy.deepcopy(model)
    return model, ref, one_device(model, (x, y), training=True, loss_fn=F.mse_loss), x, y


@pytest.mark.parametrize("by_parts", [False, True])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_the_models_zero_grad_zeroes_the_compiled_modules_gradients(set_to_none, by_parts):
    """`by_parts`: zeroed layer by layer (`model[0].zero_grad()`, ...; a second probe: the pieces kept their
    gradients, 0.25 off after 3 steps)."""
    model, ref, compiled, x, y = _pair()
    opt, ref_opt = torch.optim.SGD(compiled.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        compiled(x, y).backward()
        opt.step()
        for part in (model[0], model[2]) if by_parts else (model,):
            part.zero_grad(set_to_none=set_to_none)  # (the model's, as an eager loop writes it)
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref.zero_grad(set_to_none=set_to_none)
    full = compiled.full_state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(full[name], p.detach())


def test_a_parts_zero_grad_zeroes_every_module_compiled_from_the_model():
    """A review: a second compile of the model (for evaluation) took over its parameters' record, and a part's
    zero_grad left the training module's pieces to pile up again."""
    model, _, compiled, x, y = _pair()
    one_device(model, (x,))  # (the evaluation module)
    compiled(x, y).backward()
    model[0].zero_grad()
    assert compiled.get_parameter("0.weight").grad is None and compiled.get_parameter("2.weight").grad is not None


def test_clipping_the_models_own_parameters_is_refused_with_the_way_out():
    model, _, compiled, x, y = _pair()
    compiled(x, y).backward()
    with pytest.raises(spmd.SpmdError, match="compiled.clip_grad_norm_"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    torch.nn.utils.clip_grad_norm_(torch.nn.Linear(2, 2).parameters(), 0.1)  # (anything else: as torch)


def test_averaging_the_models_own_parameters_is_refused_and_averaging_the_compiled_module_works():
    """Found by a probe: `ema.update_parameters(model)` each step averaged the weights the model was compiled
    with (0.070 off one device after 3 steps, silently)."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    model, ref, compiled, x, y = _pair()
    stale = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    ema = AveragedModel(compiled, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    ref_ema = AveragedModel(ref, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    opt, ref_opt = torch.optim.SGD(compiled.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        for run, o in ((lambda: compiled(x, y), opt), (lambda: F.mse_loss(ref(x), y), ref_opt)):
            run().backward()
            o.step()
            o.zero_grad()
        ema.update_parameters(compiled)
        ref_ema.update_parameters(ref)
        if step == 0:
            with pytest.raises(spmd.SpmdError, match=r"AveragedModel.update_parameters\(model\).*"
                                                     r"average the compiled module \(`ema = AveragedModel\(compiled\)`"):
                stale.update_parameters(model)
    averaged = ema.module.full_state_dict()
    for name, p in ref_ema.module.named_parameters():
        torch.testing.assert_close(averaged[name], p.detach())
    model.load_state_dict(compiled.full_state_dict())  # (copied back: the model holds the trained weights again)
    stale.update_parameters(model)


def test_averaging_a_model_whose_part_was_compiled_alone_is_refused():
    """Found by a review: `spmd.compile(model.encoder)`, then `ema.update_parameters(model)` averaged the
    encoder's old weights (0.051 off after 3 steps)."""
    from torch.optim.swa_utils import AveragedModel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh())
    x, y = torch.randn(6, 8), torch.randn(6, 16)
    ema = AveragedModel(model)
    part = one_device(model[0], (x, y), training=True, loss_fn=F.mse_loss)
    opt = torch.optim.SGD(part.parameters(), lr=0.1)
    part(x, y).backward()
    opt.step()
    with pytest.raises(spmd.SpmdError, match=r"Linear \('0' of Sequential\) was compiled by spmd.compile.*"
                                             r"AveragedModel\(compiled\)"):
        ema.update_parameters(model)
