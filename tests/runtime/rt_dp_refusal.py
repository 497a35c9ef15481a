"""Per-rank body of tests/runtime/test_dp_refusal.py: 2 replicas x 2 pipeline ranks (1f1b, m=4). A step that one
replica refuses is refused on every replica, so no replica's data-parallel all-reduce meets another step's."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from pipesched.runtime import Pipeline

from rt_cases import mlp, reference_step

M = 4


def _batch(seed: int, rows: int = 8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 8, generator=g), torch.randn(rows, 8, generator=g)


def _under_bf16(enabled: bool, call):
    with torch.autocast("cpu", torch.bfloat16, enabled=enabled):
        return call()


def refusals(rank):
    """Step 1 (fine); step 2 refused on replica 1 only (2 rows for m=4; then its target of 3 rows for 8; then
    replica 1 calls forward(); then replica 1 steps under bf16 autocast); step 3 (fine). Returns each refused call's
    error text by case, and whether the gradients after step 3 (zeroed before it) equal the average over replicas of
    the unsplit model's."""
    model = mlp(num_layers=4)
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=M, loss_fn=F.mse_loss, dp_size=2, timeout=30)
    replica = pipe.grid.dp_rank
    out = {"replica": replica, "pp_rank": pipe.pp_rank, "errors": {}}
    pipe.step(*_batch(10 + replica))
    cases = {"small batch": lambda: pipe.step(*(_batch(20, rows=2) if replica == 1 else _batch(20))),
             "bad target": lambda: pipe.step(_batch(30)[0], _batch(30)[1][:3] if replica == 1 else _batch(30)[1]),
             "forward": lambda: pipe.forward(_batch(40)[0]) if replica == 1 else pipe.step(*_batch(40)),
             "autocast": lambda: _under_bf16(replica == 1, lambda: pipe.step(*_batch(45)))}
    for name, call in cases.items():
        try:
            call()
            out["errors"][name] = None
        except ValueError as exc:
            out["errors"][name] = str(exc)
    for p in pipe.parameters():
        p.grad = None
    pipe.step(*_batch(50 + replica))
    for k in range(2):
        reference_step(ref, *_batch(50 + k), M)
    refs = dict(ref.named_parameters())
    mine = {n: p for n, p in model.named_parameters() if any(p is q for q in pipe.parameters())}
    out["grads"] = {n: bool(torch.allclose(p.grad, refs[n].grad / 2, rtol=1e-5, atol=1e-7)) for n, p in mine.items()}
    pipe.close()
    return out
