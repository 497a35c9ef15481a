"""Per-rank bodies of tests/runtime/test_split_skips.py: a pipelined run against the unsplit model run on the same
rank, one microbatch at a time, the loss of microbatch i weighted by the Python float n_i / N (README "Correctness");
or the error that refuses it."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline

W = 4


class Doubled(nn.Sequential):
    """An nn.Sequential whose own forward doubles its input before running the layers."""

    def forward(self, x):
        return super().forward(x * 2.0)


def _reference(ref, x, y, m):
    total = None
    for xm, ym in zip(torch.tensor_split(x, m), torch.tensor_split(y, m)):
        part = F.mse_loss(ref(xm), ym) * (ym.shape[0] / x.shape[0])
        part.backward()
        total = part.detach() if total is None else total + part.detach()
    return total


def container(rank):
    """The model's own nn.Sequential: a subclass's forward, and hooks registered on the container itself."""
    torch.set_num_threads(1)
    out = {}
    for kind in ("subclass", "hooks"):
        torch.manual_seed(0)
        layers = [nn.Linear(W, W), nn.Tanh(), nn.Linear(W, W), nn.Tanh()]
        model = Doubled(*layers) if kind == "subclass" else nn.Sequential(*layers)
        ref = copy.deepcopy(model)
        calls = {"pipe": 0, "ref": 0}
        if kind == "hooks":  # a forward pre-hook that scales the input, and a counting forward hook
            for name, mdl in (("pipe", model), ("ref", ref)):
                mdl.register_forward_pre_hook(lambda m, args: (args[0] * 2.0,))
                mdl.register_forward_hook(lambda m, a, o, name=name: calls.__setitem__(name, calls[name] + 1))
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(4, W, generator=g), torch.randn(4, W, generator=g)
        try:
            pipe = Pipeline(model, schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss)
            loss = pipe.step(x, target=y)
        except Exception as exc:  # noqa: BLE001 - a refusal is a correct outcome
            out[kind] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        ref_loss = _reference(ref, x, y, 2)
        mine = {id(p) for p in pipe.parameters()}
        rp = dict(ref.named_parameters())
        grads = {n: torch.equal(p.grad, rp[n].grad) for n, p in model.named_parameters() if id(p) in mine}
        out[kind] = dict(loss=(loss.item(), ref_loss.item()), grads=grads, calls=dict(calls))
        pipe.close()
    return out


class Ema(nn.Module):
    """Linear whose output is centred by an EMA of its inputs (a buffer it updates in every training forward and
    reads): not a norm layer, so Pipeline does not refuse it when one object is used by two stages."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.register_buffer("mean", torch.zeros(W))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.5).add_(x.mean(0), alpha=0.5)
        return torch.tanh(self.lin(x) - self.mean)


def shared_ema_one_rank(rank, schedule, pattern, v, m=4):
    """One Ema object at two places of the model whose stages are on one rank (zbv: stages 0 and 3 on rank 0;
    interleaved-1f1b v=2: stages 0 and 2 on rank 0): the unsplit model updates it microbatch by microbatch, layer
    by layer; a rank runs one stage's microbatches before the other stage's. Returns the error or the comparison."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ema = Ema()
    model = nn.Sequential(*[ema if c == "e" else nn.Sequential(nn.Linear(W, W), nn.Tanh()) for c in pattern])
    ref = copy.deepcopy(model)
    try:
        pipe = Pipeline(model, schedule=schedule, num_microbatches=m, virtual_stages=v, loss_fn=F.mse_loss)
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(8, W, generator=g), torch.randn(8, W, generator=g)
        loss = pipe.step(x, target=y)
    except Exception as exc:  # noqa: BLE001 - an error is a correct outcome (refused or detected)
        return {"error": f"{type(exc).__name__}: {exc}"}
    ref_loss = _reference(ref, x, y, m)
    mine = {id(p) for p in pipe.parameters()}
    rp = dict(ref.named_parameters())
    grads = {n: torch.equal(p.grad, rp[n].grad) for n, p in model.named_parameters() if id(p) in mine}
    holds = any(id(m) == id(ema) for st in pipe.stages.values() for m in st.modules())
    out = {"loss": (loss.item(), ref_loss.item()), "grads": grads,
           "mean": torch.equal(ema.mean, ref[0].mean) if holds else None}
    try:  # a rank whose step ended before another rank detected a problem learns it at its next call
        pipe.forward(x)
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"}
    pipe.close()
    return out
