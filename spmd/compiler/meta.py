"""Models built on the meta device (`with torch.device("meta"): model = Build(cfg)`) are planned
through fake tensors: shapes and dtypes only, no memory, so a 60B model is planned on a laptop."""
from __future__ import annotations

import copy

import torch


def is_meta(model: torch.nn.Module, example_inputs: tuple = ()) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers())) or \
        any(isinstance(t, torch.Tensor) and t.is_meta for t in example_inputs)


def fake_model(model: torch.nn.Module, example_inputs: tuple = (), device: torch.device | str | None = None,
               ) -> tuple[torch.nn.Module, tuple]:
    """A copy of a meta model whose parameters, buffers and inputs are fake tensors on `device` (default
    CPU; `spmd.compile` passes the rank's device, so a CUDA mesh is traced with CUDA kernels, not the CPU
    ones). Meta tensors themselves do not do: kernels pick different implementations on meta (no fused
    attention) and the joint graph loses its forward/backward split. Real parameters are left as they are,
    and so are real inputs already on `device`; a model with nothing on meta comes back as it is."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    if not is_meta(model, example_inputs):
        return model, tuple(example_inputs)
    # inside a FakeTensorMode (compiling for a GPU with none here: the tests), its tensors: AOTAutograd
    # refuses to mix modes
    mode = detect_fake_mode() or FakeTensorMode(allow_non_fake_inputs=True)

    def fake(t, elsewhere: bool = False):
        """`t` as a fake on `device` if it is on meta (or, `elsewhere`, on another device than it)."""
        if not isinstance(t, torch.Tensor) or not (
                t.is_meta or elsewhere and device is not None and t.device != torch.device(device)):
            return t
        with mode:
            return torch.empty(t.shape, dtype=t.dtype, device=device or "cpu").requires_grad_(t.requires_grad)

    model = copy.deepcopy(model)  # meta: no data to copy
    made: dict[int, torch.Tensor] = {}  # a tensor shared by several modules (tied weights) stays shared
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                if id(p) not in made:
                    made[id(p)] = torch.nn.Parameter(fake(p), requires_grad=p.requires_grad)
                module._parameters[name] = made[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                if id(b) not in made:
                    made[id(b)] = fake(b)
                module._buffers[name] = made[id(b)]
    # an example input on another device than the rank's (CPU tokens for a CUDA mesh, as users write them)
    # is traced on the rank's device too: the rank graphs run there
    return model, tuple(fake(t, elsewhere=True) for t in example_inputs)
