"""A rank that leaves on purpose while a peer still waits on it: the peer says so, not that the rank was killed.

A rank leaves on purpose when it calls :meth:`Pipeline.close() <pipesched.runtime.Pipeline.close>`, or when its
Pipeline of several ranks goes away unclosed: dropped (garbage-collected), its process ending (``sys.exit``, the end
of the script, an uncaught exception), or its :func:`~pipesched.runtime.launch` ``fn`` ending (``launch``'s child
collects the garbage ``fn`` left before closing its groups). Just before its connections close it publishes an
``ended`` failure record (``"closed"`` or ``"exited"``) under its Pipeline's keys
(:class:`~pipesched.runtime.failure.FailureChannel`; the first record published wins, so a real failure published
earlier keeps its place). A peer blocked on it then gets a closed connection, reads that record and raises a
:class:`~pipesched.runtime.failure.PipelineError` saying ``world rank 1 (pipeline rank 1) closed its Pipeline
(pipe.close())`` or ``... ended without closing its Pipeline ...`` instead of naming a lost (killed) process
(:mod:`~pipesched.runtime.lost_rank`).

Each Pipeline holds its own announcement, a :class:`weakref.finalize` of itself (:func:`watch`): ``close()`` and a
failure (whose own record is published) detach it; otherwise it runs when the Pipeline is collected or, still alive,
at interpreter exit (``finalize``'s ``atexit``). Nobody reads the record when every rank has finished its last step
(the normal end): the cost is one store write, nothing waits for readers, and ``close()`` on every rank at once
raises nowhere. A process killed by a signal runs none of this: its peers still name it lost.
"""
from __future__ import annotations

import os
import sys
import time
import weakref

from .failure import FailureRecord, describe

_CLOSED = "closed its Pipeline (pipe.close()) while this rank still waited on it"


def _who(grid) -> str:
    return f"world rank {grid.world_rank} (pipeline rank {grid.pp_rank})"


def record_of(grid, ended: str, how: str) -> FailureRecord:
    """The ``ended`` record (``"closed"``, ``"exited"``) of this rank: ``cause`` is ``"<who> <how>"``."""
    return FailureRecord(rank=grid.world_rank, pp_rank=grid.pp_rank, ended=ended,
                         id=f"{ended}:{grid.world_rank}:{time.time_ns()}", cause=f"{_who(grid)} {how}")


def watch(pipe, failures, grid) -> weakref.finalize | None:
    """The announcement of ``pipe`` going away unclosed (``None`` for a Pipeline of one rank: nobody waits on it).
    It holds ``failures`` and ``grid``, not ``pipe``."""
    if grid.world_size == 1:
        return None
    return weakref.finalize(pipe, _announce_exit, failures, grid)


def announce_close(departure: weakref.finalize | None) -> None:
    """Publish that this rank closes its Pipeline (call before its groups are destroyed); nothing when ``departure``
    is ``None`` or was detached already (the Pipeline failed, or was closed)."""
    held = departure.detach() if departure is not None else None
    if held is not None:
        _, _, (failures, grid), _ = held
        record = record_of(grid, "closed", _CLOSED)
        _quietly(lambda: failures.publish(record))


def forget(departure: weakref.finalize | None) -> None:
    """The Pipeline failed (its own record is published): nothing more to announce for it."""
    if departure is not None:
        departure.detach()


def leave_unclosed(pipes) -> None:
    """The process is about to end without its interpreter's exit (``launch``'s child, ``os._exit``): for each of
    ``pipes`` (the Pipelines still alive, e.g. held by a global after ``fn`` returned) publish its announcement now,
    as interpreter exit would (``weakref.finalize`` is callable: it runs once), then destroy its groups, so a peer
    still waiting on this rank raises ``ended without closing its Pipeline`` at once, not after ``launch``'s grace
    naming a lost (killed) process."""
    from .pipeline_failure import teardown  # here: pipeline_failure imports this module

    for pipe in pipes:
        if getattr(pipe, "_closed", True):  # closed, or never built (its construction was refused)
            continue
        try:
            if pipe._departure is not None:
                pipe._departure()
            teardown(pipe)
            pipe._closed = True
        except Exception:  # noqa: BLE001 - best effort: the next Pipeline is still announced and closed
            pass


def _announce_exit(failures, grid) -> None:
    uncaught = getattr(sys, "last_value", None)  # set when the interpreter printed an uncaught exception
    how = (f"its process exited on an uncaught {describe(uncaught)}" if uncaught is not None else
           "the Pipeline was dropped, or its process or launch fn ended")
    record = record_of(grid, "exited", f"ended without closing its Pipeline ({how})")
    _quietly(lambda: failures.publish(record))


def _quietly(run) -> None:
    """``run()`` (a store write, about 0.1 ms) with file descriptor 2 on ``/dev/null``. At the normal end the store's
    host (world rank 0) may have exited already: the write then fails at once (about 5 ms), but torch's C++ store
    client logs a warning and a C++ stack for it, which a close() or a script ending normally must not print."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no stderr to protect
        run()
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        run()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
