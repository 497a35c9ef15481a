"""Per-rank bodies of tests/runtime/test_scaler_rounds.py (2 forked gloo ranks, Pipeline timeout 20 s): GradScaler's
overflow vote against another collective call on the other rank (the next step's opening, gather_timeline,
clip_grad_norm_), a scaler disabled on one rank only, and bad GradScaler arguments. Each body returns what each
rank raised, as ``"Type: message"`` (``"ok"`` where nothing was raised)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import GradScaler, Pipeline

WIDTH = 8
TIMEOUT = 20.0  # a rank left waiting in a vote would end only after it, with a timeout's text


def _pipe() -> Pipeline:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)])
    return Pipeline(model, schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, timeout=TIMEOUT)


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, WIDTH, generator=g), torch.randn(4, WIDTH, generator=g)


def _said(call) -> str:
    try:
        call()
        return "ok"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return f"{type(exc).__name__}: {exc}"


def other_call(rank: int, other: str) -> str:
    """One step with the scaler on both ranks; then rank 0 unscales (its vote) while rank 1 makes ``other``:
    ``"step"`` (opens the next step), ``"timeline"`` (gather_timeline) or ``"clip"`` (rank 0 clips without
    unscaling first, rank 1 calls scaler.step: clip_grad_norm_'s all-gather against the vote)."""
    pipe = _pipe()
    scaler, opt = GradScaler(pipe, init_scale=1024.0), torch.optim.SGD(pipe.parameters(), lr=0.01)
    x, y = _batch()
    pipe.step(x, y, scaler=scaler)
    if other == "clip":
        calls = (lambda: pipe.clip_grad_norm_(1.0), lambda: scaler.step(opt))
    else:
        calls = (lambda: scaler.unscale_(opt),
                 (lambda: pipe.step(x, y, scaler=scaler)) if other == "step" else pipe.gather_timeline)
    said = _said(calls[rank])
    pipe.close()
    return said


def disabled_on_one_rank(rank: int) -> dict:
    """A scaler disabled on rank 1 only, in three loops: unscale_ on both ranks; step only on both (torch's disabled
    step never votes); rank 0 unscale_ + step, rank 1 step; then alike scalers (enabled; disabled) still work."""
    pipe = _pipe()
    opt = torch.optim.SGD(pipe.parameters(), lr=0.01)
    x, y = _batch()
    out = {}

    def loop(enabled: bool, unscale: bool) -> str:
        scaler = GradScaler(pipe, init_scale=1024.0, enabled=enabled)

        def body():
            for _ in range(2):
                pipe.step(x, y, scaler=scaler)
                if unscale:
                    scaler.unscale_(opt)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
        said = _said(body)
        opt.zero_grad()
        return said

    out["both unscale_"] = loop(rank == 0, True)
    out["both step"] = loop(rank == 0, False)
    out["unscale_ on 0"] = loop(rank == 0, rank == 0)
    out["disabled on 0"] = loop(rank == 1, True)
    out["all enabled"] = loop(True, True)
    out["all disabled"] = loop(False, True)
    pipe.close()
    return out


BAD_ARGUMENTS = {  # GradScaler keyword arguments -> the ValueError's text
    "init_scale=-1.0": ({"init_scale": -1.0}, "init_scale must be a finite number > 0, got -1.0"),
    "init_scale=0": ({"init_scale": 0}, "init_scale must be a finite number > 0, got 0"),
    "init_scale=inf": ({"init_scale": float("inf")}, "init_scale must be a finite number > 0, got inf"),
    "growth_factor=1.0": ({"growth_factor": 1.0}, "growth_factor must be a finite number > 1, got 1.0"),
    "backoff_factor=1.0": ({"backoff_factor": 1.0},
                           "backoff_factor must be a number between 0 and 1 (both excluded), got 1.0"),
    "backoff_factor=0": ({"backoff_factor": 0}, "backoff_factor must be a number between 0 and 1 (both excluded), got 0"),
    "growth_interval=0": ({"growth_interval": 0}, "growth_interval must be an int >= 1, got 0"),
    "growth_interval=2.0": ({"growth_interval": 2.0}, "growth_interval must be an int >= 1, got 2.0"),
    "enabled=1": ({"enabled": 1}, "enabled must be True or False, got 1"),
}


def bad_arguments(rank: int) -> dict:
    """Every bad GradScaler argument on both ranks (nothing communicated), then an alike scaler still works."""
    pipe = _pipe()
    out = {name: _said(lambda: GradScaler(pipe, **kwargs)) for name, (kwargs, _) in BAD_ARGUMENTS.items()}
    scaler, opt = GradScaler(pipe, init_scale=1024.0), torch.optim.SGD(pipe.parameters(), lr=0.01)
    x, y = _batch()

    def body():
        pipe.step(x, y, scaler=scaler)
        scaler.step(opt)
        scaler.update()
    out["after"] = _said(body)
    pipe.close()
    return out


def replicas(rank: int) -> dict:
    """DP=2 x PP=2 (4 ranks): scalers that differ across the replicas, or within one replica's pipeline; every rank
    of the job raises the same ValueError (the pipeline's own error travels to the other replica in its row of the
    replicas' vote) and the pipeline stays usable."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)])
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, timeout=TIMEOUT, dp_size=2)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.01)
    x, y = _batch()
    replica, out = rank // 2, {}

    def attempt(passed: bool = True, **kwargs) -> str:
        scaler = GradScaler(pipe, **kwargs)

        def body():
            pipe.step(x, y, scaler=scaler if passed else None)
            scaler.step(opt)
            scaler.update()
        said = _said(body)
        opt.zero_grad()
        return said

    out["init_scale by replica"] = attempt(init_scale=1024.0 * (1 + replica))
    out["disabled on world rank 3"] = attempt(init_scale=1024.0, enabled=rank != 3)
    out["disabled on replica 1"] = attempt(init_scale=1024.0, enabled=replica == 0)
    out["no scaler to pipe.step on replica 1"] = attempt(passed=replica == 0, init_scale=1024.0)
    out["alike"] = attempt(init_scale=1024.0)
    pipe.close()
    return out
