"""Global gradient clipping: ``torch.nn.utils.clip_grad_norm_``'s contract over every stage of a pipeline.

``torch.nn.utils.clip_grad_norm_(pipe.parameters(), ...)`` sees this rank's gradients only, so each rank would
clip by its own norm: a different model than the unsplit one. :func:`clip_grad_norm_` computes this rank's part
with torch's own :func:`torch.nn.utils.get_total_norm` (torch >= 2.6; the same computation before), combines
the parts of all pipeline ranks (on every rank alike and in rank order, the SUM of ``norm ** p``, or the MAX for
``p = inf``), and scales with torch's
:func:`torch.nn.utils.clip_grads_with_norm_`, so the coefficient is torch's: ``min(max_norm / (total + 1e-6), 1)``.
The parts come one of two ways. Right after a step that anticipated this call (:mod:`~pipesched.runtime.norm_parts`:
each rank's part travelled point to point at the step's end), from that step, without any communication. Otherwise
(the first call, another ``norm_type`` or ``max_norm``, gradients changed since the step, a non-finite total)
through ONE ``all_gather`` over the pipeline group (:func:`gather_parts`): each rank's ``max_norm``, ``norm_type``,
``error_if_nonfinite`` and ``foreach`` travel in it, so ranks that passed different ones all raise a ``ValueError``
(:func:`check_same`) instead of clipping differently; one gather, not an all-reduce, because the reduction (SUM or
MAX) would depend on the very ``norm_type`` the ranks may disagree on. Both ways combine the same rows with the
same code, so they give bitwise the same total and gradients.

Data-parallel replicas hold identical gradients after the step's all-reduce: only the pipeline group is reduced
over, so nothing is counted twice. But the replicas must clip alike, so with data parallelism the collective way
adds ONE small all-gather over the data-parallel group (:func:`agree_replicas`, a ``SIG_LEN``-word row per rank):
each rank sends what its pipeline decided (its error, or the arguments all its ranks passed), so every rank of the
job raises the same ``ValueError`` (:func:`judge_replicas`) when any rank refused or the replicas passed different
arguments, before any gradient is scaled. The norm counts each parameter of the unsplit model once,
:meth:`Pipeline.owned_parameters <pipesched.runtime.Pipeline.owned_parameters>` (a tied parameter on its owning
stage's rank only); every parameter of this rank is scaled.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..checks import is_real
from .failure import CommError
from .handshake import CLIP_MARK, REPLICA_MARK, ROW_LEN, SIG_LEN, check_rows_meet, decode_text, encode_text
from .transport import gather_rows

# floating dtypes a norm can have, in the order of the flags the reduction carries (see :func:`local_part`)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: indices in a gathered row (:func:`gather_parts`): the arguments max_norm and norm_type (nan: a refusal,
#: :func:`refuse`), error_if_nonfinite (0/1) and foreach's code (the anticipated rows of norm_parts end at NORM_TYPE)
MAX_NORM, NORM_TYPE, EINF, FOREACH = 2 + len(_DTYPES), 3 + len(_DTYPES), 4 + len(_DTYPES), 5 + len(_DTYPES)
FOREACH_CODES = {None: 0, False: 1, True: 2}  #: foreach as a row carries it
_ARGUMENTS = (("max_norm", MAX_NORM), ("norm_type", NORM_TYPE), ("error_if_nonfinite", EINF), ("foreach", FOREACH))


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


def _norm_of(grads, norm_type: float, foreach) -> torch.Tensor:
    """``torch.nn.utils.get_total_norm`` (torch >= 2.6), else :func:`_norm_before_2_6`."""
    get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)
    if get_total_norm is None:
        return _norm_before_2_6(grads, norm_type)
    return get_total_norm(grads, norm_type, error_if_nonfinite=False, foreach=foreach)


def _norm_before_2_6(grads, norm_type: float) -> torch.Tensor:
    """What torch 2.4-2.5's ``clip_grad_norm_`` computes (one tensor at a time; ``foreach`` not used): the norm
    of the per-tensor norms, on the first gradient's device, in their promoted dtype."""
    norms = [torch.linalg.vector_norm(g, norm_type) for g in grads]
    return torch.linalg.vector_norm(torch.stack([n.to(grads[0].device) for n in norms]), norm_type)


def _scale(params, max_norm: float, total: torch.Tensor, foreach) -> None:
    """``torch.nn.utils.clip_grads_with_norm_`` (torch >= 2.6), else :func:`_scale_before_2_6`."""
    clip_grads_with_norm_ = getattr(torch.nn.utils, "clip_grads_with_norm_", None)
    if clip_grads_with_norm_ is None:
        return _scale_before_2_6(params, max_norm, total)
    return clip_grads_with_norm_(params, max_norm, total, foreach)


def _scale_before_2_6(params, max_norm: float, total: torch.Tensor) -> None:
    """torch's scaling, one gradient at a time: ``grad *= clamp(max_norm / (total + 1e-6), max=1)``."""
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.device))


def local_part(params, max_norm: float, norm_type: float, foreach, device: torch.device) -> torch.Tensor:
    """This rank's row of the reduction, a float64 tensor of shape ``(4 + len(_DTYPES),)`` on ``device``:
    ``[norm (this rank's norm_type-norm, in float64), 1 if the norm is nan, a 1 at the index of the norm's dtype, ...,
    max_norm, norm_type]`` (the norm, nan and dtype entries all zeros when no parameter here has a ``.grad``). The norm
    itself, not its power, so that a row scales exactly with its gradients (GradScaler.unscale_, norm_parts).

    Raises:
        TypeError: the norm's dtype is not one of float16, bfloat16, float32, float64.
    """
    # a sparse gradient's norm is that of its coalesced values (torch's get_total_norm has no sparse kernel)
    grads = [p.grad.coalesce().values() if p.grad.is_sparse else p.grad for p in params if p.grad is not None]
    part = torch.zeros(4 + len(_DTYPES), dtype=torch.float64, device=device)
    part[-2], part[-1] = max_norm, norm_type
    if not grads:
        return part
    norm = _norm_of(grads, norm_type, foreach)
    if norm.dtype not in _DTYPES:
        raise TypeError(f"clip_grad_norm_ supports gradients whose norm is one of {_DTYPES}, got {norm.dtype}")
    flag = 2 + _DTYPES.index(norm.dtype)
    norm = norm.to(device=device, dtype=torch.float64)
    part[0] = norm
    part[1] = norm.isnan()
    part[flag] = 1.0
    return part


def gather_parts(params, max_norm: float, norm_type: float, foreach, group, device: torch.device,
                 calls: int = 0, fell_back: bool = False, error_if_nonfinite: bool = False) -> list:
    """Every rank's :func:`local_part` (collective over ``group``: ONE ``all_gather`` per rank on ``device`` of a row
    shaped as the step's opening row, ``ROW_LEN`` int64 words: ``CLIP_MARK``, ``calls``, the part's 8 float64 values
    as their bits, ``error_if_nonfinite`` (0 or 1) and ``foreach`` (:data:`FOREACH_CODES`); then one host read).
    One operation whatever the arguments, so ranks that passed different ones still meet in it, and each rank sees
    every rank's arguments (:func:`mismatch_message`); a rank that meets another's step opening instead (it took the
    anticipated path) or another count of calls raises (:func:`~pipesched.runtime.handshake.check_rows_meet`).

    Returns:
        The rows by rank of ``group`` (pipeline rank), each a list of floats: the part's 8 values, then
        ``error_if_nonfinite`` and ``foreach``'s code as floats (indices :data:`EINF`, :data:`FOREACH`).
    Raises:
        CommError: the all-gather failed (a peer is gone, or ``timeout`` passed); ``fell_back``: this rank could
            not use the parts its last step anticipated, and the error says that the others may not have joined.
        RuntimeError: the ranks are out of step (see above), on every rank that took part.
    """
    part = local_part(params, max_norm, norm_type, foreach, device)
    words = torch.zeros(ROW_LEN, dtype=torch.int64, device=device)
    words[0], words[1] = CLIP_MARK, calls
    words[2:2 + part.numel()] = part.view(torch.int64)
    words[2 + EINF], words[2 + FOREACH] = int(error_if_nonfinite), FOREACH_CODES[foreach]
    rows = [torch.empty_like(words) for _ in range(dist.get_world_size(group))]
    try:
        dist.all_gather(rows, words, group=group)
    except RuntimeError as exc:
        what = "the all-gather of clip_grad_norm_ over the pipeline group"
        if fell_back:
            what += (" (this rank could not use the norm parts its last step anticipated: its max_norm, norm_type "
                     "or gradients differed from that step's, so it took the collective; ranks that could went on "
                     "without it. Call clip_grad_norm_ alike on every rank, or set pipe.anticipate_clip = False)")
        raise CommError(what, exc) from None
    check_rows_meet([row[:2].tolist() for row in rows], CLIP_MARK)
    flags = torch.stack([row[2 + EINF:2 + FOREACH + 1] for row in rows]).tolist()
    parts = torch.stack([row[2:2 + part.numel()] for row in rows]).view(torch.float64).tolist()
    return [values + [float(word) for word in words] for values, words in zip(parts, flags)]


def _shown(name: str, value: float):
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
    for name, column in _ARGUMENTS:
        seen: dict[float, list[int]] = {}
        for rank, row in enumerate(rows):
            seen.setdefault(row[column], []).append(rank)
        if len(seen) > 1:
            ranks = "pipeline ranks" if replica is None else f"pipeline ranks of replica {replica}"
            values = ", ".join(f"{_shown(name, value)!r} on pipeline rank(s) {who}"
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


def total_norm(rows: list, norm_type: float, device: torch.device) -> torch.Tensor:
    """The total ``norm_type``-norm from every rank's row (:func:`gather_parts`), combined in rank order.

    Returns:
        A 0-dim tensor on ``device``, the same value on every rank: ``(sum over ranks of norm_r ** p) ** (1/p)``
        (``max`` for inf), formed in float64 and rounded to the dtype torch's ``get_total_norm`` gives over all the
        gradients (the promotion of their norms' dtypes; float32 when no rank has a gradient). nan if any
        gradient holds a nan; inf if one holds an inf (as torch).
    """
    norms = [row[0] for row in rows]
    value = max(norms) if math.isinf(norm_type) else sum(norm ** norm_type for norm in norms)
    present = [d for k, d in enumerate(_DTYPES) if any(row[2 + k] > 0 for row in rows)]
    dtype = present[0] if present else torch.float32  # torch's get_total_norm([]) is float32 too
    for d in present[1:]:
        dtype = torch.promote_types(dtype, d)
    if any(row[1] > 0 for row in rows):
        value = math.nan
    elif not math.isinf(norm_type):
        value = value ** (1.0 / norm_type)
    return torch.tensor(value, dtype=dtype, device=device)


def nonfinite_message(norm_type: float) -> str:
    """torch's message for a non-finite total norm under ``error_if_nonfinite=True``, saying it is global."""
    return (f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
            "clipped (the norm over every stage of the pipeline; every rank raises this). To disable this error "
            "and scale the gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")


def _refusal_key(group, calls: int, world_rank: int) -> str:
    return f"pipesched/clip-refused/{group.group_name}/{calls}/{world_rank}"


def refuse(pipe, error: ValueError) -> None:
    """This rank refused its arguments (``error``): join the other ranks' all-gathers anyway (:func:`collect`: the
    pipeline group's, and with data parallelism the replicas'), with a row whose ``max_norm`` and ``norm_type`` are
    nan (no valid call sends nan), after writing ``error``'s message to the default store, so every other rank of
    the job raises a ``ValueError`` quoting it (:func:`refusal_message`) instead of waiting for this rank until the
    timeout or clipping while this one does not. Counted as a call (:meth:`NormParts.refused
    <pipesched.runtime.norm_parts.NormParts.refused>`), so the ranks stay in step. Nothing to do on a closed or
    failed pipeline, or a job of one rank. The caller raises ``error``.

    Raises:
        PipelineError: a rank failed or was lost meanwhile (as :meth:`Pipeline.run_collective
            <pipesched.runtime.Pipeline.run_collective>`).
    """
    if pipe.grid.world_size == 1 or pipe._closed or pipe._broken is not None:
        return
    parts = pipe._norm_parts
    parts.refused()

    def work(pp_group, dp_group):
        store = dist.distributed_c10d._get_default_store()
        store.set(_refusal_key(pp_group, parts.calls, pipe.grid.world_rank), str(error))
        collect(pipe, [], math.nan, math.nan, False, None, pp_group, dp_group, parts.calls)

    pipe.run_collective(work)


def refusal_message(pipe, rows: list, calls: int) -> str | None:
    """The error for a pipeline rank that refused its arguments (its row's ``max_norm`` is nan: :func:`refuse`),
    ``None`` if none did: ``clip_grad_norm_: world rank W (pipeline rank P) refused its arguments: <its message>;
    no gradient was changed`` (the first refusing rank; ``(pipeline rank P of replica D)`` with data parallelism).
    """
    refusing = [r for r, row in enumerate(rows) if math.isnan(row[MAX_NORM])]
    if not refusing:
        return None
    grid, rank = pipe.grid, refusing[0]
    world = grid.pipeline_ranks(grid.dp_rank)[rank]
    store = dist.distributed_c10d._get_default_store()
    message = store.get(_refusal_key(pipe._pp_group, calls, world)).decode()
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


#: a replica's row in the agreement over the data-parallel group (:func:`agree_replicas`): SIG_LEN int64 words,
#: ``[CLIP_MARK, 1, 1, *text, *data]``, ``data`` the last ``_DATA`` words: ``[calls, error, max_norm, norm_type,
#: error_if_nonfinite, foreach]`` (floats as their bits). Words 1-2 and the text read, to a step's agreement of the
#: replicas (``Handshake._agree_replicas``: the same size and group) met in its place, as "replica D refused its
#: step: <text>", so a replica that opened its next step while the others clip raises too, instead of misreading.
_DATA = 6
_MEETING = ("it is in clip_grad_norm_'s agreement of the replicas while this replica opened its next step: the "
            "replicas' clip_grad_norm_ calls differed (with pipe.anticipate_clip = True: set it alike on every "
            "rank, and call clip_grad_norm_ with the same arguments after changing gradients alike on every replica)")


def agree_replicas(pipe, rows: list, calls: int, dp_group) -> list:
    """The replicas' agreement (collective over ``dp_group``: ONE all-gather of a ``SIG_LEN``-word row): each rank
    sends what its whole pipeline decided alike from ``rows`` (its pipeline group's, :func:`gather_parts`): the
    error its pipeline raises (:func:`refusal_message`, :func:`mismatch_message`) as text, else the arguments every
    pipeline rank passed, and its count of calls. The replicas of a pipeline rank are in the same position in
    their pipelines, and every rank of a pipeline sends the same row, so every rank of the job gets the same rows,
    one per replica (:func:`judge_replicas`).

    Returns:
        The rows by replica, lists of int64 words.
    Raises:
        RuntimeError: a replica is in another call (e.g. it opened its next step: it did not call
            clip_grad_norm_, or took the anticipated path) or made another number of clip calls.
        CommError: the all-gather failed.
    """
    grid = pipe.grid
    error = refusal_message(pipe, rows, calls) or mismatch_message(rows, grid.dp_rank)
    args = [0, 0, 0, 0] if error else [float_bits(rows[0][MAX_NORM]), float_bits(rows[0][NORM_TYPE]),
                                       int(rows[0][EINF]), int(rows[0][FOREACH])]
    words = encode_text([CLIP_MARK, 1, 1], error or _MEETING, SIG_LEN - _DATA) + [calls, int(bool(error)), *args]
    replicas = gather_rows(words, dp_group, grid.dp_size, torch.int64, pipe.device,
                           "the all-gather of clip_grad_norm_ over the data-parallel group (the replicas' agreement)")
    others = [k for k, row in enumerate(replicas) if row[0] != CLIP_MARK]
    if others:
        opened = [k for k in others if replicas[k][0] == REPLICA_MARK]
        doing = "opened the next step (step() or forward())" if opened == others else "are in another collective"
        raise RuntimeError(f"clip_grad_norm_: replicas {[k for k in range(grid.dp_size) if k not in others]} are in "
                           f"clip_grad_norm_'s agreement of the replicas while replicas {others} {doing}: the "
                           f"replicas' clip_grad_norm_ calls differed. Call it on every rank of every replica alike; "
                           f"with pipe.anticipate_clip = True, set it alike on every rank and change gradients "
                           f"between step() and clip_grad_norm_() alike on every replica")
    counts = [row[-_DATA] for row in replicas]
    if len(set(counts)) > 1:
        raise RuntimeError(f"clip_grad_norm_: the replicas made different numbers of clip_grad_norm_ calls (by "
                           f"replica: {counts}); call it on every rank alike")
    return replicas


def judge_replicas(pipe, replicas: list) -> None:
    """Every rank's ruling on the replicas' rows (:func:`agree_replicas`), the same on every rank of the job.

    Raises:
        ValueError: the first replica whose pipeline raises an error (a refusal, or pipeline ranks that passed
            different arguments): that error's message (as the row carries it, so the same text everywhere); else
            replicas that passed different ``max_norm``, ``norm_type``, ``error_if_nonfinite`` or ``foreach``
            (names the argument, each value and its replicas' world ranks). No gradient was changed.
    """
    failed = [row for row in replicas if row[-_DATA + 1]]
    if failed:
        raise ValueError(decode_text(failed[0]))
    grid = pipe.grid
    for k, (name, _) in enumerate(_ARGUMENTS):
        seen: dict[int, list[int]] = {}
        for replica, row in enumerate(replicas):
            seen.setdefault(row[-_DATA + 2 + k], []).append(replica)
        if len(seen) > 1:
            values = ", ".join(
                f"{_shown(name, bits_float(word) if k < 2 else word)!r} on replica(s) {who} (world ranks "
                f"{[r for replica in who for r in grid.pipeline_ranks(replica)]})" for word, who in seen.items())
            raise ValueError(f"clip_grad_norm_: the replicas passed different {name}: {values}; pass the same "
                             f"{name} on every rank (no gradient was changed)")


def collect(pipe, params, max_norm: float, norm_type: float, error_if_nonfinite: bool, foreach, pp_group,
            dp_group, calls: int, fell_back: bool = False) -> tuple[list, list | None]:
    """The collective part of a call (inside :meth:`Pipeline.run_collective`): :func:`gather_parts` over the
    pipeline group, then with data parallelism :func:`agree_replicas` over the data-parallel group (one more small
    all-gather, so that the replicas agree as the pipeline ranks do). Returns ``(rows, replicas or None)``."""
    rows = gather_parts(params, max_norm, norm_type, foreach, pp_group, pipe.device, calls, fell_back,
                        error_if_nonfinite)
    return rows, (None if dp_group is None else agree_replicas(pipe, rows, calls, dp_group))


def float_bits(value: float) -> int:
    """The int64 word holding ``value``'s float64 bits."""
    return int(torch.tensor([value], dtype=torch.float64).view(torch.int64)[0])


def bits_float(word: int) -> float:
    return float(torch.tensor([word], dtype=torch.int64).view(torch.float64)[0])


def clip_grad_norm_(pipe, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None) -> torch.Tensor:
    """:meth:`Pipeline.clip_grad_norm_ <pipesched.runtime.Pipeline.clip_grad_norm_>`: check, the anticipated
    parts or the gathers, agree, scale. Arguments this rank refuses still join the other ranks' gathers
    (:func:`refuse`), so a bad argument on one rank is a ``ValueError`` on every rank of the job."""
    try:
        value, norm_type = check_clip_arguments(max_norm, norm_type, error_if_nonfinite, foreach)
    except ValueError as exc:
        refuse(pipe, exc)
        raise
    pipe._check_local(None, None)  # closed or broken: the error step() gives, on either path
    parts = pipe._norm_parts  # anticipated clipping (runtime/norm_parts.py)
    with torch.no_grad():
        rows = parts.take(value, norm_type, foreach)  # counts the call
        if rows is None:
            rows, replicas = pipe.run_collective(
                lambda pp_group, dp_group: collect(pipe, list(pipe.owned_parameters()), value, norm_type,
                                                   error_if_nonfinite, foreach, pp_group, dp_group, parts.calls,
                                                   parts.fell_back))
            # outside run_collective: a ValueError, the pipeline stays usable
            if replicas is None:
                check_refusals(pipe, rows, parts.calls)  # before check_same: a refusal row carries no arguments
                check_same(rows)
            else:
                judge_replicas(pipe, replicas)  # the pipeline's own errors too, the same text on every rank
        parts.wanted = (value, norm_type)  # the next steps anticipate these
        total = total_norm(rows, norm_type, pipe.device)
        if error_if_nonfinite and not bool(total.isfinite()):
            raise RuntimeError(nonfinite_message(norm_type))  # on every rank: the norm is the same everywhere
        _scale(list(pipe.parameters()), max_norm if isinstance(max_norm, torch.Tensor) else value, total, foreach)
    return total
