"""Per-rank body of tests/runtime/test_split_no_grad.py: backward roots that do not require grad or have no grad_fn
(a detached loss or output, a leaf output, stages with no parameters, a parameter returned as an output), run with
the fused backward (1f1b) and the split one (1f1b with split_backward=True, zb-h1, zbv), plain and recomputed."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline
from pipesched.runtime.failure import PipelineError

WIDTH = 8

#: name -> (schedule, virtual_stages, split_backward); 1f1b is the fused reference
CONFIGS = {"1f1b": ("1f1b", 1, False), "1f1b-split": ("1f1b", 1, True), "zb-h1": ("zb-h1", 1, False),
           "zbv": ("zbv", 2, False)}


class Detach(nn.Module):
    def forward(self, x):
        return x.detach()


class Fresh(nn.Module):
    """Outputs a new leaf that does not require grad."""

    def forward(self, x):
        return torch.ones_like(x)


class WithConst(nn.Module):
    """A tuple: an output that requires grad and a leaf that does not."""

    def forward(self, x):
        return torch.tanh(x), torch.ones_like(x)


class TakeConst(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, pair):
        h, c = pair
        return self.lin(h) * c + c


class WithParam(nn.Module):
    """Returns its parameter itself (a leaf root with no grad_fn), and ``a`` and ``a * 2`` (roots outside the input's
    graph, one below the other); ``p`` also feeds ``a``."""

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.randn(WIDTH))

    def forward(self, x):
        a = self.p * 3
        return torch.tanh(x), self.p, a, a * 2


class UseParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, parts):
        h, p, a, b = parts
        return self.lin(h) * p + a - b


def _lin():
    return nn.Linear(WIDTH, WIDTH)


def _mse_detached(out, target):
    return F.mse_loss(out.detach(), target)


#: name -> (layers (4: one stage each under zbv, two per stage otherwise), loss_fn, Pipeline options)
CASES = {
    # the fused backward fails at the last stage's B: every root must give torch's error at I
    "loss_detached": (lambda: [_lin(), _lin(), _lin(), _lin()], _mse_detached, {}),
    "output_detached": (lambda: [_lin(), _lin(), _lin(), Detach()], F.mse_loss, {}),
    "output_fresh_leaf_recompute": (lambda: [_lin(), _lin(), _lin(), Fresh()], F.mse_loss, {"recompute": True}),
    "nothing_needs_grad": (lambda: [_lin(), Detach(), nn.Tanh(), nn.Tanh()], F.mse_loss, {}),
    "nothing_needs_grad_recompute": (lambda: [_lin(), Detach(), nn.Tanh(), nn.Tanh()], F.mse_loss,
                                     {"recompute": True}),
    # the fused backward succeeds: the split one must give its gradients bitwise
    "middle_detached": (lambda: [_lin(), Detach(), _lin(), _lin()], F.mse_loss, {}),
    "leaf_output": (lambda: [_lin(), WithConst(), TakeConst(), _lin()], F.mse_loss, {}),
    "param_output": (lambda: [_lin(), WithParam(), UseParam(), _lin()], F.mse_loss, {}),
    "param_output_recompute": (lambda: [_lin(), WithParam(), UseParam(), _lin()], F.mse_loss, {"recompute": True}),
    "stages_without_params_recompute": (lambda: [_lin(), nn.Tanh(), nn.Tanh(), _lin()], F.mse_loss,
                                        {"recompute": True}),
}


def _data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(4, WIDTH, generator=g), torch.randn(4, WIDTH, generator=g)


def run_case(case, config):
    make, loss_fn, options = CASES[case]
    schedule, v, split = CONFIGS[config]
    torch.manual_seed(0)
    model = nn.Sequential(*make())
    pipe = Pipeline(model, schedule=schedule, virtual_stages=v, num_microbatches=2, loss_fn=loss_fn,
                    split_backward=split, timeout=30.0, **options)
    x, y = _data()
    try:
        loss = pipe.step(x, target=y)
    except PipelineError as exc:
        return {"type": "PipelineError", "rank": exc.rank, "instr": exc.instr, "cause": exc.cause,
                "message": str(exc)}
    except Exception as exc:  # noqa: BLE001 - reported to the test, which expects none
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None, "loss": loss, "ops": sorted({e.instr.op.value for e in pipe.timeline().events}),
            "grads": {name: p.grad for name, p in model.named_parameters()}}


def suite(rank):
    return {(case, config): run_case(case, config) for case in CASES for config in CONFIGS}
