"""Fixtures the unit tests share."""
import datetime

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """A one-rank gloo world in this process, its group's name: the collective steps run for real (a sum
    over one rank is the value itself). No process is started."""
    started = not dist.is_initialized()
    if started:
        path = tmp_path_factory.mktemp("pg") / "store"
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60))
    yield dist.group.WORLD.group_name
    if started:
        dist.destroy_process_group()
