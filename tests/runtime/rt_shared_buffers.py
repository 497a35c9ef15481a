"""Per-rank bodies of tests/runtime/test_shared_buffers.py: one module object used at two places of the model, its
uses cut onto two ranks (or one). Each returns what this rank raised, or its losses, as a dict."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline, PipelineError


class Counter(nn.Module):
    """Counts its forwards in a buffer (not a norm layer: only the check around the step can see it change)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.calls += 1
        return x


class Table(nn.Module):
    """Adds a fixed table held in a buffer (as a rotary or positional table shared by many layers): never changes."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.linspace(-1, 1, 4))

    def forward(self, x):
        return x + self.table


def _model(shared: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), shared, nn.Tanh(), nn.Linear(4, 4), shared, nn.Linear(4, 4))


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)


def _report(run) -> dict:
    try:
        return {"type": None, **run()}
    except PipelineError as exc:
        return {"type": "PipelineError", "origin": exc.rank, "message": str(exc)}
    except Exception as exc:  # noqa: BLE001 - reported, so the test shows what else happened
        return {"type": type(exc).__name__, "message": str(exc)}


def case(rank: int, kind: str, balance, schedule: str = "1f1b") -> dict:
    shared = {"batchnorm": lambda: nn.BatchNorm1d(4), "counter": Counter, "table": Table}[kind]()
    model = _model(shared)
    x, y = _batch()

    def run():
        expected = reference(kind)  # here, with the rank's one torch thread (reductions split alike)
        pipe = Pipeline(model, schedule=schedule, num_microbatches=2, loss_fn=F.mse_loss, balance=balance, timeout=30)
        losses = [pipe.step(x, y).item() for _ in range(2)]
        pipe.close()
        return {"losses": losses, "expected": expected}

    return _report(run)


def reference(kind: str) -> list:
    """The unsplit model's losses over the same two steps (two microbatches of 4 rows, mean of their losses)."""
    shared = {"batchnorm": lambda: nn.BatchNorm1d(4), "counter": Counter, "table": Table}[kind]()
    model = _model(shared)
    x, y = _batch()
    losses = []
    for _ in range(2):
        total = sum(F.mse_loss(model(xs), ys) * 0.5 for xs, ys in zip(x.chunk(2), y.chunk(2)))
        total.backward()
        losses.append(total.item())
    return losses
