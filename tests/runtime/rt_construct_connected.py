"""Per-rank body of tests/runtime/test_construct_connected.py."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline
from pipesched.runtime import pipeline as pipeline_module


def slow_peer(rank: int) -> dict:
    """World rank 1 finishes creating its groups 1 s late and then says so in the store; world rank 0 reads, as
    soon as its Pipeline is constructed, whether it has. Both then close at once and construct again."""
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        make = pipeline_module.make_groups

        def late(*args, **kwargs):
            groups = make(*args, **kwargs)
            time.sleep(1.0)  # connections up on this rank, later than on rank 0
            store.set("test/rank1-groups-done", "1")
            return groups

        pipeline_module.make_groups = late
    torch.manual_seed(0)
    pipe = Pipeline(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), num_microbatches=2, loss_fn=F.mse_loss,
                    timeout=60)
    seen = store.check(["test/rank1-groups-done"]) if rank == 0 else None
    pipe.close()
    pipeline_module.make_groups = make if rank == 1 else pipeline_module.make_groups
    again = Pipeline(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), num_microbatches=2, loss_fn=F.mse_loss,
                     timeout=60)
    loss = again.step(torch.ones(4, 4), torch.zeros(4, 4)).item()
    again.close()
    return {"rank1_done_when_rank0_constructed": seen, "loss_positive": loss > 0}
