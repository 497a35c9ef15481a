"""A wait that timed out while its peers' connections stayed open: which ranks may be the stalled one.

A rank that stops answering without failing (a hang or a long pause in the user's code between its calls, a data
loader that blocks) leaves no record and closes no connection: the first rank to time out waiting for it would
otherwise publish only its own timeout, and be blamed. So, when a wait timed out and no failure record turned up,
the timed-out rank answers a **roll call** in the store (one key per rank, under its groups' failure keys, written
only on this path: nothing per step), waits up to ``ROLL_CALL_S`` for the other members of its groups to answer
theirs, and names the members that did not: they had not timed out by then, so they were not waiting on the same
thing long enough: the stalled rank is among them (with 2 ranks: it is the other one). A rank that began waiting
much later than this one (it was computing, then waited on the stalled rank) may be named too; the text says so.
"""
from __future__ import annotations

import time

from .failure import FailureChannel

ROLL_CALL_S = 1.0  #: seconds a timed-out rank waits for the other timed-out ranks to answer the roll call


def roll_call_keys(failures: FailureChannel, world_rank: int) -> list[str]:
    """The roll-call key of ``world_rank`` under each of the channel's group keys, and under its job key (shared by
    every rank of the job) if it has one."""
    keys = [*failures.keys, *([failures.job_key] if getattr(failures, "job_key", None) else [])]
    return [f"{key}/timed-out/{world_rank}" for key in keys]


def answer_roll_call(failures: FailureChannel, world_rank: int) -> bool:
    """Answer the roll call as ``world_rank`` (alive, not the stalled rank); False if the store does not answer.
    A timed-out rank answers before it reads the store for a record: gloo may close its connections as its wait
    times out, and a peer that sees that closed connection tells it from a lost rank by this key
    (:func:`answered_roll_call`, in :func:`~pipesched.runtime.lost_rank.lost_record`), and answers at once itself
    (:func:`lookup_answering`). Also sets the job's one "some rank answered" key (:func:`another_answered`)."""
    try:
        for key in roll_call_keys(failures, world_rank):
            failures.store.set(key, "1")
        if _any_key(failures):
            failures.store.set(_any_key(failures), "1")
    except Exception:  # noqa: BLE001 - a store that is gone: no roll call
        return False
    return True


def _any_key(failures: FailureChannel) -> str | None:
    """The key every rank's answer sets, under the job key (shared by every rank), if the channel has one."""
    job_key = getattr(failures, "job_key", None)
    return f"{job_key}/timed-out/any" if job_key else None


def another_answered(failures: FailureChannel) -> bool:
    """Whether some rank answered the roll call (one store check; False without a job key or a store)."""
    try:
        return bool(_any_key(failures)) and failures.store.check([_any_key(failures)])
    except Exception:  # noqa: BLE001 - a store that is gone: nothing can be said
        return False


def lookup_answering(failures: FailureChannel, world_rank: int, wait_s: float = 1.0):
    """``failures.lookup(wait_s)`` for a rank whose wait saw a closed connection, answering the roll call as
    ``world_rank`` as soon as another rank has: that rank's wait timed out and gloo closed its connections (the
    one this rank saw close, most likely), so this rank, alive and waiting too, is not the stalled one, and says
    so well inside that rank's ``ROLL_CALL_S`` (after the read and the probe it would answer about 1 s late: a
    rank held off the CPU a little longer was named stalled). Returns the record found, or None."""
    deadline, answered = time.monotonic() + wait_s, False
    while True:
        record = failures.lookup()
        if record is not None:
            return record
        if not answered and another_answered(failures):
            answered = answer_roll_call(failures, world_rank)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.02)


def answered_roll_call(failures: FailureChannel, world_rank: int) -> bool:
    """Whether ``world_rank`` answered the roll call under one of the channel's group keys (False if the store
    does not answer)."""
    try:
        return any(failures.store.check([key]) for key in roll_call_keys(failures, world_rank))
    except Exception:  # noqa: BLE001 - a store that is gone: nothing can be said
        return False


def silent_members(failures: FailureChannel, world_rank: int, members, wait_s: float = ROLL_CALL_S) -> list[int]:
    """Answer the roll call as ``world_rank``, then the ``members`` (world ranks of this rank's groups) that did not
    answer theirs within ``wait_s`` seconds, ascending; ``[]`` if the store does not answer (nothing can be said)."""
    if not answer_roll_call(failures, world_rank):
        return []
    others = sorted(set(members) - {world_rank})
    deadline = time.monotonic() + wait_s
    while True:
        try:
            silent = [r for r in others if not any(failures.store.check([key]) for key in roll_call_keys(failures, r))]
        except Exception:  # noqa: BLE001 - as above
            return []
        if not silent or time.monotonic() >= deadline:
            return silent
        time.sleep(0.05)


STEP = "the step"  #: what a wait was in, said by :func:`stall_note`, unless the wait's ``CommError`` says (``.during``)


def stall_note(silent: list[int], pp_size: int, timeout: float, during: str = STEP) -> str:
    """The sentence added to a timed-out rank's failure naming the ranks that did not time out with it; ``during``:
    what the wait was in (:data:`STEP`, ``"the checkpoint save"``, ...)."""
    if not silent:
        return ""
    named = ", ".join(f"world rank {r} (pipeline rank {r % pp_size})" for r in silent)
    pause = "between its pipeline calls" if during == STEP else f"before or inside {during}"
    return (f"; {named} did not time out within {ROLL_CALL_S:g} s of this rank and kept their connections open: alive "
            f"but not at this point of {during} within timeout={timeout:g} s. The stall is there (a hang or a long "
            f"pause in that rank's code {pause}), or that rank began waiting later, on one that is")
