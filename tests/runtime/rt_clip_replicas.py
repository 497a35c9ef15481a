"""Per-rank bodies of tests/runtime/test_clip_replicas.py: Pipeline.clip_grad_norm_'s arguments agreed over every
rank of the job (data-parallel replicas too) and error_if_nonfinite / foreach compared like max_norm and norm_type,
on the collective path and after a step that anticipated the call (``anticipate_clip = True``)."""
from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F

from pipesched.runtime import Pipeline

from rt_cases import mlp, reference_step
from rt_clipping import compare

M = 2  # microbatches per replica


def _data(replicas: int, nan: bool = False):
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(2 * M * replicas, 8, generator=g), torch.randn(2 * M * replicas, 8, generator=g)
    if nan:
        x[0, 0] = math.nan  # every gradient of every stage becomes nan
    return x, y


def _step(pipe, model, ref, replicas: int, nan: bool = False) -> None:
    """One step on replica k's shard of the batch; the unsplit model on the whole batch (``replicas * M``
    microbatches); every gradient reset first on both."""
    for net in (model, ref):
        for p in net.parameters():
            p.grad = None
    x, y = _data(replicas, nan)
    shard = slice(2 * M * pipe.grid.dp_rank, 2 * M * (pipe.grid.dp_rank + 1))
    pipe.step(x[shard], target=y[shard])
    reference_step(ref, x, y, M * replicas)


def _build(dp_size: int, anticipate: bool = False):
    model = mlp(num_layers=4)
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=M, loss_fn=F.mse_loss, dp_size=dp_size,
                    timeout=60.0)  # a rank left waiting (a bug) fails in a minute, not five
    pipe.anticipate_clip = anticipate
    return pipe, model, ref


def _bits(pipe) -> list:
    """Every gradient's bit pattern (``torch.equal`` is False on nan)."""
    return [None if p.grad is None else p.grad.view(torch.int32).clone() for p in pipe.parameters()]


def _same_bits(a: list, b: list) -> bool:
    return len(a) == len(b) and all((x is None and y is None) or (x is not None and y is not None
                                                                   and torch.equal(x, y)) for x, y in zip(a, b))


def attempt(pipe, **kw) -> tuple:
    """``clip_grad_norm_(**kw)``: (exception type or None, its message or the total, gradients bitwise unchanged)."""
    before = _bits(pipe)
    try:
        got = (None, pipe.clip_grad_norm_(**kw).item())
    except Exception as exc:  # noqa: BLE001 - the type is the result
        got = (type(exc).__name__, str(exc))
    return (*got, _same_bits(before, _bits(pipe)))


def against_torch(pipe, model, ref, factor: float = 3.0, max_norm: float | None = None) -> dict:
    """A correct call on every rank, ``max_norm`` = the unsplit model's norm / ``factor`` (or as given), against
    torch's ``clip_grad_norm_`` on the unsplit model."""
    if max_norm is None:
        max_norm = float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])) / factor
    total = pipe.clip_grad_norm_(max_norm).item()
    ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm).item()
    count, nones, _, worst = compare(pipe, model, ref)
    return {"total": total, "ref": ref_total, "count": count, "nones": nones, "worst": worst}


def replica_cases(rank: int) -> dict:
    """dp=2 x pp=2, every call through the collective (the default): one rank or one replica passes other
    arguments, each case on the same pipeline after one step; then a correct call and another step."""
    pipe, model, ref = _build(2)
    _step(pipe, model, ref, 2)
    replica1 = rank >= 2
    cases = {
        "refusal on world rank 2": dict(max_norm=-1.0 if rank == 2 else 1e-3),
        "refusals on world ranks 3 and 1": dict(max_norm=1e-3, norm_type=-2.0 if rank in (1, 3) else 2.0),
        "max_norm by replica": dict(max_norm=1e-3 if replica1 else 1.0),
        "norm_type by replica": dict(max_norm=1.0, norm_type="inf" if replica1 else 2.0),
        "error_if_nonfinite by replica": dict(max_norm=1.0, error_if_nonfinite=replica1),
        "foreach by replica": dict(max_norm=1.0, foreach=False if replica1 else None),
        "max_norm on world rank 3": dict(max_norm=0.5 if rank == 3 else 1.0),
    }
    out = {name: attempt(pipe, **kw) for name, kw in cases.items()}
    out["then"] = against_torch(pipe, model, ref)
    _step(pipe, model, ref, 2)  # the ranks are still in step (same count of clip calls everywhere)
    out["then again"] = against_torch(pipe, model, ref, factor=2.0)
    pipe.close()
    return out


def anticipated_replica_cases(rank: int) -> dict:
    """dp=2 x pp=2 with ``anticipate_clip = True``: a step whose gradients are nan, then error_if_nonfinite by
    replica (every rank had the step's parts, every rank sees a nan total: all take the collective); then a clean
    step and a call that uses the step's parts; last, max_norm by replica after an anticipating step (replica 1
    takes the collective, replica 0 the step's parts): every rank raises by the next step."""
    pipe, model, ref = _build(2, anticipate=True)
    out = {}
    _step(pipe, model, ref, 2)
    out["first"] = against_torch(pipe, model, ref)  # the collective; the next steps anticipate this max_norm
    _step(pipe, model, ref, 2, nan=True)
    wanted = pipe._norm_parts.wanted[0]
    used = pipe._norm_parts.used
    out["error_if_nonfinite by replica"] = attempt(pipe, max_norm=wanted, error_if_nonfinite=rank >= 2)
    out["error_if_nonfinite everywhere"] = attempt(pipe, max_norm=wanted, error_if_nonfinite=True)
    out["used nan parts"] = pipe._norm_parts.used - used
    _step(pipe, model, ref, 2)
    max_norm = pipe._norm_parts.wanted[0]
    out["anticipated"] = against_torch(pipe, model, ref, max_norm=max_norm)
    out["used parts"] = pipe._norm_parts.used - used
    _step(pipe, model, ref, 2)
    clip = attempt(pipe, max_norm=1e-3 if rank >= 2 else max_norm)
    try:
        _step(pipe, model, ref, 2)
        stepped = (None, "no error")
    except Exception as exc:  # noqa: BLE001 - the type is the result
        stepped = (type(exc).__name__, str(exc))
    out["max_norm by replica"] = {"clip": clip[:2], "step": stepped}
    pipe.close()
    return out


def pipeline_cases(rank: int) -> dict:
    """pp=2 (one replica): error_if_nonfinite and foreach by rank, with a nan gradient on rank 1 (the trial's
    case) on the collective path and after an anticipating step whose gradients are all nan; then a correct call."""
    pipe, model, ref = _build(1, anticipate=True)
    _step(pipe, model, ref, 1)
    saved = _bits(pipe)
    if rank == 1:
        next(iter(pipe.parameters())).grad[0, 0] = math.nan
    out = {"error_if_nonfinite by rank": attempt(pipe, max_norm=1.0, error_if_nonfinite=rank == 0),
           "foreach by rank": attempt(pipe, max_norm=1.0, foreach=True if rank == 0 else False)}
    for p, bits in zip(pipe.parameters(), saved):
        p.grad = bits.view(torch.float32).clone()
    out["first"] = against_torch(pipe, model, ref)  # the collective: the next steps anticipate this max_norm
    _step(pipe, model, ref, 1, nan=True)
    used = pipe._norm_parts.used
    out["anticipated error_if_nonfinite by rank"] = attempt(pipe, max_norm=pipe._norm_parts.wanted[0],
                                                             error_if_nonfinite=rank == 1)
    out["used nan parts"] = pipe._norm_parts.used - used
    _step(pipe, model, ref, 1)
    out["then"] = against_torch(pipe, model, ref, max_norm=pipe._norm_parts.wanted[0])  # the step's parts
    out["used parts"] = pipe._norm_parts.used - used
    pipe.close()
    return out
