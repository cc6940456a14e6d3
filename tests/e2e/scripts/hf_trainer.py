"""transformers' Trainer driving a tiny GPT-2, as docs/huggingface.md ("transformers' Trainer") says: compiled by
spmd on 2 gloo ranks (`python hf_trainer.py spmd` under torchrun's environment), or plain on one process for the
reference (`python hf_trainer.py eager`, a batch as large as both ranks' together). Prints the losses Trainer
computed as one JSON line and saves the trained weights (rank 0) in the output folder, for
tests/e2e/test_huggingface.py to compare."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

VOCAB, ROWS, SEQ, PER_RANK, STEPS = 64, 32, 16, 4, 3


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return ROWS

    def __getitem__(self, i):
        return dict(input_ids=self.ids[i], attention_mask=torch.ones_like(self.ids[i]), labels=self.ids[i])


class Logged(Trainer):
    """Records each loss; reads the dataset in order (on 2 ranks, accelerate gives rank r the r-th of each pair of
    batches: together, the one process's batch)."""

    def compute_loss(self, model, inputs, **kwargs):
        loss = super().compute_loss(model, inputs, **kwargs)
        LOSSES.append(loss.item())
        return loss

    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)


class SpmdTrainer(Logged):
    def _clip_grad_norm(self, model):  # torch's clip over pieces is refused: the norm is the mesh's
        return model.clip_grad_norm_(self.args.max_grad_norm)


LOSSES = []
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64, resid_pdrop=0.0,
                                   embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False))
data = Tokens()
out_dir = sys.argv[2]
if sys.argv[1] == "eager":  # (the model's own mean loss, as the compiled module's: see `accepts_loss_kwargs` below)
    model.accepts_loss_kwargs = False
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=2 * PER_RANK, max_steps=STEPS,
                             report_to=[], save_strategy="no", use_cpu=True, seed=0)
    Logged(model=model, args=args, train_dataset=data).train()
    weights = model.state_dict()
else:
    import spmd
    from torch.distributed.tensor import Shard

    from tests.support import spec

    mesh = spmd.init_mesh((2,), ("dp",))
    batch = {k: torch.stack([data[i][k] for i in range(2 * PER_RANK)]) for k in ("input_ids", "attention_mask",
                                                                                  "labels")}
    compiled = spmd.compile(model, mesh, example_kwargs=batch, training=True, mesh_spec=spec((2,), ("dp",)),
                            in_placements={k: [Shard(0)] for k in batch})
    compiled._is_accelerate_prepared = True  # accelerate would wrap it in DDP (refused: it holds pieces)
    compiled.accepts_loss_kwargs = False  # no `num_items_in_batch`
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=PER_RANK, max_steps=STEPS, report_to=[],
                             save_strategy="no", use_cpu=True, seed=0, remove_unused_columns=False)
    SpmdTrainer(model=compiled, args=args, train_dataset=data).train()
    weights = compiled.full_state_dict()
    assert compiled.code.count("spmd_core_collectives_") > 0, "a plan with no collectives proves nothing"
if int(os.environ.get("RANK", "0")) == 0:
    torch.save({k: v.detach().clone() for k, v in weights.items()}, os.path.join(out_dir, "weights.pt"))
print(json.dumps({"losses": LOSSES}))
