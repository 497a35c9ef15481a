"""Per-rank body of tests/runtime/test_tie_accumulation.py: gradients of parameters tied across ranks accumulated
over several ``step()`` calls without ``zero_grad`` (gradient accumulation), against the unsplit model."""
from __future__ import annotations

import copy

import torch

from pipesched.runtime import Pipeline
from pipesched.runtime.ties import digest

from rt_cases import reference_step
from rt_tied import ATOL, M, RTOL, _names, batches, ce, tied_model


def accumulated(rank, schedule, v, balance, dp=1, steps=2, **options):
    """``steps`` calls of ``step()`` with no ``zero_grad`` between them, then one SGD step; per parameter of this
    rank: its ``.grad`` close to the unsplit model's accumulated gradient (the average over replicas of each
    batch's, summed over the calls), the weights after the SGD step close, and the digests of the tied copies."""
    model = tied_model()
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, schedule=schedule, num_microbatches=M, loss_fn=ce, virtual_stages=v, balance=balance,
                    dp_size=dp, **options)
    mine, refs = _names(model, pipe), dict(ref.named_parameters())
    total = {}
    for replicas in batches(steps, dp):
        x, y = replicas[pipe.grid.dp_rank]
        pipe.step(x, target=y)
        for xr, yr in replicas:
            ref.zero_grad(set_to_none=True)
            reference_step(ref, xr, yr, M, ce)
            for name, p in ref.named_parameters():
                total[name] = total.get(name, 0) + p.grad / dp
    grads_close = {n: bool(torch.allclose(p.grad, total[n], rtol=RTOL, atol=ATOL)) for n, p in mine.items()}
    tied = {t.names[0] for t in pipe.ties}
    for name, p in ref.named_parameters():
        p.grad = total[name]
    opt, ref_opt = torch.optim.SGD(pipe.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    opt.step(), ref_opt.step()
    out = {"grads_close": grads_close, "tied": sorted(tied),
           "weights_close": all(torch.allclose(p, refs[n], rtol=RTOL, atol=ATOL) for n, p in mine.items()),
           "copies": {n: digest(p) for n, p in mine.items() if n in tied}}
    pipe.close()
    return out


def suite(rank):
    torch.set_num_threads(1)
    return {"1f1b": accumulated(rank, "1f1b", 1, [4, 3]),
            "interleaved split": accumulated(rank, "interleaved-1f1b", 2, [2, 2, 2, 1], steps=3,
                                             split_backward=True)}


def dp_suite(rank):
    torch.set_num_threads(1)
    return {"1f1b dp": accumulated(rank, "1f1b", 1, [4, 3], dp=2)}
