"""Per-rank bodies of tests/runtime/test_v_shape.py: zbv and dualpipev (V placement, I/W) against the unsplit
model, on 2 and 4 ranks; each suite runs many cases on one set of spawned ranks and returns plain results."""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from pipesched.runtime import Pipeline, PipelineError

from rt_cases import grad_report, mlp, pair, reference_forward, reference_step
from rt_workers import _data, dp_case, message_order, transparency


def forward_case(rank, m=4):
    """forward(): the output lands on the last stage's rank, which the V puts on pipeline rank 0."""
    model, ref = pair()
    pipe = Pipeline(model, schedule="zbv", num_microbatches=m, loss_fn=F.mse_loss)
    x, _ = _data(1)
    out = pipe.forward(x)
    expect = reference_forward(ref, x, m)
    pipe.close()
    return None if out is None else bool(torch.equal(out, expect))


def failing_up_stage(rank, fail_mb=1):
    """A layer of the up stage of pipeline rank 1 (stage 2p - 2) raises at microbatch ``fail_mb``: every rank
    ends with that rank's error."""
    p = torch.distributed.get_world_size()
    model = mlp(num_layers=2 * p)
    calls = {"n": 0}

    def hook(module, args):
        calls["n"] += 1
        if calls["n"] == fail_mb + 1:
            raise ValueError(f"boom at microbatch {fail_mb}")

    if rank == 1:
        model[2 * p - 2].register_forward_pre_hook(hook)
    pipe = Pipeline(model, schedule="zbv", num_microbatches=4, loss_fn=F.mse_loss, timeout=30.0)
    start = time.monotonic()
    try:
        pipe.step(*_data(0))
    except PipelineError as exc:
        return {"rank": exc.rank, "instr": exc.instr, "cause": exc.cause, "elapsed": time.monotonic() - start}
    return None


def bad_virtual_stages(rank):
    """virtual_stages=3 is refused on every rank when Pipeline is built, before any message."""
    try:
        Pipeline(mlp(num_layers=6), schedule="zbv", num_microbatches=4, loss_fn=F.mse_loss, virtual_stages=3)
    except ValueError as exc:
        return type(exc).__name__, getattr(exc, "argument", None), str(exc)
    return None


def tied_first_and_last(rank, schedule="zbv", m=4):
    """Blocks 0 and 7 are one module (an embedding tied to a head): the V puts both on rank 0, so no TIE_REDUCE;
    per step the loss and the shared weight's gradient (both uses summed) equal the unsplit model's."""
    model, ref = pair()
    model[7], ref[7] = model[0], ref[0]
    pipe = Pipeline(model, schedule=schedule, num_microbatches=m, loss_fn=F.mse_loss)
    opt, ref_opt = torch.optim.AdamW(pipe.parameters(), lr=0.01), torch.optim.AdamW(ref.parameters(), lr=0.01)
    out = []
    for step in range(2):
        x, y = _data(step)
        loss = pipe.step(x, target=y)
        ref_loss = reference_step(ref, x, y, m)
        count, equal, worst = grad_report(pipe, model, ref)
        out.append((bool(torch.equal(loss, ref_loss)), count, equal, worst))
        opt.step(); opt.zero_grad(); ref_opt.step(); ref_opt.zero_grad()
    reduces = sum(i.op.value == "TIE_REDUCE" for s in pipe.program.ranks for i in s)
    pipe.close()
    return {"steps": out, "tie_reduces": reduces}


def two_rank_suite(rank):
    torch.set_num_threads(1)
    results = {"bad_v": bad_virtual_stages(rank)}
    for m in (1, 3, 4, 5):
        results[("m", m)] = transparency(rank, "zbv", 2, m=m, n=10, steps=2)
    results["recompute"] = transparency(rank, "zbv", 2, m=4, steps=2, recompute=True)
    results["program_order"] = transparency(rank, "zbv", 2, m=4, steps=2, early_receives=False)
    results["uneven"] = transparency(rank, "zbv", 2, m=4, n=10, steps=1)
    results["forward"] = forward_case(rank)
    for early in (True, False):
        results[("order", early)] = message_order(rank, "zbv", None, early)  # messages both ways per pair
    results["failure"] = failing_up_stage(rank)
    results["tied"] = tied_first_and_last(rank)
    for m in (1, 3, 4, 6):  # dualpipev: m < 2p runs too; B and I/W mixed on one stage
        results[("dualpipev", m)] = transparency(rank, "dualpipev", 2, m=m, n=12, steps=2)
    results[("dualpipev", "recompute")] = transparency(rank, "dualpipev", 2, m=5, n=10, steps=2, recompute=True)
    return results


def four_rank_suite(rank):
    torch.set_num_threads(1)
    results = {}
    for m in (2, 4, 7, 8):
        results[("m", m)] = transparency(rank, "zbv", 2, m=m, n=8, steps=2)
    results["recompute"] = transparency(rank, "zbv", 2, m=7, steps=2, recompute=True)
    results["dp"] = dp_case(rank, "zbv", 2)
    results["dp_recompute"] = dp_case(rank, "zbv", 2, recompute=True)
    results["forward"] = forward_case(rank, m=5)
    for m in (3, 8):
        results[("dualpipev", m)] = transparency(rank, "dualpipev", 2, m=m, n=8, steps=2)
    results[("dualpipev", "dp")] = dp_case(rank, "dualpipev", 2)
    return results
