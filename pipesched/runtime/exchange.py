"""Every rank's entry through the default group's store: the one way ranks compare notes before (or between) their
collectives (the construction agreement, the checkpoint votes), so that a rank that disagrees or never arrives is a
clear error on every rank instead of a collective that waits.

Each rank publishes a JSON entry under the number of entries it has published on that topic so far (counted in the
store, so a rank's n-th entry meets the others' n-th), then reads every world rank's.
"""
from __future__ import annotations

import datetime
import json


def publish(store, topic: str, world_rank: int, entry) -> str:
    """Publish ``entry`` (JSON-ready) as this rank's next entry on ``topic``; returns the key it was filed under."""
    count = store.add(f"{topic}/count/{world_rank}", 1)
    key = f"{topic}/{count}"
    store.set(f"{key}/{world_rank}", json.dumps(entry))
    return key


def read_all(store, key: str, world_size: int, timeout: float, late: str) -> list:
    """Every world rank's entry filed under ``key`` (from :func:`publish`), by rank.

    Raises:
        TimeoutError: some ranks published nothing within ``timeout`` seconds: ``"world ranks [..] did not
            {late}"``, naming them.
    """
    keys = [f"{key}/{rank}" for rank in range(world_size)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except Exception as exc:  # noqa: BLE001 - the store reports a timeout as one of several types
        missing = [rank for rank, k in enumerate(keys) if not store.check([k])]
        raise TimeoutError(f"world ranks {missing} did not {late.format(timeout=f'{timeout:g}')} ({exc})") from None
    return [json.loads(store.get(k)) for k in keys]
