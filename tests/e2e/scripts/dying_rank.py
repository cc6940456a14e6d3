"""Two ranks train; at step 2 one of them dies (or hangs) between forward and backward. Run by
tests/e2e/test_reliability.py under torchrun: the other rank must fail fast and say what it was doing."""
import datetime
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import spmd  # noqa: E402
from tests.models import MLP  # noqa: E402

how = sys.argv[1]  # "die" or "hang"
torch.set_num_threads(1)
mesh = spmd.init_mesh((2,), ("dp",), timeout=datetime.timedelta(seconds=float(sys.argv[2])))
rank = torch.distributed.get_rank()
torch.manual_seed(0)
x, y = torch.randn(8, 64), torch.randn(8, 64)
compiled = spmd.compile(MLP(64, 256), mesh, (x, y), loss_fn=F.mse_loss,
                        in_placements={"x": [torch.distributed.tensor.Shard(0)]})
opt = torch.optim.SGD(compiled.parameters(), lr=0.1)
local = compiled.shard_inputs(x, y)
for step in range(4):
    loss = compiled(*local)
    if step == 2 and rank == 1:
        print(f"rank 1: {how}s at step 2, {time.time():.3f}", flush=True)
        if how == "die":
            os._exit(3)
        time.sleep(3600)
    if rank == 0 and step == 2:
        print(f"rank 0: backward at step 2, {time.time():.3f}", flush=True)
    loss.backward()
    opt.step()
    opt.zero_grad()
print(f"rank {rank} finished", flush=True)
