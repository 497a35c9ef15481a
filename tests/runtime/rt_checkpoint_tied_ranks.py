"""Per-rank bodies of tests/runtime/test_checkpoint_tied_ranks.py: a model whose embedding and head share a weight,
saved on one rank count and loaded on another."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline, load_checkpoint, save_checkpoint


class Table(nn.Module):
    """Adds a fixed table held in a buffer; one object used at two layers (a buffer, not a tie)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.linspace(-1, 1, 8))

    def forward(self, x):
        return x + self.table


def model(seed: int, kind: str = "tied") -> nn.Sequential:
    torch.manual_seed(seed)
    if kind == "table":
        table = Table()
        return nn.Sequential(nn.Embedding(16, 8), table, nn.Linear(8, 8), nn.Linear(8, 8), table, nn.Linear(8, 16))
    m = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 16))
    m[4].weight = m[0].weight  # tied: stages 0 and 1 on 2 ranks, one stage on 1 rank
    return m


def save(rank: int, path: str, kind: str = "tied") -> list:
    pipe = Pipeline(model(0, kind), num_microbatches=2, loss_fn=F.cross_entropy, timeout=60)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    save_checkpoint(path, pipe, opt, step=1)
    return sorted(pipe.state_dict())


def load(rank: int, path: str, kind: str = "tied") -> dict:
    """Load into a model initialised otherwise; return its tensors (every rank returns the whole unsplit model's
    state as loaded on this rank: its own stages' tensors, the others' untouched)."""
    m = model(1, kind)
    pipe = Pipeline(m, num_microbatches=2, loss_fn=F.cross_entropy, timeout=60)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    info = load_checkpoint(path, pipe, opt)
    return {"step": info.step, "mine": {k: v.clone() for k, v in pipe.state_dict().items()},
            "tied": m[4].weight is m[0].weight if kind == "tied" else m[1] is m[4]}
