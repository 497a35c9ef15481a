"""When one rank fails: an error every rank raises, and the side channel (the c10d store) that carries it.

The failing rank writes what failed (its rank, the instruction, the original exception) to the store
under its pipeline group's and its data-parallel group's keys, then tears its process groups down, which
closes its connections: peers blocked on it get a connection error at once, read the store, raise the
same :class:`PipelineError`, and tear down their own groups in turn. Waits also end after the
configured timeout, so no rank waits forever even if a process hangs without failing.

The store lives in one process (world rank 0 under ``env://``). The rank that publishes the first record,
and world rank 0, keep their processes, and so the store, up until every rank of the job has read the record
or a bounded grace period ends (:func:`linger`: ``launch``'s children call it before exiting; a Pipeline registers it
at interpreter exit). If a rank still finds no record while its peer closed the connection (the peer's
process exited or was killed), it reports that peer as the likely origin instead of itself.
"""
from __future__ import annotations

import atexit
import json
import time
import traceback


class PipelineError(RuntimeError):
    """A rank of the pipeline failed during a step; raised on every rank of the job.

    Attributes:
        rank: world rank of the rank that failed first (or, when its record could not be read and this
            rank lost its connection to a peer, that peer: ``info["lost"]`` is then true).
        pp_rank: its pipeline rank (``None`` if unknown).
        instr: the instruction it was running, text form (``"F1.2"``), or ``None`` (outside any instruction).
        op, stage, microbatch: the instruction's kind (``"F"``, ``"B"``, ...), stage and microbatch, or ``None``.
        cause: ``"ExceptionType: message"`` of the original exception.
        detail: the original traceback text (on every rank).
    """

    def __init__(self, info: dict, seen_by: int | None = None, note: str = "") -> None:
        self.info = dict(info)
        self.rank, self.pp_rank = info.get("rank"), info.get("pp_rank")
        self.instr = info.get("instr")
        self.op, self.stage, self.microbatch = info.get("op"), info.get("stage"), info.get("microbatch")
        self.cause = info.get("cause", "")
        self.detail = info.get("traceback", "")
        self.seen_by, self.note = seen_by, note
        super().__init__(self._message())

    def _message(self) -> str:
        if self.info.get("lost"):
            text = f"pipeline rank failure: {self.cause}"
        else:
            if self.instr is not None:
                where = (f"at instruction {self.instr} (kind {self.op}, stage {self.stage}, "
                         f"microbatch {self.microbatch})")
            else:
                where = "outside any instruction (while preparing or finishing the step)"
            who = f"world rank {self.rank}" + (f" (pipeline rank {self.pp_rank})" if self.pp_rank is not None else "")
            text = f"pipeline rank failure: {who} failed {where}: {self.cause}"
        if self.seen_by is not None and self.seen_by != self.rank:
            text += f" [reported to world rank {self.seen_by}{': ' + self.note if self.note else ''}]"
        return text

    def __reduce__(self):
        return (PipelineError, (self.info, self.seen_by, self.note))


class CommError(RuntimeError):
    """A wait on a message or collective failed (peer gone, timeout); the executor turns it into a
    :class:`PipelineError` after reading the store for the rank that failed first."""

    def __init__(self, what: str, exc: BaseException, peer: int | None = None) -> None:
        self.what, self.original, self.peer = what, exc, peer  # peer: the pipeline rank waited on, if one
        super().__init__(f"{what}: {type(exc).__name__}: {exc}")


    @property
    def connection_lost(self) -> bool:
        """The peer closed the connection (its process failed or exited), rather than a timeout."""
        text = str(self.original).lower()
        return any(s in text for s in ("closed by peer", "connection reset", "broken pipe", "connection refused"))


def failure_info(rank: int, instr, exc: BaseException, pp_rank: int | None = None) -> dict:
    """The JSON-ready record of a local failure."""
    return {
        "rank": rank,
        "pp_rank": pp_rank,
        "id": f"{rank}:{time.time_ns()}",
        "instr": None if instr is None else str(instr),
        "op": None if instr is None else instr.op.value,
        "stage": None if instr is None else instr.stage,
        "microbatch": None if instr is None else instr.microbatch,
        "cause": f"{type(exc).__name__}: {exc}",
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
    }


class FailureChannel:
    """Error records in the store, one key per process group (keys named after the groups, so every
    member of a group agrees on them). The first record written to a key wins."""

    def __init__(self, store, group_names) -> None:
        self.store = store
        self.unreachable = False  # a store operation failed: its host process has probably exited
        self.keys = [f"pipesched/{name}/error" for name in group_names]

    def publish(self, info: dict) -> None:
        """Write ``info`` under every key that holds no record yet (best effort: the store may be gone)."""
        payload = json.dumps(info)
        for key in self.keys:
            try:
                self.store.compare_set(key, "", payload)
            except Exception:  # noqa: BLE001 - publishing must never hide the original error
                pass

    def lookup(self, wait_s: float = 0.0) -> dict | None:
        """The first record found under any key, polling up to ``wait_s`` seconds; ``None`` if none."""
        deadline = time.monotonic() + wait_s
        errors = 0
        while True:
            for key in self.keys:
                try:
                    if self.store.check([key]):
                        return json.loads(self.store.get(key).decode())
                except Exception:  # noqa: BLE001 - a dead store means no record (retried: it may be transient)
                    self.unreachable = True
                    errors += 1
                    if errors >= 3:
                        return None
                    time.sleep(0.1)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def seen(self, info: dict) -> None:
        """Count this rank as having read record ``info`` (the origin lingers until every rank has)."""
        if "id" in info:
            try:
                self.store.add(_seen_key(info), 1)
            except Exception:  # noqa: BLE001 - best effort
                self.unreachable = True

    def keep_alive_for(self, info: dict, world_size: int, grace_s: float) -> None:
        """This process published ``info`` first (or hosts the store): let :func:`linger` keep it up at exit
        until all ``world_size`` ranks have read ``info``, at most ``grace_s`` seconds."""
        if world_size > 1 and "id" in info:
            global _registered
            _origins.append((self.store, _seen_key(info), world_size, grace_s))
            if not _registered:
                _registered = True
                atexit.register(linger)


def _seen_key(info: dict) -> str:
    return f"pipesched/seen/{info['id']}"


_origins: list = []  # (store, seen key, world size, grace s) of records this process published first
_registered = False


def linger(max_s: float | None = None) -> float:
    """Wait until every rank has read each failure record this process published first, so that the store
    it may host stays reachable; at most each record's grace (or ``max_s``) seconds. Returns the seconds waited."""
    start = time.monotonic()
    while _origins:
        store, key, world, grace = _origins.pop()
        deadline = start + (grace if max_s is None else min(grace, max_s))
        while time.monotonic() < deadline:
            try:
                if store.add(key, 0) >= world:
                    break
            except Exception:  # noqa: BLE001 - the store is gone: nothing to keep alive
                break
            time.sleep(0.05)
    return time.monotonic() - start
