"""The optimizer a training plan assumed (`optimizer_state_factor`, AdamW's 2 by default) against the one
the user steps: one of torch's that keeps another amount of state warns at its first step, naming the
option to re-plan with (runtime/optimizer_guard.py)."""
import warnings

import pytest
import torch

import spmd

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


def _stepped(make, piece: torch.Tensor):
    """One step of `make([piece])` over a tensor watched as this rank's piece of a sharded parameter."""
    optimizer_guard.watch_pieces({"layer.weight": piece})
    optimizer = make([piece])
    piece.grad = torch.ones_like(piece)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.step(lambda: piece.sum()) if isinstance(optimizer, torch.optim.LBFGS) else optimizer.step()
    return [str(w.message) for w in caught]


@pytest.mark.parametrize("make, reads", [
    (lambda ps: torch.optim.Adafactor(ps), "factored second moment"),
    (lambda ps: torch.optim.Muon(ps), "orthogonalize"),
    (lambda ps: torch.optim.LBFGS(ps), "dot products over every parameter"),
])
def test_an_optimizer_reading_more_than_each_element_over_a_piece_is_refused(make, reads):
    """Found by a probe: Adafactor and Muon over the pieces of sharded weights computed their factored moments
    and orthogonalized updates from each rank's piece alone: 7.5e-4 and 6.7e-3 off one device after one step,
    silently (AdamW: 3e-17)."""
    with pytest.raises(spmd.SpmdError, match=rf"steps this rank's pieces of sharded parameters \(layer\.weight\).*"
                                             rf"{reads}.*param_placements=\{{\"layer\.weight\": \[Replicate\(\)\]"):
        _stepped(make, torch.nn.Parameter(torch.randn(4, 4)))


def test_per_element_optimizers_and_vectors_step_pieces_quietly():
    assert _stepped(lambda ps: torch.optim.AdamW(ps), torch.nn.Parameter(torch.randn(4, 4))) == []

    class Mine(torch.optim.SGD):  # (torch's update, kept: a subclass that only sets defaults)
        def __init__(self, params):
            super().__init__(params, lr=0.1, momentum=0.9)

    assert _stepped(Mine, torch.nn.Parameter(torch.randn(4, 4))) == []


def test_adafactor_over_a_vector_piece_and_a_refused_step_taken_again_are_refused():
    """Found by a review: Adafactor's step size and clipping read each parameter's root mean square, vectors too
    (a sharded bias: 6.8e-3 off one device after one step); and the first refusal marked the optimizer checked,
    so its next step ran unchecked."""
    piece = torch.nn.Parameter(torch.randn(4))
    optimizer_guard.watch_pieces({"layer.bias": piece})
    optimizer = torch.optim.Adafactor([piece])
    piece.grad = torch.ones_like(piece)
    for _ in range(2):
        with pytest.raises(spmd.SpmdError, match=r"Adafactor steps this rank's pieces .*\(layer\.bias\).*root mean"):
            optimizer.step()


def test_an_optimizer_spmd_cannot_read_over_a_piece_warns():
    class Lamb(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:  # (a trust ratio per tensor: its piece's norm on each rank)
                    p.add_(p.grad, alpha=-group["lr"] * float(p.norm() / p.grad.norm()))

    said = _stepped(Lamb, torch.nn.Parameter(torch.randn(4, 4)))
    assert len(said) == 1 and "Lamb steps this rank's pieces" in said[0] and "norms per tensor" in said[0], said
    assert _stepped(Lamb, torch.nn.Parameter(torch.randn(4, 4), requires_grad=True)) != []  # (each optimizer once)



def test_sam_stepping_its_base_optimizer_over_pieces_warns():
    """Found by a probe: SAM (davda54/sam) perturbs the weights by the norm of all the gradients in its own
    `first_step` and steps its base SGD in `second_step`; SAM's own `step` never runs, so nothing was said, and
    each rank took the norm of its own pieces (0.114 off one device after 3 steps). The base's step names SAM."""
    class SAM(torch.optim.Optimizer):
        def __init__(self, params, base_optimizer, rho=0.05, **kwargs):
            super().__init__(params, dict(rho=rho, **kwargs))
            self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
            self.param_groups = self.base_optimizer.param_groups

        @torch.no_grad()
        def second_step(self):
            self.base_optimizer.step()

    def stepped(optimizer):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimizer.second_step() if isinstance(optimizer, SAM) else optimizer.step()
        return [str(w.message) for w in caught if "pieces" in str(w.message)]  # (not torch's own, first import)

    piece = torch.nn.Parameter(torch.randn(4, 4))
    optimizer_guard.watch_pieces({"layer.weight": piece})
    piece.grad = torch.ones_like(piece)
    said = stepped(SAM([piece], torch.optim.SGD, lr=0.1, momentum=0.9))
    assert len(said) == 1 and "SAM (around SGD) steps this rank's pieces of sharded parameters (layer.weight)" in \
        said[0] and "a norm over all the gradients as SAM's" in said[0] and "compiled.grad_norm()" in said[0], said
    # the same SGD stepped by a holder that is no optimizer (a GradScaler, a trainer), or over other parameters
    sgd, other = torch.optim.SGD([piece], lr=0.1), SAM([torch.nn.Parameter(torch.randn(2))], torch.optim.SGD, lr=0.1)

    class Trainer:
        def step(self):
            sgd.step()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer().step()
    assert not [w for w in caught if "pieces" in str(w.message)] and stepped(other) == []

    class Passing(torch.optim.Optimizer):  # (a wrapper whose own step passes it on, through a helper of its own:
        def __init__(self, inner):        # accelerate's, Lookahead, Lightning's; a review found them named)
            self.inner, self.defaults, self.state = inner, inner.defaults, inner.state

        @property
        def param_groups(self):
            return self.inner.param_groups

        def step(self, closure=None):
            return self._step(closure)

        def _step(self, closure):
            return self.inner.step(closure)

    passing = Passing(torch.optim.AdamW([piece], lr=0.1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        passing.step()
    assert not [w for w in caught if "around" in str(w.message)], [str(w.message) for w in caught]


def test_step_hooks_of_an_optimizer_over_pieces_warn_also_when_added_after_its_first_step():
    """Found by a probe: a LARS trust ratio (`p.norm() / p.grad.norm()`) applied in SGD's step pre-hook read each
    rank's piece: 1.6e-3 to 7.7e-3 off one device, silently. The hooks are named, at the first step after one is
    added; a hook-free optimizer steps quietly."""
    piece = torch.nn.Parameter(torch.randn(4, 4))
    optimizer_guard.watch_pieces({"layer.weight": piece})
    optimizer = torch.optim.SGD([piece], lr=0.1)
    piece.grad = torch.ones_like(piece)

    def lars(opt, args, kwargs):
        for p in opt.param_groups[0]["params"]:
            p.grad.mul_(p.norm() / p.grad.norm())

    def said():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimizer.step()
        return [str(w.message) for w in caught]

    assert said() == []
    optimizer.register_step_pre_hook(lars)
    first, again = said(), said()
    assert len(first) == 1 and "SGD steps this rank's pieces of sharded parameters (layer.weight), and has 1 step " \
        "hook(s) (test_step_hooks_of_an_optimizer_over_pieces_warn_also_when_added_after_its_first_step.<locals>.lars)" \
        in first[0] and "compiled.grad_norm" in first[0], first
    assert again == [], again  # (once per hook added)


def test_pieces_added_to_a_checked_optimizer_are_checked_at_its_next_step():
    """Found by a probe: gradual unfreezing (Lightning's BackboneFinetuning) adds the sharded layers to an
    Adafactor over a replicated head with `add_param_group` after its first step, which was never checked
    again: 6.5e-3 off one device, silently."""
    head, piece = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4, 4))
    optimizer_guard.watch_pieces({"layer.weight": piece})
    optimizer = torch.optim.Adafactor([head])
    head.grad, piece.grad = torch.ones_like(head), torch.ones_like(piece)
    optimizer.step()
    optimizer.add_param_group({"params": [piece]})
    with pytest.raises(spmd.SpmdError, match=r"Adafactor steps this rank's pieces .*\(layer\.weight\)"):
        optimizer.step()


def test_attributes_set_on_a_parameter_reach_its_piece():
    """Found by a probe: Mamba marks parameters `p._no_weight_decay = True` and builds its optimizer's groups
    from them over whatever module it trains; the compiled module's fresh parameters had lost the mark, so
    everything decayed (0.30 off after two AdamW steps, silently)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    model[0].bias._no_weight_decay = True
    inputs = (torch.randn(4, 8), torch.randn(4, 8))
    opts = PlanOptions(training=True, loss_fn=torch.nn.functional.mse_loss, stamp_layers=False)
    c = run_pipeline(model, inputs, MeshSpec((1,), ("dp",), device=builtin_cpu()), opts, RankBinding(0, ("",)), quiet=True)
    compiled = CompiledModule(c, None, src_data_rank=None)
    marked = [n for n, p in compiled.named_parameters() if getattr(p, "_no_weight_decay", False)]
    assert marked == ["0.bias"]
