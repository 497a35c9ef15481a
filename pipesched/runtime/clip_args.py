"""``clip_grad_norm_``'s arguments: each rank's own checked before anything travels (:func:`check_clip_arguments`),
where a rank's gathered row carries them (:data:`MAX_NORM`, :data:`NORM_TYPE`, :data:`EINF`, :data:`FOREACH`,
:data:`FOREACH_CODES`), and the pipeline ranks' ruling on the gathered rows: ranks that passed different arguments
(:func:`mismatch_message`, :func:`check_same`) or a rank that refused its own (:func:`refusal_message`,
:func:`check_refusals`). Every rank sees the same rows, so every rank raises the same ``ValueError``, before any
gradient is scaled. Used by :mod:`~pipesched.runtime.clipping` (the call) and :mod:`~pipesched.runtime.clip_replicas`
(the replicas' agreement).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..checks import is_real

#: floating dtypes a norm can have, in the order of the flags a row carries (clipping's :func:`local_part`)
NORM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: indices in a gathered row (:func:`~pipesched.runtime.clipping.gather_parts`): the arguments max_norm and norm_type
#: (nan: a refusal, :func:`~pipesched.runtime.clipping.refuse`), error_if_nonfinite (0/1) and foreach's code (the
#: anticipated rows of norm_parts end at NORM_TYPE)
MAX_NORM, NORM_TYPE, EINF, FOREACH = (k + len(NORM_DTYPES) for k in (2, 3, 4, 5))
FOREACH_CODES = {None: 0, False: 1, True: 2}  #: foreach as a row carries it
#: each argument's name and its index in a row, in the order they are compared
ARGUMENTS = (("max_norm", MAX_NORM), ("norm_type", NORM_TYPE), ("error_if_nonfinite", EINF), ("foreach", FOREACH))


def check_clip_arguments(max_norm, norm_type, error_if_nonfinite, foreach) -> tuple[float, float]:
    """The checked ``(max_norm, norm_type)`` as floats; a local check of each rank's own arguments (that every
    rank passed the same ``max_norm`` and ``norm_type`` is checked in the reduction, :func:`check_same`).

    Raises:
        ValueError: ``max_norm`` not a real number > 0 (``inf``: never clip) nor a 0-dim real tensor holding one
            (as torch takes it); ``norm_type`` not a real number > 0, nor ``inf`` / ``"inf"``;
            ``error_if_nonfinite`` not a bool; ``foreach`` not ``None`` or a bool. The message names the argument,
            its value and what is valid.
    """
    value = _scalar_of(max_norm)
    if value is None or not value > 0:
        raise ValueError(f"max_norm must be a number > 0 or a 0-dim tensor holding one (inf: no clipping), "
                         f"got {max_norm!r}")
    norm = math.inf if isinstance(norm_type, str) and norm_type.lower() == "inf" else norm_type
    if not is_real(norm) or not norm > 0:
        raise ValueError(f"norm_type must be a number > 0 or inf (float('inf') or 'inf'), got {norm_type!r}")
    if not isinstance(error_if_nonfinite, bool):
        raise ValueError(f"error_if_nonfinite must be True or False, got {error_if_nonfinite!r}")
    if foreach is not None and not isinstance(foreach, bool):
        raise ValueError(f"foreach must be None, True or False, got {foreach!r}")
    return value, float(norm)


def _scalar_of(value) -> float | None:
    """``value`` as a float: a real number (not a bool), or a 0-dim tensor of a real dtype (not bool); else None."""
    if isinstance(value, torch.Tensor):
        real = value.dtype != torch.bool and not value.dtype.is_complex
        return float(value) if value.dim() == 0 and real else None
    return float(value) if is_real(value) else None


def shown_argument(name: str, value: float):
    """A row's value of argument ``name`` as the caller passed it (bools and ``foreach``'s ``None`` decoded)."""
    if name == "error_if_nonfinite":
        return bool(value)
    if name == "foreach":
        return {code: arg for arg, code in FOREACH_CODES.items()}[int(value)]
    return value


def mismatch_message(rows: list, replica: int | None = None) -> str | None:
    """The error for pipeline ranks that passed different ``max_norm``, ``norm_type``, ``error_if_nonfinite`` or
    ``foreach`` (the first that differs; every rank sees the same ``rows``, so every rank builds the same message,
    before any gradient is scaled); ``None`` when they agree. ``replica``: named with data parallelism."""
    for name, column in ARGUMENTS:
        seen: dict[float, list[int]] = {}
        for rank, row in enumerate(rows):
            seen.setdefault(row[column], []).append(rank)
        if len(seen) > 1:
            ranks = "pipeline ranks" if replica is None else f"pipeline ranks of replica {replica}"
            values = ", ".join(f"{shown_argument(name, value)!r} on pipeline rank(s) {who}"
                               for value, who in seen.items())
            return (f"clip_grad_norm_: the {ranks} passed different {name}: {values}; pass the same {name} on "
                    f"every rank (no gradient was changed)")
    return None


def check_same(rows: list) -> None:
    """Raise when the pipeline ranks passed different arguments (:func:`mismatch_message`).

    Raises:
        ValueError: names the argument and each value with the pipeline ranks that passed it.
    """
    message = mismatch_message(rows)
    if message is not None:
        raise ValueError(message)


def refusal_key(group, calls: int, world_rank: int) -> str:
    """The default store's key under which a refusing rank leaves its message
    (:func:`~pipesched.runtime.clipping.refuse`)."""
    return f"pipesched/clip-refused/{group.group_name}/{calls}/{world_rank}"


def refusal_message(pipe, rows: list, calls: int) -> str | None:
    """The error for a pipeline rank that refused its arguments (its row's ``max_norm`` is nan:
    :func:`~pipesched.runtime.clipping.refuse`),
    ``None`` if none did: ``clip_grad_norm_: world rank W (pipeline rank P) refused its arguments: <its message>;
    no gradient was changed`` (the first refusing rank; ``(pipeline rank P of replica D)`` with data parallelism).
    """
    refusing = [r for r, row in enumerate(rows) if math.isnan(row[MAX_NORM])]
    if not refusing:
        return None
    grid, rank = pipe.grid, refusing[0]
    world = grid.pipeline_ranks(grid.dp_rank)[rank]
    store = dist.distributed_c10d._get_default_store()
    message = store.get(refusal_key(pipe._pp_group, calls, world)).decode()
    where = f"pipeline rank {rank}" + (f" of replica {grid.dp_rank}" if grid.dp_size > 1 else "")
    return f"clip_grad_norm_: world rank {world} ({where}) refused its arguments: {message}; no gradient was changed"


def check_refusals(pipe, rows: list, calls: int) -> None:
    """Raise when a pipeline rank refused its arguments (:func:`refusal_message`).

    Raises:
        ValueError: naming the first refusing rank and quoting its message; the pipeline stays usable.
    """
    message = refusal_message(pipe, rows, calls)
    if message is not None:
        raise ValueError(message)
