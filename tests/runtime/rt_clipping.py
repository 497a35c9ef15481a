"""Per-rank bodies of tests/runtime/test_clipping.py: Pipeline.clip_grad_norm_ against the unsplit model's
torch.nn.utils.clip_grad_norm_ (norm types 2, 1, 3.5, inf; DP x PP; gradients None; nan and inf; bad arguments;
closed and failed pipelines)."""
from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline, PipelineError

from rt_cases import mlp, reference_step

NORM_TYPES = (2.0, 1.0, 3.5, math.inf)


def _grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _restore(model, saved: dict) -> None:
    for n, p in model.named_parameters():
        p.grad = saved[n].clone() if n in saved else None


def _norm(params, norm_type) -> float:
    return float(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], norm_type))


def compare(pipe, model, ref) -> tuple[int, list, bool, float]:
    """This rank's parameters against the unsplit model's: (count, names whose .grad is None here and there,
    all bitwise equal, largest |difference| / max |reference| over the tensors); a None on one side only: inf."""
    mine, refs = {id(p) for p in pipe.parameters()}, dict(ref.named_parameters())
    count, nones, bitwise, worst = 0, [], True, 0.0
    for name, p in model.named_parameters():
        if id(p) not in mine:
            continue
        count, r = count + 1, refs[name].grad
        if p.grad is None or r is None:
            nones += [name] if p.grad is None and r is None else []
            worst = worst if p.grad is None and r is None else math.inf
            continue
        bitwise &= torch.equal(p.grad, r)
        worst = max(worst, float((p.grad - r).abs().max() / r.abs().max().clamp_min(1e-30)))
    return count, sorted(nones), bitwise, worst


def clip_against_reference(pipe, model, ref, factor: float, norm_types=NORM_TYPES) -> dict:
    """After one step: for each norm type, from the step's gradients again, clip with ``max_norm`` = the
    unsplit model's unclipped norm / ``factor`` on both. {norm_type: what this rank saw}."""
    saved, ref_saved = _grads(model), _grads(ref)
    out = {}
    for norm_type in norm_types:
        _restore(model, saved), _restore(ref, ref_saved)
        max_norm = _norm(ref.parameters(), norm_type) / factor
        local = _norm(pipe.parameters(), norm_type)  # what torch's function on pipe.parameters() would use
        total = pipe.clip_grad_norm_(max_norm, norm_type)
        ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
        count, nones, bitwise, worst = compare(pipe, model, ref)
        out[norm_type] = {"total": total.item(), "ref": ref_total.item(), "local": local,
                          "form": (tuple(total.shape), total.dtype, str(total.device), total.requires_grad),
                          "count": count, "nones": nones, "bitwise": bitwise, "worst": worst}
    return out


def stepped(rank, schedule, v, num_layers=8, dp_size=1, m=4, seed=0):
    """A pipeline and the unsplit model after one step on the same batch (DP: replica k on shard k, the
    reference on the whole batch as ``dp_size * m`` microbatches)."""
    model = mlp(num_layers=num_layers, seed=seed)
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, schedule=schedule, num_microbatches=m, loss_fn=F.mse_loss, virtual_stages=v,
                    dp_size=dp_size)
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(2 * m * dp_size, 8, generator=g), torch.randn(2 * m * dp_size, 8, generator=g)
    shard = slice(2 * m * pipe.grid.dp_rank, 2 * m * (pipe.grid.dp_rank + 1))
    pipe.step(x[shard], target=y[shard])
    reference_step(ref, x, y, m * dp_size)
    return pipe, model, ref


def clip_cases(rank, schedule, v, **kw) -> dict:
    pipe, model, ref = stepped(rank, schedule, v, **kw)
    out = {"clipped": clip_against_reference(pipe, model, ref, factor=3.0),
           "unclipped": clip_against_reference(pipe, model, ref, factor=0.5, norm_types=(2.0, math.inf)),
           "layout": (pipe.program.num_ranks, pipe.program.dp_size)}
    pipe.close()
    return out


def training_loop(rank, steps=3) -> list:
    """step, clip, AdamW, zero_grad x ``steps`` on 1F1B: losses and weights stay with the unsplit model's."""
    model = mlp(num_layers=4, seed=1)
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss)
    opt, ref_opt = torch.optim.AdamW(pipe.parameters(), lr=0.05), torch.optim.AdamW(ref.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
        loss, ref_loss = pipe.step(x, target=y), reference_step(ref, x, y, 2)
        total = pipe.clip_grad_norm_(0.05)
        ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        mine, refs = {id(p) for p in pipe.parameters()}, dict(ref.named_parameters())
        worst = max(float((p - refs[n]).detach().abs().max()) for n, p in model.named_parameters() if id(p) in mine)
        out.append((abs(loss.item() - ref_loss.item()) / ref_loss.item(), abs(total.item() - ref_total.item())
                    / ref_total.item(), ref_total.item() > 0.05, worst))
    pipe.close()
    return out


class Detach(nn.Module):
    def forward(self, x):
        return x.detach()


def none_grads(rank) -> dict:
    """Linear, Linear | Detach, Linear(frozen), Linear on 2 ranks: rank 0's gradients are all None, and the
    frozen layer's too; torch skips them, so must the pipeline."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), Detach(), nn.Linear(8, 8), nn.Linear(8, 8))
    model[3].requires_grad_(False)
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, balance=[2, 3])
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    pipe.step(x, target=y)
    reference_step(ref, x, y, 2)
    out = clip_against_reference(pipe, model, ref, factor=3.0, norm_types=(2.0, math.inf))
    pipe.close()
    return out


class ToFloat32(nn.Module):
    def forward(self, x):
        return x.float()


def mixed_dtypes(rank) -> dict:
    """Linear (float64), ToFloat32 | Linear (float32): torch's norm over both is float64 (the promotion of the
    per-tensor norms' dtypes), which rank 1 alone (float32 gradients) cannot know."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8).double(), ToFloat32(), nn.Linear(8, 8))
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, balance=[2, 1])
    x, y = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8)
    pipe.step(x, target=y)
    reference_step(ref, x, y, 2)
    out = clip_against_reference(pipe, model, ref, factor=3.0, norm_types=(2.0, math.inf))
    pipe.close()
    return out


def _bits(grads: dict) -> dict:
    """Bit patterns of float32 gradients (``torch.equal`` is False on nan)."""
    return {n: g.view(torch.int32).clone() for n, g in grads.items()}


def nonfinite(rank) -> dict:
    """After a step, one gradient on the LAST stage only is set to nan (then inf): what every rank's
    clip_grad_norm_ returns or raises, against torch's on the unsplit model with the same gradient."""
    pipe, model, ref = stepped(rank, "1f1b", 1, num_layers=4, m=2)
    saved, ref_saved = _grads(model), _grads(ref)
    target = "3.0.weight"  # the last stage's (rank 1's) first Linear
    out = {}
    for bad in (math.nan, math.inf):
        for norm_type in (2.0, math.inf):
            _restore(model, saved), _restore(ref, ref_saved)
            for net in (model, ref):
                param = dict(net.named_parameters())[target]
                if param.grad is not None:  # in ``model``: on the rank holding the last stage only
                    param.grad[0, 0] = bad
            before = _bits(_grads(model))
            try:
                pipe.clip_grad_norm_(1.0, norm_type, error_if_nonfinite=True)
                raised = "no error"
            except RuntimeError as exc:
                raised = str(exc)
            unscaled = all(torch.equal(before[n], b) for n, b in _bits(_grads(model)).items())
            total = pipe.clip_grad_norm_(1.0, norm_type)  # error_if_nonfinite=False: torch returns it and scales
            ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0, norm_type)
            out[(str(bad), norm_type)] = {"raised": raised, "unscaled": unscaled, "total": total.item(),
                                          "ref": ref_total.item()}
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    out["usable"] = math.isfinite(pipe.step(x, target=y).item())
    pipe.close()
    return out


BAD = ({"max_norm": 0.0}, {"max_norm": -1}, {"max_norm": "1.0"}, {"max_norm": math.nan}, {"max_norm": True},
       {"max_norm": 1.0, "norm_type": 0}, {"max_norm": 1.0, "norm_type": -2.0},
       {"max_norm": 1.0, "norm_type": -math.inf}, {"max_norm": 1.0, "norm_type": "two"},
       {"max_norm": 1.0, "norm_type": None}, {"max_norm": 1.0, "error_if_nonfinite": "yes"},
       {"max_norm": 1.0, "foreach": 1}, {"max_norm": torch.tensor([1.0])}, {"max_norm": torch.tensor(True)},
       {"max_norm": torch.tensor(-1.0)})


def bad_arguments(rank) -> dict:
    """Each bad argument: the message every rank raises; then a valid call still equals the reference
    (the ranks stayed in step: nothing was communicated), and ``norm_type='inf'`` is torch's inf."""
    pipe, model, ref = stepped(rank, "1f1b", 1, num_layers=4, m=2)
    out = {}
    for kwargs in BAD:
        try:
            pipe.clip_grad_norm_(**kwargs)
            out[repr(kwargs)] = ("no error", "")
        except Exception as exc:  # noqa: BLE001 - the test checks the type
            out[repr(kwargs)] = (type(exc).__name__, str(exc))
    total = pipe.clip_grad_norm_(max_norm=1e9, norm_type="inf")
    out["valid"] = (total.item(), torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9, "inf").item())
    pipe.close()
    return out


class FailOnce(nn.Module):
    """Raises on its first call on this rank when armed."""

    def __init__(self, armed: bool):
        super().__init__()
        self.armed = armed

    def forward(self, x):
        if self.armed:
            self.armed = False
            raise ArithmeticError("forced failure")
        return x


def closed_and_broken(rank) -> dict:
    """clip_grad_norm_ on a closed pipeline and on one whose last step failed: the error step() gives."""
    out = {}
    pipe, _, _ = stepped(rank, "1f1b", 1, num_layers=2, m=2)
    pipe.close()
    for name, call in (("step", lambda: pipe.step(torch.ones(2, 8), target=torch.ones(2, 8))),
                       ("clip", lambda: pipe.clip_grad_norm_(1.0))):
        try:
            call()
            out[("closed", name)] = "no error"
        except Exception as exc:  # noqa: BLE001
            out[("closed", name)] = f"{type(exc).__name__}: {exc}"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), FailOnce(armed=rank == 1), nn.Linear(8, 8))
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, balance=[1, 2], timeout=30.0)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    try:
        pipe.step(x, target=y)
        out["failed"] = "no error"
    except PipelineError:
        out["failed"] = "PipelineError"
    for name, call in (("step", lambda: pipe.step(x, target=y)), ("clip", lambda: pipe.clip_grad_norm_(1.0))):
        try:
            call()
            out[("broken", name)] = "no error"
        except Exception as exc:  # noqa: BLE001
            out[("broken", name)] = f"{type(exc).__name__}: {exc}"
    return out


# each rank's arguments, by pipeline rank: ranks that disagree must all raise, gradients unchanged
MISMATCHED = {"norm_type": ({"max_norm": 1.0, "norm_type": 2.0}, {"max_norm": 1.0, "norm_type": "inf"}),
              "max_norm": ({"max_norm": 1e-3}, {"max_norm": 1e3}),
              "max_norm, a tensor": ({"max_norm": torch.tensor(1e-3)}, {"max_norm": 1e-2})}


def mismatched_and_tensor(rank) -> dict:
    """Ranks passing different ``max_norm`` / ``norm_type`` (MISMATCHED): what each raises and whether its gradients
    stayed bitwise; then a 0-dim tensor ``max_norm`` (as torch takes it) against torch on the unsplit model:
    {norm_type: what this rank saw} as :func:`clip_against_reference`."""
    pipe, model, ref = stepped(rank, "1f1b", 1, num_layers=4, m=2)
    out = {}
    for name, per_rank in MISMATCHED.items():
        before = _grads(model)
        try:
            pipe.clip_grad_norm_(**per_rank[pipe.pp_rank])
            out[name] = ("no error", "", None)
        except Exception as exc:  # noqa: BLE001 - the test checks the type
            after = _grads(model)
            out[name] = (type(exc).__name__, str(exc), all(torch.equal(before[n], after[n]) for n in before))
    saved, ref_saved = _grads(model), _grads(ref)
    for norm_type in (2.0, math.inf):
        _restore(model, saved), _restore(ref, ref_saved)
        max_norm = torch.tensor(_norm(ref.parameters(), norm_type) / 3.0)
        total = pipe.clip_grad_norm_(max_norm, norm_type)
        ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
        count, nones, bitwise, worst = compare(pipe, model, ref)
        out[("tensor", norm_type)] = {"total": total.item(), "ref": ref_total.item(), "count": count,
                                      "worst": worst, "max_norm": max_norm.item()}
    pipe.close()
    return out


def tied(rank) -> dict:
    """Embedding (rank 0) tied to the head (rank 1), plus one weight shared by three layers across both ranks
    (rt_tied.tied_model): each tied parameter counted once in the total norm."""
    from rt_tied import M, batches, ce, tied_model

    model = tied_model()
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=M, loss_fn=ce, balance=[3, 4])
    (x, y), = batches(1)[0]
    pipe.step(x, target=y)
    reference_step(ref, x, y, M, ce)
    out = clip_against_reference(pipe, model, ref, factor=3.0, norm_types=(2.0, 1.0, math.inf))
    pipe.close()
    return out


def two_rank_suite(rank) -> dict:
    return {"tied": tied(rank), "1f1b": clip_cases(rank, "1f1b", 1), "interleaved-1f1b": clip_cases(rank, "interleaved-1f1b", 2),
            "loop": training_loop(rank), "none": none_grads(rank), "dtypes": mixed_dtypes(rank),
            "nonfinite": nonfinite(rank), "bad": bad_arguments(rank), "closed_and_broken": closed_and_broken(rank),
            "mismatched": mismatched_and_tensor(rank)}


def four_rank_suite(rank) -> dict:
    return {"dp2xpp2": clip_cases(rank, "1f1b", 1, dp_size=2),
            "interleaved-p4": clip_cases(rank, "interleaved-1f1b", 2)}


def cuda_case(rank) -> dict:
    """One rank on the GPU (its pipeline group is NCCL): the reduction runs on the device; the norm is a CUDA
    tensor equal to torch's on the same model, for 2 and inf. {norm_type: (device, dtype, total, torch's)}."""
    model = mlp(num_layers=4).cuda()
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss)
    x, y = torch.randn(4, 8, device="cuda"), torch.randn(4, 8, device="cuda")
    pipe.step(x, target=y)
    reference_step(ref, x, y, 2)
    out = {}
    for norm_type in (2.0, math.inf):
        total = pipe.clip_grad_norm_(1e-3, norm_type)
        ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3, norm_type)
        out[norm_type] = (str(total.device), total.dtype, total.item(), ref_total.item())
    pipe.close()
    return out
