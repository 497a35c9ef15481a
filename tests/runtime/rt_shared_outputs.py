"""Per-rank body of tests/runtime/test_shared_outputs.py (2 ranks, m=2): a stage returns one tensor twice, or a
tensor and a view of it; the next stage reads both names and, in the ``write`` cases, writes to one in place."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipesched.runtime import Pipeline

from rt_cases import grad_report, outcome, reference_forward, reference_step

M = 2
WIDTH = 8


class Share(nn.Module):
    """``h -> (l(h), mask, mask)``, or ``(l(h), mask, mask[:, :4])`` with ``view``: a no-grad mask given twice."""

    def __init__(self, view: bool) -> None:
        super().__init__()
        self.l, self.view = nn.Linear(WIDTH, WIDTH), view

    def forward(self, h):
        mask = (h > 0).float()
        return self.l(h), mask, mask[:, :4] if self.view else mask


class Use(nn.Module):
    """Reads both names of the mask; with ``write``, first adds 1 to one of them in place (unsplit: to both)."""

    def __init__(self, write: bool) -> None:
        super().__init__()
        self.l, self.write = nn.Linear(WIDTH, WIDTH), write

    def forward(self, t):
        h, a, b = t
        if self.write:
            a.add_(1)
        return self.l(h) * b.sum(dim=1, keepdim=True)


def _model(schedule: str, view: bool, write: bool) -> nn.Sequential:
    torch.manual_seed(0)
    if schedule == "zbv":  # stages 1 and 2 are both rank 1's: the shared mask is handed over on one rank
        return nn.Sequential(nn.Linear(WIDTH, WIDTH), Share(view), Use(write), nn.Linear(WIDTH, WIDTH))
    return nn.Sequential(Share(view), Use(write))


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(6, WIDTH, generator=g), torch.randn(6, WIDTH, generator=g)


def case(schedule: str, view: bool, write: bool) -> dict:
    """One step and one forward(), each on a Pipeline of its own (a refused one ends its Pipeline): their outcomes,
    and where they ran, whether they equal the unsplit model's one microbatch at a time (the last stage's rank)."""
    model = _model(schedule, view, write)
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, schedule=schedule, num_microbatches=M, loss_fn=F.mse_loss, timeout=60.0)
    x, y = _batch()
    got = {}
    out = {"step": outcome(lambda: got.setdefault("loss", pipe.step(x, y)))}
    if out["step"] == "ok":
        reference = reference_step(ref, x, y, M)
        out["loss and grads"] = torch.equal(got["loss"], reference) and grad_report(pipe, model, ref)[1]
        pipe.close()
    model = _model(schedule, view, write)
    ref = copy.deepcopy(model)
    forward_pipe = Pipeline(model, schedule=schedule, num_microbatches=M, timeout=60.0)
    out["forward"] = outcome(lambda: got.setdefault("output", forward_pipe.forward(x)))
    if out["forward"] == "ok":
        output = got["output"]
        out["output"] = output if output is None else torch.equal(output, reference_forward(ref, x, M))
        forward_pipe.close()
    return out


def shared(rank):
    """``{case name: outcome}`` on this rank."""
    cases = {"1f1b same tensor": ("1f1b", False), "1f1b view": ("1f1b", True), "zbv same tensor": ("zbv", False)}
    results = {}
    for name, (schedule, view) in cases.items():
        for write in (False, True):
            results[f"{name}{' write' if write else ''}"] = case(schedule, view, write)
    return results
