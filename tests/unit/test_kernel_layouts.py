"""passes/kernel_layouts.py: values take the strides the device's kernels give (batch norm over a transposed
input returns a contiguous tensor; its meta kernel keeps the input's strides), and every value computed from
them follows; graphs without such a node are left as they are."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from spmd.passes.kernel_layouts import kernel_layouts
from spmd.passes.trace_joint import trace_joint
from spmd.passes.trace_module import trace_module


class _Transposed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.bn, self.head = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)
        self.seen = None

    def forward(self, x):
        h = self.bn(self.fc(x).transpose(1, 2)).transpose(1, 2)
        if not torch.compiler.is_compiling():
            self.seen = h.stride()  # (what one device's dropout below draws on)
        return self.head(F.dropout(h, 0.5))


def _dropout_input_stride(traced) -> tuple:
    drop = next(n for n in traced.graph.nodes if n.target is torch.ops.aten.native_dropout.default)
    return tuple(drop.args[0].meta["val"].stride())


def test_values_after_a_batch_norm_over_a_transposed_input_take_its_kernels_strides():
    model, x = _Transposed(), torch.randn(4, 6, 8)
    model(x)
    for traced in (trace_joint(model, (x, torch.randn(4, 6, 4)), F.mse_loss), trace_module(model, (x,))):
        assert _dropout_input_stride(traced) == (96, 16, 1)  # (the meta kernel's: contiguous)
        kernel_layouts(traced)
        assert _dropout_input_stride(traced) == model.seen == (96, 1, 6)
        norm = next(n for n in traced.graph.nodes if "batch_norm" in str(n.target))
        assert norm.meta["val"][0].is_contiguous()


class _Conv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)

    def forward(self, x):
        return F.dropout(self.bn(self.conv(x)), 0.5)


def test_a_graph_whose_norms_are_laid_out_as_traced_is_left_as_it_is():
    """NCHW and channels_last inputs: the kernels and the meta kernels agree (the suggested memory format)."""
    for x in (torch.randn(2, 3, 8, 8), torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)):
        model = _Conv().to(memory_format=torch.channels_last) if x.is_contiguous(
            memory_format=torch.channels_last) and not x.is_contiguous() else _Conv()
        traced = trace_module(model, (x,))
        before = {n: n.meta.get("val") for n in traced.graph.nodes}
        assert kernel_layouts(traced) is traced
        assert all(n.meta.get("val") is v for n, v in before.items())
