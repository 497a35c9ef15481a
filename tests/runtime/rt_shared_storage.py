"""Per-rank bodies of tests/runtime/test_shared_storage.py: tensors of two layers that are different objects but
share memory (a buffer or parameter that is a view of another layer's), their uses cut onto two ranks (or one);
and two different Pipelines saved to (or loaded from) one checkpoint path by rank-dependent code. Each returns what
this rank raised, or its losses and what the unsplit model gave, as a dict."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline, PipelineError, load_checkpoint, save_checkpoint

from rt_cases import reference_step


class Table(nn.Module):
    """Adds a fixed table held in a buffer (a rotary or positional table): never changes."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.linspace(-1, 1, 4))

    def forward(self, x):
        return x + self.table


class TableView(nn.Module):
    """Scales by a view of another layer's table (``table[:]``): another tensor object, the same memory."""

    def __init__(self, source: Table):
        super().__init__()
        self.register_buffer("t", source.table[:])

    def forward(self, x):
        return x * self.t


class Counter(nn.Module):
    """Counts its forwards in a buffer, or in a view of ``source``'s (``.view(())``): then both count in one."""

    def __init__(self, source: "Counter | None" = None):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64) if source is None
                             else source.calls.view(()))

    def forward(self, x):
        self.calls += 1
        return x


class WeightAsBuffer(nn.Module):
    """Multiplies by a buffer that is a view of another layer's weight (``weight.detach()``): it follows the
    weight's updates in the unsplit model."""

    def __init__(self, source: nn.Linear):
        super().__init__()
        self.register_buffer("w", source.weight.detach())

    def forward(self, x):
        return x @ self.w


def _pair(kind: str):
    """The modules at layers 1 and 4 of the model."""
    if kind == "table_view":
        a = Table()
        return a, TableView(a)
    if kind == "counter_view":
        a = Counter()
        return a, Counter(a)
    if kind == "batchnorm_view":  # the second norm layer's running statistics are views of the first's
        a, b = nn.BatchNorm1d(4), nn.BatchNorm1d(4)
        b.running_mean, b.running_var = a.running_mean[:], a.running_var.view(4)
        return a, b
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    if kind == "weight_view":  # a Parameter of its own over the first's memory
        b.weight = nn.Parameter(a.weight.detach().view(4, 4))
        return a, b
    if kind == "weight_slice":  # overlaps half of the first's weight
        b = nn.Linear(4, 2)
        b.weight = nn.Parameter(a.weight.detach()[1:3])
        return a, nn.Sequential(b, nn.Linear(2, 4))
    if kind == "weight_halves":  # two Parameters over the two halves of one storage: no byte in common
        packed = torch.randn(4, 4)
        a, b = nn.Linear(4, 2), nn.Linear(4, 2)
        a.weight, b.weight = nn.Parameter(packed[:2]), nn.Parameter(packed[2:])
        return nn.Sequential(a, nn.Linear(2, 4)), nn.Sequential(b, nn.Linear(2, 4))
    if kind == "weight_buffer":
        return a, WeightAsBuffer(a)
    raise ValueError(kind)


def model(kind: str) -> nn.Sequential:
    torch.manual_seed(0)
    a = nn.Linear(4, 4)  # drawn first: the same values whatever the kind
    first, second = _pair(kind)
    return nn.Sequential(a, first, nn.Tanh(), nn.Linear(4, 4), second, nn.Linear(4, 4))


def batch(step: int):
    g = torch.Generator().manual_seed(10 + step)
    return torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)


def _report(run) -> dict:
    try:
        return {"type": None, **run()}
    except PipelineError as exc:
        return {"type": "PipelineError", "origin": exc.rank, "message": str(exc)}
    except Exception as exc:  # noqa: BLE001 - reported, so the test shows what else happened
        return {"type": type(exc).__name__, "message": str(exc)}


def case(rank: int, kind: str, balance, schedule: str = "1f1b", steps: int = 3) -> dict:
    """``steps`` steps of SGD (lr 0.1) on the pipeline and on the unsplit model: the losses (hex) of both, and this
    rank's buffers (hex of their values) against the unsplit model's."""
    net = model(kind)

    def run():
        expected, ref = reference(kind, steps)  # here, with the rank's one torch thread (reductions split alike)
        pipe = Pipeline(net, schedule=schedule, num_microbatches=2, loss_fn=F.mse_loss, balance=balance, timeout=30)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        losses = []
        for step in range(steps):
            x, y = batch(step)
            losses.append(pipe.step(x, target=y).item().hex())
            opt.step()
            opt.zero_grad()
        mine = {id(t) for m in pipe.stages.values() for t in [*m.parameters(), *m.buffers()]}
        theirs = dict(ref.state_dict(keep_vars=True))
        state = {n: t for n, t in net.state_dict(keep_vars=True).items() if id(t) in mine}
        pipe.close()
        return {"losses": losses, "expected": expected, "checked": sorted(state),
                "same_state": all(torch.equal(t, theirs[n]) for n, t in state.items())}

    return _report(run)


def reference(kind: str, steps: int):
    """The unsplit model's losses (hex) over the same steps, and the model after them."""
    ref = model(kind)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x, y = batch(step)
        losses.append(reference_step(ref, x, y, 2).item().hex())
        opt.step()
        opt.zero_grad()
    return losses, ref


# ---- two Pipelines, one checkpoint path ----------------------------------------------------------------------


def _pipe(seed: int) -> Pipeline:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh())
    return Pipeline(net, schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, balance=[2, 2], timeout=60.0)


def _error_of(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test compares type and message
        return type(exc).__name__, str(exc)
    return None


def two_pipelines(rank: int, root: str) -> dict:
    """Two Pipelines of the same architecture (other values): rank 0 saves (loads) pipe_a where rank 1 saves
    (loads) pipe_b, at one path; then the same calls with one Pipeline on every rank, which work (nothing is left
    out of step)."""
    pipe_a, pipe_b = _pipe(1), _pipe(2)
    mixed = os.path.join(root, "mixed")
    out = {"save": _error_of(lambda: save_checkpoint(mixed, pipe_a if rank == 0 else pipe_b, step=1))}
    torch.distributed.barrier()  # rank 0 has cleaned up after the refusal
    out["listed"] = sorted(os.listdir(root))
    torch.distributed.barrier()  # both have listed before the next save makes its temporary directory
    good = os.path.join(root, "good")
    save_checkpoint(good, pipe_a, step=2)
    fresh = _pipe(3)
    before = {n: t.clone() for n, t in fresh.state_dict().items()}
    out["load"] = _error_of(lambda: load_checkpoint(good, fresh if rank == 0 else pipe_b))
    out["unchanged"] = all(torch.equal(t, before[n]) for n, t in fresh.state_dict().items())
    info = load_checkpoint(good, fresh)
    out["loaded"] = (info.step, all(torch.equal(t, pipe_a.state_dict()[n]) for n, t in fresh.state_dict().items()))
    out["listed_after"] = sorted(os.listdir(root))
    for pipe in (pipe_a, pipe_b, fresh):
        pipe.close()
    return out
