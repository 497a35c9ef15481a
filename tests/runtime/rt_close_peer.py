"""Per-rank bodies of tests/runtime/test_close_peer.py: one rank leaves on purpose (``pipe.close()``, or its launch
``fn`` returns or raises without closing) while the other enters a step; or every rank closes after its last step.
Each returns what this rank raised (or None) as a dict, so launch returns every rank's report."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline, PipelineError


#: what a user's global would hold after launch's fn returned ("return, kept"): the case is about exactly that state
_KEPT: list = []


def _pipeline() -> Pipeline:
    torch.manual_seed(0)
    return Pipeline(nn.Sequential(*[nn.Linear(4, 4) for _ in range(2)]), num_microbatches=2, loss_fn=F.mse_loss,
                    timeout=60)


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g)


def _report(run) -> dict:
    try:
        run()
        return {"type": None}
    except PipelineError as exc:
        return {"type": "PipelineError", "rank": exc.rank, "pp_rank": exc.pp_rank, "lost": exc.record.lost,
                "ended": exc.record.ended, "message": str(exc)}
    except Exception as exc:  # noqa: BLE001 - reported, so the test shows what else happened
        return {"type": type(exc).__name__, "message": str(exc)}


def leave_while_other_steps(rank: int, leaver: int, how: str) -> dict:
    """One step together; then world rank ``leaver`` leaves (``how``: ``"close"``, ``"return"``, ``"raise"``) after
    the others are in the next step (a barrier on the default group orders it), and the others step
    (``"return, kept"``: returns with its Pipeline still referenced, by :data:`_KEPT`). ``"raise"``
    makes launch raise that ValueError, so the others' report is printed (for a manual look) rather than returned."""
    pipe = _pipeline()
    x, y = _batch()
    pipe.step(x, y)
    if rank == leaver:
        dist.barrier()  # the other rank is about to enter its step, which waits on this one
        if how == "close":
            pipe.close()
            return {"type": None, "left": "closed"}
        if how == "raise":
            raise ValueError("boom outside the step")
        if how == "return, kept":  # a global (a notebook's, a trainer object's) holds it past fn: not collected
            _KEPT.append(pipe)
        return {"type": None, "left": "returned"}
    dist.barrier()
    report = _report(lambda: pipe.step(x, y))
    if how == "raise":
        print(f"rank {rank}: {report}", flush=True)
    return report


def close_everywhere(rank: int, steps: int) -> dict:
    """``steps`` steps, then close() on every rank at once; then a new Pipeline steps (the old records must not
    reach it)."""
    pipe = _pipeline()
    x, y = _batch()

    def run():
        for _ in range(steps):
            pipe.step(x, y)
        pipe.close()
        again = _pipeline()
        loss = again.step(x, y)
        again.close()
        return loss

    report = _report(run)
    report["closed"] = pipe._closed
    return report


def close_inside_a_layer(rank: int) -> dict:
    """Rank 1's last layer calls its Pipeline's close() during a step's forward: its step fails naming that (not an
    internal AttributeError), the other rank learns of the failure, and close() afterwards works."""
    holder = {}

    class Closer(nn.Module):
        def forward(self, x):
            if holder.get("armed"):
                holder["pipe"].close()
            return x

    torch.manual_seed(0)
    pipe = Pipeline(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), Closer()), num_microbatches=2, loss_fn=F.mse_loss,
                    timeout=60, balance=[1, 2])
    holder["pipe"] = pipe
    x, y = _batch()
    pipe.step(x, y)
    holder["armed"] = rank == 1
    report = _report(lambda: pipe.step(x, y))
    pipe.close()
    return report
