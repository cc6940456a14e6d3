"""The messages users read when something goes wrong on live ranks."""
import torch
from torch.distributed.tensor import Shard

import spmd
from spmd import SpmdError
from tests.models import MLP


def _world_mismatch(rank, world):
    try:
        spmd.init_mesh((2, 2), ("dp", "tp"))
    except SpmdError as e:
        return str(e)
    return None


def test_mesh_size_must_match_world_size(ranks):
    messages = ranks(2).run(_world_mismatch)
    assert all(m and "needs 4 processes but the world has 2" in m and "--nproc-per-node 4" in m for m in messages)


def _mesh_out_of_order(rank, world):
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", torch.tensor([1, 0]), mesh_dim_names=("dp",))
    try:
        spmd.compile(MLP(16, 64), mesh, (torch.randn(8, 16),))
    except SpmdError as e:
        return str(e)
    return None


def test_a_mesh_that_numbers_its_ranks_out_of_order_is_refused(ranks):
    """Found by a probe: a `DeviceMesh("cpu", [[0, 2], [1, 3]])` ran its collectives over its own groups while the
    pieces went by the row-major coordinate, so ranks 1 and 2 held each other's: 0.66 off one device after 3
    steps, without a word (and a batch split there was said to differ between ranks)."""
    for said in ranks(2).run(_mesh_out_of_order):
        assert said and "the mesh numbers its ranks [1, 0], not in order (row-major: [0, 1])" in said and \
            "What to do: build the mesh with spmd.init_mesh" in said, said


def _wrong_local_shape(rank, world):
    torch.manual_seed(0)
    model, x = MLP(16, 64), torch.randn(8, 16)
    mesh = spmd.init_mesh((2,), ("dp",))
    compiled = spmd.compile(model, mesh, (x,), in_placements={"x": [Shard(0)]})
    try:
        compiled(x)  # the full input, not this rank's shard
    except SpmdError as e:
        return str(e)
    return None


def test_wrong_local_input_shape_at_run_time(ranks):
    messages = ranks(2).run(_wrong_local_shape)
    for m in messages:
        assert m is not None
        assert "input 'x': got the full tensor [8, 16]; this rank takes its shard [4, 16] (global [8, 16] laid " \
               "out as [S(0)]" in m
        assert "compiled.shard_inputs" in m
        assert "compile for the whole batch (all ranks' rows) with the inputs pinned" in m  # (a Trainer's slices)


def _optimizer_over_original(rank, world):
    torch.manual_seed(0)
    model, x = MLP(16, 64), torch.randn(8, 16)
    mesh = spmd.init_mesh((2,), ("dp",))
    compiled = spmd.compile(model, mesh, (x, x), loss_fn=torch.nn.functional.mse_loss)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # the trap: not compiled.parameters()
    compiled(*compiled.shard_inputs(x, x)).backward()
    try:
        opt.step()
    except SpmdError as e:
        ok = torch.optim.AdamW(compiled.parameters(), lr=1e-2)
        ok.step()  # the right optimizer steps
        return str(e)
    return None


def test_optimizer_over_the_original_parameters_fails_at_its_first_step(ranks):
    for m in ranks(2).run(_optimizer_over_original):
        assert m is not None
        assert "AdamW steps 4 parameter(s) of the original MLP (fc1.weight, fc1.bias, fc2.weight, fc2.bias)" in m
        assert "AdamW(compiled.parameters(), ...)" in m


class _Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(128, 8)

    def forward(self, tokens):
        h = self.emb(tokens)
        return h * 2 if h.sum() > 0 else h


class _SetOrder(torch.nn.Module):
    """Two rotary tables made in the order a set of strings iterates in (transformers' Gemma3 and ModernBERT loop
    over `set(config.layer_types)`): each process's hash seed picks it."""

    def __init__(self, order):
        super().__init__()
        self.order = order
        self.rope = torch.nn.ModuleDict({"sliding": torch.nn.Linear(8, 8), "full": torch.nn.Linear(8, 8)})

    def forward(self, x):
        made = {kind: self.rope[kind](x) for kind in self.order}
        return made["sliding"] * 2 + made["full"]


def _disagree(rank, world, what):
    """Each rank compiles something a little different; every rank must raise the same SpmdError."""
    from tests.models import GPT, GPTConfig

    torch.manual_seed(0)
    layers = 3 if (what == "layers" and rank == 1) else 2
    model = GPT(GPTConfig(layers=layers))
    batch = 6 if (what == "batch" and rank == 1) else 4
    tokens = torch.randint(0, 128, (batch, 16))
    dtype = torch.float64 if (what == "dtype" and rank == 1) else torch.float32
    model = model.to(dtype)
    pins = {"tokens": [Shard(0)]} if (what == "pins" and rank == 1) else {}
    mesh = spmd.init_mesh((2,), ("dp",))
    if what == "trace" and rank == 1:
        model = _Branchy()  # its forward branches on the data: torch.export cannot trace it
    if what == "constant" and rank == 1:
        model.ln_f.eps = 1e-3  # (a number in the graph: each rank would normalize with its own; found by a probe)
    if what == "wiring":  # (the same ops wired apart; found by a probe: ModernBERT trained 0.5 off, no error)
        model, tokens = _SetOrder(("sliding", "full") if rank == 0 else ("full", "sliding")), torch.randn(4, 8)
        if rank == 1:  # (as another hash seed would: torchrun starts each rank with its own)
            import spmd.compiler.agreement as agreement
            agreement.hash = lambda text: 7
    version = torch.__version__
    if what == "version" and rank == 1:
        torch.__version__ = "2.99.0"  # (a machine set up apart; found by a probe: nothing named it)
    try:
        spmd.compile(model, mesh, (tokens,), in_placements=pins)
    except SpmdError as e:
        return str(e)
    finally:
        torch.__version__ = version
        import spmd.compiler.agreement as agreement
        agreement.__dict__.pop("hash", None)
    return None


import pytest  # noqa: E402


@pytest.mark.parametrize("what,expected", [
    ("layers", r"parameters: rank 1 differs from rank 0; rank 1 has 53, rank 0 has 37; only on rank 1: blocks.2.\* "
               r"\(16\)"),
    ("batch", r"inputs: rank 1 differs from rank 0; tokens is \[6, 16\] int64 on rank 1, \[4, 16\] int64 on rank 0"),
    ("dtype", r"parameters: rank 1 differs from rank 0; .* float64 on rank 1, .* float32 on rank 0"),
    ("pins", r"pins: rank 1 differs from rank 0; rank 1 adds 'input tokens: \[S\(0\)\]'"),
    ("trace", r"rank 1 could not compile: SpmdError: trace_module: torch.export could not trace _Branchy"),
    ("constant", r"graph: rank 1 differs from rank 0; op \d+: 'native_layer_norm\(64, 0\.001\) of [\w, ]+ -> tuple' on "
                 r"rank 1, 'native_layer_norm\(64, 1e-05\) of [\w, ]+ -> tuple' on rank 0"),
    ("wiring", r"graph: rank 1 differs from rank 0; op 0: 'permute\(1, 0\) of p_rope_full_weight -> \[8, 8\] float32' on "
               r"rank 1, 'permute\(1, 0\) of p_rope_sliding_weight -> \[8, 8\] float32' on rank 0; the same ops, wired apart\. Rank 1 hashes "
               r"strings unlike rank 0 .*`PYTHONHASHSEED=0 torchrun \.\.\.`"),
    ("version", r"versions: rank 1 differs from rank 0; .*torch 2\.99\.0.* on rank 1"),
])
def test_ranks_that_disagree_all_raise_the_first_difference(ranks, what, expected):
    import re

    messages = ranks(2).run(_disagree, what)
    if what == "trace":  # the rank that failed raises its own error, the other one names it
        assert "torch.export could not trace _Branchy" in messages[1]
        # (the whole of it, its way out too: it reached the others as its first line once)
        assert "\n    What to do: " in messages[0], messages[0]
        messages = messages[:1]
    for m in messages:
        assert m is not None and re.search(expected, m), m
