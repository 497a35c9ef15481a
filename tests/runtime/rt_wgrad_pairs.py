"""Per-rank bodies of tests/runtime/test_wgrad_pairs.py: Pipeline with ``gradient_accumulation_fusion=True`` and
``pair_weight_grads=True`` against the unsplit model (one microbatch at a time) and against fusion alone."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from pipesched.runtime import Pipeline

from rt_cases import mlp, reference_step


def _data(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randn(n, 8, generator=g)


def _worst(pipe, model, other):
    """Over this rank's parameters: (count, all allclose(rtol=1e-5, atol=1e-6), largest absolute difference)
    of the gradients against ``other``'s (same names)."""
    mine, theirs = {id(p) for p in pipe.parameters()}, dict(other.named_parameters())
    count, close, worst = 0, True, 0.0
    for name, p in model.named_parameters():
        if id(p) not in mine:
            continue
        count += 1
        r = theirs[name].grad
        if p.grad is None or r is None:
            return count, False, float("inf")
        close &= bool(torch.allclose(p.grad, r, rtol=1e-5, atol=1e-6))
        worst = max(worst, float((p.grad - r).abs().max()))
    return count, close, worst


def compare(rank, schedule, v, m, dp=1, steps=3, rows=2, **options):
    """``steps`` AdamW steps of a paired pipeline, a fused-only one and the unsplit model on the same data
    (8 x Linear(8) + Tanh, ``rows`` rows per microbatch, each replica its shard); per step the gradient
    comparisons; the paired executor's :class:`~pipesched.runtime.wgrad_fusion.PairStats`."""
    model = mlp()
    plain, ref = copy.deepcopy(model), copy.deepcopy(model)
    pipe = Pipeline(model, schedule=schedule, num_microbatches=m, loss_fn=F.mse_loss, virtual_stages=v,
                    dp_size=dp, gradient_accumulation_fusion=True, pair_weight_grads=True, **options)
    fused = Pipeline(plain, schedule=schedule, num_microbatches=m, loss_fn=F.mse_loss, virtual_stages=v,
                     dp_size=dp, gradient_accumulation_fusion=True, **options)
    opts = [torch.optim.AdamW(x.parameters(), lr=0.01) for x in (pipe, fused, ref)]
    n = rows * m
    shard = slice(n * pipe.grid.dp_rank, n * (pipe.grid.dp_rank + 1))
    out = []
    for step in range(steps):
        x, y = _data(step, n * dp)
        pipe.step(x[shard], target=y[shard])
        fused.step(x[shard], target=y[shard])
        reference_step(ref, x, y, m * dp)
        count, close_ref, worst_ref = _worst(pipe, model, ref)
        _, close_fused, worst_fused = _worst(pipe, model, plain)
        out.append({"grads": count, "close_ref": close_ref, "worst_ref": worst_ref, "close_fused": close_fused,
                    "worst_fused": worst_fused})
        for opt in opts:
            opt.step()
            opt.zero_grad()
    stats = pipe._executor.pair_stats.as_dict()
    pairing = pipe._executor.pair_wgrad  # after the last step (zb-auto rebuilds its executor after step 1)
    assert (pipe.pair_weight_grads, fused.pair_weight_grads) == (True, False)
    fused_stats = fused._executor.pair_stats.as_dict()
    ops = sorted({i.op.value for i in pipe.program.ranks[pipe.pp_rank]})
    split_stages = sum(1 for s in pipe.stage_ids if s > 0)  # stage 0's W is its whole backward: nothing fused
    pipe.close()
    fused.close()
    return {"steps": out, "stats": stats, "fused_stats": fused_stats, "ops": ops,
            "split_stages": split_stages, "pairing": pairing}


def suite(rank):
    """zbv and zb-h1 at m = 4 and m = 3 on 2 ranks, zbv with recompute and 1f1b (its B run as I then W) at m = 4,
    then the construction refusals (every rank, before any communication)."""
    out = {f"{s}-m{m}": compare(rank, s, v, m) for s, v in (("zbv", 2), ("zb-h1", 1)) for m in (4, 3)}
    out["zbv-recompute"] = compare(rank, "zbv", 2, 4, recompute=True)
    out["1f1b"] = compare(rank, "1f1b", 1, 4)
    for name, kwargs in (("no-fusion", {"pair_weight_grads": True}),
                         ("fusion-false", {"pair_weight_grads": True, "gradient_accumulation_fusion": False}),
                         ("not-bool", {"pair_weight_grads": "yes", "gradient_accumulation_fusion": True}),
                         ("int", {"pair_weight_grads": 1, "gradient_accumulation_fusion": True})):
        try:
            Pipeline(mlp(), schedule="zbv", num_microbatches=4, **kwargs)
        except (TypeError, ValueError) as exc:
            out[name] = (type(exc).__name__, str(exc))
    return out


def replicated(rank):
    """zbv, p = 2 x dp = 2, m = 4."""
    return compare(rank, "zbv", 2, 4, dp=2)


def measured_zb_auto(rank):
    """zb-auto with costs measured in step 1 (then the executor is rebuilt for the compiled program), m = 4."""
    return compare(rank, "zb-auto", 1, 4)
