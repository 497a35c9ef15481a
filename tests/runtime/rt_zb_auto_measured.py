"""Per-rank bodies of tests/runtime/test_zb_auto_measured.py: ``Pipeline(schedule="zb-auto")`` without ``costs=``
measures them in its first step (a safe program), then runs zb-auto compiled from the agreed costs; every step
against the unsplit model."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import pipesched as ps
from pipesched.api import step_programs
from pipesched.program_io import fingerprint
from pipesched.runtime import Pipeline

from rt_cases import grad_report, pair, params_equal, reference_forward, reference_step

STEPS = 3


def _data(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randn(n, 8, generator=g)


def _costs(costs) -> dict | None:
    """The CostModel's per-stage seconds, latency and send overhead as plain values (compared across ranks
    bitwise)."""
    if costs is None:
        return None
    names = ("forward", "backward", "input_grad", "weight_grad", "recompute")
    return {"type": type(costs).__name__, "latency": costs.latency, "bandwidth": costs.bandwidth,
            "send_overhead": costs.send_overhead,
            **{name: costs.per_stage(name, 2) for name in names},
            "recompute_given": costs.recompute is not None}


def _program_state(pipe) -> dict:
    return {"schedule": pipe.program.schedule, "fingerprint": fingerprint(pipe.program),
            "costs": _costs(pipe.costs), "ops": sorted({i.op.value for i in pipe.program.ranks[pipe.pp_rank]})}


def _reference_grads(ref, x, y, m, dp_size, dp_rank):
    """The unsplit model's loss on this replica's shard and its gradients averaged over the replicas' shards (as
    the data-parallel all-reduce does: sum, then divide by dp_size)."""
    n = x.shape[0] // dp_size
    losses, grads = [], []
    for k in range(dp_size):
        ref.zero_grad(set_to_none=True)
        losses.append(reference_step(ref, x[k * n:(k + 1) * n], y[k * n:(k + 1) * n], m))
        grads.append({name: p.grad.clone() for name, p in ref.named_parameters()})
    for name, p in ref.named_parameters():
        total = grads[0][name]
        for g in grads[1:]:
            total = total + g[name]
        p.grad = total / dp_size if dp_size > 1 else total
    return losses[dp_rank]


def measured_case(rank, m, n, dp_size=1, memory_limit=None, recompute=False, forward_first=True):
    """``STEPS`` AdamW steps of zb-auto with measured costs; per step the loss and gradients against the unsplit
    model, the program and costs before the first step and after each."""
    torch.manual_seed(0)
    model, ref = pair(num_layers=4)
    pipe = Pipeline(model, schedule="zb-auto", num_microbatches=m, loss_fn=F.mse_loss, dp_size=dp_size,
                    memory_limit=memory_limit, recompute=recompute, timeout=120.0)
    out = {"before": _program_state(pipe), "dp_rank": pipe.grid.dp_rank, "pp_rank": pipe.pp_rank, "steps": []}
    shard = pipe.grid.dp_rank
    safe = pipe.programs  # the safe program's step programs, before the switch
    if forward_first:  # a forward before any step runs the safe program
        x, _ = _data(100, n)
        got = pipe.forward(x)
        out["forward_equal"] = None if got is None else bool(torch.equal(got, reference_forward(ref, x, m)))
    opt, ref_opt = torch.optim.AdamW(pipe.parameters(), lr=0.01), torch.optim.AdamW(ref.parameters(), lr=0.01)
    for step in range(STEPS):
        x, y = _data(step, n * dp_size)
        loss = pipe.step(x[shard * n:(shard + 1) * n], target=y[shard * n:(shard + 1) * n])
        ran = sorted({e.instr.op.value for e in pipe.timeline().events})
        # the instructions this rank ran, in order, against the stream it should have run: step 1 learns the
        # message shapes with the safe program, later steps run the zb-auto program
        should = safe.learn_train if step == 0 else pipe.programs.train
        ran_stream = [e.instr for e in pipe.timeline().events] == list(should.ranks[pipe.pp_rank])
        ref_loss = _reference_grads(ref, x, y, m, dp_size, shard)
        count, equal, worst = grad_report(pipe, model, ref)
        out["steps"].append({"loss_equal": bool(torch.equal(loss, ref_loss)), "grads": count, "bitwise": equal,
                             "worst": worst, "ran": ran, "ran_stream": ran_stream, **_program_state(pipe)})
        opt.step(); opt.zero_grad(); ref_opt.step(); ref_opt.zero_grad()
    out["params_equal"] = params_equal(pipe, model, ref)
    expected = ps.compile_program("zb-auto", 2, m, dp_size=dp_size, recompute=recompute, costs=pipe.costs,
                                  memory_limit=memory_limit)
    expected = step_programs(expected, "gloo").train
    out["expected_fingerprint"] = fingerprint(expected)
    out["program_equal"] = pipe.program == expected
    out["chosen"] = pipe.program.meta["zb_auto"]["chosen"]
    pipe.close()
    return out


def suite_two(rank):
    """2 ranks: the default limit (safe program zb-h1), and recompute with a limit of 1 (zb-h1 does not fit: the
    safe program is zb-auto for the default costs) on an uneven batch."""
    return {"default": measured_case(rank, m=4, n=8),
            "tight": measured_case(rank, m=4, n=10, memory_limit=1, recompute=True, forward_first=False),
            "tied": tied_case(rank),
            "mismatch": mismatch_case(rank), "limit_mismatch": limit_mismatch_case(rank)}


def tied_case(rank, steps=2):
    """The embedding tied to the head across the 2 ranks (rt_tied.tied_model): the zb-auto program compiled after
    the first step keeps the TIE_REDUCE; per step (no optimizer) the loss is bitwise the unsplit model's and the
    gradients equal it within rt_tied's tolerance (a tied gradient sums the same terms in another order)."""
    from rt_tied import ATOL, M, RTOL, batches, ce, tied_model
    model = tied_model()
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, schedule="zb-auto", num_microbatches=M, loss_fn=ce, timeout=120.0)
    mine = {id(p) for p in pipe.parameters()}
    out = []
    for (x, y), in batches(steps):
        loss = pipe.step(x, target=y)
        ref.zero_grad(set_to_none=True)
        ref_loss = reference_step(ref, x, y, M, ce)
        refs = dict(ref.named_parameters())
        close = all(torch.allclose(p.grad, refs[n].grad, rtol=RTOL, atol=ATOL)
                    for n, p in model.named_parameters() if id(p) in mine)
        out.append({"loss_equal": bool(torch.equal(loss, ref_loss)), "close": close, "schedule": pipe.program.schedule,
                    "tie_reduce": any(i.op.value == "TIE_REDUCE" for i in pipe.program.ranks[pipe.pp_rank])})
        model.zero_grad(set_to_none=True)
    pipe.close()
    return out


def mismatch_case(rank):
    """Rank 0 gives costs, rank 1 asks for them to be measured: refused at construction on both, naming costs."""
    costs = ps.CostModel() if rank == 0 else None
    try:
        Pipeline(pair(num_layers=2)[0], schedule="zb-auto", num_microbatches=2, loss_fn=F.mse_loss, costs=costs,
                 timeout=30.0)
    except ValueError as exc:
        return str(exc)
    return None


def limit_mismatch_case(rank):
    """Measured costs, memory_limit 3 on rank 1 and the default (min(p, m) = 2 per rank) on rank 0: refused at
    construction on both, naming memory_limit (every rank's safe program is the same zb-h1, so nothing else differs
    until the ranks compile zb-auto after the first step)."""
    try:
        Pipeline(pair(num_layers=2)[0], schedule="zb-auto", num_microbatches=8, loss_fn=F.mse_loss,
                 memory_limit=3 if rank == 1 else None, timeout=30.0)
    except ValueError as exc:
        return str(exc)
    return None


def suite_four(rank):
    """DP x PP = 2 x 2: replica k trains on shard k."""
    return {"dp": measured_case(rank, m=4, n=8, dp_size=2)}
