"""Per-rank body of tests/runtime/test_one_rank_bad_call.py (2 ranks, 1f1b, m=2): a call that one rank alone gets
wrong -- its own checks before the step's opening fail on that rank only (a bad ``scaler=``, no ``loss_fn``) or it
passes a bad target, calls under ``torch.no_grad()``, calls ``forward()`` -- is refused on every rank alike,
through the opening all-gather, and the next correct step runs and gives the unsplit model's loss."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from pipesched.runtime import GradScaler, Pipeline

from rt_cases import mlp, outcome, reference_forward, reference_step

M = 2
TIMEOUT = 60.0  # a rank left waiting would raise its own timeout error (naming itself), which the test refuses


def _batch(seed: int, rows: int = 8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 8, generator=g), torch.randn(rows, 8, generator=g)


def bad_calls(rank):
    """Each case: rank 1 alone passes the bad value (rank 0 a correct one), then a correct step on both ranks.
    Returns ``{"cases": {name: (outcome, next step's loss, the unsplit model's loss)}, ...}``."""
    model = mlp(num_layers=4)
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=M, loss_fn=F.mse_loss, timeout=TIMEOUT)
    other = Pipeline(mlp(num_layers=4, seed=1), schedule="1f1b", num_microbatches=M, loss_fn=F.mse_loss,
                     timeout=TIMEOUT)
    bare_model = mlp(num_layers=4, seed=2)  # loss_fn None on rank 1 only: construction allows it (not agreed)
    bare = Pipeline(copy.deepcopy(bare_model), schedule="1f1b", num_microbatches=M,
                    loss_fn=None if rank == 1 else F.mse_loss, timeout=TIMEOUT)
    scaler = GradScaler(pipe)  # rank 0 passes it in the refused "torch scaler" step: that step must not count
    x, y = _batch(1)
    bad = rank == 1

    def no_grad_step():
        with torch.no_grad() if bad else torch.enable_grad():
            pipe.step(x, y)

    def autocast_step():
        with torch.autocast("cpu", torch.bfloat16, enabled=bad):
            pipe.step(x, y)

    cases = {
        "torch scaler": lambda: pipe.step(x, y, scaler=torch.amp.GradScaler("cpu") if bad else scaler),
        "another pipeline's scaler": lambda: pipe.step(x, y, scaler=GradScaler(other) if bad else None),
        "no loss_fn": lambda: bare.step(x, y),
        "no target": lambda: pipe.step(x, None if bad else y),
        "target not a tensor": lambda: pipe.step(x, "abc" if bad else y),
        "target batch size": lambda: pipe.step(x, y[:3] if bad else y),
        "gradients disabled": no_grad_step,
        "forward instead of step": lambda: pipe.forward(x) if bad else pipe.step(x, y),
        "x on rank 1 only": lambda: pipe.step(x if bad else None, y),
        "bad scalers on both ranks": lambda: pipe.step(x, y, scaler=GradScaler(other) if bad else
                                                       torch.amp.GradScaler("cpu")),
        "torch scaler on both ranks": lambda: pipe.step(x, y, scaler=torch.amp.GradScaler("cpu")),
        # arguments that do not fit step()'s signature: Python's TypeError, carried in the opening (misfit.py)
        "misspelled keyword": lambda: pipe.step(x, target=y, targets=y) if bad else pipe.step(x, y),
        "one argument too many": lambda: pipe.step(x, y, None, 5) if bad else pipe.step(x, y),
        "forward() misspelled keyword": lambda: pipe.forward(x, batch=x) if bad else pipe.forward(x),
        "autocast on rank 1 only": autocast_step,
    }
    out = {"cases": {}}
    for k, (name, call) in enumerate(cases.items()):
        result = outcome(call)
        untouched = all(p.grad is None for p in pipe.parameters())  # a refused step does no work
        xs, ys = _batch(10 + k)
        loss = None
        try:
            loss = float(pipe.step(xs, ys))
        except Exception as exc:  # noqa: BLE001 - the pipeline must stay usable
            loss = f"{type(exc).__name__}: {exc}"
        expected = float(reference_step(ref, xs, ys, M))
        for p in list(pipe.parameters()) + list(ref.parameters()):
            p.grad = None
        out["cases"][name] = (result, untouched, loss, expected)
    # the scaler counted no refused step: a scaled step on both ranks, then its collective step agrees
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)

    def scaled():
        pipe.step(x, y, scaler=scaler)
        scaler.step(opt)
        scaler.update()

    out["scaled step"] = (outcome(scaled), scaler.scaled_steps)
    try:  # the pipeline whose step was refused stays usable: its forward() gives the unsplit model's output
        output = bare.forward(x)
        want = reference_forward(bare_model, x, M)
        out["bare forward"] = output is None if rank == 0 else bool(torch.allclose(output, want, rtol=1e-6,
                                                                                   atol=1e-7))
    except Exception as exc:  # noqa: BLE001 - recorded for the test to judge
        out["bare forward"] = f"{type(exc).__name__}: {exc}"
    for p in (bare, other, pipe):
        p.close()
    return out
