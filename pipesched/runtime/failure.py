"""When one rank fails: an error every rank raises, and the side channel (the c10d store) that carries it.

The failing rank writes what failed (its rank, the instruction, the original exception) to the store
under its pipeline group's and its data-parallel group's keys, then tears its process groups down, which
closes its connections: peers blocked on it get a connection error at once, read the store, raise the
same :class:`PipelineError`, and tear down their own groups in turn. Waits also end after the
configured timeout, so no rank waits forever even if a process hangs without failing.

The store lives in one process (world rank 0 under ``env://``; torchrun's agent, or the
:func:`~pipesched.runtime.launch` process, which outlive every rank). The rank that publishes the first record,
and world rank 0 where it hosts the store, keep their processes up until every rank of the job has read the record
or a bounded grace period ends (:meth:`FailureChannel.keep_alive_for` registers one :class:`Linger` per record at
interpreter exit; ``launch``'s children, which skip interpreter exit, each wait instead for the parent's word that every
rank reported or died, at most ``grace``). If a rank still finds no record while a connection closed (a process was
killed), it names the lost rank and publishes that ``lost`` record for the others (:mod:`pipesched.runtime.lost_rank`).

A rank whose :func:`~pipesched.runtime.launch` ``fn`` raises outside any Pipeline call publishes a record under the
job's key (:data:`JOB_KEY`, :func:`publish_job_failure`) before its connections close; every channel reads that key
first, so a peer's Pipeline names that rank's error, not its closed connection or its unclosed Pipeline.
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import time
import traceback
from dataclasses import dataclass

from .torch_errors import peer_closed_connection


@dataclass(frozen=True)
class FailureRecord:
    """What failed, as every rank of the job learns it: published to the store as JSON (:meth:`to_json`).

    Attributes:
        rank: world rank of the rank that failed (for a ``lost`` record: the rank whose process was lost).
        pp_rank: its pipeline rank (``None`` if unknown).
        instr: the instruction it was running, text form (``"F1.2"``), or ``None`` (outside any instruction).
        op, stage, microbatch: the instruction's kind (``"F"``, ``"B"``, ...), stage and microbatch, or ``None``.
        cause: ``"ExceptionType: message"`` of the original exception.
        traceback: the original traceback text.
        id: unique per published record (``"rank:time_ns"``, ``"lost:rank:time_ns"``): the store key counting the
            ranks that read it.
        lost: ``rank``'s process was lost (killed, crashed) and left no record; the first rank to notice published
            this one (:func:`~pipesched.runtime.lost_rank.lost_record`).
        ended: ``rank`` left on purpose while others could still wait on it: ``"closed"`` (``pipe.close()``) or
            ``"exited"`` (its process or launch ``fn`` ended without closing the Pipeline), published by that rank
            before its connections closed (:mod:`pipesched.runtime.departure`); ``"returned"``: its launch ``fn``
            returned while a peer was in the fns' own collective with it (built by that peer,
            :func:`~pipesched.runtime.launch_child.told`); else ``None``.
        where: what the rank was running, in words, where no instruction names it (``"while running
            run_collective's collective"``, ``"in its launch fn, outside any Pipeline call"``); ``None``: while
            preparing or finishing a step.
        received: what the stage of a failed forward received, or what its ``loss_fn`` got, in words (said after
            the cause); ``None``: not a forward's failure.
        stalled: for a wait that timed out, the world ranks that did not answer the roll call
            (:mod:`~pipesched.runtime.stalled`): alive but not at this point of the call (the step, the checkpoint
            save, ...), the stall among them; also named in ``cause``. Empty otherwise.
    """

    rank: int | None
    pp_rank: int | None = None
    instr: str | None = None
    op: str | None = None
    stage: int | None = None
    microbatch: int | None = None
    cause: str = ""
    traceback: str = ""
    id: str | None = None
    lost: bool = False
    ended: str | None = None
    where: str | None = None
    received: str | None = None
    stalled: tuple = ()

    @classmethod
    def local(cls, rank: int, instr, exc: BaseException, pp_rank: int | None = None,
              where: str | None = None, received: str | None = None) -> FailureRecord:
        """The record of a failure of this rank: ``exc`` raised while running ``instr`` (or outside any: ``None``;
        ``where`` then says what ran, ``None``: while preparing or finishing a step). ``received``: what the
        failed forward's stage (or ``loss_fn``) received, said after the cause (``None``: nothing said)."""
        return cls(
            rank=rank, pp_rank=pp_rank, id=f"{rank}:{time.time_ns()}", where=None if instr is not None else where,
            instr=None if instr is None else str(instr),
            op=None if instr is None else instr.op.value,
            stage=None if instr is None else instr.stage,
            microbatch=None if instr is None else instr.microbatch,
            cause=describe(exc), received=received,
            traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> FailureRecord:
        fields = json.loads(text)
        fields["stalled"] = tuple(fields.get("stalled", ()))  # JSON gives a list: the record's own type back
        return cls(**fields)


def world_ranks_text(ranks) -> str:
    """``"world rank 3"`` for one rank, ``"world ranks 1, 3"`` for several (ascending as given)."""
    ranks = list(ranks)
    return f"world rank {ranks[0]}" if len(ranks) == 1 else "world ranks " + ", ".join(map(str, ranks))


def describe(exc: BaseException) -> str:
    """``"ExceptionType: message"`` (``"ExceptionType"`` alone for an empty message: a bare ``KeyboardInterrupt``);
    where the exception's ``str()`` itself raises, its type and what ``str()`` raised instead, so the record of a
    failure is always published (a failure that cannot be described must still end every rank)."""
    try:
        text = str(exc)
    except Exception as inner:  # noqa: BLE001 - a user's __str__ may raise anything
        text = f"<str() of this exception raised {type(inner).__name__}>"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class PipelineError(RuntimeError):
    """A rank of the pipeline failed during a step; raised on every rank of the job.

    A rank whose process is lost in the middle of a step (SIGKILL, the out-of-memory killer, a crash) raises
    nothing; every other rank raises this error naming it (``rank``, ``pp_rank``; ``record.lost`` true; see
    :mod:`pipesched.runtime.lost_rank`). Bound (gloo, CPU stages): a rank raises at most ``timeout + 2`` seconds
    after it starts waiting for a message or collective that can no longer complete (``timeout``: the
    Pipeline's); the 2 s are at most 1 s looking for a failure record in the store, the probe of closed
    connections and the teardown of its groups. As the operating system closes a lost process's connections, a
    rank waiting on it directly ends after about 1 s, and each rank between it and the lost one adds about 1 s.
    A rank still computing in a layer ends when it next waits. A rank that left on purpose (``pipe.close()``, or its
    process or launch ``fn`` ended without closing) is named as such instead (``record.ended``; see
    :mod:`pipesched.runtime.departure`).

    Attributes:
        record: the :class:`FailureRecord` every rank read.
        rank: world rank of the rank that failed first (``record.lost`` true: of the rank whose process was
            lost).
        pp_rank: its pipeline rank (``None`` if unknown).
        instr: the instruction it was running, text form (``"F1.2"``), or ``None`` (outside any instruction: the
            message then says what ran, ``record.where``, e.g. ``while running run_collective's collective``).
        op, stage, microbatch: the instruction's kind (``"F"``, ``"B"``, ...), stage and microbatch, or ``None``.
        cause: ``"ExceptionType: message"`` of the original exception.
        stalled: the world ranks a timed-out wait found alive but not there (did not answer the roll call: the
            stall is among them), as a tuple; ``()`` for any other failure. ``rank`` is then the rank whose wait
            timed out first.
        received: for a forward (``F``) that raised, what its stage received (``"its input (from stage 0 on
            pipeline rank 0): tensor (3, 16) float16"``), or what ``loss_fn`` got; said after the cause. ``None``
            otherwise.
        detail: the original traceback text (on every rank).
    """

    def __init__(self, record: FailureRecord, seen_by: int | None = None, note: str = "") -> None:
        self.record = record
        self.rank, self.pp_rank = record.rank, record.pp_rank
        self.instr = record.instr
        self.op, self.stage, self.microbatch = record.op, record.stage, record.microbatch
        self.cause, self.received = record.cause, record.received
        self.stalled = tuple(record.stalled)
        self.detail = record.traceback
        self.seen_by, self.note = seen_by, note
        super().__init__(self._message())

    def _message(self) -> str:
        if self.record.lost or self.record.ended:
            text = f"pipeline rank failure: {self.cause}"
        else:
            if self.instr is not None:
                where = (f"at instruction {self.instr} (kind {self.op}, stage {self.stage}, "
                         f"microbatch {self.microbatch})")
            elif self.record.where is not None:
                where = self.record.where
            else:
                where = "outside any instruction (while preparing or finishing the step)"
            who = f"world rank {self.rank}" + (f" (pipeline rank {self.pp_rank})" if self.pp_rank is not None else "")
            text = f"pipeline rank failure: {who} failed {where}: {self.cause}"
            if self.received:
                text += f"; {self.received}"
        if self.seen_by is not None and self.seen_by != self.rank:
            text += f" [reported to world rank {self.seen_by}{': ' + self.note if self.note else ''}]"
        return text

    def __reduce__(self):
        return (PipelineError, (self.record, self.seen_by, self.note))


class CommError(RuntimeError):
    """A wait on a message or collective failed (peer gone, timeout); the executor turns it into a
    :class:`PipelineError` after reading the store for the rank that failed first.

    Attributes:
        what: the message or collective waited for (``"RECV_F1.1 from pipeline rank 0"``).
        original: torch's exception.
        peer: the pipeline rank waited on, if one.
        connection_lost: the peer closed the connection (its process failed or exited) rather than the wait timing
            out; decided once, from ``original`` (:func:`~pipesched.runtime.torch_errors.peer_closed_connection`).
    """

    def __init__(self, what: str, exc: BaseException, peer: int | None = None) -> None:
        self.what, self.original, self.peer = what, exc, peer
        self.connection_lost = peer_closed_connection(exc)
        super().__init__(f"{what}: {type(exc).__name__}: {exc}")


class FailureChannel:
    """Error records in the store, one key per process group (keys named after the groups, so every
    member of a group agrees on them). The first record written to a key wins."""

    def __init__(self, store, group_names, job_key: str | None = None) -> None:
        self.store = store
        self.unreachable = False  # a store operation failed: its host process has probably exited
        self.keys = [f"pipesched/{name}/error" for name in group_names]
        #: a key every rank of the job shares for this channel's owner (a Pipeline's construction round), under which
        #: the stalled-rank roll call is answered too, so every rank can hear every other (``runtime/stalled.py``)
        self.job_key = job_key
        self.read_keys = [JOB_KEY, *self.keys]  # a launch fn's own failure (publish_job_failure) is read first

    def publish(self, record: FailureRecord) -> None:
        """Write ``record`` under every key that holds no record yet (best effort: the store may be gone)."""
        payload = record.to_json()
        for key in self.keys:
            try:
                self.store.compare_set(key, "", payload)
            except Exception:  # noqa: BLE001 - publishing must never hide the original error
                pass

    def lookup(self, wait_s: float = 0.0) -> FailureRecord | None:
        """The first record found under any key, polling up to ``wait_s`` seconds; ``None`` if none."""
        deadline = time.monotonic() + wait_s
        errors = 0
        while True:
            for key in self.read_keys:
                try:
                    if self.store.check([key]):
                        return FailureRecord.from_json(self.store.get(key).decode())
                except Exception:  # noqa: BLE001 - a dead store means no record (retried: it may be transient)
                    self.unreachable = True
                    errors += 1
                    if errors >= 3:
                        return None
                    time.sleep(0.1)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def seen(self, record: FailureRecord) -> None:
        """Count this rank as having read ``record`` (the origin lingers until every rank has)."""
        if record.id is not None:
            try:
                self.store.add(_seen_key(record), 1)
            except Exception:  # noqa: BLE001 - best effort
                self.unreachable = True

    def keep_alive_for(self, record: FailureRecord, world_size: int, grace_s: float) -> Linger | None:
        """This process published ``record`` first (or hosts the store): keep it up at interpreter exit until all
        ``world_size`` ranks have read it, at most ``grace_s`` seconds (a :class:`Linger` of its own, registered with
        ``atexit``; returned, ``None`` when nobody else reads the record). Ranks the record names as stalled (alive,
        but not at the step's point within the timeout: a hung layer) are not waited for: they cannot read it."""
        if world_size <= 1 or record.id is None:
            return None
        readers = world_size - 1 if record.lost or record.ended else world_size  # nor does a rank that left
        readers -= len(set(record.stalled))
        wait = Linger(self.store, _seen_key(record), readers, grace_s)
        atexit.register(wait)
        return wait


def _seen_key(record: FailureRecord) -> str:
    return f"pipesched/seen/{record.id}"


class Linger:
    """Keeps this process (and the store it may host) up until ``readers`` ranks have read one failure record (the
    count under ``key``), at most ``grace_s`` seconds; called once, at interpreter exit or earlier."""

    def __init__(self, store, key: str, readers: int, grace_s: float) -> None:
        self.store, self.key, self.readers, self.grace_s = store, key, readers, grace_s

    def __call__(self, max_s: float | None = None) -> float:
        """Wait (at most ``grace_s``, or ``max_s`` if smaller); returns the seconds waited. Unregisters itself: a
        later call, or interpreter exit, waits no more."""
        atexit.unregister(self)
        start = time.monotonic()
        deadline = start + (self.grace_s if max_s is None else min(self.grace_s, max_s))
        self.grace_s = 0.0
        while time.monotonic() < deadline:
            try:
                if self.store.add(self.key, 0) >= self.readers:
                    break
            except Exception:  # noqa: BLE001 - the store is gone: nothing to keep alive
                break
            time.sleep(0.05)
        return time.monotonic() - start


#: the store key of the first failure of a launch ``fn`` outside any Pipeline call (:func:`publish_job_failure`)
JOB_KEY = "pipesched/job/error"


def publish_job_failure(store, rank: int, exc: BaseException) -> FailureRecord:
    """Publish (first wins, best effort) that world rank ``rank``'s launch ``fn`` raised ``exc`` outside any Pipeline
    call, under :data:`JOB_KEY`; returns the record now there (another rank's, if it published first)."""
    record = FailureRecord.local(rank, None, exc, where="in its launch fn, outside any Pipeline call")
    try:
        found = store.compare_set(JOB_KEY, "", record.to_json())
        return FailureRecord.from_json(found.decode() if isinstance(found, bytes) else found)
    except Exception:  # noqa: BLE001 - the store is gone: the parent still reports this rank's error
        return record


def job_failure(store) -> FailureRecord | None:
    """The record :func:`publish_job_failure` left, ``None`` if none (or the store does not answer)."""
    try:
        if store.check([JOB_KEY]):
            return FailureRecord.from_json(store.get(JOB_KEY).decode())
    except Exception:  # noqa: BLE001 - a store that is gone holds nothing
        pass
    return None
