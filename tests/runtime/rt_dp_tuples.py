"""Per-rank bodies of tests/runtime/test_dp_and_tuples.py, on 3 spawned ranks: data parallelism where the
replica count differs from the pipeline's rank count (p=1 x dp=3), and a stage whose output tuple starts with a
floating tensor that needs no gradient (p=3)."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline

from rt_cases import SCHEDULES, grad_report, mlp, pair, reference_step

WORLD = 3


def dp_over_replicas(rank, schedule, v, **options):
    """p=1 x dp=3: replica k steps on shard k of a 24-row batch (4 microbatches of 2 rows); after the all-reduce,
    every gradient must be that of the unsplit model on the whole batch (the same 12 microbatches of 2 rows)."""
    model, ref = pair()
    pipe = Pipeline(model, schedule=schedule, num_microbatches=4, loss_fn=F.mse_loss, virtual_stages=v,
                    dp_size=WORLD, **options)
    g = torch.Generator().manual_seed(11)
    x, y = torch.randn(8 * WORLD, 8, generator=g), torch.randn(8 * WORLD, 8, generator=g)
    shard = slice(8 * pipe.grid.dp_rank, 8 * (pipe.grid.dp_rank + 1))
    loss = pipe.step(x[shard], target=y[shard])
    reference_step(ref, x, y, 4 * WORLD)
    count, _, worst = grad_report(pipe, model, ref)
    shard_loss = reference_step(mlp(), x[shard], y[shard], 4)  # a fresh copy of the same model
    return {"layout": (pipe.program.num_ranks, pipe.program.dp_size, pipe.grid.dp_rank), "grads": count,
            "params": len(list(pipe.parameters())), "worst": worst, "loss_equal": bool(torch.equal(loss, shard_loss))}


class ConstThenActivation(nn.Module):
    """x (B, D) -> (c, a): ``c`` a floating tensor computed from x without autograd (needs no gradient), first;
    then ``a``, the activation, which does."""

    def __init__(self, width=8):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        c = torch.cos(x.detach()) * 0.5  # (B, D) float32, requires_grad False
        return c, torch.tanh(self.lin(x))  # (B, D), (B, D)


class UseBoth(nn.Module):
    """(c, a) -> (B, D): uses both elements, so a swapped or misplaced gradient changes the result."""

    def __init__(self, width=8):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, pair_):
        c, a = pair_
        if c.requires_grad or not c.is_floating_point():
            raise TypeError(f"element 0 arrived with requires_grad={c.requires_grad}, dtype {c.dtype}")
        return torch.tanh(self.lin(a) * (1.0 + c))  # (B, D)


def const_first_model(seed=0):
    """Linear+Tanh, ConstThenActivation | UseBoth, then Linear+Tanh blocks: 7 layers, so that interleaved on 3 ranks
    (6 stages, balance [2, 1, 1, 1, 1, 1]) also cuts between the tuple's producer and its consumer."""
    torch.manual_seed(seed)
    blocks = list(mlp(num_layers=5, seed=seed))
    return nn.Sequential(blocks[0], ConstThenActivation(), UseBoth(), *blocks[1:])


def const_first_tuple(rank, schedule, v, steps=2, **options):
    """Per step (the first learns the messages, the second uses what it learned): loss and every gradient
    bitwise those of the unsplit model over the same microbatches."""
    model = const_first_model()
    ref = copy.deepcopy(model)
    balance = [2, 1, 1, 1, 1, 1] if v == 2 else [2, 2, 3]
    pipe = Pipeline(model, schedule=schedule, num_microbatches=4, loss_fn=F.mse_loss, virtual_stages=v,
                    balance=balance, **options)
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(steps):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
        loss = pipe.step(x, target=y)
        ref_loss = reference_step(ref, x, y, 4)
        count, equal, worst = grad_report(pipe, model, ref)
        out.append({"loss_equal": bool(torch.equal(loss, ref_loss)), "grads": count, "bitwise": equal,
                    "worst": worst})
        for p in list(model.parameters()) + list(ref.parameters()):
            p.grad = None
    return {"stages": pipe.stage_ids, "params": len(list(pipe.parameters())), "steps": out}


OPTIONS = ((), ("split_backward",), ("recompute",))


class SignBranch(nn.Module):
    """x (B, D) -> (B, D): adds ``used(x)`` only when the microbatch's first column is positive on average, so which
    replica's data reaches ``used`` decides whether it gets a gradient there; ``never`` gets none anywhere."""

    def __init__(self, width=8):
        super().__init__()
        self.used, self.never = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.used(x)) if x[:, 0].mean() > 0 else x


def unused_on_some_replicas(rank):
    """p=1 x dp=3, a layer whose branch only replica 1's data takes: its gradient on every replica must be the
    unsplit model's on the whole batch (replica 1's part / 3, the other replicas contributing nothing), and a
    parameter no replica used keeps ``.grad`` None. Without presence flags the replicas' flat buffers differ in
    length (replica 1 has two more gradients)."""
    torch.manual_seed(0)
    model = nn.Sequential(SignBranch(), nn.Linear(8, 8), nn.Linear(8, 8))
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, dp_size=WORLD)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(4 * WORLD, 8, generator=g), torch.randn(4 * WORLD, 8, generator=g)
    x[:, 0] = torch.tensor([-1.0, 1.0, -1.0]).repeat_interleave(4) * (x[:, 0].abs() + 0.1)  # replica 1: positive
    shard = slice(4 * pipe.grid.dp_rank, 4 * (pipe.grid.dp_rank + 1))
    pipe.step(x[shard], target=y[shard])
    reference_step(ref, x, y, 2 * WORLD)
    grads = {name: (None if p.grad is None else p.grad.clone()) for name, p in model.named_parameters()}
    want = {name: p.grad for name, p in ref.named_parameters()}
    return {"none": sorted(n for n, gr in grads.items() if gr is None),
            "ref_none": sorted(n for n, gr in want.items() if gr is None),
            "worst": max(float((grads[n] - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-30))
                         for n in grads if grads[n] is not None and want[n] is not None),
            "used_nonzero": bool(grads["0.used.weight"] is not None and grads["0.used.weight"].abs().sum() > 0)}


def suite(rank):
    results = {"unused": unused_on_some_replicas(rank)}
    for schedule, v in SCHEDULES:
        results[("dp", schedule)] = dp_over_replicas(rank, schedule, v)
        for options in OPTIONS:
            results[("tuple", schedule, options)] = const_first_tuple(rank, schedule, v,
                                                                      **{name: True for name in options})
    results[("dp", "1f1b", "split_backward")] = dp_over_replicas(rank, "1f1b", 1, split_backward=True)
    return results
