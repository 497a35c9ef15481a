"""A collective a Pipeline runs outside ``step()`` (:meth:`Pipeline.run_collective
<pipesched.runtime.Pipeline.run_collective>`: the caller's work, ``gather_timeline``, ``clip_grad_norm_``, the
GradScaler's agreement) fails as a step does: a peer that closed its connection is a :class:`CommError`, so the
Pipeline reads the failure record of the rank that failed first, or names the lost rank
(:mod:`~pipesched.runtime.lost_rank`), instead of blaming the calling rank. A public collective call that fails on
this rank alone, before or instead of joining its collective, ends every rank through :func:`fail_every_rank`."""
from __future__ import annotations

from .failure import CommError
from .torch_errors import peer_closed_connection


def peer_loss_as_comm_error(run, what: str):
    """``run()``; a ``RuntimeError`` from torch saying a peer closed its connection is raised as a
    :class:`CommError` waiting for ``what`` (no peer: the Pipeline probes its groups for the closed member).

    Returns:
        What ``run()`` returns.
    Raises:
        CommError: ``run()`` raised one, or a ``RuntimeError`` whose peer closed the connection
            (:func:`~pipesched.runtime.torch_errors.peer_closed_connection`).
        Exception: anything else ``run()`` raised, as it is (the calling rank's own failure).
    """
    try:
        return run()
    except CommError:
        raise
    except RuntimeError as exc:
        if peer_closed_connection(exc):
            raise CommError(what, exc) from None
        raise


def fail_every_rank(pipe, call: str, exc: BaseException):
    """Raise ``exc`` -- this rank's own failure in a collective call (a bad argument, a misuse torch refuses, an error
    before this rank joined the collective the other ranks wait in) -- as every rank learns a failed step: this rank
    publishes its failure record and tears its groups down (:meth:`Pipeline.run_collective
    <pipesched.runtime.Pipeline.run_collective>`), so the other ranks, blocked in that collective or the next one,
    end at once with a ``PipelineError`` naming this rank and ``exc`` instead of waiting until the timeout.
    ``call``: the public call that failed, named in that error (``failed in a collective call outside any step
    (<call>)``).

    Raises:
        PipelineError: always, from ``exc``, on a pipeline of several ranks (the pipeline is unusable afterwards).
        BaseException: ``exc`` itself on a pipeline of one rank (nobody waits for it: the pipeline stays usable).
    """
    if pipe.grid.world_size == 1:
        raise exc

    def work(_pp_group, _dp_group):
        raise exc

    pipe._collective(work, False, call)  # the others are in the call's own collective, not in a meeting
    raise AssertionError("run_collective returned from a failing work")  # unreachable: work always raises
