"""Per-rank bodies of tests/runtime/test_s15_hunt.py (2 spawned gloo ranks): settings changed between steps
that the step's own bookkeeping must follow, checked against the unsplit model bitwise."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline

from rt_cases import reference_step
from rt_workers import _data


def _grads(pipe, model, ref):
    """(this rank's parameters, whether each one's .grad is the unsplit model's: both None or bitwise equal)."""
    mine = {id(p) for p in pipe.parameters()}
    ref_params = dict(ref.named_parameters())
    pairs = [(p.grad, ref_params[name].grad) for name, p in model.named_parameters() if id(p) in mine]
    return len(pairs), all((a is None) == (b is None) and (a is None or torch.equal(a, b)) for a, b in pairs)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))  # cut: [0, 1] | [2, 3]


def input_grad_between_steps(rank, schedule, frozen=False):
    """Steps whose x needs no gradient, then one, then none: x.grad as the unsplit model's (bitwise; None on the
    ranks without stage 0) and parameter gradients bitwise, each step. ``frozen``: stage 0 has no trainable
    parameters, so x.requires_grad alone decides whether stage 0's output requires grad."""
    model = _model()
    if frozen:
        for p in [*model[0].parameters(), *model[1].parameters()]:
            p.requires_grad_(False)
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, schedule=schedule, num_microbatches=2, loss_fn=F.mse_loss, timeout=60)
    out = []
    for step, wants in enumerate((False, True, False)):
        x, y = _data(step)
        x_ref = x.clone().requires_grad_(wants)
        x.requires_grad_(wants)
        loss = pipe.step(x, target=y)
        ref_loss = reference_step(ref, x_ref, y, 2)
        grads_equal = x.grad is None if rank else (x.grad is None) == (x_ref.grad is None) and (
            x.grad is None or torch.equal(x.grad, x_ref.grad))
        count, equal = _grads(pipe, model, ref)
        out.append((bool(torch.equal(loss, ref_loss)), bool(grads_equal), count, equal))
        model.zero_grad(), ref.zero_grad()
    pipe.close()
    return out


def inplace_set_later(rank, schedule, recompute=False):
    """``inplace=True`` set on stage 1's first layer (an nn.ReLU) after the Pipeline was built: the stage gets a
    copy of its input, as one built that way does; loss and gradients bitwise the unsplit model's."""
    model = _model()
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, schedule=schedule, num_microbatches=2, loss_fn=F.mse_loss, recompute=recompute,
                    timeout=60)
    out = []
    for step in range(2):
        if step == 1:
            model[2].inplace = ref[2].inplace = True
        x, y = _data(step)
        loss = pipe.step(x, target=y)
        ref_loss = reference_step(ref, x, y, 2)
        count, equal = _grads(pipe, model, ref)
        out.append((bool(torch.equal(loss, ref_loss)), count, equal))
        model.zero_grad(), ref.zero_grad()
    pipe.close()
    return out


def suite(rank):
    out = {}
    for schedule in ("1f1b", "zbv"):
        out[f"input-grad-{schedule}"] = input_grad_between_steps(rank, schedule)
        out[f"input-grad-frozen-{schedule}"] = input_grad_between_steps(rank, schedule, frozen=True)
        out[f"inplace-later-{schedule}"] = inplace_set_later(rank, schedule)
    out["inplace-later-recompute"] = inplace_set_later(rank, "gpipe", recompute=True)
    return out
