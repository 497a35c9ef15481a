"""What a :class:`~pipesched.runtime.Pipeline` does when one of its calls fails on this rank: publish the first
failure (or read the one another rank published), name a lost or stalled peer, tear the process groups down so
peers blocked on this rank see a closed connection at once, and mark the pipeline broken."""
from __future__ import annotations

import dataclasses
import gc
import time
import traceback

import torch.distributed as dist

from .departure import forget
from .failure import CommError, FailureRecord, PipelineError
from .lost_rank import adoptable, lost_record, store_host
from .stalled import STEP, answer_roll_call, lookup_answering, silent_members, stall_note
from .vote import votes_note, waiting_in_votes

_VOTE_SLACK_S = 5.0  # a checkpoint round given up on at most this long before this rank's wait began still counts
_ORIGIN_GRACE_S = 30.0  # at most this the origin's (and the store host's) process lingers at exit for its peers


def fail(pipe, exc: BaseException, where: str | None = None) -> PipelineError:
    """Publish (or read) the first failure, tear ``pipe``'s process groups down, and return the ``PipelineError``
    to raise (also kept as ``pipe._broken``: every later call raises it). ``where``: what ran, said where no
    instruction was running (``None``: a step, while preparing or finishing it)."""
    grid, me, instr = pipe.grid, pipe.grid.world_rank, pipe._executor.current
    note, record = "", None
    if isinstance(exc, CommError):
        note = f"while waiting for {exc.what}"
        if not exc.connection_lost:  # timed out: alive, said before the wait below (lost_record tells it from lost)
            answer_roll_call(pipe._failures, me)
            found = pipe._failures.lookup(wait_s=1.0)
        else:  # a closed connection: answered as soon as another rank has (its timeout closed it), else not yet
            found = lookup_answering(pipe._failures, me, wait_s=1.0)
        record = adoptable(found, me)  # a record calling this live rank lost: not it
        if record is None and exc.connection_lost:  # a process was lost: name it (published for the others)
            record = adoptable(lost_record(exc, grid, pipe._failures, _probed_groups(pipe), pipe.device,
                                           away_s=getattr(pipe, "_away_s", 0.0), timeout=pipe.timeout), me)
    origin = record is None
    votes = votes_note(waiting_in_votes(pipe._failures.store, me, grid.world_size,  # rounds given up on since
                                        time.time() - pipe.timeout - _VOTE_SLACK_S)) if isinstance(exc, CommError) else ""
    if votes and not origin:
        note += votes  # e.g. rank 0 timed out in `if rank == 0: save_checkpoint(...)` and exited: say where it was
    if origin:
        failed = pipe._executor.failed_input  # (instr, text) where a forward or loss_fn raised (executor._f)
        received = failed[1] if failed is not None and instr is not None and failed[0] is instr else None
        record = FailureRecord.local(me, instr, exc, grid.pp_rank, where=where, received=received)
        if isinstance(exc, CommError) and not exc.connection_lost:  # timed out: name who did not (stalled.py)
            # every world rank: with data parallelism the stalled rank may be in none of this rank's groups (this
            # rank timed out waiting for a replica that itself waits for it); all answer under the job key
            members = set(range(grid.world_size))
            silent = silent_members(pipe._failures, me, members)
            during = getattr(exc, "during", None) or (STEP if where is None else "this call")  # what was waited in
            note = stall_note(silent, grid.pp_size, pipe.timeout, during) + votes
            record = dataclasses.replace(record, cause=record.cause + note, stalled=tuple(silent)) if note else record
    publish_and_linger(pipe, record, origin)
    if exc.__traceback__ is not None:
        traceback.clear_frames(exc.__traceback__)  # drop frame references to pending messages
    forget(pipe._departure)  # its own record is published: nothing to announce at close() or exit
    teardown(pipe)
    pipe._broken = PipelineError(record, me, note)  # note: what this rank waited for
    return pipe._broken


def _probed_groups(pipe) -> tuple:
    """The groups :func:`~.lost_rank.lost_record` probes for a closed member: pipeline, data-parallel, and the
    checkpoint's over every world rank (once a save or load made it: DCP's collectives run there)."""
    return pipe._pp_group, pipe._dp_group, getattr(pipe, "_checkpoint_group", None)


def publish_and_linger(pipe, record: FailureRecord, origin: bool):
    """Publish ``record`` (this rank's own where ``origin``, else the one it read; passed on to this rank's other
    group, DP), count this rank a reader of the record the job reads, and keep this process up at exit until that
    record's readers have read it where it is this rank's own, or where this process hosts the store (world rank 0
    under env://; not under torchrun's agent store or launch). Returns that :class:`~.failure.Linger`, or None."""
    if not record.lost:
        pipe._failures.publish(record)
    first = _first(pipe, record) if origin else record  # what the others read: another's if it published first
    pipe._failures.seen(first)
    if first is record and origin or pipe.grid.world_rank == store_host():
        return pipe._failures.keep_alive_for(first, pipe.grid.world_size, _ORIGIN_GRACE_S)
    return None


def _first(pipe, record: FailureRecord) -> FailureRecord:
    """The record the job's ranks read after this rank published its own ``record``: another rank's where that rank
    failed at the same time and published first (then this rank is one of its readers, and nobody reads
    ``record``: this process must not linger at exit for readers of it)."""
    found = pipe._failures.lookup()
    return record if found is None or found.id == record.id else found


def teardown(pipe) -> None:
    """Destroy ``pipe``'s process groups on this rank so peers blocked on it see a closed connection at once."""
    pipe._executor.step = None
    pipe._executor.transport.group = None
    pipe._executor.dp_group = None
    pipe._handshake.dp_group = None  # no reference may keep a destroyed group's connections open
    checkpoint = getattr(pipe, "_checkpoint_group", None)  # DCP's (checkpoint_group.py), once a save or load made it
    for group in (pipe._pp_group, pipe._dp_group, *pipe._tie_groups.values(), checkpoint):
        if group is not None:
            try:
                dist.destroy_process_group(group)
            except Exception:  # noqa: BLE001 - best effort while failing
                pass
    pipe._pp_group = pipe._dp_group = pipe._checkpoint_group = None
    pipe._tie_groups = {}
    gc.collect()
