"""Per-rank bodies of tests/runtime/test_stalled.py: one rank pauses between two steps for longer than the
Pipeline's timeout (alive, connections open, no error of its own); every rank reports what its second step raised."""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline, PipelineError

TIMEOUT_S = 3.0


def pause_between_steps(rank: int, stalled: int, pause_s: float) -> dict:
    torch.manual_seed(0)
    world = torch.distributed.get_world_size()
    pipe = Pipeline(nn.Sequential(*[nn.Linear(4, 4) for _ in range(world)]), num_microbatches=2, loss_fn=F.mse_loss,
                    timeout=TIMEOUT_S)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g)
    pipe.step(x, y)
    if rank == stalled:
        time.sleep(pause_s)
    try:
        pipe.step(x, y)
        return {"type": None}
    except PipelineError as exc:
        return {"type": "PipelineError", "rank": exc.rank, "message": str(exc), "stalled": exc.stalled}
