"""Per-rank bodies of tests/runtime/test_checkpoint_rounds.py (2 forked gloo ranks, one launch): the rounds of the
store votes (runtime/exchange.py). A rank late to a round the other gave up on (save_checkpoint, Pipeline
construction) fails at once naming the rank that gave up, instead of going on alone into DCP's collective or
``new_group``; ranks in different checkpoint calls (one saving, one loading) are named at once; a ``pipe`` that is
not a Pipeline, or a bad step, on one rank is refused on every rank at once, naming that rank on the others; after
each, the next calls of both ranks meet (the counters stay in step).

"Late" is made certain without any clock: the late rank waits for a store key that the other sets once its own
vote has timed out (a Pipeline timeout of ``TIMEOUT`` s)."""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline, load_checkpoint, save_checkpoint

from rt_checkpoint import error_of

TIMEOUT = 5.0  # the Pipeline's: a round one rank does not reach is abandoned after it


def _pipe() -> Pipeline:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    return Pipeline(model, schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, timeout=TIMEOUT)


def _signal(name: str) -> None:
    dist.distributed_c10d._get_default_store().set(f"rt-rounds/{name}", "1")


def _await(name: str) -> None:
    dist.distributed_c10d._get_default_store().wait([f"rt-rounds/{name}"], datetime.timedelta(seconds=120))


def _late(rank: int, name: str, call):
    """Rank 0 calls ``call`` at once (it times out); rank 1 calls it once rank 0 has raised."""
    if rank == 1:
        _await(name)
    got = error_of(call)
    if rank == 0:
        _signal(name)
    return got


def everything(rank: int, root: str) -> dict:
    torch.set_num_threads(1)
    out = {}
    pipe = _pipe()
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    path = lambda name: os.path.join(root, name)  # noqa: E731

    # a rank late to save_checkpoint by more than the timeout, then both save again: the next saves meet
    out["late_save"] = _late(rank, "save", lambda: save_checkpoint(path("late"), pipe, opt, step=1))
    out["save_after_late"] = error_of(lambda: save_checkpoint(path("late"), pipe, opt, step=1))
    # rank 0 saves while rank 1 loads: named at once on both; the next save and load meet
    mismatched = (lambda: save_checkpoint(path("other"), pipe, opt, step=2)) if rank == 0 else (
        lambda: load_checkpoint(path("late"), pipe, opt))
    out["mismatch"] = error_of(mismatched)
    out["save_after_mismatch"] = error_of(lambda: save_checkpoint(path("after"), pipe, opt, step=3))
    out["load_after_mismatch"] = load_checkpoint(path("after"), pipe, opt).step
    # a pipe that is not a Pipeline on one rank: refused in the vote, on both; the retry meets
    out["save_none"] = error_of(lambda: save_checkpoint(path("none"), None if rank == 1 else pipe, opt, step=4))
    out["load_str"] = error_of(lambda: load_checkpoint(path("after"), "pipe" if rank == 0 else pipe, opt))
    out["save_retry"] = error_of(lambda: save_checkpoint(path("none"), pipe, opt, step=4))
    # a bad step on rank 1 only: rank 0 names rank 1
    out["bad_step"] = error_of(lambda: save_checkpoint(path("step"), pipe, opt, step=-1 if rank == 1 else 5))
    out["load_after"] = load_checkpoint(path("none"), pipe, opt).step
    pipe.close()
    dist.barrier()
    out["saved"] = sorted(os.listdir(root))  # no hidden temporary directory left by the refused or abandoned saves

    # a rank late to the construction agreement: it does not go on into the process groups' creation
    out["late_construct"] = _late(rank, "construct", lambda: _pipe().close())
    again = _pipe()  # the next construction of both ranks meets
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    out["step_after"] = again.step(x, target=y).item() > 0
    again.close()
    return out
