"""Every rank's verdict before (and between) the collectives of a checkpoint, through the default group's store.

A collective call such as a checkpoint save is checked on each rank first (arguments, paths, names); the ranks
then *vote*: each publishes its verdict (a JSON value, or the error it would raise) and reads every rank's. So one
rank's bad argument is an error on every rank, raised before any rank enters the collective, and a rank that never
votes makes the others fail after ``timeout`` seconds instead of waiting forever.

Every checkpoint vote (of ``save_checkpoint`` and ``load_checkpoint``, each stage) is a round of ONE sequence
(:mod:`~pipesched.runtime.exchange`: a rank's n-th vote meets the others' n-th), and each entry says which call and
stage it belongs to: ranks in different calls (one saving while another loads) or stages are named at once on every
rank, and, each having used the round, stay in step for their next calls. A round that timed out is abandoned: a
rank that reaches it later raises ``TimeoutError`` naming the ranks that gave up, instead of going on alone.
"""
from __future__ import annotations

import torch.distributed as dist

from .exchange import publish, read_all, record_at, unjoined_rounds
from .failure import FailureRecord, PipelineError

_PREFIX = "pipesched/vote"  # one sequence for every checkpoint vote
#: seconds a vote waits when the caller has no timeout to give (``pipe`` is not a Pipeline: the Pipeline's default)
FALLBACK_TIMEOUT = 300.0
#: exception types a vote carries from the failing rank to the others by name (anything else: ValueError)
_TYPES = {cls.__name__: cls for cls in (ValueError, TypeError, FileNotFoundError, FileExistsError,
                                        NotADirectoryError, KeyError, RuntimeError)}
#: stage -> (what the vote is, in a message naming a rank's place; how another rank's error is named)
STAGES = {"arguments": ("the vote on its arguments", "refused its arguments"),
          "written": ("the vote after writing", "failed after writing"),
          "commit": ("the vote on renaming the checkpoint into place", "failed to rename the checkpoint into place"),
          "checkpoint": ("the vote on the checkpoint it reads", "refused the checkpoint"),
          "loaded": ("the vote after copying in", "failed while copying in")}
_ORDER = ("every rank must make the same checkpoint calls (save_checkpoint, load_checkpoint) in the same order "
          "(they are collective: on every rank, not only under `if rank == 0`)")


class Verdict:
    """One rank's vote: ``ok`` (any JSON value) or ``error`` (an exception to raise everywhere)."""

    __slots__ = ("ok", "error")

    def __init__(self, ok=None, error: BaseException | None = None) -> None:
        self.ok, self.error = ok, error


def vote(call: str, stage: str, verdict: Verdict, timeout: float | None, pipe=None) -> list:
    """Publish this rank's ``verdict`` on ``call``'s ``stage`` and return every world rank's ``ok`` value, by rank.

    Args:
        call: the function voting (``"save_checkpoint"``, ``"load_checkpoint"``), named in the messages.
        stage: which of its votes, a key of :data:`STAGES`.
        verdict: this rank's; ``verdict.ok`` must be JSON-serialisable.
        timeout: seconds to wait for the other ranks' verdicts; ``None``: :data:`FALLBACK_TIMEOUT`.
        pipe: the Pipeline the call is for, if it is one: the vote watches its failure keys while waiting
            (:func:`watched_keys`), so a record appearing there (a rank closed its Pipeline, its launch ``fn`` ended,
            it failed) ends the wait at once, and passes that record on to this rank's other groups (as a failing
            step does), so that the ranks waiting in those learn it too.
    Raises:
        ValueError: the ranks are in different calls or stages (``"the ranks are in different checkpoint calls:
            world rank 0 is in save_checkpoint (...), world rank 1 in load_checkpoint (...); ..."``, the same on
            every rank), checked first.
        The first refusing rank's error (lowest world rank), of its type: its exception object on that rank, the
            same message on every other rank that refused too (every refusing rank raises one and the same
            error), and named on a rank that refused nothing: ``"<call>: world rank R refused its arguments: <its
            message>"`` (a message that names its rank already, ``"<call>: world rank R ..."``, as it is). Types
            outside ``ValueError``, ``TypeError``, ``FileNotFoundError``, ``FileExistsError``,
            ``NotADirectoryError``, ``KeyError``, ``RuntimeError`` travel as ``ValueError``.
        TimeoutError: some ranks did not vote within ``timeout`` seconds (names them); or this rank reached a
            round the others had given up on (names them; see :mod:`~pipesched.runtime.exchange`).
        PipelineError: a record appeared under ``pipe``'s failure keys while waiting (names the rank and what it
            did), or another rank's launch ``fn`` raised outside any Pipeline call.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if verdict.error is not None:
            raise verdict.error
        return [verdict.ok]
    timeout = FALLBACK_TIMEOUT if timeout is None else timeout
    store, rank, world = dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size()
    key = publish(store, _PREFIX, rank, {"call": call, "stage": stage, **_entry(verdict)})
    late = f"reach {_place(call, stage)} within {{timeout}} s; {_ORDER}"
    try:
        entries = read_all(store, key, rank, world, timeout, late, watched_keys(pipe),
                           f"while waiting in {_place(call, stage)}")
    except PipelineError as exc:
        if pipe is not None and exc.record.rank != rank:
            pipe._failures.publish(exc.record)  # to this rank's other groups' keys (a key holding one keeps it)
        raise
    except TimeoutError as exc:
        closed = _closed_by_others(pipe, rank)
        if closed:
            raise TimeoutError(f"{exc}; {closed}") from None
        raise
    _check_same_call(entries)
    for r, entry in enumerate(entries):
        if "error" in entry:
            if r == rank:
                raise verdict.error
            kind, message = entry["error"]
            named = f"{call}: world rank {r} "
            if verdict.error is None and not message.startswith(named):  # this rank had nothing to refuse
                message = f"{named}{STAGES[stage][1]}: {message}"
            raise _TYPES.get(kind, ValueError)(message)
    return [entry["ok"] for entry in entries]


def watched_keys(pipe) -> list | None:
    """The failure keys of ``pipe``'s groups that a vote watches (``None``: ``pipe`` is not a Pipeline): a peer that
    leaves or fails while this rank waits publishes its record there and ends the wait at once. A key already holding
    a rank's departure (``closed``/``exited``: it will never vote) is watched too; one holding a failure from before
    the vote is not, so a call after a failure (e.g. an emergency save by ranks that all caught the PipelineError)
    is not ended by it."""
    from .pipeline import Pipeline  # the pipeline's modules are imported after this one

    if not isinstance(pipe, Pipeline):
        return None
    store = pipe._failures.store
    try:
        return [key for key in pipe._failures.keys if _gone(record_at(store, key))]
    except Exception:  # noqa: BLE001 - a store that is gone: nothing to watch (the vote's wait fails on it)
        return None


def _gone(record: FailureRecord | None) -> bool:
    """Whether a key holding ``record`` is watched: it holds none yet, or its rank left (``closed``/``exited``) or
    was lost (its process ended): such a rank never votes, even where its record came before the vote."""
    return record is None or bool(record.ended or record.lost)


def waiting_in_votes(store, world_rank: int, world_size: int, since: float = 0.0) -> dict:
    """``{world rank: "save_checkpoint (the vote on its arguments)"}``: the other ranks whose latest checkpoint vote
    is one this rank never joined and that did not complete (:func:`~pipesched.runtime.exchange.unjoined_rounds`,
    ``since`` as there): said by a rank whose own wait timed out, since those ranks were in a checkpoint call while
    it was elsewhere (e.g. ``if rank == 0: save_checkpoint(...)``)."""
    return {r: _place(entry.get("call"), entry.get("stage"))
            for r, entry in unjoined_rounds(store, _PREFIX, world_rank, world_size, since).items()}


def votes_note(votes: dict) -> str:
    """The sentence a timed-out rank's failure adds for :func:`waiting_in_votes`'s answer (``""`` for none)."""
    if not votes:
        return ""
    named = ", ".join(f"world rank {r} was in {place}" for r, place in sorted(votes.items()))
    return (f"; meanwhile {named}, a checkpoint call this rank did not make: save_checkpoint and load_checkpoint are "
            f"collective (call them on every rank, not only under `if rank == 0`)")


def _closed_by_others(pipe, rank: int) -> str:
    """``"world rank R had closed its Pipeline (pipe.close())"`` where a ``closed`` record of another
    rank is under ``pipe``'s failure keys (a likely reason it never voted), else ``""``."""
    for key in watched_keys(pipe) or ():
        try:
            record = record_at(pipe._failures.store, key)
        except Exception:  # noqa: BLE001 - no store: nothing to add
            continue
        if record is not None and record.ended == "closed" and record.rank != rank:
            return f"world rank {record.rank} had closed its Pipeline (pipe.close())"
    return ""


def _place(call: str, stage: str) -> str:
    return f"{call} ({STAGES[stage][0] if stage in STAGES else stage})"


def _check_same_call(entries: list) -> None:
    """Raise ``ValueError`` naming every rank's call and stage unless they are the same on every rank."""
    places = [_place(entry.get("call"), entry.get("stage")) for entry in entries]
    if len(set(places)) == 1:
        return
    groups: dict = {}
    for rank, place in enumerate(places):
        groups.setdefault(place, []).append(rank)
    parts = []
    for place, ranks in groups.items():
        who, verb = (f"world rank {ranks[0]}", "is") if len(ranks) == 1 else (f"world ranks {ranks}", "are")
        parts.append(f"{who} {verb} in {place}" if not parts else f"{who} in {place}")
    raise ValueError(f"the ranks are in different checkpoint calls: {', '.join(parts)}; {_ORDER} (no rank goes on "
                     f"with this call)")


def check_same(oks: list, field: str, caller: str) -> None:
    """Raise ``ValueError`` unless every world rank's ``ok[field]`` (``oks``: :func:`vote`'s answer, dicts by rank)
    equals world rank 0's; the message names ``caller``, the first differing rank, both values and the field."""
    for rank, ok in enumerate(oks):
        if ok[field] != oks[0][field]:
            raise ValueError(f"{caller}: world rank {rank} gave {field}={ok[field]!r} but world rank 0 "
                             f"{field}={oks[0][field]!r}; every rank must pass the same {field}")


def check_optimizers(oks: list, caller: str) -> None:
    """Raise ``ValueError`` unless every rank that holds parameters gave an optimizer, or none did (``oks``: dicts
    by rank with ``optimizer`` (bool: given) and ``parameters`` (bool: this rank's stages hold any)). A rank whose
    stages hold no parameters may pass ``None`` while the others pass theirs (torch refuses an optimizer over an
    empty parameter list); the message names ``caller``, both ranks and what each gave."""
    given = [rank for rank, ok in enumerate(oks) if ok["optimizer"]]
    missing = [rank for rank, ok in enumerate(oks) if not ok["optimizer"] and ok["parameters"]]
    if given and missing:
        raise ValueError(f"{caller}: world rank {given[0]} gave an optimizer but world rank {missing[0]} "
                         f"optimizer=None although its stages hold parameters; every rank must pass its optimizer, "
                         f"or every rank None (only a rank whose stages hold no parameters may pass None while the "
                         f"others pass theirs)")


def _entry(verdict: Verdict) -> dict:
    if verdict.error is None:
        return {"ok": verdict.ok}
    error = verdict.error
    message = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    return {"error": [type(error).__name__, message]}
