"""Which tensor differs, when ranks built their Pipeline from models of other names or shapes: the construction
agreement compares one digest of every rank's (name, shape) list (:func:`~pipesched.runtime.agreement.model_shapes`),
which says *that* the models differ; on that failure path only, each rank publishes its whole list in the store so
the error can say *where* (``'0.weight' has shape (16, 16) on world rank 1 but (8, 8) on world rank 0``). Nothing
is published when the digests agree."""
from __future__ import annotations

import datetime
import json


def publish_spec(store, key: str, world_rank: int, spec: dict) -> None:
    """File this rank's ``spec`` ({name: shape}) under round ``key`` of the agreement (best effort)."""
    try:
        store.set(f"{key}/spec/{world_rank}", json.dumps([[name, list(shape)] for name, shape in spec.items()]))
    except Exception:  # noqa: BLE001 - only the detail of an error that is raised anyway
        pass


def difference(store, key: str, world_rank: int, other: int, spec: dict, wait_s: float) -> str:
    """``"; the first difference: ..."`` between this rank's ``spec`` and world rank ``other``'s (filed by
    :func:`publish_spec`, waited for at most ``wait_s`` seconds); ``""`` if it cannot be read or none is found."""
    try:
        store.wait([f"{key}/spec/{other}"], datetime.timedelta(seconds=wait_s))
        theirs = {name: tuple(shape) for name, shape in json.loads(store.get(f"{key}/spec/{other}"))}
    except Exception:  # noqa: BLE001 - as above
        return ""
    text = first_difference(spec, theirs, f"world rank {world_rank}", f"world rank {other}")
    return f"; the first difference: {text}" if text else ""


def first_difference(mine: dict, theirs: dict, me: str, them: str) -> str:
    """The first tensor, in this rank's order, whose shape differs or that one side lacks, in words; ``""`` if
    the two {name: shape} dicts are equal."""
    for name, shape in mine.items():
        if name not in theirs:
            return f"{name!r} (shape {shape}) is in the model on {me} but not on {them}"
        if theirs[name] != shape:
            return f"{name!r} has shape {theirs[name]} on {them} but {shape} on {me}"
    for name, shape in theirs.items():
        if name not in mine:
            return f"{name!r} (shape {shape}) is in the model on {them} but not on {me}"
    return ""
