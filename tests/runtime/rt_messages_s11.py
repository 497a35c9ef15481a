"""Per-rank bodies of test_messages_s11: a forward that raises says what its stage received (shapes and dtypes
between stages), or what loss_fn got. Each case builds a 2-rank Pipeline that fails in its first step."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipesched.runtime import Pipeline, PipelineError


class Half(nn.Module):
    """Stage 0's output in float16: the float32 Linear of stage 1 refuses it."""

    def forward(self, x):
        return x.half()


class FirstOfTuple(nn.Module):
    """A first layer taking the step's tuple x and using its first element."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 16)

    def forward(self, xs):
        return self.lin(xs[0])


class _BadBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("bad backward")


class BadBackward(nn.Module):
    """The identity whose backward raises: a B failure, which says nothing of a received input."""

    def forward(self, x):
        return _BadBackward.apply(x)


def _model(case: str) -> nn.Sequential:
    torch.manual_seed(0)
    if case == "shapes":  # stage 1 expects 8 features, stage 0 gives 16
        return nn.Sequential(nn.Linear(8, 16), nn.Linear(8, 16))
    if case == "dtype":
        return nn.Sequential(Half(), nn.Linear(8, 8))
    if case == "first":  # stage 0 expects 8 features, x has 4
        return nn.Sequential(FirstOfTuple(), nn.Linear(16, 8))
    if case == "backward":
        return nn.Sequential(nn.Linear(8, 8), nn.Sequential(BadBackward(), nn.Linear(8, 8)))
    if case in ("loss", "eval"):  # output 16 wide, target 8 wide (loss); eval: stage 1 expects 8
        return nn.Sequential(nn.Linear(8, 16), nn.Linear(16 if case == "loss" else 8, 16))
    raise ValueError(case)


def _x(case: str):
    g = torch.Generator().manual_seed(1)
    if case == "first":  # a tuple of 5: the message names 3, then the count
        return (torch.randn(6, 4, generator=g), *(torch.zeros(6, dtype=torch.int64) for _ in range(4)))
    return torch.randn(6, 8, generator=g)


def one_case(case: str) -> dict:
    pipe = Pipeline(_model(case), schedule="gpipe", num_microbatches=2, loss_fn=F.mse_loss, balance=[1, 1])
    try:
        if case == "eval":
            pipe.forward(_x(case))
        else:
            pipe.step(_x(case), target=torch.zeros(6, 8))
    except PipelineError as exc:
        return {"type": "PipelineError", "message": str(exc), "received": exc.received, "instr": exc.instr,
                "cause": exc.cause}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"type": type(exc).__name__, "message": str(exc)}
    finally:
        pipe.close()
    return {"type": None}


def suite(rank: int) -> dict:
    return {case: one_case(case) for case in ("shapes", "dtype", "first", "loss", "eval", "backward")}
