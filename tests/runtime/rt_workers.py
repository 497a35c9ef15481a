"""Per-rank bodies of the multi-process runtime tests: each runs many cases on one set of spawned ranks
and returns plain results that the tests assert on in the parent process."""
from __future__ import annotations

import copy
import time

import torch
import torch.nn.functional as F

import pipesched
from pipesched.memory import peak_activation_bytes
from pipesched.runtime import Pipeline, PipelineError, stage_activation_bytes
from pipesched.runtime.transport import Transport

from rt_cases import (SCHEDULES, grad_report, pair, params_equal, reference_forward, reference_step, seq_model,
                      tuple_model, mlp)


def _data(seed, n=8, width=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=g), torch.randn(n, width, generator=g)


def transparency(rank, schedule, v, m=4, n=8, steps=3, layers=8, balance=None, early_receives=None, **options):
    """Several optimizer steps; per step: loss equal, grads bitwise; at the end params bitwise.
    ``options``: more Pipeline arguments (split_backward, recompute); ``early_receives=False``: every message at
    its program position, as with NCCL."""
    model, ref = pair(num_layers=layers)
    pipe = Pipeline(model, schedule=schedule, num_microbatches=m, loss_fn=F.mse_loss, virtual_stages=v,
                    balance=balance, early_receives=early_receives, **options)
    opt, ref_opt = torch.optim.AdamW(pipe.parameters(), lr=0.01), torch.optim.AdamW(ref.parameters(), lr=0.01)
    out = []
    for step in range(steps):
        x, y = _data(step, n)
        loss = pipe.step(x, target=y)
        ref_loss = reference_step(ref, x, y, m)
        count, equal, worst = grad_report(pipe, model, ref)
        out.append({"loss_equal": bool(torch.equal(loss, ref_loss)), "loss": float(loss), "grads": count,
                    "bitwise": equal, "worst": worst})
        opt.step(); opt.zero_grad(); ref_opt.step(); ref_opt.zero_grad()
    return {"steps": out, "params_equal": params_equal(pipe, model, ref),
            "events": len(pipe.timeline().events), "stream": len(pipe.program.ranks[pipe.pp_rank]),
            "ops": sorted({e.instr.op.value for e in pipe.timeline().events})}


def tuple_flow(rank):
    model = tuple_model()
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, schedule="interleaved-1f1b", num_microbatches=4, loss_fn=F.mse_loss,
                    virtual_stages=2, balance=[2, 1, 1, 1])
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(8, 3, 8, generator=g), torch.randint(0, 11, (8, 3), generator=g),
         torch.rand(8, 3, generator=g) > 0.3)
    y = torch.randn(8, 3, 8, generator=g)
    loss = pipe.step(x, target=y)
    ref_loss = reference_step(ref, x, y, 4)
    count, equal, _ = grad_report(pipe, model, ref)
    return {"stages": pipe.stage_ids, "loss_equal": bool(torch.equal(loss, ref_loss)), "grads": count, "bitwise": equal}


def seq_lengths(rank):
    """Forward before, between and after steps, with the sequence length changing (5, 7, 6, 5)."""
    model = seq_model()
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=4, loss_fn=F.mse_loss)
    g = torch.Generator().manual_seed(7)
    results = []
    for kind, length in (("forward", 5), ("step", 5), ("forward", 6), ("step", 7), ("step", 5), ("forward", 7)):
        x, y = torch.randn(8, length, 8, generator=g), torch.randn(8, length, 8, generator=g)
        if kind == "forward":
            out = pipe.forward(x)
            expect = reference_forward(ref, x, 4)
            results.append((kind, length, out is None if rank == 0 else bool(torch.equal(out, expect))))
            continue
        loss = pipe.step(x, target=y)
        ref_loss = reference_step(ref, x, y, 4)
        _, equal, _ = grad_report(pipe, model, ref)
        results.append((kind, length, equal and bool(torch.equal(loss, ref_loss))))
        for p in model.parameters():
            p.grad = None
        for p in ref.parameters():
            p.grad = None
    return {"results": results, "signatures": pipe.learned_steps}


def recompute_bitwise(rank, schedule, v):
    """Dropout model: grads with recompute == grads without, bitwise, over two steps."""
    grads = {}
    for flag in (False, True):
        model = mlp(dropout=0.25)
        pipe = Pipeline(model, schedule=schedule, num_microbatches=4, loss_fn=F.mse_loss, virtual_stages=v,
                        recompute=flag)
        for step in range(2):
            x, y = _data(step)
            torch.manual_seed(100 + rank + step)
            loss = pipe.step(x, target=y)
        grads[flag] = ([p.grad.clone() for p in pipe.parameters()], float(loss),
                       any(i.op is pipesched.Op.R for i in pipe.program.ranks[pipe.pp_rank]))
    same = all(torch.equal(a, b) for a, b in zip(grads[False][0], grads[True][0]))
    return {"bitwise": same, "count": len(grads[True][0]), "loss_equal": grads[False][1] == grads[True][1],
            "has_r": grads[True][2]}


def memory(rank, schedule, v, tanh_first):
    """Measured peak activation bytes with and without recompute, next to the prediction and the stage
    input bytes: ``{recompute: (measured, predicted, timeline's value, input bytes of this rank's stages)}``."""
    out = {"inflight": None}
    for flag in (False, True):
        model = mlp(num_layers=8, width=16, tanh_first=tanh_first)
        pipe = Pipeline(model, schedule=schedule, num_microbatches=4, loss_fn=F.mse_loss, virtual_stages=v,
                        recompute=flag)
        x, y = _data(0, n=16, width=16)
        pipe.step(x, target=y)
        sizes = stage_activation_bytes(model, x[:4], pipe.program.num_stages, loss_fn=F.mse_loss, target=y[:4])
        predicted = peak_activation_bytes(pipe.program, pipesched.CostModel(**sizes))
        inputs = max(sizes["input_bytes"][s] for s in pipe.stage_ids)
        out[flag] = (pipe.peak_activation_bytes, predicted[pipe.pp_rank], pipe.timeline().peak_activation_bytes[rank],
                     inputs)
        out["inflight"] = pipe.timeline().peak_inflight[pipe.pp_rank]
    return out


def small_batches(rank):
    """Rejected inputs: batch 3 < m=4 on every rank and only on the first stage's rank, no x on the first
    stage's rank, no target on the last stage's rank, a target of the wrong batch size. Each is a plain
    ValueError on every rank (the checking rank's message relayed); the pipeline stays usable."""
    model, ref = pair()
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=4, loss_fn=F.mse_loss)
    x, y = _data(0)
    errors = []
    cases = ((x[:3], y[:3]), (x[:3] if rank == 0 else None, y[:3]), (None, y), (x, None if rank == 1 else y),
             (x, y[:5]))
    for x_here, y_here in cases:
        try:
            pipe.step(x_here, target=y_here)
            errors.append(None)
        except Exception as exc:  # noqa: BLE001 - the test asserts the exact type
            errors.append((type(exc).__name__, str(exc)))
    loss = pipe.step(x, target=y)
    ref_loss = reference_step(ref, x, y, 4)
    return {"errors": errors, "then_ok": bool(torch.equal(loss, ref_loss)) and grad_report(pipe, model, ref)[1]}


def last_step_records(rank):
    """A forward() after a step() leaves the step's timeline and peak in place; kind="forward" gives its own."""
    pipe = Pipeline(mlp(), schedule="1f1b", num_microbatches=4, loss_fn=F.mse_loss)
    before = (pipe.timeline(), pipe.peak_activation_bytes)
    x, y = _data(0)
    pipe.step(x, target=y)
    step_peak = pipe.peak_activation_bytes
    pipe.forward(x)
    step_tl, forward_tl = pipe.timeline(), pipe.timeline(kind="forward")
    gathered, gathered_fwd = pipe.gather_timeline(), pipe.gather_timeline(kind="forward")
    pipe.close()
    return {"before": before, "step_peak": step_peak, "peak_after_forward": pipe.peak_activation_bytes,
            "step_ops": sorted({e.instr.op.value for e in step_tl.events}), "step_events": len(step_tl.events),
            "forward_ops": sorted({e.instr.op.value for e in forward_tl.events}),
            "kinds": (step_tl.meta["step"], forward_tl.meta["step"], gathered.meta["step"], gathered_fwd.meta["step"]),
            "gathered_events": (len(gathered.events), len(gathered_fwd.events)),
            "bubbles": (step_tl.bubble_per_rank(), step_tl.bubble_fraction, gathered.bubble_per_rank())}


def accumulate(rank):
    """Two steps without zeroing: .grad holds the sum, like two backward passes of the plain model."""
    model, ref = pair()
    pipe = Pipeline(model, schedule="interleaved-1f1b", num_microbatches=4, loss_fn=F.mse_loss, virtual_stages=2)
    for step in range(2):
        x, y = _data(10 + step)
        pipe.step(x, target=y)
        reference_step(ref, x, y, 4)
    return grad_report(pipe, model, ref)


def message_order(rank, schedule, v, early_receives):
    """Every send and receive post this rank makes, in call order, as ("send" | "recv", peer, tag), over a step
    that learns the shapes, a step that knows them and a forward; ``early_receives=False`` runs the NCCL
    discipline. Logged by wrapping the point-to-point calls of every ``Transport`` while it runs."""
    pipe = Pipeline(mlp(), schedule=schedule, num_microbatches=4, loss_fn=F.mse_loss, virtual_stages=v,
                    early_receives=early_receives)
    ops, send, post = [], Transport.send, Transport.post

    def logged_send(transport, tensors, peer, tag):
        ops.append(("send", peer, tag))
        return send(transport, tensors, peer, tag)

    def logged_post(transport, specs, peer, tag, what):
        ops.append(("recv", peer, tag))
        return post(transport, specs, peer, tag, what)

    Transport.send, Transport.post = logged_send, logged_post
    try:
        x, y = _data(0)
        pipe.step(x, target=y)
        pipe.step(x, target=y)
        pipe.forward(x)
    finally:
        Transport.send, Transport.post = send, post
    pipe.close()
    return ops


def two_rank_suite(rank):
    results = {"small": small_batches(rank), "records": last_step_records(rank), "accumulate": accumulate(rank)}
    for schedule, v in SCHEDULES:
        results[("transparency", schedule)] = transparency(rank, schedule, v)
        results[("split", schedule)] = transparency(rank, schedule, v, steps=2, split_backward=True)
    # every stage split, stage 0 too (its input needs no gradient: its W is the whole backward), recomputed
    results["split_all"] = transparency(rank, "1f1b", 1, steps=2, split_backward=[True, True], recompute=True)
    results["uneven"] = transparency(rank, "1f1b", 1, m=4, n=10, steps=1)
    results["tuple"] = tuple_flow(rank)
    for schedule, v in SCHEDULES:
        for early in (True, False):
            results[("order", schedule, early)] = message_order(rank, schedule, v, early)
    results["program_order"] = transparency(rank, "interleaved-1f1b", 2, steps=2, early_receives=False,
                                            split_backward=True)
    results["seq"] = seq_lengths(rank)
    for schedule, v in SCHEDULES:
        results[("recompute", schedule)] = recompute_bitwise(rank, schedule, v)
        results[("memory", schedule)] = memory(rank, schedule, v, tanh_first=False)
        results[("memory-tanh-first", schedule)] = memory(rank, schedule, v, tanh_first=True)
    pipe = Pipeline(mlp(), schedule="1f1b", num_microbatches=4, loss_fn=F.mse_loss)
    pipe.step(*_data(0))
    results["gathered"] = pipe.gather_timeline()
    pipe.close()
    try:
        pipe.step(*_data(0))
    except RuntimeError as exc:
        results["closed"] = str(exc)
    return results


def dp_case(rank, schedule, v, tied=False, **options):
    """DP x PP = 2 x 2: replica k trains on shard k; grads = mean of the shards' reference grads.
    ``tied``: layers 0 and 4 share one Linear (stages 0 and 2 of interleaved, both on pipeline rank 0)."""
    model, ref = pair()
    if tied:
        model[4], ref[4] = model[0], ref[0]
    pipe = Pipeline(model, schedule=schedule, num_microbatches=4, loss_fn=F.mse_loss, virtual_stages=v, dp_size=2,
                    **options)
    x, y = _data(3, n=16)
    shard = pipe.grid.dp_rank
    loss = pipe.step(x[shard * 8:(shard + 1) * 8], target=y[shard * 8:(shard + 1) * 8])
    ref_losses = []
    ref_grads = []
    for k in range(2):
        ref.zero_grad(set_to_none=True)
        ref_losses.append(reference_step(ref, x[k * 8:(k + 1) * 8], y[k * 8:(k + 1) * 8], 4))
        ref_grads.append({n: p.grad.clone() for n, p in ref.named_parameters()})
    for n, p in ref.named_parameters():
        p.grad = (ref_grads[0][n] + ref_grads[1][n]) / 2
    count, _, worst = grad_report(pipe, model, ref)
    return {"loss_equal": bool(torch.equal(loss, ref_losses[shard])), "grads": count, "worst": worst,
            "pp_rank": pipe.pp_rank, "dp_rank": shard, "params": len(list(pipe.parameters()))}


def failing_case(rank, fail_rank, fail_mb, world, timeout=30.0, linger=10.0, dp_size=1):
    """A layer on ``fail_rank`` raises at microbatch ``fail_mb``; every rank reports what it raised and when."""
    pp = world // dp_size
    model = mlp(num_layers=pp)
    calls = {"n": 0}

    def hook(module, args):
        calls["n"] += 1
        if calls["n"] == fail_mb + 1:
            raise ValueError(f"boom at microbatch {fail_mb}")

    if rank == fail_rank:
        model[fail_rank % pp].register_forward_pre_hook(hook)
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=4, loss_fn=F.mse_loss, timeout=timeout, dp_size=dp_size)
    start = time.monotonic()
    try:
        pipe.step(*_data(0))
    except PipelineError as exc:
        elapsed = time.monotonic() - start
        if rank == fail_rank:
            time.sleep(linger)  # the peers must not need this process to exit
        again = None
        try:
            pipe.step(*_data(0))
        except PipelineError as second:
            again = str(second)
        return {"type": "PipelineError", "rank": exc.rank, "instr": exc.instr, "op": exc.op, "stage": exc.stage,
                "microbatch": exc.microbatch, "cause": exc.cause, "message": str(exc), "elapsed": elapsed,
                "again": again, "cause_type": type(exc.__cause__).__name__}
    return {"type": None}


def four_rank_suite(rank):
    results = {}
    for schedule, v in SCHEDULES:
        results[("transparency", schedule)] = transparency(rank, schedule, v, steps=2)
    results["m<p"] = transparency(rank, "1f1b", 1, m=2, n=8, steps=2)
    results["split"] = transparency(rank, "interleaved-1f1b", 2, steps=2, split_backward=True)
    for schedule, v in SCHEDULES:
        results[("dp", schedule)] = dp_case(rank, schedule, v)
    results["dp_split"] = dp_case(rank, "1f1b", 1, split_backward=True)
    results["dp_tied"] = dp_case(rank, "interleaved-1f1b", 2, tied=True)
    for schedule, v in (("1f1b", 1), ("interleaved-1f1b", 2)):
        for early in (True, False):
            results[("order", schedule, early)] = message_order(rank, schedule, v, early)
    # replica 1 (world ranks 2 and 3) asks for 8 microbatches, replica 0 for 4: every rank must refuse at once
    results["replica_mismatch"] = mismatch_case(rank, num_microbatches=(4, 4, 8, 8), dp_size=(2, 2, 2, 2))
    results["failure"] = failing_case(rank, fail_rank=2, fail_mb=1, world=4, linger=1.0)
    # DP x PP = 2 x 2: world rank 1 (replica 0, stage 1) fails; replica 1 learns it at its all-reduce
    results["dp_failure"] = failing_case(rank, fail_rank=1, fail_mb=1, world=4, dp_size=2, linger=1.0)
    return results


def hang_case(rank, timeout):
    """Rank 1's layer stalls longer than the timeout on its first call: rank 0 must give up in time."""
    model = mlp(num_layers=2)
    if rank == 1:
        model[1].register_forward_pre_hook(lambda m, a: time.sleep(3 * timeout))
    pipe = Pipeline(model, schedule="gpipe", num_microbatches=2, loss_fn=F.mse_loss, timeout=timeout)
    start = time.monotonic()
    try:
        pipe.step(*_data(0))
    except PipelineError as exc:
        return {"type": "PipelineError", "rank": exc.rank, "message": str(exc), "elapsed": time.monotonic() - start}
    return {"type": None}


def mismatch_case(rank, **per_rank):
    """Rank r builds its Pipeline with ``{name: values[r]}`` for each keyword: a user error every rank must
    report at construction, not a hang."""
    kwargs = {"schedule": "1f1b", "num_microbatches": 4, "loss_fn": F.mse_loss, "timeout": 30.0}
    kwargs.update({name: values[rank] for name, values in per_rank.items()})
    start = time.monotonic()
    try:
        Pipeline(mlp(num_layers=2), **kwargs)
    except (TypeError, ValueError) as exc:
        return {"type": type(exc).__name__, "message": str(exc), "elapsed": time.monotonic() - start}
    return {"type": None}


class _ReluInPlace(torch.nn.Module):
    def forward(self, x):
        return x.relu_()  # in place, with no inplace=True attribute: not a layer the stage can give a copy to


def inplace_case(rank):
    """Stage 1 starts with a layer writing its input in place (x.relu_(), no inplace=True attribute): fine in the
    unsplit model, refused on a stage input (a first layer with inplace=True gets a copy:
    tests/runtime/test_inplace_first_layer.py)."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), _ReluInPlace(), torch.nn.Linear(8, 8))
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, balance=[1, 2], timeout=30.0)
    try:
        pipe.step(*_data(0))
    except PipelineError as exc:
        return {"rank": exc.rank, "instr": exc.instr, "cause": exc.cause}
    return {"rank": None}


class _Double(torch.nn.Module):
    def forward(self, x):
        return x.mul_(2)  # in place, on stage 0's input (which needs no gradient): allowed by autograd


def inplace_recompute_case(rank):
    """Stage 0 changes its input in place; recomputing from that input would silently change gradients."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Double(), torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, balance=[2, 2],
                    recompute=True, timeout=30.0)
    try:
        pipe.step(*_data(0))
    except PipelineError as exc:
        return {"rank": exc.rank, "instr": exc.instr, "cause": exc.cause}
    return {"rank": None}


def failure_suite(rank):
    hang = hang_case(rank, timeout=3.0)  # first: its stalled rank arrives late at the next group creation
    return {"hang": hang, "raise": failing_case(rank, fail_rank=1, fail_mb=2, world=2), "inplace": inplace_case(rank),
            "inplace_recompute": inplace_recompute_case(rank),
            "other_schedule": mismatch_case(rank, schedule=("1f1b", "gpipe")),
            "other_m": mismatch_case(rank, num_microbatches=(4, 2)),
            "other_dp": mismatch_case(rank, dp_size=(1, 2)),
            "refused": mismatch_case(rank, balance=(None, [2, 0]))}


def store_host_exits(rank, timeout):
    """World rank 0 (which hosts the store) times out waiting for stalled rank 1 and returns at once, so its
    process would exit; rank 1 wakes later and must still read rank 0's failure record."""
    model = mlp(num_layers=2)
    if rank == 1:
        model[1].register_forward_pre_hook(lambda m, a: time.sleep(3 * timeout))
    pipe = Pipeline(model, schedule="gpipe", num_microbatches=2, loss_fn=F.mse_loss, timeout=timeout)
    try:
        pipe.step(*_data(0))
    except PipelineError as exc:
        return {"type": "PipelineError", "rank": exc.rank, "pp_rank": exc.pp_rank, "instr": exc.instr,
                "lost": exc.record.lost, "message": str(exc)}
    return {"type": None}
