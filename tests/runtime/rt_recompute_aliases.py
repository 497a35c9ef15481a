"""Per-rank body of tests/runtime/test_recompute_aliases.py: a recomputed stage holding two buffers that are
different tensors over one memory (a counter's buffer and another layer's view of it, ``.view(())`` or a slice;
a constant table and another layer's ``table[:]``), trained with recompute under 1f1b and zbv (split I/W) against
the unsplit model. Returns this rank's losses, gradients and buffers against the unsplit model's, as a dict."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline

from rt_cases import reference_step
from rt_shared_storage import Table, TableView, batch


class Counter(nn.Module):
    """Counts its forwards in a buffer of ``size`` int64 elements, element ``i`` by ``i + 1``."""

    def __init__(self, size=()):
        super().__init__()
        self.register_buffer("calls", torch.zeros(size, dtype=torch.int64))

    def forward(self, x):
        self.calls += torch.arange(1, self.calls.numel() + 1).reshape(self.calls.shape)
        return x


class Reader(nn.Module):
    """Scales by the sum of ``view`` (a view of a Counter's buffer, another tensor object over its memory), read
    after the Counter wrote it: a recompute that does not share the memory reads a stale count."""

    def __init__(self, view: torch.Tensor):
        super().__init__()
        self.register_buffer("c", view)

    def forward(self, x):
        return x * (1.0 + 0.1 * self.c.sum().float())


def _pair(kind: str):
    """Layers 1 and 2 of the model (one recomputed stage)."""
    if kind == "counter_view":  # the 0-dim count, viewed whole
        a = Counter()
        return a, Reader(a.calls.view(()))
    if kind == "counter_slice":  # a slice at an offset: the last two of three counts
        a = Counter((3,))
        return a, Reader(a.calls[1:])
    if kind == "table_view":  # a constant (rotary-like) table and a view of it: read only
        a = Table()
        return a, TableView(a)
    raise ValueError(kind)


def model(kind: str) -> nn.Sequential:
    torch.manual_seed(0)
    first = nn.Linear(4, 4)
    a, b = _pair(kind)
    return nn.Sequential(first, a, b, nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 4))


SCHEDULES = {  # schedule -> Pipeline options: the aliased layers 1 and 2 in stage 0, on pipeline rank 0
    "1f1b": dict(schedule="1f1b", balance=[5, 1]),
    "zbv": dict(schedule="zbv", balance=[3, 1, 1, 1]),  # 4 stages, split backward (I and W)
}


def case(rank: int, kind: str, schedule: str, recompute: bool = True, steps: int = 2) -> dict:
    """``steps`` SGD steps (lr 0.1) of the pipeline and of the unsplit model: per step, the losses (hex) and
    whether every gradient of this rank's parameters is bitwise the unsplit model's; at the end whether this
    rank's parameters and buffers are."""
    net, ref = model(kind), model(kind)
    pipe = Pipeline(net, num_microbatches=2, loss_fn=F.mse_loss, recompute=recompute, timeout=60,
                    **SCHEDULES[schedule])
    opt, ref_opt = torch.optim.SGD(pipe.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    mine = {id(t) for m in pipe.stages.values() for t in [*m.parameters(), *m.buffers()]}
    theirs = dict(ref.named_parameters())
    out = []
    for step in range(steps):
        x, y = batch(step)
        loss = pipe.step(x, target=y).item().hex()
        expected = reference_step(ref, x, y, 2).item().hex()
        grads = {n: p.grad for n, p in net.named_parameters() if id(p) in mine}
        out.append((loss, expected, len(grads), all(g is not None and torch.equal(g, theirs[n].grad)
                                                    for n, g in grads.items())))
        opt.step(); opt.zero_grad(); ref_opt.step(); ref_opt.zero_grad()
    ref_state = ref.state_dict(keep_vars=True)
    state = {n: t for n, t in net.state_dict(keep_vars=True).items() if id(t) in mine}
    result = {"steps": out, "checked": sorted(state), "counts": [t.tolist() for n, t in state.items()
                                                                 if n == "1.calls"],
              "same_state": all(torch.equal(t, ref_state[n]) for n, t in state.items())}
    pipe.close()
    return result


def suite(rank: int) -> dict:
    """Every case on one launch (forking ranks costs more than the steps)."""
    return {(kind, schedule): case(rank, kind, schedule)
            for kind in ("counter_view", "counter_slice", "table_view") for schedule in SCHEDULES}
