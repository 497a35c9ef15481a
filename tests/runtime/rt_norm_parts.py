"""Per-rank bodies of tests/runtime/test_norm_parts.py: anticipated clip_grad_norm_ (runtime/norm_parts.py) against
the unsplit model's torch.nn.utils.clip_grad_norm_ and against the same pipeline with ``anticipate_clip = False``
(every call through the collective), step by step."""
from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F

from pipesched.runtime import GradScaler, Pipeline, PipelineError

from rt_cases import mlp, reference_step

MAX_NORM = 0.05  # below every norm of these models: every call clips


def _twins(build):
    """Two pipelines of the same model (same seed), the second never anticipating, and the unsplit model."""
    model, twin_model = build(), build()
    ref = copy.deepcopy(model)
    return model, twin_model, ref


def _worst(pipe, model, ref) -> float:
    """Largest |grad - reference grad| / max |reference grad| over this rank's parameters (inf: None on one side)."""
    mine, refs = {id(p) for p in pipe.parameters()}, dict(ref.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        if id(p) not in mine:
            continue
        r = refs[name].grad
        if (p.grad is None) != (r is None):
            return math.inf
        if r is not None:
            worst = max(worst, float((p.grad - r).abs().max() / r.abs().max().clamp_min(1e-30)))
    return worst


def _bitwise(pipe, twin) -> bool:
    return all((a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)
               for a, b in zip(pipe.parameters(), twin.parameters()))


def clip_loop(build, schedule, v, m, norm_types, loss_fn=F.mse_loss, data=None, dp_size=1, balance=None,
              touch=None, scale=None, accumulate=1) -> list:
    """``step``, ``clip_grad_norm_(MAX_NORM, norm_type)``, AdamW for each of ``norm_types`` on a pipeline and its
    twin that never anticipates (``anticipate_clip = False``), and torch on the unsplit model.

    ``touch(step, grads_of)``: called on the three models' parameters between the step and the clip (changes the
    gradients). ``scale``: a GradScaler's ``init_scale`` (loss scaling, ``unscale_`` before the clip).
    ``accumulate``: steps on the same batch before each clip (gradients accumulate: the reference's times that,
    exact for 2).
    Returns per step: (anticipated: the call used the step's parts, total, twin's total, torch's total, grads
    after clipping bitwise the twin's, worst relative gradient difference to torch's, weights bitwise the twin's).
    """
    model, twin_model, ref = _twins(build)
    kw = dict(schedule=schedule, num_microbatches=m, loss_fn=loss_fn, virtual_stages=v, dp_size=dp_size,
              balance=balance, timeout=60.0)  # a rank waiting on the other pipeline (a bug) fails in a minute
    pipe, twin = Pipeline(model, **kw), Pipeline(twin_model, **kw)
    pipe.anticipate_clip = True  # opt in; the twin keeps the default (never anticipates)
    opts = [torch.optim.AdamW(p.parameters(), lr=0.01) for p in (pipe, twin, ref)]
    scalers = [GradScaler(p, init_scale=scale) for p in (pipe, twin)] if scale else [None, None]
    out = []
    for k, norm_type in enumerate(norm_types):
        replicas = data(k)  # [(x, y)] per replica
        x, y = replicas[pipe.grid.dp_rank]
        used = pipe._norm_parts.used
        for _ in range(accumulate):
            for p, scaler in zip((pipe, twin), scalers):
                p.step(x, target=y, scaler=scaler)
        _reference(ref, replicas, m, loss_fn)
        for p in ref.parameters():
            if p.grad is not None:
                p.grad.mul_(accumulate)
        if touch is not None:
            touch(k, pipe, twin, ref)
        for opt, scaler in zip(opts, scalers):
            if scaler is not None:
                scaler.unscale_(opt)
        total, twin_total = pipe.clip_grad_norm_(MAX_NORM, norm_type), twin.clip_grad_norm_(MAX_NORM, norm_type)
        ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM, norm_type)
        row = [pipe._norm_parts.used - used, total.item(), twin_total.item(), ref_total.item(), _bitwise(pipe, twin),
               _worst(pipe, model, ref)]
        for opt, scaler in zip(opts, scalers + [None]):
            (scaler.step(opt), scaler.update()) if scaler is not None else opt.step()
            opt.zero_grad()
        row.append(all(torch.equal(a, b) for a, b in zip(pipe.parameters(), twin.parameters())))
        out.append(tuple(row))
    assert twin._norm_parts.used == 0
    pipe.close(), twin.close()
    return out


def _reference(ref, replicas, m, loss_fn) -> None:
    """The unsplit model's gradients of the step, averaged over the replicas' batches."""
    total = {}
    for x, y in replicas:
        ref.zero_grad(set_to_none=True)
        reference_step(ref, x, y, m, loss_fn)
        for name, p in ref.named_parameters():
            if p.grad is not None:
                total[name] = p.grad.clone() if name not in total else total[name] + p.grad
    for name, p in ref.named_parameters():
        p.grad = total[name] / len(replicas) if name in total else None


def mlp_data(replicas=1, rows=4):
    def data(k):
        g = torch.Generator().manual_seed(100 + k)
        return [(torch.randn(rows, 8, generator=g), torch.randn(rows, 8, generator=g)) for _ in range(replicas)]
    return data


SWITCH = (2.0, 2.0, 2.0, math.inf, math.inf, 1.0, 1.0)  # collective, parts, parts, collective, parts, ...


def halve_all(k, pipe, twin, ref) -> None:
    """Every gradient of every rank (and of the twin and the reference) halved in place, on step 1 only."""
    if k == 1:
        for model in (pipe, twin, ref):
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(0.5)


def two_rank_suite(rank) -> dict:
    torch.set_num_threads(1)
    from rt_tied import M, batches, ce, tied_model

    tied_batches = batches(5)
    return {
        "switch": clip_loop(lambda: mlp(num_layers=4, seed=1), "1f1b", None, 2, SWITCH, data=mlp_data()),
        "tied": clip_loop(tied_model, "1f1b", None, M, (2.0, 2.0, math.inf, math.inf, 2.0), loss_fn=ce,
                          data=lambda k: tied_batches[k], balance=[3, 4]),
        "scaler": clip_loop(lambda: mlp(num_layers=4, seed=2), "1f1b", None, 2, (2.0, 2.0, 2.0, math.inf, math.inf),
                            data=mlp_data(), scale=2.0 ** 10),
        "odd_scale": clip_loop(lambda: mlp(num_layers=4, seed=2), "1f1b", None, 2, (2.0, 2.0, 2.0),
                               data=mlp_data(), scale=3.0),
        "all_changed": clip_loop(lambda: mlp(num_layers=4, seed=3), "1f1b", None, 2, (2.0, 2.0, 2.0),
                                 data=mlp_data(), touch=halve_all),
        "accumulate": clip_loop(lambda: mlp(num_layers=4, seed=8), "1f1b", None, 2, (2.0, 2.0, 2.0),
                                data=mlp_data(), accumulate=2),
        "twice": clip_twice(rank),
        "deviations": {name: deviation(rank, name) for name in DEVIATIONS},
    }


def four_rank_suite(rank) -> dict:
    torch.set_num_threads(1)
    return {
        "dp2xpp2": clip_loop(lambda: mlp(num_layers=4, seed=4), "1f1b", None, 2, (2.0, 2.0, math.inf, math.inf),
                             data=mlp_data(replicas=2), dp_size=2),
        "interleaved-p4": clip_loop(lambda: mlp(num_layers=8, seed=5), "interleaved-1f1b", 2, 4,
                                    (2.0, 2.0, math.inf, math.inf), data=mlp_data(rows=8)),
    }


def clip_twice(rank) -> list:
    """After a step that anticipated: two clip calls (the second must not reuse the parts) against torch twice."""
    model = mlp(num_layers=4, seed=6)
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss)
    pipe.anticipate_clip = True
    out = []
    for k in range(2):
        (x, y), = mlp_data()(k)
        for p in pipe.parameters():
            p.grad = None
        ref.zero_grad(set_to_none=True)
        pipe.step(x, target=y)
        reference_step(ref, x, y, 2)
        for max_norm in (MAX_NORM, MAX_NORM):  # the second: by a norm of about MAX_NORM, no parts left
            used = pipe._norm_parts.used
            total = pipe.clip_grad_norm_(max_norm)
            ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
            out.append((pipe._norm_parts.used - used, total.item(), ref_total.item(), _worst(pipe, model, ref)))
    pipe.close()
    return out


# what each rank does between an anticipating step and its clip call: rank 1 alone changes its gradients, or
# passes another max_norm; or rank 0 alone calls clip_grad_norm_. Then every rank calls step().
DEVIATIONS = ("grads_on_one_rank", "max_norm_on_one_rank", "clip_on_one_rank")


def deviation(rank, name) -> dict:
    model = mlp(num_layers=4, seed=7)
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, timeout=60.0)
    pipe.anticipate_clip = True  # the contract these deviations break (the default never anticipates)
    (x, y), = mlp_data()(0)
    pipe.step(x, target=y)
    pipe.clip_grad_norm_(MAX_NORM)  # the collective: the next steps anticipate (MAX_NORM, 2.0)
    pipe.step(x, target=y)
    anticipated = pipe._norm_parts.rows is not None
    error = "no error"
    try:
        if name == "grads_on_one_rank" and rank == 1:
            next(pipe.parameters()).grad.mul_(2.0)
        if name != "clip_on_one_rank" or rank == 0:
            pipe.clip_grad_norm_(MAX_NORM * (2 if name == "max_norm_on_one_rank" and rank == 1 else 1))
        pipe.step(x, target=y)
    except PipelineError as exc:
        error = exc.cause
    except Exception as exc:  # noqa: BLE001 - the test checks the type
        error = f"{type(exc).__name__}: {exc}"
    return {"anticipated": anticipated, "error": error}
