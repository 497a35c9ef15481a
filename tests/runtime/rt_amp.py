"""Per-rank bodies of tests/runtime/test_amp.py (2 ranks) and test_amp_dp.py (DP=2 x PP=2): autocast and
dynamic loss scaling against the unsplit model run under the same ``torch.autocast`` and ``torch.amp.GradScaler``."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import GradScaler, Pipeline, PipelineError

from rt_cases import mlp

WIDTH = 16
# (schedule, virtual stages, recompute)
CASES = (("1f1b", 1, False), ("interleaved-1f1b", 2, False), ("1f1b", 1, True), ("interleaved-1f1b", 2, True))


def sizes_of(n: int, m: int) -> list[int]:
    base, extra = divmod(n, m)
    return [base + 1 if i < extra else base for i in range(m)]


def reference_step(model, x, y, m, dtype, scaler=None, loss_fn=F.mse_loss):
    """The unsplit model, microbatch by microbatch: each forward and loss under ``torch.autocast(x's device, dtype)``,
    its backward outside, of ``loss_i * n_i / N`` (times the scale when ``scaler`` is given). Returns the loss."""
    n, total = x.shape[0], None
    sizes = sizes_of(n, m)
    for xm, ym, size in zip(x.split(sizes), y.split(sizes), sizes):
        with torch.autocast(x.device.type, dtype=dtype):
            loss = loss_fn(model(xm), ym) * (size / n)
        (loss if scaler is None else scaler.scale(loss)).backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total


def mine(pipe, model) -> dict:
    """{name: parameter} of this rank's parameters, by their names in the unsplit model."""
    ids = {id(p) for p in pipe.parameters()}
    return {n: p for n, p in model.named_parameters() if id(p) in ids}


def grads_equal(pipe, model, ref) -> bool:
    refs = dict(ref.named_parameters())
    return all(p.grad is not None and torch.equal(p.grad, refs[n].grad) for n, p in mine(pipe, model).items())


def weights_equal(pipe, model, ref) -> bool:
    refs = dict(ref.named_parameters())
    return all(torch.equal(p, refs[n]) for n, p in mine(pipe, model).items())


def data(steps: int, n: int = 8, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g)) for _ in range(steps)]


# ---- autocast -----------------------------------------------------------------------------------------

def autocast_matches(rank, schedule, v, recompute, dtype=torch.bfloat16):
    """Three AdamW steps under ``autocast=dtype``: per step the loss and every gradient bitwise those of the
    unsplit model under the same autocast per microbatch; what loss_fn saw; parameter dtypes; weights after."""
    model = mlp(num_layers=8, width=WIDTH)
    ref = copy.deepcopy(model)
    seen = []

    def loss_fn(out, target):  # records whether it runs under autocast, and the dtype it gets
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), out.dtype))
        return F.mse_loss(out, target)

    pipe = Pipeline(model, schedule=schedule, num_microbatches=4, loss_fn=loss_fn, virtual_stages=v,
                    recompute=recompute, autocast=dtype)
    opt, ref_opt = torch.optim.AdamW(pipe.parameters(), lr=0.01), torch.optim.AdamW(ref.parameters(), lr=0.01)
    steps, dtypes = [], set()
    for x, y in data(3):
        loss = pipe.step(x, target=y)
        ref_loss = reference_step(ref, x, y, 4, dtype)
        steps.append((bool(torch.equal(loss, ref_loss)), loss.dtype, grads_equal(pipe, model, ref)))
        dtypes |= {(str(p.dtype), str(p.grad.dtype)) for p in pipe.parameters()}
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    out = {"steps": steps, "weights": weights_equal(pipe, model, ref), "loss_fn": sorted(set(seen)),
           "param_dtypes": sorted(dtypes)}
    pipe.close()
    return out


def forward_under_autocast(rank):
    """forward() under autocast=bfloat16: the unsplit model's no-grad autocast output, bitwise, in bfloat16."""
    model = mlp(num_layers=4, width=WIDTH)
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=4, autocast=torch.bfloat16)
    x, _ = data(1)[0]
    out = pipe.forward(x)
    pipe.close()
    if out is None:
        return None
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expect = torch.cat([model(xm) for xm in x.split(sizes_of(8, 4))])
    return out.dtype, bool(torch.equal(out, expect))


def message_bytes(rank):
    """The bytes each SEND put on the wire in the second step (shapes known: no header), float32 and bfloat16."""
    out = {}
    for dtype in (None, torch.bfloat16):
        pipe = Pipeline(mlp(num_layers=4, width=WIDTH), schedule="1f1b", num_microbatches=4, loss_fn=F.mse_loss,
                        autocast=dtype)
        x, y = data(1)[0]
        pipe.step(x, target=y)
        first = dict(pipe.timeline().meta["message_bytes"])
        pipe.step(x, target=y)
        out[str(dtype)] = {"learning": first, "local": dict(pipe.timeline().meta["message_bytes"]),
                           "gathered": dict(pipe.gather_timeline().meta["message_bytes"])}
        pipe.close()
    return out


def bad_autocast(rank):
    """autocast=torch.float32 on every rank: a ValueError before any communication."""
    try:
        Pipeline(mlp(num_layers=4, width=WIDTH), schedule="1f1b", num_microbatches=2, autocast=torch.float32)
    except ValueError as exc:
        return str(exc)
    return "no error"


def mismatched_autocast(rank):
    """Rank 0 asks for bfloat16, rank 1 for none: the construction check names autocast on every rank."""
    try:
        Pipeline(mlp(num_layers=4, width=WIDTH), schedule="1f1b", num_microbatches=2,
                 autocast=torch.bfloat16 if rank == 0 else None)
    except ValueError as exc:
        return str(exc)
    return "no error"


# ---- loss scaling ---------------------------------------------------------------------------------------

class _TimesHuge(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by 1e38: inf (or nan) in any float dtype."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 1e38


class Boom(nn.Module):
    """Identity; while ``armed``, its backward overflows: the gradients of the layers before it become inf/nan."""

    def __init__(self):
        super().__init__()
        self.armed = False

    def forward(self, x):
        return _TimesHuge.apply(x) if self.armed else x


def boom_model(seed: int = 0) -> nn.Sequential:
    """Linear+Tanh, Boom, then 6 x (Linear+Tanh): 8 layers; Boom is in stage 0 for p=2 (v=1: layers 0-3;
    v=2: layers 0-1), the first stage: its overflow reaches no other stage's gradients."""
    blocks = list(mlp(num_layers=7, width=WIDTH, seed=seed))
    return nn.Sequential(blocks[0], Boom(), *blocks[1:])


def snapshot(pipe):
    return [p.detach().clone() for p in pipe.parameters()]


def unchanged(pipe, before) -> bool:
    return all(torch.equal(p, b) for p, b in zip(pipe.parameters(), before))


def local_overflow(pipe) -> bool:
    return any(not bool(torch.isfinite(p.grad).all()) for p in pipe.parameters() if p.grad is not None)


def scaler_steps(rank, schedule, v, recompute, fused=False, clip=False):
    """float16 autocast with GradScaler(init 1024, growth interval 2) over 4 Adam steps, Boom armed in step 2;
    the unsplit model runs the same with torch.amp.GradScaler. Per step on this rank: the loss bitwise, this
    rank's own inf check before the agreement, whether the step was skipped (weights bitwise unchanged), the
    scale after update(), the reference's scale, gradients (after unscale_) and weights bitwise equal to the
    reference's. ``fused``: Adam(fused=True), whose step checks the gradients itself (no unscale_ called);
    ``clip``: unscale_ then pipe.clip_grad_norm_ (torch's clip_grad_norm_ on the reference) in step 4."""
    model = boom_model()
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, schedule=schedule, num_microbatches=4, loss_fn=F.mse_loss, virtual_stages=v,
                    recompute=recompute, autocast=torch.float16)
    opt = torch.optim.Adam(pipe.parameters(), lr=0.01, fused=fused)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01, fused=fused)
    scaler = GradScaler(pipe, init_scale=1024.0, growth_interval=2)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    out = []
    for step, (x, y) in enumerate(data(4), start=1):
        model[1].armed = ref[1].armed = step == 2
        loss = pipe.step(x, target=y, scaler=scaler)
        ref_loss = reference_step(ref, x, y, 4, torch.float16, ref_scaler)
        row = {"loss": bool(torch.equal(loss, ref_loss)), "overflow_here": local_overflow(pipe)}
        if not fused:
            scaler.unscale_(opt), ref_scaler.unscale_(ref_opt)
            row["grads"] = grads_equal(pipe, model, ref) if step != 2 else None
        if clip and step == 4:
            total = pipe.clip_grad_norm_(1e-3)
            ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3)
            row["clip_total_rel"] = abs(float(total) - float(ref_total)) / float(ref_total)
        before = snapshot(pipe)
        scaler.step(opt), ref_scaler.step(ref_opt)
        scaler.update(), ref_scaler.update()
        row.update(skipped=unchanged(pipe, before), scale=scaler.get_scale(), ref_scale=ref_scaler.get_scale())
        if clip and step == 4:  # clipped gradients agree to rounding (the norm is summed in another order)
            refs = dict(ref.named_parameters())
            row["weights_rel"] = max(float((p - refs[n]).abs().max() / refs[n].abs().max())
                                     for n, p in mine(pipe, model).items())
        else:
            row["weights"] = weights_equal(pipe, model, ref)
        opt.zero_grad(), ref_opt.zero_grad()
        out.append(row)
    pipe.close()
    return out


def scaler_misuse(rank):
    """The scaler passed to pipe.step on rank 0 only; a torch.amp.GradScaler; another Pipeline's scaler; a
    GradScaler of something else: each a clear error (the first on every rank, at scaler.step)."""
    model = boom_model()
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, autocast=torch.float16)
    other = Pipeline(boom_model(), schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    scaler = GradScaler(pipe)
    x, y = data(1)[0]
    out = {}
    for name, call in (("torch scaler", lambda: pipe.step(x, y, scaler=torch.amp.GradScaler("cpu"))),
                       ("other pipe", lambda: pipe.step(x, y, scaler=GradScaler(other))),
                       ("not a pipe", lambda: GradScaler(model))):
        try:
            call()
            out[name] = "no error"
        except (TypeError, ValueError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    pipe.step(x, y, scaler=scaler if rank == 0 else None)
    try:
        scaler.step(opt)
        out["one rank"] = "no error"
    except ValueError as exc:
        out["one rank"] = str(exc)
    never = GradScaler(pipe)
    pipe.step(x, y)
    try:
        never.step(opt)
        out["never"] = "no error"
    except ValueError as exc:
        out["never"] = str(exc)
    out["usable"] = float(pipe.step(x, y)) > 0  # the pipeline is still usable
    other.close(), pipe.close()
    return out


def unscale_fails_on_one_rank(rank):
    """Stage 1 holds a float16 layer: torch's unscale_ refuses its float16 gradients on rank 1 only; rank 0 must
    end with a PipelineError naming rank 1 at once, not wait in the agreement until the timeout."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH).half())
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, autocast=torch.float16,
                    timeout=120.0)
    scaler, opt = GradScaler(pipe), torch.optim.SGD(pipe.parameters(), lr=0.1)
    x, y = data(1)[0]
    pipe.step(x, y, scaler=scaler)
    try:
        scaler.step(opt)
        return "no error"
    except PipelineError as exc:
        return str(exc)


def suite(rank):
    results = {}
    for schedule, v, recompute in CASES:
        results[("bf16", schedule, recompute)] = autocast_matches(rank, schedule, v, recompute)
        results[("scaler", schedule, recompute)] = scaler_steps(rank, schedule, v, recompute)
    results[("fp16 autocast", "1f1b", False)] = autocast_matches(rank, "1f1b", 1, False, torch.float16)
    results["fused"] = scaler_steps(rank, "1f1b", 1, False, fused=True)
    results["clip"] = scaler_steps(rank, "interleaved-1f1b", 2, False, clip=True)
    results["forward"] = forward_under_autocast(rank)
    results["bytes"] = message_bytes(rank)
    results["bad"] = bad_autocast(rank)
    results["mismatch"] = mismatched_autocast(rank)
    results["misuse"] = scaler_misuse(rank)
    results["unscale fails"] = unscale_fails_on_one_rank(rank)
    return results


# ---- DP = 2 x PP = 2 ------------------------------------------------------------------------------------

def dp_scaler(rank, poison_rank=3):
    """p=2 x dp=2, float16 autocast, GradScaler; SGD. Step 2: after pipe.step, world rank ``poison_rank`` alone
    writes an inf into one of its gradients (after the data-parallel all-reduce: no other rank sees it), as a
    user's gradient hook or an overflow in its own processing would. Every rank must skip that step and halve
    its scale; the other steps update like the unsplit model on the whole batch (8 microbatches, the same
    GradScaler sequence), within rounding (replicas average their halves), and the replicas stay bitwise equal."""
    model = mlp(num_layers=4, width=WIDTH)
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=4, loss_fn=F.mse_loss, dp_size=2, autocast=torch.float16)
    opt, ref_opt = torch.optim.SGD(pipe.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = GradScaler(pipe, init_scale=1024.0, growth_interval=2)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    shard = slice(8 * pipe.grid.dp_rank, 8 * (pipe.grid.dp_rank + 1))
    out = []
    for step, (x, y) in enumerate(data(3, n=16), start=1):
        pipe.step(x[shard], target=y[shard], scaler=scaler)
        reference_step(ref, x, y, 8, torch.float16, ref_scaler)
        if step == 2:
            if dist.get_rank() == poison_rank:
                next(iter(pipe.parameters())).grad.view(-1)[0] = float("inf")
            ref[0][0].weight.grad.view(-1)[0] = float("inf")  # the reference skips too
        row = {"overflow_here": local_overflow(pipe)}
        before = snapshot(pipe)
        scaler.step(opt), ref_scaler.step(ref_opt)
        scaler.update(), ref_scaler.update()
        refs = dict(ref.named_parameters())
        row.update(skipped=unchanged(pipe, before), scale=scaler.get_scale(), ref_scale=ref_scaler.get_scale(),
                   weights_rel=max(float((p - refs[n]).abs().max() / refs[n].abs().max())
                                   for n, p in mine(pipe, model).items()))
        opt.zero_grad(), ref_opt.zero_grad()
        out.append(row)
    weights = [p.detach().clone() for p in pipe.parameters()]
    pipe.close()
    return {"layout": (pipe.grid.pp_rank, pipe.grid.dp_rank), "steps": out, "weights": weights}


def one_gpu(rank):
    """p=1 on cuda:0 (test_amp.py, with a GPU): bf16 autocast bitwise as the unsplit model; a float16 GradScaler on
    the device skips an overflowing step and halves its scale (the agreement runs over NCCL groups of one)."""
    device = torch.device("cuda", 0)
    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        model = boom_model().to(device)
        ref = copy.deepcopy(model)
        pipe = Pipeline(model, schedule="1f1b", num_microbatches=4, loss_fn=F.mse_loss, autocast=dtype)
        scaler = GradScaler(pipe, init_scale=1024.0)
        ref_scaler = torch.amp.GradScaler("cuda", init_scale=1024.0)
        opt, ref_opt = torch.optim.SGD(pipe.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
        rows = []
        for step, (x, y) in enumerate(data(2), start=1):
            x, y = x.to(device), y.to(device)
            model[1].armed = ref[1].armed = step == 2
            loss = pipe.step(x, target=y, scaler=scaler)
            ref_loss = reference_step(ref, x, y, 4, dtype, ref_scaler)
            before = snapshot(pipe)
            scaler.step(opt), ref_scaler.step(ref_opt), scaler.update(), ref_scaler.update()
            rows.append((bool(torch.equal(loss, ref_loss)), unchanged(pipe, before), scaler.get_scale(),
                         weights_equal(pipe, model, ref)))
            opt.zero_grad(), ref_opt.zero_grad()
        out[str(dtype)] = rows
        pipe.close()
    return out


def dp_suite(rank):
    return {"dp": dp_scaler(rank)}
