"""Model-writing patterns whose init a model built under torch.device("meta") cannot replay, each found by a probe
(session 97) to come out of `init_weights` silently other than `torch.manual_seed(s); Model()`: now refused, each
naming its line. Kept in a module of its own: the scan reads their source."""
import math
from functools import partial

import torch
import torch.nn as nn
from torch.nn.init import _calculate_fan_in_and_fan_out, calculate_gain
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


class MLPBlock(nn.Module):
    def __init__(self, a=4, b=4):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(a, b), nn.GELU(), nn.Linear(b, a))  # (draws inside a container)


class WithHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = MLPBlock()


class NewHead(WithHead):
    def __init__(self):
        super().__init__()
        self.head = MLPBlock(4, 8)


class NoHead(WithHead):
    def __init__(self, drop=True):
        super().__init__()
        if drop:
            self.head = None


class LoRALinear(nn.Linear):  # loralib's: nn.Linear's __init__ ran the override once, before lora_A existed
    def __init__(self, a, b):
        nn.Linear.__init__(self, a, b)
        self.lora_A = nn.Parameter(torch.empty(2, a))
        self.reset_parameters()

    def reset_parameters(self):
        nn.Linear.reset_parameters(self)
        if hasattr(self, "lora_A"):
            nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))


class UsesLoRA(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = LoRALinear(4, 4)


class KeptLayer(nn.Module):  # the layer given to the stack is kept too: the stack's layers are its copies
    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(self.layer, 2, enable_nested_tensor=False)


REFUSED = {NewHead: "builds `head` again", NoHead: "throws `head` away", UsesLoRA: "runs twice",
           KeptLayer: "a copy of a built module", SetToNone: "throws `a` away", Deleted: "throws `a` away", BuiltTwice: "builds `a` again",
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


class ResetThenDropout(nn.Module):  # (its reset before children that draw nothing: the same stream)
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(4, 4))
        self.reset_parameters()
        self.drop = nn.Dropout(0.1)

    def reset_parameters(self):
        nn.init.normal_(self.w)


class Gain(nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = calculate_gain("relu")
        self.fc = nn.Linear(4, 4)


class EqualLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4))
        fan_in, _ = _calculate_fan_in_and_fan_out(self.weight)
        self.scale = 1 / math.sqrt(fan_in)
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.normal_(self.weight)


class Codebook(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 4)

    @torch.no_grad()
    def update(self, z):
        self.embed.weight.mul_(0.99).add_(z, alpha=0.01)


class VQ(nn.Module):  # (`cfg.update`: a dict's, not the codebook's)
    def __init__(self, **kw):
        super().__init__()
        cfg = dict(d=4)
        cfg.update(kw)
        self.enc = nn.Linear(cfg["d"], cfg["d"])
        self.codebook = Codebook()


FINE = (ResetThenDropout, Gain, EqualLinear, VQ)
