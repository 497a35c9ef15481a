"""Per-rank body of tests/runtime/test_split_silent.py: four models whose split backward (I then W) gave silently
wrong results, run with the fused backward (1f1b) and the split one (1f1b with split_backward=True, zb-h1, zbv,
dualpipev's I/W), each against the unsplit model run one microbatch at a time on the same rank.

- ``loss_param``: a loss_fn module with its own parameter (a learnable temperature) and a layer holding a tensor
  created with ``requires_grad=True`` that is not a registered parameter: W accumulates into both, as B does.
- ``hook``: ``y.register_hook(lambda g: g * 0.5)`` on each Linear's output: applied once to the weight gradients.
- ``input_grad``: ``x.requires_grad_()``: ``x.grad`` on stage 0's rank, as the fused backward fills it.
- ``checkpoint_bn``: ``torch.utils.checkpoint(use_reentrant=False)`` around Linear + BatchNorm + a forward counter:
  the region's forward runs twice per microbatch (forward, then the backward's recompute), as unsplit, not once
  more per W.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipesched.runtime import Pipeline

WIDTH, ROWS, M = 8, 4, 2

#: name -> (schedule, virtual_stages, split_backward); 1f1b is the fused control; split_backward=True leaves
#: stage 0, whose input gradient goes to no rank, fused: [True, True] splits it too
CONFIGS = {"1f1b": ("1f1b", 1, False), "1f1b-split": ("1f1b", 1, True), "1f1b-split-all": ("1f1b", 1, [True, True]),
           "zb-h1": ("zb-h1", 1, False),
           "zbv": ("zbv", 2, False), "dualpipev": ("dualpipev", 2, False)}


class TempLoss(nn.Module):
    """MSE of the output scaled by a learnable temperature: the loss function's own parameter."""

    def __init__(self):
        super().__init__()
        self.log_t = nn.Parameter(torch.tensor(0.3))

    def forward(self, out, target):
        return F.mse_loss(out * self.log_t.exp(), target)


class Gained(nn.Module):
    """A Linear times ``gain``, a plain attribute created with ``requires_grad=True`` (not a Parameter: not in
    ``parameters()``), used twice (two paths into one leaf)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.gain = torch.linspace(0.5, 1.5, WIDTH).requires_grad_(True)

    def forward(self, x):
        return torch.tanh(self.lin(x) * self.gain) + self.gain


class Halved(nn.Module):
    """A Linear whose output's gradient a tensor hook halves (gradient scaling)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        y = self.lin(x)
        if y.requires_grad:
            y.register_hook(lambda g: g * 0.5)
        return torch.tanh(y)


class Counter(nn.Module):
    """Counts its forwards in an integer buffer (a forward's side effect on a buffer)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.calls += 1
        return x


class Checkpointed(nn.Module):
    """Linear + BatchNorm (cumulative running statistics: momentum=None) + Counter under a non-reentrant
    checkpoint."""

    def __init__(self):
        super().__init__()
        self.lin, self.bn, self.count = nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH, momentum=None), Counter()

    def inner(self, x):
        return torch.tanh(self.count(self.bn(self.lin(x))))

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=False)


def _lin():
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())


#: name -> (layers (4: one stage each with v=2, two per stage otherwise), loss_fn factory, x requires grad)
CASES = {
    "loss_param": (lambda: [_lin(), _lin(), Gained(), _lin()], TempLoss, False),
    "hook": (lambda: [Halved(), Halved(), Halved(), Halved()], lambda: F.mse_loss, False),
    "input_grad": (lambda: [_lin(), _lin(), _lin(), _lin()], lambda: F.mse_loss, True),
    "checkpoint_bn": (lambda: [_lin(), Checkpointed(), Checkpointed(), Checkpointed()], lambda: F.mse_loss, False),
}


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, WIDTH, generator=g), torch.randn(ROWS, WIDTH, generator=g)


def _extras(model, loss_fn):
    """{name: tensor} of the leaves outside ``model.parameters()``: each ``gain`` and the loss_fn's parameters."""
    found = {f"{name}.gain": m.gain for name, m in model.named_modules() if isinstance(m, Gained)}
    if isinstance(loss_fn, nn.Module):
        found.update({f"loss_fn.{name}": p for name, p in loss_fn.named_parameters()})
    return found


def run_case(case, config):
    """{"ops", "loss": (pipe, ref), "grads": {name: (pipe grad, ref grad)}, "buffers": {name: (pipe, ref)}} for
    the tensors this rank holds (x as "x", loss_fn parameters on the last stage's rank)."""
    make, make_loss, x_grad = CASES[case]
    schedule, v, split = CONFIGS[config]
    torch.manual_seed(0)
    model = nn.Sequential(*make())
    ref, loss_fn = copy.deepcopy(model), make_loss()
    ref_loss_fn = copy.deepcopy(loss_fn)
    pipe = Pipeline(model, schedule=schedule, virtual_stages=v, num_microbatches=M, loss_fn=loss_fn,
                    split_backward=split, timeout=60.0)
    x, y = _data()
    xp, xr = x.clone().requires_grad_(x_grad), x.clone().requires_grad_(x_grad)
    loss = pipe.step(xp, target=y)
    ref_total = None
    for xm, ym in zip(xr.split(ROWS // M), y.split(ROWS // M)):  # the unsplit model, one microbatch at a time
        part = ref_loss_fn(ref(xm), ym) * (1 / M)
        part.backward()
        ref_total = part.detach() if ref_total is None else ref_total + part.detach()
    local = [m for stage in pipe.stages.values() for m in stage.modules()]
    mine = {id(t) for m in local for t in (*m.parameters(recurse=False), *m.buffers(recurse=False),
                                           *([m.gain] if isinstance(m, Gained) else []))}
    last = pipe.program.num_stages - 1 in pipe.stage_ids
    grads = {name: (p.grad, q.grad) for (name, p), q in zip(model.named_parameters(), ref.parameters())
             if id(p) in mine}
    ref_extras = _extras(ref, ref_loss_fn)
    grads.update({name: (t.grad, ref_extras[name].grad) for name, t in _extras(model, loss_fn).items()
                  if id(t) in mine or (name.startswith("loss_fn.") and last)})
    if 0 in pipe.stage_ids and x_grad:
        grads["x"] = (xp.grad, xr.grad)
    buffers = {name: (b.clone(), q.clone()) for (name, b), q in zip(model.named_buffers(), ref.buffers())
               if id(b) in mine}
    ops = sorted({e.instr.op.value for e in pipe.timeline().events})
    pipe.close()
    return {"ops": ops, "loss": (loss, ref_total), "grads": grads, "buffers": buffers}


def suite(rank):
    torch.set_num_threads(1)
    return {(case, config): run_case(case, config) for case in CASES for config in CONFIGS}
