"""Naming a rank whose process was lost (killed by SIGKILL or the OOM killer, crashed) in the middle of a step.

A lost process leaves no failure record (:mod:`pipesched.runtime.failure`); the operating system closes its
connections, so every rank blocked on it gets a closed-connection error at once. Such a rank finds no record in the
store, names the lost rank here, and publishes that ``lost`` record before it tears its own groups down, so a rank
blocked on *it* (a third rank, or the other replica in the data-parallel all-reduce) reads the record and names the
same lost rank instead of its direct peer. Who is lost, in order:

1. the store is unreachable: the process hosting it is gone, and under ``env://`` that is world rank 0 (it
   lingers while any rank has a record to read, :class:`~pipesched.runtime.failure.Linger`, so it is gone only if it
   was lost). Unless this rank itself began the
   call more than ``timeout`` after its previous call ended: a rank waiting on it meanwhile timed out, so the job most
   likely ended already and the store host exited after naming that failure (gone with the store): the record then
   says so (``ended="exited"``), not that the host was killed. Under torchrun's agent store
   (``TORCHELASTIC_USE_AGENT_STORE=True``) and under :func:`~pipesched.runtime.launch`, whose own process hosts it
   (its children have ``PIPESCHED_LAUNCH_STORE=parent``), the store outlives every worker and this rule never
   applies (launch's children with ``PIPESCHED_LAUNCH_STORE=rank0`` have ``env://``'s layout);
2. a point-to-point wait: the peer it waited on;
3. a collective (the step-opening all-gather, the data-parallel all-reduce, DCP's): the first member of this rank's
   pipeline, data-parallel or checkpoint group whose connection is closed, found by posting a receive from each
   (gloo raises at once on a closed connection); the store is read once more afterwards, in case a peer published
   meanwhile. A closed member that answered the roll call (:mod:`~pipesched.runtime.stalled`) is alive, its own
   wait timed out: this rank answers too and takes the record that member publishes; so too where no probed member
   is closed but some rank answered (the connection closed in a group not probed).

Gloo only (CPU stages): NCCL reports a lost peer through its own watchdog, after ``timeout``.
"""
from __future__ import annotations

import os
import time

import torch

from .failure import CommError, FailureChannel, FailureRecord
from .stalled import ROLL_CALL_S, answer_roll_call, answered_roll_call
from .torch_errors import peer_closed_connection

_PROBE_TAG = 2**30 - 7  # a tag no pipeline message uses (tag_of stays far below it)
# how long a rank whose peer closed its connection, but answered the roll call (alive: its own wait timed out and
# gloo closed its connections), waits for that peer's record: the peer reads the store for 1 s
# (pipeline_failure.fail) and waits up to ROLL_CALL_S for the roll call before it publishes
_TIMED_OUT_PEER_S = 1.0 + ROLL_CALL_S + 1.0


def adoptable(record: FailureRecord | None, world_rank: int) -> FailureRecord | None:
    """``record``, unless it says ``world_rank`` -- the rank reading it, alive -- was lost: ``None`` then, and the
    rank gives its own account. A peer may publish that record when this rank's wait timed out and gloo closed its
    connections before this rank published its own."""
    if record is not None and record.lost and record.rank == world_rank:
        return None
    return record


def store_host() -> int | None:
    """World rank whose process hosts the c10d store: 0 under ``env://`` (and a launch child with
    ``PIPESCHED_LAUNCH_STORE=rank0``); ``None`` under torchrun's agent store, which lives in the agent, not in a rank,
    and under :func:`~pipesched.runtime.launch`, whose own process hosts it (its children have
    ``PIPESCHED_LAUNCH_STORE=parent``)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return None
    return None if os.environ.get("PIPESCHED_LAUNCH_STORE") == "parent" else 0


def closed_members(group, world_ranks, device) -> list[int]:
    """The world ranks (of ``world_ranks``, ``group``'s members by group rank) whose connection to this rank is
    closed. Posts a 1-element receive from each other member: gloo raises at once for a closed connection; the
    receives from live members stay pending until the group is destroyed. Empty for a non-gloo ``group``."""
    if group is None or device.type != "cpu":
        return []
    closed, pending = [], []
    me = group.rank()
    for r, world in enumerate(world_ranks):
        if r == me:
            continue
        try:
            pending.append(group.recv([torch.zeros(1, device=device)], r, _PROBE_TAG))
        except RuntimeError as exc:
            if peer_closed_connection(exc):
                closed.append(world)
    return closed


def lost_record(exc: CommError, grid, failures: FailureChannel, groups, device, away_s: float = 0.0,
                timeout: float = float("inf")) -> FailureRecord | None:
    """The record naming the lost rank after ``exc`` (a wait whose connection closed) found no failure record
    in the store; published (the first published wins, and that one is returned, so every rank names the same).

    Args:
        exc: the failed wait (``exc.peer``: the pipeline rank waited on, ``None`` for a collective).
        grid: this rank's :class:`~pipesched.runtime.comm.Grid`.
        failures: the failure channel (its ``unreachable`` flag says whether the store answered).
        groups: ``(pipeline group, data-parallel group or None)`` of this rank, before teardown, and optionally a
            third: a group over every world rank by world rank (the checkpoint's, :mod:`.checkpoint_group`) or None.
        device: the stages' device (probing needs gloo: CPU).
        away_s: how long this rank was away from the Pipeline before the failing call (since its last call ended);
            more than ``timeout`` (the Pipeline's) with the store host gone: the job most likely already ended.
    Returns:
        A ``lost`` :class:`~pipesched.runtime.failure.FailureRecord` (its ``rank``/``pp_rank``: the lost rank), or
        ``None`` when no lost rank can be named (a collective whose members all still answer). A peer whose
        connection closed but that answered the roll call (:mod:`~pipesched.runtime.stalled`) is alive, its own
        wait timed out: not named; the record it publishes is returned (waited for up to ``_TIMED_OUT_PEER_S``),
        ``None`` if none turns up.
    """
    host = store_host()
    me = f"world rank {grid.world_rank} (pipeline rank {grid.pp_rank})"
    if failures.unreachable and host is not None and host != grid.world_rank and away_s > timeout:
        return FailureRecord(
            rank=host, pp_rank=host % grid.pp_size, ended="exited", id=f"exited:{host}:{time.time_ns()}",
            cause=f"the job most likely ended already: world rank {host} (pipeline rank {host % grid.pp_size}), which "
                  f"hosts the store, has exited (the store no longer answers), and {me} began this call {away_s:.0f} s "
                  f"after its previous one ended, more than timeout={timeout:g} s, so a rank waiting on it meanwhile "
                  f"timed out; the failure record that named the rank that failed first went with the store. "
                  f"{me} found this while waiting for {exc.what}",
            traceback=f"{type(exc.original).__name__}: {exc.original}")
    if failures.unreachable and host is not None and host != grid.world_rank:
        lost, how = host, "hosts the store, which no longer answers"
    elif exc.peer is not None:
        lost, how = grid.pipeline_ranks(grid.dp_rank)[exc.peer], "closed its connection"
    else:
        pp_group, dp_group, *every = groups
        closed = (closed_members(pp_group, grid.pipeline_ranks(grid.dp_rank), device)
                  + closed_members(dp_group, grid.dp_ranks(grid.pp_rank), device)
                  + closed_members(next(iter(every), None), range(grid.world_size), device))
        published = failures.lookup()
        if published is not None:
            return published
        if not closed:  # it closed in a group not probed: gloo closes a rank's connections as its wait times out
            others = (r for r in range(grid.world_size) if r != grid.world_rank)
            if not any(answered_roll_call(failures, r) for r in others):
                return None
            return _timed_out_peers_record(failures, grid)
        closed.sort(key=lambda r: answered_roll_call(failures, r))  # a member that did not answer first
        lost, how = closed[0], "closed its connection"
    if answered_roll_call(failures, lost):
        return _timed_out_peers_record(failures, grid)
    return _named_lost(exc, grid, failures, lost, how, me)


def _timed_out_peers_record(failures: FailureChannel, grid) -> FailureRecord | None:
    """The connection that closed was a rank's whose own wait timed out (it answered the roll call: alive), so
    neither it nor this rank is the stalled one: answer too, and take the record it publishes (``None`` if none
    turns up within ``_TIMED_OUT_PEER_S``)."""
    answer_roll_call(failures, grid.world_rank)
    return failures.lookup(wait_s=_TIMED_OUT_PEER_S)


def _named_lost(exc: CommError, grid, failures: FailureChannel, lost: int, how: str, me: str) -> FailureRecord:
    """The ``lost`` record naming world rank ``lost``, published (the first published wins and is returned)."""
    record = FailureRecord(
        rank=lost, pp_rank=lost % grid.pp_size, lost=True, id=f"lost:{lost}:{time.time_ns()}",
        cause=f"world rank {lost} (pipeline rank {lost % grid.pp_size}) was lost: its process ended in the middle of "
              f"the step without a failure record (killed, e.g. by SIGKILL or the out-of-memory killer, or exited); "
              f"{me} found it while waiting for {exc.what}: it {how}",
        traceback=f"{type(exc.original).__name__}: {exc.original}")
    failures.publish(record)
    return failures.lookup() or record
