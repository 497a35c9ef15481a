"""Ranks for test_measured_tail.py: measured ALL_REDUCE / TIE_REDUCE events span until their result was awaited
(dp=2 x pp=1; ties on pp=2), and timeline() / gather_timeline() after a failed step."""
import time

import torch
import torch.nn.functional as F

from pipesched.runtime import Pipeline, PipelineError

from rt_cases import mlp
from rt_tied import batches, ce, tied_model

SLOW_S = 0.05  # the slow replica's (rank's) sleep per call: the other's collective must wait for it


def _sleep(*_):
    time.sleep(SLOW_S)


def dp_tail(rank):
    """dp=2, pp=1, 1f1b m=4: replica 1 sleeps before each of its forwards in the second step, so replica 0's
    ALL_REDUCE waits for replica 1's start of it."""
    pipe = Pipeline(mlp(num_layers=4, width=16), schedule="1f1b", num_microbatches=4, loss_fn=F.mse_loss, dp_size=2)
    torch.manual_seed(1)
    x, y = torch.randn(16, 16), torch.randn(16, 16)
    pipe.step(x, target=y)  # the first step pays autograd's start-up
    if pipe.grid.dp_rank == 1:
        pipe.stages[0].register_forward_pre_hook(_sleep)
    start = time.perf_counter()
    pipe.step(x, target=y)
    wall = time.perf_counter() - start
    out = {"dp_rank": pipe.grid.dp_rank, "program": str(pipe.program), "wall": wall,
           "wall0": pipe._records["step"].wall0, "local": pipe.timeline().to_json_dict()}
    pipe.close()
    return out


def _slow_backward(module, grad_input, grad_output):
    time.sleep(SLOW_S)


def tie_tail(rank):
    """pp=2 with the embedding tied to the head: pipeline rank 0's backwards are slow, so rank 1's TIE_REDUCE waits
    for rank 0's start of it."""
    model = tied_model()
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=4, loss_fn=ce)
    (x0, y0), = batches(1)[0]
    pipe.step(x0, target=y0)
    if pipe.pp_rank == 0:
        model[1].register_full_backward_hook(_slow_backward)
    start = time.perf_counter()
    pipe.step(x0, target=y0)
    wall = time.perf_counter() - start
    out = {"program": str(pipe.program), "wall": wall, "gathered": pipe.gather_timeline().to_json_dict()}
    pipe.close()
    return out


def failed_step(rank):
    """pp=2: a good step, then rank 1's stage raises at F1.2 of the second step; what timeline() and
    gather_timeline() (each kind) do afterwards."""
    pipe = Pipeline(mlp(num_layers=2, width=16), schedule="1f1b", num_microbatches=4, loss_fn=F.mse_loss,
                    timeout=30.0)
    torch.manual_seed(1)
    x, y = torch.randn(16, 16), torch.randn(16, 16)
    pipe.step(x, target=y)
    pipe.forward(x)
    before = {"step": len(pipe.timeline().events), "forward": len(pipe.timeline(kind="forward").events)}
    calls = {"n": 0}

    def boom(module, args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise ValueError("boom")

    if rank == 1:
        pipe.stages[1].register_forward_pre_hook(boom)
    out = {"before": before}
    try:
        pipe.step(x, target=y)
    except PipelineError as exc:
        out["step"] = str(exc)
    for name, call in (("timeline", pipe.timeline), ("gather_timeline", pipe.gather_timeline)):
        for kind in ("step", "forward"):
            try:
                call(kind=kind)
                out[(name, kind)] = "returned"
            except PipelineError as exc:
                out[(name, kind)] = (type(exc).__name__, exc.instr, exc.cause, str(exc))
    return out


def suite(rank):
    return {"dp": dp_tail(rank), "ties": tie_tail(rank), "failed": failed_step(rank)}
