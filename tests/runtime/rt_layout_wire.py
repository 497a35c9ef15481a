"""Per-rank bodies of tests/runtime/test_layout_wire.py: stage outputs laid out otherwise than row-major (a
transpose, ``channels_last``, a tuple mixing layouts and dtypes, a slice) cross the wire in their own dim order.
Each case runs the unsplit model (one microbatch at a time) and a Pipeline on the same data; a :class:`Probe` at each
side of a rank boundary records the strides of the activation and of the gradient that reach it, in both runs."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline

from rt_cases import reference_step


class Probe(nn.Module):
    """Identity that records ``("act", strides)`` of what reaches it and, by a tensor hook, ``("grad", strides)``
    of the gradient that reaches that tensor in the backward (a tuple: one record per floating tensor)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        parts = x if isinstance(x, tuple) else (x,)
        for k, t in enumerate(parts):
            self.seen.append(("act", k, t.stride()))
            if t.requires_grad:
                t.register_hook(lambda g, k=k: self.seen.append(("grad", k, g.stride())))
        return x


class Transpose(nn.Module):
    def forward(self, x):
        return x.transpose(-1, -2)


class ChannelsLast(nn.Module):
    def forward(self, x):
        return x.contiguous(memory_format=torch.channels_last)


class Every(nn.Module):
    """Keeps every other column: a tensor with gaps (not dense), which arrives dense."""

    def forward(self, x):
        return x[..., ::2]


class Fan(nn.Module):
    """(B, 12) -> a tuple of five layouts and dtypes: transposed float (12, B), row-major float, a column-major
    float (B, 12) made by ``.t().contiguous().t()``, a transposed int16 (sent as bytes) and a bool."""

    def forward(self, x):
        col = x.t().contiguous().t() * 2
        ints = (x * 100).to(torch.int16).t()
        return x.t(), torch.tanh(x), col, ints, x > 0


class Gather(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(12, 12)

    def forward(self, parts):
        t, h, col, ints, mask = parts
        return self.lin(t.t() @ torch.tanh(col.t() @ h) / 12 + ints.t().float() / 100 * mask)


def _model(name):
    torch.manual_seed(0)
    if name == "transpose":  # (B, 16, 37) -> (B, 53, 16) transposed -> ... -> (B, 29, 7)
        return ([nn.Linear(37, 53), Transpose(), Probe(), Probe(), nn.Linear(16, 29), Transpose(), nn.Linear(53, 7)],
                [3, 4], (16, 37))
    if name == "channels_last":
        return ([nn.Conv2d(3, 8, 3, padding=1), ChannelsLast(), nn.ReLU(), Probe(), Probe(),
                 nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 2, 3), nn.Flatten()], [4, 5], (3, 8, 8))
    if name == "tuple":
        return [nn.Linear(12, 12), Fan(), Probe(), Probe(), Gather()], [3, 2], (12,)
    if name == "slice":
        return [nn.Linear(9, 40), Every(), Probe(), Probe(), nn.Linear(20, 5)], [3, 2], (9,)
    if name == "zbv":  # V placement: transposed boundaries crossed rank 0 -> 1 (stage 0 -> 1) and back (2 -> 3)
        return ([nn.Linear(37, 53), Transpose(), Probe(), Probe(), nn.Linear(16, 16), Transpose(), nn.Tanh(),
                 Probe(), Probe(), nn.Linear(53, 29), Transpose(), nn.Linear(16, 7)], [3, 3, 2, 4], (16, 37))
    raise ValueError(name)


def _data(shape, out_of, n=10):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, *shape, generator=g)
    with torch.no_grad():
        y = out_of(x)
    return x, torch.randn(y.shape, generator=g)


def _records(model):
    """Per probe (by layer index): its records, each once (a recompute runs a forward twice)."""
    return {i: sorted(set(layer.seen)) for i, layer in enumerate(model) if isinstance(layer, Probe)}


def run_case(rank, name, schedule="1f1b", recompute=False):
    """Two steps on the same data; returns, for this rank: the second step's loss of both runs, every local
    parameter's gradient (summed over both steps) both ways, and the probe records of both runs for the probes on
    this rank."""
    layers, balance, shape = _model(name)
    model = nn.Sequential(*layers)
    ref = copy.deepcopy(model)
    x, y = _data(shape, copy.deepcopy(model))
    v = 2 if schedule == "zbv" else None
    pipe = Pipeline(model, schedule=schedule, virtual_stages=v, num_microbatches=4, loss_fn=F.mse_loss,
                    balance=balance, recompute=recompute, timeout=60.0)
    for _ in range(2):  # the first step learns the metas (headers, gradient orders), the second uses them
        ref_loss = reference_step(ref, x, y, 4)
        loss = pipe.step(x, y)
    mine = {id(p) for p in pipe.parameters()}
    named = dict(ref.named_parameters())
    grads = {n: (p.grad, named[n].grad) for n, p in model.named_parameters() if id(p) in mine}
    here = {i for i, layer in enumerate(model) if isinstance(layer, Probe) and any(
        layer is m for stage in pipe.stages.values() for m in stage)}
    probes = ({i: r for i, r in _records(model).items() if i in here},
              {i: r for i, r in _records(ref).items() if i in here})
    return {"loss": (float(loss), float(ref_loss)), "grads": grads, "probes": probes}


class Flip(nn.Module):
    """Row-major ``x * 2`` or the same values column-major (``flip.col``): a layout that changes between steps
    while shapes and dtypes do not."""

    col = False

    def forward(self, x):
        return x.t().contiguous().t() * 2 if Flip.col else x * 2


def layout_change(rank):
    """Step 1 learns a row-major boundary, step 2's output is column-major: sent in the learned order (the receiver
    expects it), no error; stage 1 is elementwise, so both steps match the unsplit model to the bit."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), Flip(), nn.Tanh(), nn.Hardtanh(-0.5, 0.5))
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, balance=[2, 2], timeout=60.0)
    out = []
    for step, col in enumerate((False, True)):
        Flip.col = col
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(6, 6, generator=g), torch.randn(6, 6, generator=g)
        for p in (*model.parameters(), *ref.parameters()):
            p.grad = None
        out.append((float(pipe.step(x, y)), float(reference_step(ref, x, y, 2))))
        if rank == 0:
            out.append(all(torch.equal(a.grad, b.grad) for a, b in zip(model[0].parameters(), ref[0].parameters())))
    return out


def suite(rank):
    """Every case on the same two ranks: name -> result of :func:`run_case` (or :func:`layout_change`)."""
    torch.set_num_threads(1)
    cases = {(name, "1f1b", False): (name, "1f1b", False) for name in ("transpose", "channels_last", "tuple", "slice")}
    cases.update({("transpose", "zb-h1", False): ("transpose", "zb-h1", False),
                  ("channels_last", "zb-h1", True): ("channels_last", "zb-h1", True),
                  ("tuple", "gpipe", True): ("tuple", "gpipe", True),
                  ("zbv", "zbv", False): ("zbv", "zbv", False), ("zbv", "zbv", True): ("zbv", "zbv", True)})
    out = {key: run_case(rank, *args) for key, args in cases.items()}
    out["layout_change"] = layout_change(rank)
    return out
