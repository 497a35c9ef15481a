"""Per-rank bodies of tests/runtime/test_one_rank_fault_*.py (2 spawned gloo ranks): a public collective call
outside ``step()`` that fails on ONE rank (a bad argument, a misuse, an error of its own) while the other rank waits
for it in that collective, or in the next one. Every case reports what each rank raised; the rank that failed then
waits, still alive with its process groups' connections open as far as launch is concerned, until every other rank
has raised (a store counter), at most ``WAIT_S`` seconds. So a fix that leaves the others blocked until the failing
process ends (or until the 60 s timeout) fails the assertions (``others_ended`` False, a ``lost`` record, a timed-out
wait naming itself) instead of only being slower: no timing assertion."""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import GradScaler, Pipeline, checkpoint_read, load_checkpoint, save_checkpoint

WIDTH = 8
TIMEOUT = 60.0  # the Pipeline's; a rank left waiting would end only after it, naming itself
WAIT_S = 20.0  # the failing rank waits at most this long for the others to have raised


def _model() -> nn.Sequential:
    """Linear, Tanh, Linear, Tanh: with ``balance=[3, 1]`` pipeline rank 1 holds only the last Tanh (no parameters)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh())


def _pipe(**kwargs) -> Pipeline:
    return Pipeline(_model(), schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, timeout=TIMEOUT, **kwargs)


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, WIDTH, generator=g), torch.randn(4, WIDTH, generator=g)


def _report(exc: BaseException | None) -> dict:
    if exc is None:
        return {"type": None}
    cause = exc.__cause__
    return {"type": type(exc).__name__, "message": str(exc), "rank": getattr(exc, "rank", None),
            "cause": getattr(exc, "cause", None), "lost": getattr(getattr(exc, "record", None), "lost", None),
            "cause_type": None if cause is None else type(cause).__name__}


def run_case(rank: int, name: str, origin: int, calls) -> dict:
    """``calls[rank]()`` on this rank; what it raised (``type`` None: nothing). The ``origin`` rank then waits until
    every other rank has raised (``others_ended``: they did, while it was still alive and waiting)."""
    store = dist.distributed_c10d._get_default_store()
    key = f"test-one-rank-fault/{name}/ended"
    try:
        calls[rank]()
        got = _report(None)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        got = _report(exc)
    if rank != origin:
        store.add(key, 1)
        return got
    others = dist.get_world_size() - 1
    deadline = time.monotonic() + WAIT_S
    while store.add(key, 0) < others and time.monotonic() < deadline:
        time.sleep(0.05)
    got["others_ended"] = store.add(key, 0) >= others
    return got


# ---- GradScaler (float16 autocast; pipeline rank 1 holds no parameters) -------------------------------------


def _scaled(rank):
    """A float16 pipeline whose rank 1 holds no parameters, one ``pipe.step`` with its GradScaler done: (pipe,
    optimizer or None, scaler)."""
    pipe = _pipe(autocast=torch.float16, balance=[3, 1])
    params = list(pipe.parameters())
    opt = torch.optim.SGD(params, lr=0.1) if params else None
    scaler = GradScaler(pipe, init_scale=1024.0)
    x, y = _batch()
    pipe.step(x, target=y, scaler=scaler)
    return pipe, opt, scaler


def scaler_update_without_step(rank):
    """Rank 1 (no parameters) skips ``scaler.step(None)`` and calls ``update()``; rank 0 waits in the overflow vote
    of ``scaler.step(opt)``."""
    pipe, opt, scaler = _scaled(rank)

    def paramful():
        scaler.step(opt)
        scaler.update()

    return run_case(rank, "update without step", 1, {0: paramful, 1: scaler.update})


class _CorruptStep(torch.optim.SGD):
    """An optimizer whose ``step`` fails (as a buggy custom optimizer would), on the rank that uses it."""

    def step(self, closure=None):
        raise RuntimeError("momentum buffer of a parameter on the wrong device")


def scaler_step_twice(rank):
    """Rank 0 calls ``scaler.step(opt)`` twice before ``update()`` (torch refuses the second, before any vote); rank
    1 steps once, updates and opens the next step, where it waits for rank 0."""
    pipe, opt, scaler = _scaled(rank)
    x, y = _batch()

    def twice():
        scaler.step(opt)
        scaler.step(opt)

    def once_then_next_step():
        scaler.step(opt)
        scaler.update()
        pipe.step(x, target=y, scaler=scaler)

    return run_case(rank, "step twice", 0, {0: twice, 1: once_then_next_step})


def scaler_optimizer_fails(rank):
    """Rank 0's optimizer raises inside ``scaler.step`` after the overflow vote; rank 1 updates and opens the next
    step, where it waits for rank 0."""
    pipe, opt, scaler = _scaled(rank)
    if opt is not None:
        opt = _CorruptStep(list(pipe.parameters()), lr=0.1)
    x, y = _batch()

    def next_step():
        scaler.step(opt)
        scaler.update()
        pipe.step(x, target=y, scaler=scaler)

    return run_case(rank, "optimizer fails", 0, {0: lambda: scaler.step(opt), 1: next_step})


# ---- gather_timeline and clip_grad_norm_ -------------------------------------------------------------------


def gather_timeline_bad_kind(rank):
    """Rank 1 asks ``gather_timeline(kind="fwd")`` (a typo on one rank); rank 0 waits in the all-gather of
    ``gather_timeline()``."""
    pipe = _pipe()
    x, y = _batch()
    pipe.step(x, target=y)
    return run_case(rank, "gather bad kind", 1, {0: pipe.gather_timeline, 1: lambda: pipe.gather_timeline("fwd")})


def clip_bad_max_norm(rank):
    """Rank 1 passes ``max_norm=-1.0`` (a sign lost on one rank); rank 0 passes 1.0 and waits in the all-gather of
    ``clip_grad_norm_``. Then both clip validly and step: the pipeline is still usable."""
    pipe = _pipe()
    x, y = _batch()
    pipe.step(x, target=y)
    got = run_case(rank, "clip bad max_norm", 1, {0: lambda: pipe.clip_grad_norm_(1.0),
                                                  1: lambda: pipe.clip_grad_norm_(-1.0)})
    got["then"] = float(pipe.clip_grad_norm_(1.0)) > 0 and float(pipe.step(x, target=y)) > 0
    pipe.close()
    return got


# ---- checkpoints (DCP's collectives run on the default group, whose timeout is launch's: 30 min) ----------------


class _Unconsolidated(torch.optim.SGD):
    """An optimizer whose ``state_dict()`` refuses on this rank, as ``ZeroRedundancyOptimizer``'s does until its
    state is consolidated."""

    def state_dict(self):
        raise RuntimeError("Optimizer state has not been consolidated on this rank. Please call "
                           "`consolidate_state_dict(to=0)` on all ranks beforehand if you meant to save the global "
                           "state.")


def save_state_fails(rank, root):
    """Rank 1's optimizer refuses its ``state_dict()`` while ``save_checkpoint`` collects what to write; rank 0
    would wait in DCP's collectives. Then: nothing at the path, and the pipeline still steps."""
    pipe = _pipe()
    x, y = _batch()
    pipe.step(x, target=y)
    kind = _Unconsolidated if rank == 1 else torch.optim.SGD
    opt = kind(pipe.parameters(), lr=0.1)
    path = f"{root}/ckpt"
    got = run_case(rank, "save state fails", 1, {r: (lambda: save_checkpoint(path, pipe, opt)) for r in (0, 1)})
    got["then"] = not os.path.exists(path) and float(pipe.step(x, target=y)) > 0
    pipe.close()
    return got


def load_buffers_fail(rank, root):
    """A checkpoint saved by both ranks; loading it, rank 1 cannot allocate its read buffers (the host is out of
    memory); rank 0 would wait in DCP's collectives. Then: the weights unchanged, and the pipeline still steps."""
    pipe = _pipe()
    x, y = _batch()
    path = save_checkpoint(f"{root}/ckpt", pipe)
    pipe.step(x, target=y)
    torch.optim.SGD(pipe.parameters(), lr=0.5).step()
    before = [p.detach().clone() for p in pipe.parameters()]
    real = checkpoint_read.empty_for

    def no_memory(md):
        raise RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 256 bytes.")

    checkpoint_read.empty_for = no_memory if rank == 1 else real
    try:
        got = run_case(rank, "load buffers fail", 1, {r: (lambda: load_checkpoint(path, pipe)) for r in (0, 1)})
    finally:
        checkpoint_read.empty_for = real
    got["then"] = (all(torch.equal(a, b) for a, b in zip(before, pipe.parameters()))
                   and float(pipe.step(x, target=y)) > 0)
    pipe.close()
    return got


def load_copy_fails(rank, root):
    """A checkpoint saved with SGD state by both ranks; loading it, rank 1's optimizer refuses the state
    (``load_state_dict`` raising after DCP's read); rank 0, done, would wait for rank 1 in the next step."""
    pipe = _pipe()
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    x, y = _batch()
    pipe.step(x, target=y)
    opt.step()
    path = save_checkpoint(f"{root}/ckpt", pipe, opt)
    if rank == 1:
        def refuse(state):
            raise ValueError("loaded state dict contains a parameter group that doesn't match the size of "
                             "optimizer's group")
        opt.load_state_dict = refuse
    return run_case(rank, "load copy fails", 1, {0: lambda: (load_checkpoint(path, pipe, opt),
                                                             pipe.step(x, target=y)),
                                                 1: lambda: load_checkpoint(path, pipe, opt)})


#: the cases by name, each one launch (a rank left waiting in one case must not run into the next case's calls)
CASES = {"update without step": scaler_update_without_step, "step twice": scaler_step_twice,
         "optimizer fails": scaler_optimizer_fails, "gather bad kind": gather_timeline_bad_kind,
         "clip bad max_norm": clip_bad_max_norm, "save state fails": save_state_fails,
         "load buffers fail": load_buffers_fail, "load copy fails": load_copy_fails}
