"""Per-rank bodies of tests/runtime/test_user_programs.py: Pipeline(schedule=program) with user programs (the
catalogue's hand-written example, a looped one, one with its own R/I/W, one with its own dp_size) and a registered
user schedule (examples/chunked_gpipe.py), each against the unsplit model; bad programs refused on every rank."""
from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn.functional as F

import pipesched as ps
from pipesched.ir import Op
from pipesched.registry import REGISTRY
from pipesched.runtime import Pipeline

from rt_cases import grad_report, mlp, params_equal, reference_forward, reference_step

ROOT = Path(__file__).resolve().parents[2]
HANDWRITTEN = ROOT / "schedules" / "examples" / "handwritten-1f1b-p2-m3.txt"
BROKEN = ROOT / "schedules" / "examples" / "broken-deadlock.txt"
EXAMPLE_MODULE = ROOT / "examples" / "chunked_gpipe.py"


def as_text(program):
    """The program as a user has it: written to its text form and read back."""
    return ps.loads(ps.to_text(program))


def against_unsplit(rank, schedule, num_layers=4, n=6, steps=2, **options):
    """``steps`` AdamW steps and a forward: per step (grads compared, bitwise, loss bitwise); weights bitwise at
    the end; the forward's output bitwise on the last stage's rank (None elsewhere)."""
    model = mlp(num_layers=num_layers)
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, schedule=schedule, loss_fn=F.mse_loss, **options)
    m = pipe.program.num_microbatches
    opt, ref_opt = (torch.optim.AdamW(p, lr=0.05) for p in (pipe.parameters(), ref.parameters()))
    g = torch.Generator().manual_seed(11)
    out = {"steps": [], "m": m, "stage_ids": pipe.stage_ids, "schedule": pipe.program.schedule,
           "programs_derived": pipe.programs == ps.step_programs(pipe.programs.learn_train, "gloo"),
           "R": sorted(pipe.program.stages_with(Op.R)), "I": sorted(pipe.program.stages_with(Op.I))}
    for _ in range(steps):
        x, y = torch.randn(n, 8, generator=g), torch.randn(n, 8, generator=g)
        loss = pipe.step(x, target=y)
        ref_loss = reference_step(ref, x, y, m)
        count, bitwise, _ = grad_report(pipe, model, ref)
        out["steps"].append((count, bitwise, bool(torch.equal(loss, ref_loss))))
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    out["params_equal"] = params_equal(pipe, model, ref)
    x = torch.randn(n, 8, generator=g)
    y = pipe.forward(x)
    out["forward"] = None if y is None else bool(torch.equal(y, reference_forward(ref, x, m)))
    pipe.close()
    return out


def own_dp_size(rank):
    """A program of 1 rank with dp_size 2 on a world of 2: Pipeline's dp_size left at 1, the program's 2 wins.
    Each replica steps on its own batch; the gradients are the mean of the two replicas' (1e-6 relative)."""
    program = as_text(ps.compile_program("1f1b", 1, 2, dp_size=2))
    model = mlp(num_layers=2)
    refs = [copy.deepcopy(model) for _ in range(2)]
    pipe = Pipeline(model, schedule=program, loss_fn=F.mse_loss)
    batches = [(torch.randn(4, 8, generator=torch.Generator().manual_seed(20 + k)),
                torch.randn(4, 8, generator=torch.Generator().manual_seed(30 + k))) for k in range(2)]
    loss = pipe.step(*batches[rank])
    ref_losses = [reference_step(ref, x, y, 2) for ref, (x, y) in zip(refs, batches)]
    grads = [dict(ref.named_parameters()) for ref in refs]
    worst = 0.0
    for name, p in model.named_parameters():
        want = (grads[0][name].grad + grads[1][name].grad) / 2
        worst = max(worst, float((p.grad - want).abs().max() / want.abs().max()))
    out = {"dp": (pipe.grid.dp_size, pipe.grid.pp_size), "loss_equal": bool(torch.equal(loss, ref_losses[rank])),
           "worst": worst}
    pipe.close()
    return out


def refused(rank, schedule, **options):
    """``Pipeline(...)`` with a program it must refuse: the exception's type and message on this rank."""
    try:
        Pipeline(mlp(num_layers=4), schedule=schedule, loss_fn=F.mse_loss, **options)
    except Exception as exc:  # noqa: BLE001 - the test compares what each rank raised
        return type(exc).__name__, str(exc)
    return None, "no error"


def suite(rank):
    torch.set_num_threads(1)
    results = {}
    handwritten = ps.load(HANDWRITTEN)
    results["handwritten"] = against_unsplit(rank, handwritten)
    results["handwritten-uneven"] = against_unsplit(rank, handwritten, n=7, steps=1, num_microbatches=3)
    results["registered-import"] = REGISTRY.import_module(str(EXAMPLE_MODULE))  # in this rank's process
    results["registered"] = against_unsplit(rank, "chunked-gpipe", num_microbatches=4, n=8)
    results["looped"] = against_unsplit(rank, as_text(ps.compile_program("interleaved-1f1b", 2, 4, 2)), n=8)
    results["own-r-i-w"] = against_unsplit(
        rank, as_text(ps.compile_program("1f1b", 2, 4, recompute=True, split_backward=True)), n=8)
    results["own-dp"] = own_dp_size(rank)
    results["deadlock"] = refused(rank, ps.load(BROKEN))
    results["ranks"] = refused(rank, ps.compile_program("1f1b", 4, 2))
    results["microbatches"] = refused(rank, handwritten, num_microbatches=4)
    results["recompute"] = refused(rank, handwritten, recompute=True)
    ps.register_schedule("by-rank", lambda p, m, v: ps.build("1f1b" if rank == 0 else "gpipe", p, m),
                         "a builder whose program depends on the rank (as one drawing random numbers would)")
    results["by-rank"] = refused(rank, "by-rank", num_microbatches=4)
    results["after"] = against_unsplit(rank, handwritten, steps=1)  # nothing left waiting: the next one runs
    return results
