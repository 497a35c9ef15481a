"""Models, references and comparisons shared by the runtime tests (imported by spawned ranks too)."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2))


def mlp(num_layers: int = 8, width: int = 8, seed: int = 0, dropout: float = 0.0, tanh_first=False) -> nn.Sequential:
    """``num_layers`` x (Linear + Tanh [+ Dropout]) blocks, one layer each; ``tanh_first``: Tanh + Linear
    (then no stage saves its own input: Tanh saves its output)."""
    torch.manual_seed(seed)
    blocks = []
    for _ in range(num_layers):
        parts = [nn.Linear(width, width), nn.Tanh()] + ([nn.Dropout(dropout)] if dropout else [])
        if tanh_first:
            parts = parts[::-1]
        blocks.append(nn.Sequential(*parts))
    return nn.Sequential(*blocks)


def reference_step(model, x, target, num_microbatches, loss_fn=F.mse_loss):
    """The unsplit model over the same microbatches in the same order: sum_i loss_i * n_i / N, backward each."""
    n = x.shape[0] if isinstance(x, torch.Tensor) else x[0].shape[0]
    base, extra = divmod(n, num_microbatches)
    sizes = [base + 1 if i < extra else base for i in range(num_microbatches)]
    xs = x.split(sizes) if isinstance(x, torch.Tensor) else list(zip(*(t.split(sizes) for t in x)))
    total = None
    for xm, tm, size in zip(xs, target.split(sizes), sizes):
        loss = loss_fn(model(xm), tm) * (size / n)
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total


def reference_forward(model, x, num_microbatches):
    n = x.shape[0]
    base, extra = divmod(n, num_microbatches)
    sizes = [base + 1 if i < extra else base for i in range(num_microbatches)]
    with torch.no_grad():
        return torch.cat([model(xm) for xm in x.split(sizes)])


def grad_report(pipe, model, ref, rtol=None):
    """For this rank's parameters: (count, all bitwise equal, largest relative difference)."""
    mine = {id(p) for p in pipe.parameters()}
    ref_params = dict(ref.named_parameters())
    equal, worst, count = True, 0.0, 0
    for name, p in model.named_parameters():
        if id(p) not in mine:
            continue
        count += 1
        r = ref_params[name].grad
        if p.grad is None or r is None:
            return count, False, float("inf")
        equal &= torch.equal(p.grad, r)
        worst = max(worst, float(((p.grad - r).abs().max() / r.abs().max().clamp_min(1e-30))))
    return count, equal, worst


def params_equal(pipe, model, ref) -> bool:
    mine = {id(p) for p in pipe.parameters()}
    ref_params = dict(ref.named_parameters())
    return all(torch.equal(p, ref_params[n]) for n, p in model.named_parameters() if id(p) in mine)


def pair(seed: int = 0, **kw):
    model = mlp(seed=seed, **kw)
    return model, copy.deepcopy(model)


class TupleMix(nn.Module):
    """(hidden (B,T,D) float, ids (B,T) int64, mask (B,T) bool) -> the same, checking dtypes on the way."""

    def __init__(self, width=8, vocab=11, shift=1):
        super().__init__()
        self.lin, self.emb, self.vocab, self.shift = nn.Linear(width, width), nn.Embedding(vocab, width), vocab, shift

    def forward(self, batch):
        h, ids, mask = batch
        if ids.dtype != torch.int64 or mask.dtype != torch.bool or ids.requires_grad or mask.requires_grad:
            raise TypeError(f"bad tuple: {ids.dtype} {mask.dtype} grad={ids.requires_grad}")
        h = torch.tanh(self.lin(h) + self.emb(ids)) * mask.unsqueeze(-1)  # (B, T, D)
        return h, (ids * 3 + self.shift) % self.vocab, mask  # ids change: must arrive exactly


class TupleHead(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, batch):
        h, ids, mask = batch
        return self.lin(h) + ids.unsqueeze(-1).float() * mask.unsqueeze(-1)  # (B, T, D)


def tuple_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(TupleMix(shift=1), TupleMix(shift=2), TupleMix(shift=3), TupleMix(shift=4), TupleHead())


def seq_model(seed=0, width=8):
    """Layers on (B, T, D): the sequence length may change between steps."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(4)])


def outcome(call) -> str:
    """``"ok"``, or the exception ``call()`` raised as ``"Type: message"`` (any type: a PipelineError or a timeout is
    a failure too), for a test to compare with what it expects."""
    try:
        call()
        return "ok"
    except Exception as exc:  # noqa: BLE001 - recorded for the test to judge
        return f"{type(exc).__name__}: {exc}"
