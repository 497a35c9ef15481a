"""Per-rank bodies of tests/runtime/test_scaler_no_params.py (4 spawned gloo ranks): float16 autocast with a
GradScaler on a pipeline where some ranks hold no parameters (``opt = None`` there, README "A rank without
parameters"), running README's loop on every rank, against the unsplit model with torch.amp.GradScaler."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import GradScaler, Pipeline, PipelineError

from rt_amp import WIDTH, Boom, data, mine, reference_step, snapshot, unchanged

WORLD = 4


def _model(seed: int = 0) -> nn.Sequential:
    """Linear, Boom, Tanh, Linear, Tanh, Linear, Tanh, Linear, Tanh (Boom: overflow in its backward while armed)."""
    torch.manual_seed(seed)
    layers = [nn.Linear(WIDTH, WIDTH), Boom()]
    for i in range(4):
        layers += [nn.Tanh()] + ([nn.Linear(WIDTH, WIDTH)] if i < 3 else [])
    return nn.Sequential(*layers)


# pp=2 x dp=2: stage 1 is [Tanh] (pipeline rank 1 of both replicas holds nothing); pp=4, interleaved, 8 stages:
# stage 0 = [Linear, Boom], then one layer each: ranks 1 and 3 hold only Tanh stages
LAYOUTS = {"pp2xdp2": dict(schedule="1f1b", dp_size=2, balance=[8, 1]),
           "pp4-interleaved": dict(schedule="interleaved-1f1b", virtual_stages=2, balance=[2] + [1] * 7)}


def documented_loop(rank, layout, paramless="none", steps=4):
    """README's loop on every rank, ``opt = None`` where the rank holds no parameters: ``paramless="none"`` calls
    ``scaler.unscale_(opt)``, ``pipe.clip_grad_norm_``, ``scaler.step(opt)``, ``scaler.update()`` there too;
    ``"step only"`` (no unscale_, no clipping): ``scaler.step(opt)`` alone joins the vote, then ``update()``
    (``update()`` alone on a rank ends every rank: tests/runtime/test_one_rank_fault_collectives.py). Boom armed
    in step 2 (an overflow on the rank holding stage 0 only).
    Per step: skipped (weights bitwise unchanged), this rank's scale and the reference's, weights bitwise equal
    to the reference's (every replica gets the same batch: the average is the unsplit gradient)."""
    model = _model()
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, num_microbatches=4, loss_fn=F.mse_loss, autocast=torch.float16, **LAYOUTS[layout])
    params = list(pipe.parameters())
    opt = torch.optim.Adam(params, lr=0.01) if params else None
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    scaler = GradScaler(pipe, init_scale=1024.0, growth_interval=2)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    out = {"params": len(params), "steps": [], "errors": []}
    for step, (x, y) in enumerate(data(steps), start=1):
        model[1].armed = ref[1].armed = step == 2
        pipe.step(x, target=y, scaler=scaler)
        reference_step(ref, x, y, 4, torch.float16, ref_scaler)
        before = snapshot(pipe)
        if paramless == "none":
            scaler.unscale_(opt)
            pipe.clip_grad_norm_(1e9)  # collective, on every rank; never clips (coefficient 1): gradients bitwise
            ref_scaler.unscale_(ref_opt), torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
        scaler.step(opt)
        ref_scaler.step(ref_opt)
        scaler.update(), ref_scaler.update()
        refs = dict(ref.named_parameters())
        out["steps"].append({"skipped": unchanged(pipe, before) if params else None, "scale": scaler.get_scale(),
                             "ref_scale": ref_scaler.get_scale(),
                             "weights": all(torch.equal(p, refs[n]) for n, p in mine(pipe, model).items())})
        if opt is not None:
            opt.zero_grad()
        ref_opt.zero_grad()
    pipe.close()
    return out


def none_on_a_rank_with_parameters(rank):
    """pp=4 (1f1b, one Linear/Tanh each): pipeline rank 0 passes opt=None although it holds parameters: refused
    (they would be neither unscaled nor checked), on every rank."""
    pipe = Pipeline(_model(), schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, autocast=torch.float16,
                    balance=[3, 2, 2, 2])
    params = list(pipe.parameters())
    opt = torch.optim.SGD(params, lr=0.1) if params and rank != 0 else None
    scaler = GradScaler(pipe, init_scale=1024.0)
    x, y = data(1)[0]
    pipe.step(x, target=y, scaler=scaler)
    try:
        scaler.unscale_(opt)
    except PipelineError as exc:
        return {"rank": exc.rank, "cause": exc.cause}
    return "no error"


def suite(rank):
    out = {(layout, paramless): documented_loop(rank, layout, paramless)
           for layout in LAYOUTS for paramless in ("none", "step only")}
    out["misuse"] = none_on_a_rank_with_parameters(rank)
    return out
