"""When one rank fails: an error every rank raises, and the side channel (the c10d store) that carries it.

The failing rank writes what failed (its rank, the instruction, the original exception) to the store
under its pipeline group's and its data-parallel group's keys, then tears its process groups down, which
closes its connections: peers blocked on it get a connection error at once, read the store, raise the
same :class:`PipelineError`, and tear down their own groups in turn. Waits also end after the
configured timeout, so no rank waits forever even if a process hangs without failing.
"""
from __future__ import annotations

import json
import time
import traceback


class PipelineError(RuntimeError):
    """A rank of the pipeline failed during a step; raised on every rank of the job.

    Attributes:
        rank: world rank of the rank that failed first.
        instr: the instruction it was running, text form (``"F1.2"``), or ``None`` (outside any instruction).
        op, stage, microbatch: the instruction's kind (``"F"``, ``"B"``, ...), stage and microbatch, or ``None``.
        cause: ``"ExceptionType: message"`` of the original exception.
        detail: the original traceback text (on every rank).
    """

    def __init__(self, info: dict, seen_by: int | None = None, note: str = "") -> None:
        self.info = dict(info)
        self.rank = info.get("rank")
        self.instr = info.get("instr")
        self.op, self.stage, self.microbatch = info.get("op"), info.get("stage"), info.get("microbatch")
        self.cause = info.get("cause", "")
        self.detail = info.get("traceback", "")
        self.seen_by, self.note = seen_by, note
        super().__init__(self._message())

    def _message(self) -> str:
        if self.instr is not None:
            where = f"at instruction {self.instr} (kind {self.op}, stage {self.stage}, microbatch {self.microbatch})"
        else:
            where = "outside any instruction (while preparing or finishing the step)"
        text = f"pipeline rank failure: rank {self.rank} failed {where}: {self.cause}"
        if self.seen_by is not None and self.seen_by != self.rank:
            text += f" [reported to rank {self.seen_by}{': ' + self.note if self.note else ''}]"
        return text

    def __reduce__(self):
        return (PipelineError, (self.info, self.seen_by, self.note))


class CommError(RuntimeError):
    """A wait on a message or collective failed (peer gone, timeout); the executor turns it into a
    :class:`PipelineError` after reading the store for the rank that failed first."""

    def __init__(self, what: str, exc: BaseException) -> None:
        self.what, self.original = what, exc
        super().__init__(f"{what}: {type(exc).__name__}: {exc}")


def failure_info(rank: int, instr, exc: BaseException) -> dict:
    """The JSON-ready record of a local failure."""
    return {
        "rank": rank,
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
        while True:
            for key in self.keys:
                try:
                    if self.store.check([key]):
                        return json.loads(self.store.get(key).decode())
                except Exception:  # noqa: BLE001 - a dead store means no record
                    return None
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)
