"""Per-rank bodies of tests/runtime/test_collective_meet.py: run_collective on every rank, or on one rank while the
other opens its next step."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline, PipelineError


def _pipeline() -> Pipeline:
    torch.manual_seed(0)
    return Pipeline(nn.Sequential(*[nn.Linear(4, 4) for _ in range(2)]), num_microbatches=2, loss_fn=F.mse_loss,
                    timeout=60)


def _sum(pp_group, _dp_group):
    value = torch.tensor([float(dist.get_rank(pp_group) + 1)])
    dist.all_reduce(value, group=pp_group)
    return value.item()


def case(rank: int, together: bool) -> dict:
    pipe = _pipeline()
    x, y = torch.ones(4, 4), torch.zeros(4, 4)
    pipe.step(x, y)
    try:
        if together or rank == 1:
            got = pipe.run_collective(_sum)
        else:
            got = pipe.step(x, y).item()
        again = pipe.run_collective(_sum, meet=False) if together else None  # own rows or none: no meeting row
        return {"type": None, "got": got, "again": again}
    except PipelineError as exc:
        return {"type": "PipelineError", "origin": exc.rank, "message": str(exc)}
