"""Who to name when :func:`~pipesched.runtime.comm.make_groups` fails: the rank that failed first (its published
record), a launch ``fn`` that raised before it came, the ranks that never began the creation (their count in the
store is behind), the ranks stalled inside it (the roll call of :mod:`~pipesched.runtime.stalled`), else this rank's
own error. Every rank's n-th creation meets the others' n-th: the per-rank counter :data:`COUNT_KEY` says which."""
from __future__ import annotations

import dataclasses
import time

import torch.distributed as dist

COUNT_KEY = "pipesched/groups/count/{rank}"  # how many creations this world rank has begun
ERROR_KEY = "pipesched/groups/{attempt}/error"  # the first failure of every rank's n-th creation


def creation_failure(store, attempt: int, grid, timeout: float, exc: BaseException):
    """The ``PipelineError`` for a failed :func:`~pipesched.runtime.comm.make_groups` (this rank's ``attempt``-th):
    the first record published under its :data:`ERROR_KEY` (this rank's own if none: published for the others,
    whose creation waits on this rank until their timeout)."""
    from .failure import FailureChannel, FailureRecord, PipelineError, job_failure
    from .torch_errors import wait_timed_out

    where = (f"while creating the Pipeline's process groups (dist.new_group, every rank of the job, "
             f"timeout={timeout:g} s)")
    channel = FailureChannel(store, [])
    channel.keys = channel.read_keys = [ERROR_KEY.format(attempt=attempt)]
    waited = isinstance(exc, (TimeoutError, dist.DistStoreError)) or wait_timed_out(exc)  # for the others
    mine = (channel.lookup() or job_failure(store)  # a launch fn that raised before it came: named as itself
            or (waited and _absent_record(store, attempt, grid, timeout, exc))
            or (waited and _stalled_record(channel, grid, timeout, exc, where))
            or FailureRecord.local(grid.world_rank, None, exc, grid.pp_rank, where=where))
    channel.publish(mine)
    record = channel.lookup() or mine
    note = "" if record.rank == grid.world_rank else f"its own wait ended with {type(exc).__name__}"
    return PipelineError(record, grid.world_rank, note)


def _absent_record(store, attempt: int, grid, timeout: float, exc: BaseException):
    """Where no rank published a failure and this rank's wait timed out: the record naming the ranks that never
    began this creation (their :data:`COUNT_KEY` is below this rank's ``attempt``: stalled or hung after the
    construction agreement, before ``make_groups``), so that every rank that waited for them names them, not its
    own timeout; ``None`` if every rank began it (or the store does not answer)."""
    from .failure import FailureRecord, world_ranks_text

    try:
        absent = [r for r in range(grid.world_size)
                  if r != grid.world_rank and store.add(COUNT_KEY.format(rank=r), 0) < attempt]
    except Exception:  # noqa: BLE001 - a store that does not answer: this rank's own timeout is all it knows
        return None
    if not absent:
        return None
    record = FailureRecord.local(absent[0], None, exc, absent[0] % grid.pp_size,
                                 where="before creating the Pipeline's process groups (dist.new_group, every rank "
                                       "of the job)")
    cause = (f"TimeoutError: {world_ranks_text(absent)} did not begin creating them within timeout={timeout:g} s of "
             f"world rank {grid.world_rank}, after the construction agreement: stalled or hung in between")
    return dataclasses.replace(record, id=f"absent:{absent[0]}:{time.time_ns()}", cause=cause)


def _stalled_record(channel, grid, timeout: float, exc: BaseException, where: str):
    """Where every rank began the creation and none published a failure, and this rank's wait timed out: the record
    naming the ranks that did not time out with it (the roll call: stalled inside the creation); ``None`` when every
    rank answered."""
    from .failure import FailureRecord, world_ranks_text
    from .stalled import ROLL_CALL_S, silent_members

    silent = silent_members(channel, grid.world_rank, range(grid.world_size))
    if not silent:
        return None
    record = FailureRecord.local(silent[0], None, exc, silent[0] % grid.pp_size, where=where)
    cause = (f"TimeoutError: {world_ranks_text(silent)} began creating them but did not finish within "
             f"timeout={timeout:g} s, nor time out within {ROLL_CALL_S:g} s of world rank {grid.world_rank}: stalled "
             f"or hung inside the creation")
    return dataclasses.replace(record, id=f"stalled:{silent[0]}:{time.time_ns()}", cause=cause,
                               stalled=tuple(silent))  # err.stalled, as a step's roll call gives it
