"""Per-rank bodies of tests/runtime/test_launch_store_host.py."""
from __future__ import annotations

import os
import signal

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline
from pipesched.runtime.lost_rank import store_host

TIMEOUT_S = 3.0  # the Pipeline's; launch's is 120 s


def stop_rank0_in_a_step(rank: int, out_dir: str) -> str:
    """Every rank writes its pid; world rank 0 SIGSTOPs itself in its first layer's forward of the second step (alive,
    connections open, its process -- and, before launch hosted the store, the job's store -- frozen). The others'
    PipelineError propagates (launch re-raises it)."""
    with open(os.path.join(out_dir, f"{rank}.pid"), "w") as handle:
        handle.write(str(os.getpid()))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(torch.distributed.get_world_size())])
    armed = []
    if rank == 0:
        model[0].register_forward_pre_hook(lambda m, a: os.kill(os.getpid(), signal.SIGSTOP) if armed else None)
    pipe = Pipeline(model, num_microbatches=2, loss_fn=F.mse_loss, timeout=TIMEOUT_S)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g)
    pipe.step(x, y)
    armed.append(True)
    pipe.step(x, y)
    return "the second step ended"


def who_hosts(rank: int) -> tuple:
    """What this rank's child is told about the store's host."""
    return store_host(), os.environ.get("PIPESCHED_LAUNCH_STORE")
