"""The predicted peak per rank against the tensors a training step holds at once, on gloo ranks: every storage
an op makes, counted from its making to its freeing (a dispatch mode over the whole step, `loss.backward()`
and AdamW's step included), on top of the parameters, optimizer state and inputs held before it. RSS is not
the measure: it also counts the allocator's own keep, gloo's buffers and Python's objects (a probe found
RSS 15-17% over the prediction where the tensors' peak was within 0.2% of it).

This found two holds the plan did not predict, both fixed: backward held every saved activation until it
ended (autograd's saved tensors and the call's argument tuple; measured 1.21x the prediction on (2, 2)), and
overlap_collectives moved every weight gradient's matmul after a 39 KiB gradient bucket at the end of
backward, holding their inputs (1.17x on (2,))."""
import pytest


def _step_peak(rank: int, world: int, mesh_shape: tuple, names: tuple, pins: dict, recompute, size: tuple) -> dict:
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    import spmd
    from spmd.core.specs import placement_from_text
    from tests.models import GPT, GPTConfig
    from tests.support import lm_loss, megatron_spec, spec

    class Held(TorchDispatchMode):
        """Bytes of the storages alive now, and the most at once."""

        def __init__(self):
            super().__init__()
            self.sizes, self.now, self.peak = {}, 0, 0

        def hold(self, t):
            try:
                storage = t.untyped_storage()
                key = storage.data_ptr()
            except RuntimeError:  # (a collective's result waited on later: its storage comes with the wait)
                return
            if key in self.sizes or storage.nbytes() == 0:
                return
            self.sizes[key] = storage.nbytes()
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
            weakref.finalize(storage, self.free, key)

        def free(self, key):
            self.now -= self.sizes.pop(key, 0)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    self.hold(t)
            return out

    torch.manual_seed(0)
    vocab, seq, dim, layers, batch = size
    model = GPT(GPTConfig(vocab=vocab, seq=seq, dim=dim, heads=4, layers=layers))
    g = torch.Generator().manual_seed(1)
    tokens, targets = (torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(2))
    mesh = spmd.init_mesh(mesh_shape, names)
    profile = megatron_spec() if pins is None else spec(mesh_shape, names)  # (None: Megatron's plan by its costs)
    compiled = spmd.compile(model, mesh, (tokens, targets), loss_fn=lm_loss, mesh_spec=profile,
                            param_placements={k: [placement_from_text(p) for p in v] for k, v in (pins or {}).items()},
                            recompute=recompute)
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-3)
    local = compiled.shard_inputs(tokens, targets)
    for _ in range(2):  # (the optimizer's state made, the module's first-call checks done)
        compiled(*local).backward()
        opt.step()
        opt.zero_grad()
    peaks = []
    for _ in range(2):  # (the lower of two steps: gloo's worker may let a finished collective's tensors go a
        held = Held()  # little after the wait returns, at random, most on oversubscribed cores; a probe, 1.16x)
        state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
        for t in (*compiled.parameters(), *compiled.buffers(), *state, *local):
            held.hold(t)
        with held:
            compiled(*local).backward()
            opt.step()
            opt.zero_grad()
        peaks.append(held.peak)
    return {"measured": min(peaks), "predicted": compiled.plan.predicted_peak_bytes,
            "collectives": sum(compiled.plan.collective_summary().values())}


MEGATRON = {
    **{f"blocks.{i}.attn.{n}.weight": ["R", "S(0)"] for i in range(2) for n in ("q_proj", "k_proj", "v_proj")},
    **{f"blocks.{i}.attn.o_proj.weight": ["R", "S(1)"] for i in range(2)},
    **{f"blocks.{i}.mlp.fc1.weight": ["R", "S(0)"] for i in range(2)},
    **{f"blocks.{i}.mlp.fc2.weight": ["R", "S(1)"] for i in range(2)}}
CASES = {  # (measured / predicted: 0.95, 1.00, 1.00; 1.01-1.02 for the latter two before buckets held the gradients once)
    "batch split": ((2,), ("dp",), {}, None, (512, 64, 128, 2, 8)),
    "megatron on (2, 2)": ((2, 2), ("dp", "tp"), MEGATRON, None, (512, 64, 128, 2, 8)),
    "megatron on (2, 2), every layer recomputed": ((2, 2), ("dp", "tp"), MEGATRON, True, (512, 64, 128, 2, 8)),
    # (a batch of 2: the step peaks where the dp gradient bucket is packed, its flat copy beside the gradients;
    # 1.21x the prediction before the schedule counted it, found by a memory probe)
    "megatron's costs on (2, 2), the peak at the bucket's packing": ((2, 2), ("dp", "tp"), None, None,
                                                                     (256, 32, 64, 4, 2)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_predicted_peak_is_the_tensors_a_step_holds_at_once(ranks, name):
    mesh_shape, names, pins, recompute, size = CASES[name]
    world = 1
    for n in mesh_shape:
        world *= n
    for rank, r in enumerate(ranks(world).run(_step_peak, mesh_shape, names, pins, recompute, size)):
        ratio = r["measured"] / r["predicted"]
        print(f"{name} rank {rank}: measured {r['measured'] / 2**20:.2f} MiB, predicted "
              f"{r['predicted'] / 2**20:.2f} MiB ({ratio:.3f})")
        assert 0.9 <= ratio <= 1.1, (name, rank, r)
