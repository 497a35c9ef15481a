"""Per-rank body of tests/runtime/test_lost_rank.py: one rank SIGKILLs itself in the middle of a step (in a layer's
forward or backward) or between two steps; each surviving rank writes what it raised to ``<out>/<rank>.json``
(``launch`` itself raises the killed child's error, so the survivors report through files)."""
from __future__ import annotations

import json
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline, PipelineError


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class Trigger:
    """On world rank ``victim``, while ``armed``, the ``nth`` call (0-based) of phase ``phase`` ("F": a forward,
    "B": a backward, counted over every bomb of this rank) SIGKILLs this process."""

    def __init__(self, victim: int, phase: str, nth: int) -> None:
        self.victim, self.phase, self.nth = victim, phase, nth
        self.armed, self.calls = False, 0

    def tick(self, phase: str) -> None:
        if self.armed and phase == self.phase and dist.get_rank() == self.victim:
            if self.calls == self.nth:
                _die()
            self.calls += 1


class _KillInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, trigger):
        ctx.trigger = trigger
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.trigger.tick("B")
        return grad, None


class Bomb(nn.Module):
    """Passes its input through, ticking ``trigger`` in its forward and its backward."""

    def __init__(self, trigger: Trigger) -> None:
        super().__init__()
        self.trigger = trigger

    def forward(self, x):
        self.trigger.tick("F")
        return _KillInBackward.apply(x, self.trigger)


def model_with_bombs(num_layers: int, trigger: Trigger) -> nn.Sequential:
    """``num_layers`` x (Linear(4, 4), Bomb, Tanh)."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), Bomb(trigger), nn.Tanh()) for _ in range(num_layers)])


# collectives a Pipeline runs outside step(): each must name the lost rank as step() does
OUTSIDE_STEP = {
    "gather": lambda pipe: pipe.gather_timeline(),
    "collective": lambda pipe: pipe.run_collective(lambda pp, dp: dist.all_reduce(torch.ones(1), group=pp)),
    "clip": lambda pipe: pipe.clip_grad_norm_(1.0),
}


def run_case(rank: int, out: str, victim: int, when: str, schedule: str = "1f1b", dp_size: int = 1,
             kill_step: int = 1, timeout: float = 60.0) -> None:
    """Three steps; world rank ``victim`` dies at step ``kill_step``: ``when`` is ``"F"`` (forward of its second
    microbatch), ``"B"`` (backward of its second microbatch) or ``"between"`` (after step ``kill_step - 1``
    returned, before step ``kill_step`` starts: the others wait in the step-opening all-gather) or a key of
    ``OUTSIDE_STEP`` (as ``"between"``, but the others first call that collective outside step())."""
    trigger = Trigger(victim, when, nth=1)
    p = dist.get_world_size() // dp_size
    pipe = Pipeline(model_with_bombs(p, trigger), schedule=schedule, num_microbatches=4, loss_fn=F.mse_loss,
                    dp_size=dp_size, timeout=timeout)
    result = {"type": None, "steps": 0}
    start = None
    try:
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)
            if when in ("between", *OUTSIDE_STEP) and step == kill_step and rank == victim:
                _die()
            if when in OUTSIDE_STEP and step == kill_step:
                start = time.monotonic()
                OUTSIDE_STEP[when](pipe)  # the survivors meet in a collective outside step()
            trigger.armed = step == kill_step
            start = time.monotonic()
            pipe.step(x, y)
            result["steps"] += 1
    except PipelineError as exc:
        result = dict(result, type="PipelineError", rank=exc.rank, pp_rank=exc.pp_rank, lost=exc.record.lost,
                      message=str(exc), elapsed=time.monotonic() - start)
    except Exception as exc:  # noqa: BLE001 - reported, so the test shows what else happened
        result = dict(result, type=type(exc).__name__, message=str(exc))
    with open(os.path.join(out, f"{rank}.json"), "w") as handle:
        json.dump(result, handle)
