"""Every rank's verdict before (and between) the collectives of a checkpoint, through the default group's store.

A collective call such as a checkpoint save is checked on each rank first (arguments, paths, names); the ranks
then *vote*: each publishes its verdict (a JSON value, or the error it would raise) under the number of votes it
has cast on that topic so far, and reads every rank's. So one rank's bad argument is the same error on every
rank, raised before any rank enters the collective, and a rank that never votes makes the others fail after
``timeout`` seconds instead of waiting forever.
"""
from __future__ import annotations

import torch.distributed as dist

from .exchange import publish, read_all

_PREFIX = "pipesched/vote"
#: exception types a vote carries from the failing rank to the others by name (anything else: ValueError)
_TYPES = {cls.__name__: cls for cls in (ValueError, TypeError, FileNotFoundError, FileExistsError,
                                        NotADirectoryError, KeyError, RuntimeError)}


class Verdict:
    """One rank's vote: ``ok`` (any JSON value) or ``error`` (an exception to raise everywhere)."""

    __slots__ = ("ok", "error")

    def __init__(self, ok=None, error: BaseException | None = None) -> None:
        self.ok, self.error = ok, error


def vote(topic: str, verdict: Verdict, timeout: float) -> list:
    """Publish this rank's ``verdict`` on ``topic`` and return every world rank's ``ok`` value, by rank.

    Args:
        topic: what is voted on (``"save"``, ``"load"``, ...); each rank's n-th vote on a topic meets the others' n-th.
        verdict: this rank's; ``verdict.ok`` must be JSON-serialisable.
        timeout: seconds to wait for the other ranks' verdicts.
    Raises:
        The first failing rank's error (lowest world rank), on every rank: its own exception object on that rank,
        the same type and message elsewhere (types outside ``ValueError``, ``TypeError``, ``FileNotFoundError``,
        ``FileExistsError``, ``NotADirectoryError``, ``KeyError``, ``RuntimeError`` travel as ``ValueError``).
        TimeoutError: some ranks did not vote within ``timeout`` seconds (names them).
    """
    if not (dist.is_available() and dist.is_initialized()):
        if verdict.error is not None:
            raise verdict.error
        return [verdict.ok]
    store, rank, world = dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size()
    key = publish(store, f"{_PREFIX}/{topic}", rank, _entry(verdict))
    late = f"reach {topic} within {{timeout}} s; every rank must call it, in the same order"
    entries = read_all(store, key, world, timeout, late)
    for r, entry in enumerate(entries):
        if "error" in entry:
            if r == rank:
                raise verdict.error
            kind, message = entry["error"]
            raise _TYPES.get(kind, ValueError)(message)
    return [entry["ok"] for entry in entries]


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
    message = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
    return {"error": [type(error).__name__, message]}
