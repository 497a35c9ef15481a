"""Per-rank body of tests/runtime/test_unprintable.py: stage 0 raises an exception whose str() raises."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline, PipelineError


class Unprintable(Exception):
    def __str__(self):
        raise TypeError("no text")


class RaisesOnCall(nn.Module):
    """Identity that raises ``Unprintable`` on its ``at``-th call (counting from 1)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at:
            raise Unprintable()
        return x


def unprintable(rank, at):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), RaisesOnCall(at), nn.Tanh(), nn.Linear(4, 4))
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, timeout=30)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g)
    try:
        for _ in range(3):
            pipe.step(x, target=y)
    except PipelineError as exc:
        return {"type": "PipelineError", "rank": exc.rank, "text": str(exc)}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"type": type(exc).__name__, "rank": None, "text": repr(exc)}
    return {"type": None}
