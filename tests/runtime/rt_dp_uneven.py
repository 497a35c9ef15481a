"""Workers for test_dp_uneven.py: data-parallel replicas given different batch sizes (one batch split unevenly
across replicas) against the unsplit model on the whole batch; equal replica batches against the pre-fix
weighting (n / N in backward), bitwise."""
from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F
from torch import nn

import pipesched.runtime.step_run as step_run
from pipesched.runtime import Pipeline

import rt_loop_silent as R

#: (schedule, v, m, recompute, split_backward)
SCHEDULES = (("1f1b", 1, 2, False, False), ("zbv", 2, 2, True, False), ("1f1b", 1, 3, True, True),
             ("dualpipev", 2, 2, False, False))
SUM_MSE = functools.partial(F.mse_loss, reduction="sum")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[R._lin() for _ in range(4)])


def _whole_batch_loss(ref, x, y, loss_fn, rows, m):
    """sum over every replica's microbatches of loss_fn * n / N_all (the whole-batch mean for a mean loss)."""
    from pipesched.runtime.microbatch import split_sizes
    total, start, out = sum(rows), 0, 0.0
    for n_r in rows:
        for n in split_sizes(n_r, m):
            out = out + loss_fn(ref(x[start:start + n]), y[start:start + n]) * (n / total)
            start += n
    return out


def uneven(rank, pp, spec, steps, loss_fn=F.mse_loss):
    """``steps``: per step, the rows of each replica (replica k gets the k-th slice of one batch). The pipeline
    accumulates over the steps; the reference sums the whole batches' gradients."""
    torch.set_num_threads(1)
    schedule, v, m, recompute, split = spec
    model = _model()
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, schedule=schedule, virtual_stages=v, num_microbatches=m, loss_fn=loss_fn,
                    dp_size=len(steps[0]), recompute=recompute, split_backward=split, timeout=60.0)
    replica = torch.distributed.get_rank() // pp
    losses = []
    for k, rows in enumerate(steps):
        x, y = R._x_y("f", sum(rows), seed=70 + k)
        start = sum(rows[:replica])
        mine = slice(start, start + rows[replica])
        loss = pipe.step(x[mine], target=y[mine])
        own = _whole_batch_loss(ref, x[mine], y[mine], loss_fn, [rows[replica]], m)  # the replica's own loss
        losses.append((loss, own.detach()))
        _whole_batch_loss(ref, x, y, loss_fn, rows, m).backward()
    res = {"losses": losses, "grads": R._compare(model, ref, pipe)}
    pipe.close()
    return res


def equal_vs_before(rank, pp, spec, rows):
    """Equal replica batches: the fixed step's gradients and loss against the same step with backward weighted
    n / N as before the fix (``loss_weights`` patched to it), on two copies of one model."""
    torch.set_num_threads(1)
    schedule, v, m, recompute, split = spec
    out = {}
    for name, patched in (("now", None), ("before", lambda sizes, replicas: [n / sum(sizes) for n in sizes])):
        model = _model()
        saved = step_run.loss_weights
        if patched is not None:
            step_run.loss_weights = patched
        try:
            pipe = Pipeline(model, schedule=schedule, virtual_stages=v, num_microbatches=m, loss_fn=F.mse_loss,
                            dp_size=2, recompute=recompute, split_backward=split, timeout=60.0)
            replica = torch.distributed.get_rank() // pp
            x, y = R._x_y("f", 2 * rows, seed=90)
            loss = pipe.step(x[replica * rows:(replica + 1) * rows], target=y[replica * rows:(replica + 1) * rows])
            out[name] = (loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
            pipe.close()
        finally:
            step_run.loss_weights = saved
    return out
