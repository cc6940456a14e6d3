"""Model-writing patterns whose init a model built under torch.device("meta") cannot replay, each found by a probe
(session 97) to come out of `init_weights` silently other than `torch.manual_seed(s); Model()`: now refused, each
naming its line. Kept in a module of its own: the scan reads their source."""
from functools import partial

import torch
import torch.nn as nn
from torch.nn.init import zeros_ as zero_init

winit = partial(nn.init.normal_, std=0.02)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def init_weights(self):
        nn.init.normal_(self.fc.weight, std=0.02)


class TorchtitanStyle(nn.Module):  # __init__ -> self.init_weights() -> layer.init_weights() on each child
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Layer() for _ in range(2)])
        self.init_weights()

    def init_weights(self):
        for layer in self.layers:
            layer.init_weights()


class ChildMethod(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Layer()
        self.block.init_weights()


class WithThis(nn.Module):  # (the receiver by another name)
    def __init__(this):
        super().__init__()
        this.fc = nn.Linear(4, 4)
        this._init()

    def _init(this):
        nn.init.normal_(this.fc.weight, std=0.02)


class ResetBeforeChildren(nn.Module):  # its own reset run before a child is built (the replay runs it after)
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(4, 4))
        self.reset_parameters()
        self.fc = nn.Linear(4, 4)

    def reset_parameters(self):
        nn.init.normal_(self.w)


class ResetWithArgs(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(4, 4))
        self.reset_parameters(0.5)

    def reset_parameters(self, std=1.0):
        nn.init.normal_(self.w, std=std)


class PartialAlias(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        winit(self.fc.weight)


class ZeroAlias(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        zero_init(self.fc.bias)


class Initializer:
    def __call__(self, m):
        for p in m.parameters():
            if p.dim() > 1:
                nn.init.orthogonal_(p)


class CallableObject(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        Initializer()(self)


class MoCo(nn.Module):  # the key encoder starts as a copy of the query encoder
    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(4, 4), nn.Linear(4, 4)
        self.k.load_state_dict(self.q.state_dict())


class ParentResetsChild(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.fc.reset_parameters()


class DropoutAtInit(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        _ = torch.nn.functional.dropout(torch.ones(4), 0.5)


class SetToNone(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.a = None


class Deleted(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        del self.a


class BuiltTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.a = nn.Linear(4, 8)


class KeptByNone(nn.Module):
    def __init__(self):
        super().__init__()
        nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)


REFUSED = {SetToNone: "throws `a` away", Deleted: "throws `a` away", BuiltTwice: "builds `a` again",
           KeptByNone: "builds a module no attribute keeps",
           TorchtitanStyle: "calls Layer.init_weights", ChildMethod: "calls Layer.init_weights",
           WithThis: "calls WithThis._init", ResetBeforeChildren: r"self.fc = nn.Linear\(4, 4\)",
           ResetWithArgs: r"self.reset_parameters\(0.5\)", PartialAlias: r"winit\(self.fc.weight\)",
           ZeroAlias: r"zero_init\(self.fc.bias\)", CallableObject: r"calls Initializer.__call__",
           MoCo: r"self.k.load_state_dict", ParentResetsChild: r"self.fc.reset_parameters\(\)",
           DropoutAtInit: r"functional.dropout"}


class MetaBranch(nn.Module):  # initializes only off meta: recorded on meta, deferred_init takes the other branch
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        if not self.fc.weight.is_meta:
            nn.init.normal_(self.fc.weight, std=0.02)


class MetaBranchByDevice(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        if self.fc.weight.device.type != "meta":
            self.fc.weight.data.mul_(0.1)


class DeviceRead(nn.Module):  # (a device read for a tensor's placement: fine)
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("pos", torch.arange(4, device=self.fc.weight.device))
