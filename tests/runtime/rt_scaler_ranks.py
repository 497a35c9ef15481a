"""Per-rank bodies of tests/runtime/test_scaler_ranks.py (2 ranks): a GradScaler passed to pipe.step on one rank
only, or built with other settings on one rank: the error, on every rank, names which pipeline ranks did what."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pipesched.runtime import GradScaler, Pipeline

from rt_cases import mlp

WIDTH = 16


def _attempt(pipe, opt, scaler, passed: bool, x, y) -> str:
    pipe.step(x, y, scaler=scaler if passed else None)
    try:
        scaler.step(opt)
        scaler.update()
        return "no error"
    except ValueError as exc:
        return str(exc)
    finally:
        opt.zero_grad()


def suite(rank):
    torch.manual_seed(0)
    pipe = Pipeline(mlp(num_layers=4, width=WIDTH), schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss,
                    autocast=torch.float16)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, WIDTH, generator=g), torch.randn(4, WIDTH, generator=g)
    out = {}
    # the last stage's rank alone passes it (the rank that scales the loss: the gradients are scaled, yet rank 0's
    # scaler never heard of the step)
    out["last only"] = _attempt(pipe, opt, GradScaler(pipe, init_scale=1024.0), rank == 1, x, y)
    out["first only"] = _attempt(pipe, opt, GradScaler(pipe, init_scale=1024.0), rank == 0, x, y)
    out["init_scale"] = _attempt(pipe, opt, GradScaler(pipe, init_scale=1024.0 * (1 + rank)), True, x, y)
    out["growth_interval"] = _attempt(pipe, opt, GradScaler(pipe, init_scale=1024.0,
                                                            growth_interval=2000 if rank == 0 else 10), True, x, y)
    out["alike"] = _attempt(pipe, opt, GradScaler(pipe, init_scale=1024.0), True, x, y)  # still usable
    pipe.close()
    return out
