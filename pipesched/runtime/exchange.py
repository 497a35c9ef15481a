"""Every rank's entry through the default group's store: the one way ranks compare notes before (or between) their
collectives (the construction agreement, the checkpoint votes), so that a rank that disagrees or never arrives is a
clear error on every rank instead of a collective that waits.

Rounds. Entries are filed on a *sequence* (a store prefix: the construction agreement has one, the checkpoint votes
share one). Each rank files its entry under the number of entries it has filed on that sequence so far (a counter
per rank, in the store), so a rank's n-th entry meets the others' n-th: round n. Then it reads every world rank's.

Each round is settled once, the same way for every rank: the first rank to rule on it wins (``compare_set`` on the
round's ``state`` key, which only a missing key lets through):

- ``complete``: ruled by a rank that found every rank's entry. Every rank reads the entries and goes on, even one
  whose own wait timed out meanwhile (it lost the race: the round had completed).
- ``abandoned``: ruled by a rank whose wait timed out first (the record says which ranks were missing and after how
  long). It raises ``TimeoutError`` naming the missing ranks; so does every other rank that timed out. A rank that
  reaches the round *after* that (late by more than the timeout) finds the others' leftover entries but does not
  go on alone with them (into a collective nobody else enters): it raises ``TimeoutError`` naming the ranks that
  gave up on the round (``"world ranks [0] gave up on this round ..."``), at once.

Counters stay in step by one rule: a round counts as used for every rank that files an entry in it, whatever its
ruling. So a rank late to a call fails that call at the round the others abandoned, and its next call meets the
others' next; ranks that make the same calls in the same order (each raising or not) stay in step. A rank that
skips a call the others made altogether stays behind until it has failed at each round the others gave up on
(each such call fails at once, naming who gave up; the checkpoint votes also name a rank that is in another call).
This is why every caller files its entry even when it refuses its own arguments.
"""
from __future__ import annotations

import datetime
import json
import time

from .failure import FailureRecord, PipelineError, job_failure

_COMPLETE = "complete"
_POLL_S = 0.05  # the longest pause between two looks at a round's entries (and at the job's failure key)


def publish(store, sequence: str, world_rank: int, entry) -> str:
    """File ``entry`` (JSON-ready) as this rank's next entry on ``sequence``; returns the round's key."""
    count = store.add(f"{sequence}/count/{world_rank}", 1)
    key = f"{sequence}/{count}"
    store.set(f"{key}/{world_rank}", json.dumps(entry))
    return key


def read_all(store, key: str, world_rank: int, world_size: int, timeout: float, late: str,
             watch=None, where: str | None = None) -> list:
    """Every world rank's entry in round ``key`` (from :func:`publish`), by rank, once the round is settled
    ``complete`` (see the module's docstring).

    Args:
        late: what a missing rank did not do, with ``{timeout}`` (e.g. ``"reach X within {timeout} s; ..."``).
        watch: a store key, or a list of them, where a :class:`~pipesched.runtime.failure.FailureRecord` may be
            published (:class:`~pipesched.runtime.failure.FailureChannel` keys): one ends the wait at once, as the
            job's failure (e.g. a peer's ``closed``/``exited`` record: it left and will never file its entry).
        where: what this rank was doing, for that ``PipelineError`` (default: waiting for the round's entries).
    Raises:
        TimeoutError: some ranks filed nothing within ``timeout`` seconds: ``"world ranks [..] did not
            {late}"``, naming them; or this rank reached a round the others had already given up on:
            ``"world ranks [..] gave up on this round (world ranks [..] did not {late}); world rank R reached it
            after that and does not go on alone"``.
        PipelineError: another rank's launch ``fn`` raised outside any Pipeline call meanwhile
            (:func:`~pipesched.runtime.failure.publish_job_failure`), or a record appeared under ``watch``: at
            once, naming it, not after ``timeout``.
    """
    keys = [f"{key}/{rank}" for rank in range(world_size)]
    failed = None
    try:
        failed = _wait(store, keys, timeout, watch)
    except Exception as exc:  # noqa: BLE001 - the store reports a timeout as one of several types
        _timed_out(store, key, keys, world_rank, timeout, late, exc)
    if failed is not None:
        raise PipelineError(failed, world_rank, where or f"while waiting for every rank's entry in {key}")
    else:
        ruling = _rule(store, key, _COMPLETE)
        if ruling != _COMPLETE:
            record = json.loads(ruling)
            gave_up = [rank for rank in range(world_size) if _present(store, f"{key}/gave-up/{rank}")]
            raise TimeoutError(f"world ranks {gave_up or [record['by']]} gave up on this round (world ranks "
                               f"{record['missing']} did not {record['late']}); world rank {world_rank} reached "
                               f"it after that and does not go on alone")
    return [json.loads(store.get(k)) for k in keys]


def _wait(store, keys: list, timeout: float, watch=None):
    """Wait until every key of ``keys`` is set, at most ``timeout`` seconds (raises as the store's ``wait`` does), or
    until a launch ``fn`` published its failure or a record appeared under ``watch`` (returns that record; ``None``
    once the keys are set)."""
    deadline = time.monotonic() + timeout
    pause = 0.001
    while not store.check(keys):
        failed = job_failure(store) or _watched(store, watch, keys)
        if failed is not None:
            return failed
        if time.monotonic() >= deadline:  # one last look; the store's own timeout error if still missing
            try:
                store.wait(keys, datetime.timedelta(milliseconds=1))
            except Exception as exc:  # noqa: BLE001 - said with the whole wait's length
                missing = ", ".join(k for k in keys if not store.check([k]))
                raise TimeoutError(f"wait timeout after {timeout:g} s, keys: {missing}") from exc
            return None
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(2 * pause, _POLL_S)
    return None


def _watched(store, watch, keys: list) -> FailureRecord | None:
    """The first record under ``watch`` (a key or a list of keys) that ends a wait for ``keys`` (the round's entries,
    by world rank): a failure or an exit of a rank that has not filed its entry (one that has is no longer awaited,
    and a ``closed`` record is not final: a rank that closed its Pipeline may still make the call). ``None`` if none
    (or the store does not answer: as job_failure)."""
    for key in [watch] if isinstance(watch, str) else watch or ():
        try:
            record = record_at(store, key)
            if record is None:
                continue
            voted = record.rank is not None and 0 <= record.rank < len(keys) and store.check([keys[record.rank]])
            if record.ended != "closed" and not voted:
                return record
        except Exception:  # noqa: BLE001 - a store that is gone holds nothing
            return None
    return None


def _timed_out(store, key: str, keys: list, world_rank: int, timeout: float, late: str, exc) -> None:
    """This rank's wait for round ``key`` timed out: rule the round abandoned (unless every entry has arrived
    meanwhile, or another rank ruled it complete first: then return, and the round goes on) and raise."""
    late = late.format(timeout=f"{timeout:g}")
    try:
        missing = [rank for rank, k in enumerate(keys) if not store.check([k])]
        if not missing:
            ruling = _rule(store, key, _COMPLETE)
        else:
            store.set(f"{key}/gave-up/{world_rank}", "1")
            ruling = _rule(store, key, json.dumps({"by": world_rank, "missing": missing, "late": late,
                                                   "at": time.time()}))
    except Exception:  # noqa: BLE001 - the store itself failed: what this rank knows is its timeout
        missing, ruling = [rank for rank in range(len(keys)) if rank != world_rank], None
    if ruling == _COMPLETE:
        return
    raise TimeoutError(f"world ranks {missing} did not {late} ({exc})") from None


def unjoined_rounds(store, sequence: str, world_rank: int, world_size: int, since: float = 0.0) -> dict:
    """``{world rank: its entry}`` for each other rank whose latest round on ``sequence`` this rank never filed an
    entry in and that did not complete: still waited in, or abandoned at ``time.time() >= since`` (one abandoned
    earlier is an old one). ``{}`` where the store does not answer."""
    found = {}
    try:
        for r in range(world_size):
            count = store.add(f"{sequence}/count/{r}", 0)
            key = f"{sequence}/{count}"
            if r == world_rank or count == 0 or store.check([f"{key}/{world_rank}"]) or not store.check([f"{key}/{r}"]):
                continue
            if store.check([f"{key}/state"]):
                ruling = store.get(f"{key}/state").decode()
                if ruling == _COMPLETE or json.loads(ruling).get("at", 0.0) < since:
                    continue
            found[r] = json.loads(store.get(f"{key}/{r}"))
    except Exception:  # noqa: BLE001 - a store that is gone: nothing can be said
        return {}
    return found


def record_at(store, key: str) -> FailureRecord | None:
    """The :class:`~pipesched.runtime.failure.FailureRecord` under ``key``, ``None`` if none (checked first: the
    store's ``get`` waits for a key that is not there)."""
    return FailureRecord.from_json(store.get(key).decode()) if store.check([key]) else None


def _rule(store, key: str, ruling: str) -> str:
    """Settle round ``key`` as ``ruling`` unless it is settled already; the round's ruling (the first one)."""
    value = store.compare_set(f"{key}/state", "", ruling)
    return value.decode() if isinstance(value, bytes) else value


def _present(store, key: str) -> bool:
    try:
        return store.check([key])
    except Exception:  # noqa: BLE001 - naming who gave up is best effort
        return False
