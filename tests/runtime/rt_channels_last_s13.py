"""Per-rank bodies of tests/runtime/test_channels_last_s13.py: a small CNN converted with
``model.to(memory_format=torch.channels_last)``, fed channels_last images, trained with a Pipeline on 2 ranks (and
DP 2 x PP 2 on 4) against the same model unsplit, one microbatch at a time. Each case returns, per step, plain
values (names of what differs, bools, hex floats) so the test can state what it expects."""
from __future__ import annotations

import copy
import dataclasses
import os

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import GradScaler, Pipeline, load_checkpoint, profile_layers, save_checkpoint

from rt_cases import reference_forward, reference_step

CL = torch.channels_last
M = 4  # microbatches


def cnn(seed: int = 0, tied: bool = False, frozen: bool = False) -> nn.Sequential:
    """Conv, BN, ReLU, Conv, ReLU, Conv, BN, ReLU, pool, Flatten, Linear (11 layers), converted to channels_last
    (the 4-D conv weights become channels_last; 1-D parameters and the Linear stay as they are). ``tied``: layer 5's
    weight is layer 3's; ``frozen``: layer 0's bias does not require a gradient (stays ``None``)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                          nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)).to(memory_format=CL)
    if tied:
        model[5].weight = model[3].weight
    if frozen:
        model[0].bias.requires_grad_(False)
    return model


def data(step: int, n: int = 8):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(n, 3, 8, 8, generator=g).contiguous(memory_format=CL), torch.randn(n, 4, generator=g)


def local_names(pipe, model) -> list[str]:
    ids = {id(p) for p in pipe.parameters()}
    return [n for n, p in model.named_parameters() if id(p) in ids]


def grads_report(pipe, model, ref) -> dict:
    """This rank's parameters against the unsplit model's: names whose ``.grad`` differs in value (bitwise), in
    strides, or in being ``None``."""
    mine, refs = dict(model.named_parameters()), dict(ref.named_parameters())
    out = {"value": [], "stride": [], "none": [], "rel": 0.0}
    for n in local_names(pipe, model):
        a, b = mine[n].grad, refs[n].grad
        if (a is None) != (b is None):
            out["none"].append(n)
        elif a is not None:
            if not torch.equal(a, b):
                out["value"].append(n)
                out["rel"] = max(out["rel"], float((a - b).abs().max() / b.abs().max()))
            if a.stride() != b.stride():
                out["stride"].append(n)
    return out


def tensors_report(pipe, ref) -> dict:
    """This rank's parameters and buffers (``pipe.state_dict()``) against the unsplit model's: names that differ in
    value (bitwise) or strides."""
    theirs = ref.state_dict()
    out = {"value": [], "stride": []}
    for n, t in pipe.state_dict().items():
        if not torch.equal(t, theirs[n]):
            out["value"].append(n)
        if t.stride() != theirs[n].stride():
            out["stride"].append(n)
    return out


def opt_state_report(pipe, model, opt, ref, ref_opt) -> dict:
    """Optimizer state tensors (momentum_buffer, exp_avg, exp_avg_sq) of this rank's parameters: names/keys whose
    value or strides differ from the unsplit model's optimizer's, and how many were compared."""
    mine, refs = dict(model.named_parameters()), dict(ref.named_parameters())
    out = {"value": [], "stride": [], "count": 0}
    for n in local_names(pipe, model):
        s, r = opt.state.get(mine[n], {}), ref_opt.state.get(refs[n], {})
        if sorted(s) != sorted(r):
            out["value"].append((n, "keys"))
            continue
        for key, value in s.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            out["count"] += 1
            if not torch.equal(value, r[key]):
                out["value"].append(f"{n}:{key}")
            if value.stride() != r[key].stride():
                out["stride"].append(f"{n}:{key}")
    return out


def make_opt(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def train(rank, schedule="1f1b", recompute=False, opt_kind="sgd", fusion=False, tied=False, frozen=False,
          set_to_none=True, steps=3, balance=None, forward=False, profile=False):
    """``steps`` steps of the Pipeline and the unsplit model on the same data; per step, after backward: the loss
    (bitwise), the gradient report; after the optimizer step: parameters/buffers and optimizer state reports."""
    model = cnn(0, tied, frozen)
    ref = copy.deepcopy(model)
    v = 2 if schedule == "zbv" else None
    options = {}
    if profile:
        x0, y0 = data(99)
        measured = profile_layers(model, x0[:2], target=y0[:2], loss_fn=F.mse_loss, repeat=1, warmup=0)
        fixed = tuple(float(1 + i % 3) for i in range(len(model)))  # the same on every rank (measured ones differ)
        times = {f.name: (fixed if f.name in ("forward", "input_grad", "weight_grad") else (0.0,) * len(model))
                 for f in dataclasses.fields(measured) if f.name.endswith(("forward", "grad", "_fixed"))}
        options = {"balance": "time", "profile": dataclasses.replace(measured, **times)}
        out_profile = tensors_report_all(model, ref)
    elif balance is not None:
        options = {"balance": balance}
    pipe = Pipeline(model, schedule=schedule, virtual_stages=v, num_microbatches=M, loss_fn=F.mse_loss,
                    recompute=recompute, gradient_accumulation_fusion=fusion, timeout=60.0, **options)
    opt, ref_opt = make_opt(opt_kind, pipe.parameters()), make_opt(opt_kind, ref.parameters())
    rows, names = [], local_names(pipe, model)
    for step in range(steps):
        x, y = data(step)
        loss, ref_loss = pipe.step(x, target=y), reference_step(ref, x, y, M)
        row = {"loss": torch.equal(loss, ref_loss), "grads": grads_report(pipe, model, ref),
               "grad_none": [n for n, p in model.named_parameters() if n in names and p.grad is None],
               "strides": {n: (p.stride(), p.grad.stride()) for n, p in model.named_parameters()
                           if n in names and p.dim() == 4 and p.grad is not None}}
        opt.step(), ref_opt.step()
        opt.zero_grad(set_to_none=set_to_none), ref_opt.zero_grad(set_to_none=set_to_none)
        row["none_after_zero"] = [n for n, p in model.named_parameters() if n in names and p.grad is None]
        row["after"] = tensors_report(pipe, ref)
        row["opt"] = opt_state_report(pipe, model, opt, ref, ref_opt)
        rows.append(row)
    out = {"rows": rows, "names": local_names(pipe, model)}
    if profile:
        out["profile"] = out_profile
    if forward:
        x, _ = data(50)
        got, want = pipe.forward(x), reference_forward(ref, x, M)  # the reference on every rank: its BN updates
        if got is not None:
            out["forward"] = (torch.equal(got, want), got.stride() == want.stride())
        out["forward_after"] = tensors_report(pipe, ref)  # training-mode BN: running stats updated by forward()
    pipe.close()
    return out


def tensors_report_all(model, ref) -> dict:
    """Every parameter/buffer of ``model`` against ``ref``'s: names differing in value or strides."""
    theirs = ref.state_dict()
    out = {"value": [], "stride": []}
    for n, t in model.state_dict().items():
        if not torch.equal(t, theirs[n]):
            out["value"].append(n)
        if t.stride() != theirs[n].stride():
            out["stride"].append(n)
    return out


def clip(rank):
    """Each step: pipe.clip_grad_norm_(0.05) against torch's on the unsplit model: the norm's relative difference,
    the clipped gradients' largest relative difference and strides, then SGD."""
    model = cnn(0)
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=M, loss_fn=F.mse_loss, timeout=60.0)
    opt, ref_opt = make_opt("sgd", pipe.parameters()), make_opt("sgd", ref.parameters())
    rows = []
    mine, refs = dict(model.named_parameters()), dict(ref.named_parameters())
    for step in range(2):
        x, y = data(step)
        pipe.step(x, target=y), reference_step(ref, x, y, M)
        total = pipe.clip_grad_norm_(0.05)
        ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        names = local_names(pipe, model)
        scale = max(float(refs[n].grad.abs().max()) for n in names)  # relative to this rank's largest gradient: a
        # bias feeding a BatchNorm has a gradient of 0 up to rounding, whose own relative difference means nothing
        rows.append({"norm_rel": abs(float(total) - float(ref_total)) / float(ref_total),
                     "grad_rel": max(float((mine[n].grad - refs[n].grad).abs().max()) for n in names) / scale,
                     "stride": [n for n in names if mine[n].grad.stride() != refs[n].grad.stride()]})
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        rows[-1]["param_stride"] = tensors_report(pipe, ref)["stride"]
    pipe.close()
    return rows


def scaler(rank):
    """float16 autocast + GradScaler(init 1024) and Adam, 3 steps, against torch.amp.GradScaler on the unsplit model
    under the same autocast: loss, unscaled gradients, weights, optimizer state."""
    model = cnn(0)
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=M, loss_fn=F.mse_loss, autocast=torch.float16,
                    timeout=60.0)
    opt, ref_opt = make_opt("adam", pipe.parameters()), make_opt("adam", ref.parameters())
    sc = GradScaler(pipe, init_scale=1024.0, growth_interval=2)
    ref_sc = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    rows = []
    for step in range(3):
        x, y = data(step)
        loss = pipe.step(x, target=y, scaler=sc)
        n = x.shape[0]
        total = None
        for xm, ym in zip(x.split(n // M), y.split(n // M)):
            with torch.autocast("cpu", dtype=torch.float16):
                lm = F.mse_loss(ref(xm), ym) * (xm.shape[0] / n)
            ref_sc.scale(lm).backward()
            total = lm.detach() if total is None else total + lm.detach()
        sc.unscale_(opt), ref_sc.unscale_(ref_opt)
        row = {"loss": torch.equal(loss, total), "grads": grads_report(pipe, model, ref)}
        sc.step(opt), ref_sc.step(ref_opt)
        sc.update(), ref_sc.update()
        opt.zero_grad(), ref_opt.zero_grad()
        row.update(after=tensors_report(pipe, ref), opt=opt_state_report(pipe, model, opt, ref, ref_opt),
                   scale=(sc.get_scale(), ref_sc.get_scale()))
        rows.append(row)
    pipe.close()
    return rows


def checkpoint(rank, root):
    """Adam, 2 steps, save_checkpoint; a new Pipeline over another model (seed 5, channels_last) loads it: layouts of
    parameters and optimizer state against the unsplit model's after 2 steps; then 2 more steps against the unsplit
    model trained 4 steps without interruption."""
    model = cnn(0)
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=M, loss_fn=F.mse_loss, timeout=60.0)
    opt, ref_opt = make_opt("adam", pipe.parameters()), make_opt("adam", ref.parameters())
    for step in range(2):
        x, y = data(step)
        pipe.step(x, target=y), reference_step(ref, x, y, M)
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    path = save_checkpoint(os.path.join(root, "ckpt"), pipe, opt, step=2)
    pipe.close()
    model2 = cnn(5)
    pipe2 = Pipeline(model2, schedule="1f1b", num_microbatches=M, loss_fn=F.mse_loss, timeout=60.0)
    opt2 = make_opt("adam", pipe2.parameters())
    load_checkpoint(path, pipe2, opt2)
    out = {"loaded": tensors_report(pipe2, ref), "loaded_opt": opt_state_report(pipe2, model2, opt2, ref, ref_opt),
           "rows": [], "strides": {n: (p.stride(), opt2.state[p]["exp_avg"].stride(), opt2.state[p]["exp_avg_sq"].stride())
                                   for n, p in model2.named_parameters() if n in local_names(pipe2, model2)
                                   and p.dim() == 4}}
    for step in range(2, 4):
        x, y = data(step)
        loss, ref_loss = pipe2.step(x, target=y), reference_step(ref, x, y, M)
        row = {"loss": torch.equal(loss, ref_loss), "grads": grads_report(pipe2, model2, ref)}
        opt2.step(), ref_opt.step()
        opt2.zero_grad(), ref_opt.zero_grad()
        row.update(after=tensors_report(pipe2, ref), opt=opt_state_report(pipe2, model2, opt2, ref, ref_opt))
        out["rows"].append(row)
    pipe2.close()
    return out


def suite2(rank, root):
    out = {}
    for key, kw in {"1f1b-sgd": {}, "1f1b-adam-zeros": {"opt_kind": "adam", "set_to_none": False},
                    "1f1b-recompute": {"recompute": True}, "zb-h1": {"schedule": "zb-h1", "opt_kind": "adam"},
                    "zb-h1-fusion": {"schedule": "zb-h1", "fusion": True},
                    "zbv": {"schedule": "zbv", "opt_kind": "adam", "forward": True},
                    "zbv-recompute": {"schedule": "zbv", "recompute": True},
                    "frozen": {"frozen": True, "forward": True},
                    "tied": {"tied": True, "balance": [4, 7], "steps": 2},
                    "time": {"profile": True, "steps": 2}}.items():
        out[key] = train(rank, **kw)
    out["clip"] = clip(rank)
    out["scaler"] = scaler(rank)
    out["checkpoint"] = checkpoint(rank, root)
    return out


# ---- DP 2 x PP 2 -------------------------------------------------------------------------------------------------

def replica_zero_model() -> nn.Sequential:
    """What replica 0 holds: world rank 0 (seed 100) built stage 0's layers, world rank 1 (seed 101) stage 1's."""
    a, b = cnn(100), cnn(101)
    return nn.Sequential(*[a[i] if i < 4 else b[i] for i in range(11)])


def dp_body(rank):
    """Seed = world rank (replica copy at construction), balance [4, 7], SGD momentum, 3 steps, each replica on its
    half of 16 rows: right after construction, parameters' strides; per step, gradients (the average of both
    halves' as the all-reduce gives) and weights bitwise against the unsplit model built from replica 0's values,
    running statistics against that model run on this replica's half only."""
    model = cnn(100 + rank)
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, dp_size=2, balance=[4, 7],
                    timeout=60.0)
    ref = replica_zero_model()
    out = {"init": tensors_report(pipe, ref), "rows": [], "dp_rank": pipe.grid.dp_rank}
    opt, ref_opt = make_opt("sgd", pipe.parameters()), make_opt("sgd", ref.parameters())
    params = [p for p in ref.parameters()]
    bufs = [copy.deepcopy(dict(ref.named_buffers())) for _ in range(2)]  # each replica's running statistics
    k = pipe.grid.dp_rank
    for step in range(3):
        x, y = data(step, 16)
        pipe.step(x[8 * k:8 * (k + 1)], target=y[8 * k:8 * (k + 1)])
        halves = []
        for h in range(2):
            with torch.no_grad():
                for n, b in ref.named_buffers():
                    b.copy_(bufs[h][n])
            reference_step(ref, x[8 * h:8 * (h + 1)], y[8 * h:8 * (h + 1)], 2)
            bufs[h] = copy.deepcopy(dict(ref.named_buffers()))
            halves.append([p.grad for p in params])
            for p in params:
                p.grad = None
        for p, g0, g1 in zip(params, *halves):
            p.grad = (g0 + g1) / 2  # same layout as each half's (elementwise)
        with torch.no_grad():
            for n, b in ref.named_buffers():
                b.copy_(bufs[k][n])
        row = {"grads": grads_report(pipe, model, ref)}
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        row.update(after=tensors_report(pipe, ref), opt=opt_state_report(pipe, model, opt, ref, ref_opt))
        out["rows"].append(row)
    pipe.close()
    return out


class Maybe(nn.Module):
    """A conv used only when the batch's mean is positive (data-dependent: one replica's data may skip it)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x):
        return self.conv(x) if bool(x.mean() > 0) else x


def dp_skipped(rank):
    """DP 2 x PP 2, balance [2, 4]: replica 0's images are positive (uses layer 0's conv), replica 1's negative
    (skips it). The data-parallel all-reduce gives both replicas that conv's gradient: per rank, the strides of
    each 4-D parameter's ``.grad`` and of its SGD momentum buffer, and the gradient's value."""
    torch.manual_seed(0)
    model = nn.Sequential(Maybe(), nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(8, 4)).to(memory_format=CL)
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=1, loss_fn=F.mse_loss, dp_size=2, balance=[2, 4],
                    timeout=60.0)
    opt = make_opt("sgd", pipe.parameters())
    k = pipe.grid.dp_rank
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(2, 3, 8, 8, generator=g).abs(), torch.randn(2, 4, generator=g)
    x = (x if k == 0 else -x).contiguous(memory_format=CL)
    pipe.step(x, target=y)
    names = local_names(pipe, model)
    out = {"dp_rank": k, "pp_rank": pipe.grid.pp_rank,
           "grads": {n: p.grad.clone() for n, p in model.named_parameters() if n in names},
           "grad_strides": {n: p.grad.stride() for n, p in model.named_parameters() if n in names and p.dim() == 4}}
    opt.step()
    out["momentum_strides"] = {n: opt.state[p]["momentum_buffer"].stride() for n, p in model.named_parameters()
                               if n in names and p.dim() == 4}
    pipe.close()
    return out


def suite4(rank):
    return {"dp": dp_body(rank), "skipped": dp_skipped(rank)}
