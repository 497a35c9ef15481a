"""Per-rank body of tests/runtime/test_recompute_host_rng.py: a layer drawing from Python's ``random`` and NumPy's
global generator in its forward (stochastic depth written without torch), trained with and without recompute from
the same seeds: the recomputed run must equal the plain one bitwise (R replays those draws and leaves the streams
where the plain run leaves them)."""
from __future__ import annotations

import copy
import random

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline

M = 4


class HostScale(nn.Module):
    """``x * (0.5 + random.random() + np.random.rand())``: a draw from each host generator per call."""

    def forward(self, x):
        return x * (0.5 + random.random() + float(np.random.rand()))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), HostScale(), nn.Tanh(), nn.Linear(8, 8), HostScale(), nn.Tanh())


def _run(rank: int, schedule: str, recompute: bool, split_backward: bool) -> dict:
    random.seed(100 + rank)
    np.random.seed(200 + rank)
    model = _model()
    pipe = Pipeline(copy.deepcopy(model), schedule=schedule, num_microbatches=M, loss_fn=F.mse_loss,
                    recompute=recompute, split_backward=split_backward, timeout=60.0)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(10, 8, generator=g), torch.randn(10, 8, generator=g)
    losses = [float(pipe.step(x, y)) for _ in range(2)]
    out = {"losses": losses, "grads": [p.grad.clone() for p in pipe.parameters()],
           "after": (random.random(), float(np.random.rand()))}  # where each stream was left
    pipe.close()
    return out


def compare(rank: int) -> dict:
    """Per case: whether the recomputed run's losses, gradients and streams equal the plain run's."""
    result = {}
    for schedule, split in (("1f1b", False), ("zbv", False), ("1f1b", True)):
        plain, redone = _run(rank, schedule, False, split), _run(rank, schedule, True, split)
        result[f"{schedule}{'+split' if split else ''}"] = {
            "losses": plain["losses"] == redone["losses"],
            "grads": len(plain["grads"]) > 0 and all(torch.equal(a, b)
                                                     for a, b in zip(plain["grads"], redone["grads"])),
            "streams": plain["after"] == redone["after"]}
    return result
