"""Smoke test on real GPUs: the demo's forward and one training step with NCCL, checked against one device.

    torchrun --nproc-per-node 2 examples/gpu_smoke.py            # one GPU per rank, NCCL
    torchrun --nproc-per-node 2 examples/gpu_smoke.py --cpu      # the same on gloo (CI runs this)
    torchrun --nproc-per-node 2 examples/gpu_smoke.py --one-gpu  # every rank on cuda:0, collectives on gloo
    torchrun --nproc-per-node 2 examples/gpu_smoke.py --one-gpu --flex  # FlexAttention (its backward: CUDA only)
    torchrun --nproc-per-node 2 examples/gpu_smoke.py --one-gpu --save  # and save_safetensors, read back
    torchrun --nproc-per-node 2 examples/gpu_smoke.py --one-gpu --hf    # transformers' Llama, padded batch

NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so where a single GPU is lent, `--one-gpu`
checks the CUDA rank graphs' kernels and numerics on several ranks with gloo moving CUDA tensors, and a
one-rank run checks the NCCL process group and mesh.

Every rank builds the GPT example on the meta device (no rank holds it whole), compiles it for a
(dp, tp) mesh over all ranks, initializes its shards with the model's own init (`init_weights`), runs a
forward and one AdamW step, and compares with the single-device model built from the same seed on rank
0: outputs, loss, and every parameter after the step. Prints one line per rank and `OK` or `MISMATCH`;
exits non-zero on a mismatch. Results on real GPUs go to bench/results_gpu.md.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import spmd  # noqa: E402
from spmd.runtime.distribute import local_shard  # noqa: E402


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU instead of NCCL on GPUs")
    parser.add_argument("--one-gpu", action="store_true",
                        help="every rank on cuda:0 with gloo collectives (NCCL refuses two ranks on one GPU)")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--flex", action="store_true",
                        help="FlexAttention under a causal block mask in place of SDPA (the tests' GPT: torch "
                             "trains it on CUDA only)")
    parser.add_argument("--hf", action="store_true",
                        help="transformers' LlamaForCausalLM (grouped-query attention) in place of the GPT, called "
                             "with keyword inputs, a left-padded batch and labels of -100 at the padding; its own loss")
    parser.add_argument("--save", action="store_true",
                        help="also save_safetensors after the step (each part sent to rank 0), every rank checking "
                             "its own pieces in the file")
    args = parser.parse_args()

    cuda = torch.cuda.is_available() and not args.cpu
    world = int(os.environ["WORLD_SIZE"])
    if args.one_gpu and cuda:
        torch.cuda.set_device(0)
        dist.init_process_group("gloo")  # init_mesh keeps a process group that exists
    tp = 2 if world % 2 == 0 else 1
    mesh = spmd.init_mesh((world // tp, tp), ("dp", "tp"), "cuda" if cuda else "cpu")
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    build, tokens, kwargs = _model(args, world // tp)
    with torch.device("meta"):
        model = build()
    t0 = time.perf_counter()
    if args.hf:  # the model's own loss (`out.loss`), keyword inputs
        compiled = spmd.compile(model, mesh, example_kwargs=kwargs, training=True)
    else:
        compiled = spmd.compile(model, mesh, tokens, loss_fn=lm_loss)
    compile_s = time.perf_counter() - t0
    compiled.init_weights(seed=0)
    on_device = {k: v.to(device) for k, v in kwargs.items()}
    if args.hf:
        positional, local = compiled.shard_inputs(**on_device)
        loss = compiled(*positional, **local).loss
    else:
        loss = compiled(*compiled.shard_inputs(*on_device.values()))
    lr = 1e-3
    opt = torch.optim.AdamW(compiled.parameters(), lr=lr)
    loss.backward()
    opt.step()
    # gloo moving CUDA tensors (--one-gpu) runs the step's collectives but crashes in all_gather: there each
    # rank checks its own shards against its piece of the one-device model instead of gathering them
    shards = compiled.sharded_state_dict() if args.one_gpu else None
    after = None if args.one_gpu else compiled.full_state_dict()
    coord = tuple(mesh.get_coordinate())

    def piece(k, full):  # this rank's piece of a full tensor (the whole of it when gathered)
        return local_shard(full, shards[k].placements, tuple(mesh.shape), coord) if shards else full

    def mine(k):
        return shards[k].to_local() if shards else after[k]

    # one device: rank 0 (every rank with --one-gpu) builds the model from the same seed, takes the same step
    errors = torch.zeros(2, dtype=torch.float64, device="cpu" if args.one_gpu else device)
    if rank == 0 or args.one_gpu:
        torch.manual_seed(0)
        reference = build().to(device)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=lr)
        ref_loss = reference(**on_device).loss if args.hf else lm_loss(reference(on_device["tokens"]),
                                                                        on_device["targets"])
        ref_loss.backward()
        ref_opt.step()
        errors[0] = abs(loss.item() - ref_loss.item())
        # AdamW's first step moves an element by lr * g / (|g| + eps): where the gradient is zero up to
        # rounding (a key bias's is exactly zero in exact arithmetic), two valid summation orders move it
        # by different noise, up to lr; there only a move beyond lr counts
        scale = max(float(v.grad.abs().max()) for v in reference.parameters())
        errors[1] = max(float(torch.where(piece(k, v.grad).abs() <= 1e-6 * scale,
                                          ((mine(k) - piece(k, v.detach())).abs() - lr).clamp(min=0),
                                          (mine(k) - piece(k, v.detach())).abs()).max())
                        for k, v in reference.named_parameters())
    if args.one_gpu:
        dist.all_reduce(errors, op=dist.ReduceOp.MAX)
    else:
        dist.broadcast(errors, src=0)
    saved_error = _saved_error(compiled, mesh) if args.save else None
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    backend = dist.get_backend()
    line = (f"rank {rank} on {device} ({'NCCL' if backend == 'nccl' else 'gloo'}): compile {compile_s:.1f} s, loss {loss.item():.6f}, "
            f"|loss - one device| {errors[0].item():.2e}, max |parameter - one device| {errors[1].item():.2e}"
            + (f", peak GPU memory {peak / 2**20:.0f} MiB" if cuda else "")
            + (f", saved file vs own pieces {saved_error:.1e}" if saved_error is not None else ""))
    lines = [None] * world
    dist.all_gather_object(lines, line)
    tol = 1e-3 if cuda else 1e-5  # TF32 matmuls on GPUs, fp32 on CPU
    ok = errors[0].item() <= tol * max(1.0, abs(loss.item())) and errors[1].item() <= tol and math.isfinite(loss.item())
    ok = ok and (saved_error is None or saved_error == 0.0)
    if rank == 0:
        print("\n".join(lines))
        print("OK: one training step equals one device" if ok else "MISMATCH")
    dist.destroy_process_group()
    return 0 if ok else 1


def _model(args, dp: int):
    """(a constructor, the example inputs, the same by name): the GPT (the examples', or the tests' with FlexAttention),
    or transformers' Llama with a batch whose first row is left-padded."""
    g = torch.Generator().manual_seed(1)
    if args.hf:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=512, hidden_size=args.dim, intermediate_size=2 * args.dim,
                          num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                          max_position_embeddings=64, use_cache=False)
        ids = torch.randint(0, cfg.vocab_size, (2 * dp, 64), generator=g)
        mask = torch.ones_like(ids)
        mask[0, :16] = 0  # (left padding, as a batch of prompts for a causal LM comes)
        labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
        return (lambda: LlamaForCausalLM(cfg)), (), dict(input_ids=ids, attention_mask=mask, labels=labels)
    if args.flex:
        from tests.models import GPT, GPTConfig  # the examples' GPT has no FlexAttention
        cfg = GPTConfig(vocab=512, seq=64, dim=args.dim, heads=8, layers=args.layers, flex="mask")
    else:
        from examples.models import GPT, GPTConfig
        cfg = GPTConfig(vocab=512, seq=64, dim=args.dim, heads=8, layers=args.layers)
    tokens = torch.randint(0, cfg.vocab, (2 * dp, cfg.seq), generator=g)
    targets = torch.randint(0, cfg.vocab, tokens.shape, generator=g)
    return (lambda: GPT(cfg)), (tokens, targets), dict(tokens=tokens, targets=targets)


def _saved_error(compiled, mesh) -> float:
    """`save_safetensors` after the step, read back on every rank: the largest difference between this rank's
    piece of each saved tensor and the piece it holds (0: the file is the trained model)."""
    import tempfile

    from safetensors import safe_open

    path = os.path.join(tempfile.gettempdir(), f"gpu_smoke_{os.getppid()}.safetensors")  # (torchrun's pid: shared)
    compiled.save_safetensors(path)
    dist.barrier()
    shards, coord, err = compiled.sharded_state_dict(), tuple(mesh.get_coordinate()), 0.0
    with safe_open(path, "pt") as f:
        for k, d in shards.items():
            mine = d.to_local().cpu() if hasattr(d, "to_local") else d.cpu()
            placements = d.placements if hasattr(d, "placements") else ()
            got = local_shard(f.get_tensor(k), placements, tuple(mesh.shape), coord) if placements else f.get_tensor(k)
            err = max(err, float((got.float() - mine.float()).abs().max()))
    dist.barrier()
    if dist.get_rank() == 0:
        os.remove(path)
    return err


if __name__ == "__main__":
    sys.exit(main())
