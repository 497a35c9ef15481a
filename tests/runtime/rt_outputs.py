"""Per-rank bodies of tests/runtime/test_outputs.py: the step loss on every rank (its shape, dtype and value),
and last-stage outputs that are dicts or tuples with non-tensor parts. Plain results, asserted in the parent."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline, PipelineError

from rt_cases import grad_report, mlp, pair, reference_step

SIZES = [3, 3, 2, 2]  # 10 samples in 4 microbatches


def _data(seed, n=10, width=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=g), torch.randn(n, width, generator=g)


def _zero(*models):
    for model in models:
        for p in model.parameters():
            p.grad = None


# ---- item 4: the same loss on every rank ------------------------------------------------------------------

class ShapedLoss:
    """``mse_loss(out, y)`` cast to ``dtype`` and reshaped to ``shape`` (one element); both settable between steps."""

    def __init__(self):
        self.shape, self.dtype = (), torch.float32

    def __call__(self, out, y):
        return F.mse_loss(out, y).to(self.dtype).reshape(self.shape)


LOSS_CASES = (((), torch.float32), ((1,), torch.float32), ((1, 1), torch.float32), ((), torch.float64),
              ((1,), torch.float64), ((1, 1), torch.bfloat16), ((), torch.bfloat16), ((1,), torch.float16))


def loss_values(rank):
    """One pipeline (1f1b, 4 microbatches of 3, 3, 2, 2), one step per (shape, dtype) of ``loss_fn``'s result.
    Per case: the returned loss (a tensor), the reference loss of the unsplit model, grads bitwise."""
    model, ref = pair(num_layers=4)
    fn = ShapedLoss()
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=4, loss_fn=fn)
    out = {}
    for k, (shape, dtype) in enumerate(LOSS_CASES):
        fn.shape, fn.dtype = shape, dtype
        x, y = _data(k)
        loss = pipe.step(x, target=y)
        ref_loss = reference_step(ref, x, y, 4, loss_fn=fn)
        _, bitwise, _ = grad_report(pipe, model, ref)
        out[(shape, dtype)] = {"loss": loss, "device": loss.device.type, "requires_grad": loss.requires_grad,
                               "ref": ref_loss, "bitwise": bitwise}
        _zero(model, ref)
    pipe.close()
    return out


# ---- item 5: last-stage outputs that are not tensors ------------------------------------------------------

class DictHead(nn.Module):
    """``(B, 8) -> {"logits": (B, 8), "aux": (B,)}``; with ``scalar_aux`` ``"aux"`` is 0-dim (summed)."""

    def __init__(self, width=8):
        super().__init__()
        self.lin, self.scalar_aux = nn.Linear(width, width), False

    def forward(self, x):
        h = self.lin(x)
        aux = torch.tanh(h).sum(-1)
        return {"logits": h, "aux": aux.sum() if self.scalar_aux else aux}


def dict_loss(out, y):
    return F.mse_loss(out["logits"], y) + 0.1 * out["aux"].pow(2).mean()


class TaggedHead(nn.Module):
    """``(B, 8) -> ((B, 8), "tag", 3, B)``: a tensor, a constant str and int, and the microbatch size."""

    def __init__(self, width=8):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return self.lin(x), "tag", 3, x.shape[0]


def tagged_loss(out, y):
    h, tag, k, n = out
    if (tag, k, n) != ("tag", 3, h.shape[0]):
        raise ValueError(f"loss_fn got {out[1:]}")
    return F.mse_loss(h, y) * (k / 3)


HEADS = {"dict": (DictHead, dict_loss), "tagged": (TaggedHead, tagged_loss)}


def head_model(head):
    """3 x (Linear(8) + Tanh), then the head: 4 layers."""
    layers = list(mlp(num_layers=3))
    torch.manual_seed(1)
    return nn.Sequential(*layers, HEADS[head][0]())


def microbatch_outputs(model, x):
    """The unsplit model's output on each microbatch (sizes ``SIZES``), without grad."""
    with torch.no_grad():
        return [model(xm) for xm in x.split(SIZES)]


def _local(fn, *args):
    """``fn(*args)``, or ``"Type: message"`` of what it raised: a forward() whose merge fails on the last stage's
    rank only (after the step, so the ranks stay in step) must not end this rank's other cases."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        return f"{type(exc).__name__}: {exc}"


def outputs_case(rank, head, schedule, v, **options):
    """step(): loss and grads against the unsplit model; forward(): the merged output and the unsplit model's
    per-microbatch outputs (merged in the parent). For the dict head on 1f1b without options, also a forward()
    whose "aux" is 0-dim (a ValueError on the last stage's rank) and one after it (the pipeline still works)."""
    model = head_model(head)
    ref = copy.deepcopy(model)
    loss_fn = HEADS[head][1]
    pipe = Pipeline(model, schedule=schedule, num_microbatches=4, loss_fn=loss_fn, virtual_stages=v, **options)
    x, y = _data(3)
    loss = pipe.step(x, target=y)
    ref_loss = reference_step(ref, x, y, 4, loss_fn=loss_fn)
    count, bitwise, _ = grad_report(pipe, model, ref)
    result = {"loss": loss, "ref_loss": ref_loss, "grads": count, "bitwise": bitwise,
              "forward": _local(pipe.forward, x), "ref_parts": microbatch_outputs(ref, x)}
    if head == "dict" and not options and schedule == "1f1b":
        model[-1].scalar_aux = True  # the last stage's module on rank 1; unused on rank 0
        result["scalar_aux"] = _local(pipe.forward, x)
        model[-1].scalar_aux = False
        again = _local(pipe.forward, x)
        first = result["forward"]
        result["again"] = (bool(torch.equal(again["logits"], first["logits"]))
                           if isinstance(again, dict) and isinstance(first, dict) else again)
    pipe.close()
    return result


class ToDict(nn.Module):
    def forward(self, x):
        return {"h": x}


class FromDict(nn.Module):
    def forward(self, d):
        return d["h"]


class Tag(nn.Module):
    def forward(self, x):
        return x, "tag"


class First(nn.Module):
    def forward(self, pair):
        return pair[0]


def middle_case(rank, kind):
    """Stage 0 (of 2) ends with a dict (``kind="dict"``) or a ``(tensor, "tag")`` tuple: it cannot be sent."""
    torch.manual_seed(0)
    out, back = (ToDict(), FromDict()) if kind == "dict" else (Tag(), First())
    model = nn.Sequential(nn.Linear(8, 8), out, back, nn.Linear(8, 8))
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, balance=[2, 2], timeout=30.0)
    try:
        pipe.step(*_data(0, n=4))
    except PipelineError as exc:
        return {"rank": exc.rank, "instr": exc.instr, "cause": exc.cause}
    return {"rank": None}


def int_loss_case(rank):
    """loss_fn returns an int64 scalar: refused on the last stage's rank before backward."""
    pipe = Pipeline(mlp(num_layers=2), schedule="1f1b", num_microbatches=2, timeout=30.0,
                    loss_fn=lambda out, y: (out - y).abs().sum().round().long())
    try:
        pipe.step(*_data(0, n=4))
    except PipelineError as exc:
        return {"rank": exc.rank, "instr": exc.instr, "cause": exc.cause}
    return {"rank": None}


def suite(rank):
    results = {"loss": loss_values(rank)}
    for head in HEADS:
        for schedule, v in (("1f1b", 1), ("interleaved-1f1b", 2)):
            results[(head, schedule)] = outputs_case(rank, head, schedule, v)
    results[("dict", "1f1b", "recompute+split")] = outputs_case(rank, "dict", "1f1b", 1, recompute=True,
                                                                split_backward=True)
    results[("tagged", "interleaved-1f1b", "recompute+split")] = outputs_case(
        rank, "tagged", "interleaved-1f1b", 2, recompute=True, split_backward=True)
    results["middle_dict"] = middle_case(rank, "dict")  # last: these fail their pipelines
    results["middle_tag"] = middle_case(rank, "tag")
    results["int_loss"] = int_loss_case(rank)
    return results
