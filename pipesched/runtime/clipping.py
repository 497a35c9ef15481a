"""Global gradient clipping: ``torch.nn.utils.clip_grad_norm_``'s contract over every stage of a pipeline.

``torch.nn.utils.clip_grad_norm_(pipe.parameters(), ...)`` sees this rank's gradients only, so each rank would
clip by its own norm: a different model than the unsplit one. :func:`clip_grad_norm_` computes this rank's part
with torch's own :func:`torch.nn.utils.get_total_norm` (torch >= 2.6; the same computation before), combines
the parts of all pipeline ranks (on every rank alike and in rank order, the SUM of ``norm ** p``, or the MAX for
``p = inf``), and scales with torch's
:func:`torch.nn.utils.clip_grads_with_norm_`, so the coefficient is torch's: ``min(max_norm / (total + 1e-6), 1)``.
The parts come one of two ways. Right after a step that anticipated this call (:mod:`~pipesched.runtime.norm_parts`:
each rank's part travelled point to point at the step's end), from that step, without any communication. Otherwise
(the first call, another ``norm_type`` or ``max_norm``, gradients changed since the step) through ONE ``all_gather``
over the pipeline group (:func:`gather_parts`): each rank's ``max_norm`` and ``norm_type`` travel in it, so ranks
that passed different ones all raise a ``ValueError`` (:func:`check_same`) instead of clipping differently; one
gather, not an all-reduce, because the reduction (SUM or MAX) would depend on the very ``norm_type`` the ranks may
disagree on. Both ways combine the same rows with the same code, so they give bitwise the same total and gradients.

Data-parallel replicas hold identical gradients after the step's all-reduce: only the pipeline group is reduced
over, so nothing is counted twice. The norm counts each parameter of the unsplit model once,
:meth:`Pipeline.owned_parameters <pipesched.runtime.Pipeline.owned_parameters>` (a tied parameter on its owning
stage's rank only); every parameter of this rank is scaled.
"""
from __future__ import annotations

import math
import numbers

import torch
import torch.distributed as dist

from .failure import CommError
from .handshake import CLIP_MARK, ROW_LEN, check_rows_meet

# floating dtypes a norm can have, in the order of the flags the reduction carries (see :func:`local_part`)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


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
    if not _is_real(norm) or not norm > 0:
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
    return float(value) if _is_real(value) else None


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


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
                 calls: int = 0, fell_back: bool = False) -> list:
    """Every rank's :func:`local_part` (collective over ``group``: ONE ``all_gather`` per rank on ``device`` of a row
    shaped as the step's opening row, ``ROW_LEN`` int64 words: ``CLIP_MARK``, ``calls``, the part's 8 float64 values
    as their bits; then one host read). One operation whatever the arguments, so ranks that passed different ones
    still meet in it, and each rank sees every rank's arguments (:func:`check_same`); a rank that meets another's
    step opening instead (it took the anticipated path) or another count of calls raises
    (:func:`~pipesched.runtime.handshake.check_rows_meet`).

    Returns:
        The rows by rank of ``group`` (pipeline rank), each a list of floats.
    Raises:
        CommError: the all-gather failed (a peer is gone, or ``timeout`` passed); ``fell_back``: this rank could
            not use the parts its last step anticipated, and the error says that the others may not have joined.
        RuntimeError: the ranks are out of step (see above), on every rank that took part.
    """
    part = local_part(params, max_norm, norm_type, foreach, device)
    words = torch.zeros(ROW_LEN, dtype=torch.int64, device=device)
    words[0], words[1] = CLIP_MARK, calls
    words[2:2 + part.numel()] = part.view(torch.int64)
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
    return torch.stack([row[2:2 + part.numel()] for row in rows]).view(torch.float64).tolist()


def check_same(rows: list) -> None:
    """Raise when the pipeline ranks passed different ``max_norm`` or ``norm_type`` (every rank sees the same
    ``rows``, so every rank raises the same error, before any gradient is scaled).

    Raises:
        ValueError: names the argument and each value with the pipeline ranks that passed it.
    """
    for name, column in (("max_norm", -2), ("norm_type", -1)):
        seen: dict[float, list[int]] = {}
        for rank, row in enumerate(rows):
            seen.setdefault(row[column], []).append(rank)
        if len(seen) > 1:
            values = ", ".join(f"{value!r} on pipeline rank(s) {ranks}" for value, ranks in seen.items())
            raise ValueError(f"clip_grad_norm_: the pipeline ranks passed different {name}: {values}; pass the "
                             f"same {name} on every rank (no gradient was changed)")


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
    """This rank refused its arguments (``error``): join the other pipeline ranks' all-gather anyway, with a row
    whose ``max_norm`` and ``norm_type`` are nan (no valid call sends nan), after writing ``error``'s message to
    the default store, so they raise a ``ValueError`` quoting it (:func:`check_refusals`) instead of waiting for
    this rank until the timeout. Counted as a call (:meth:`NormParts.refused
    <pipesched.runtime.norm_parts.NormParts.refused>`), so the ranks stay in step. Nothing to do on a closed or
    failed pipeline, or one pipeline rank. The caller raises ``error``.

    Raises:
        PipelineError: a rank failed or was lost meanwhile (as :meth:`Pipeline.run_collective
            <pipesched.runtime.Pipeline.run_collective>`).
    """
    if pipe.grid.pp_size == 1 or pipe._closed or pipe._broken is not None:
        return
    parts = pipe._norm_parts
    parts.refused()

    def work(pp_group, _dp_group):
        store = dist.distributed_c10d._get_default_store()
        store.set(_refusal_key(pp_group, parts.calls, pipe.grid.world_rank), str(error))
        gather_parts([], math.nan, math.nan, None, pp_group, pipe.device, parts.calls)

    pipe.run_collective(work)


def check_refusals(pipe, rows: list, calls: int) -> None:
    """Raise when a pipeline rank refused its arguments (its row's ``max_norm`` is nan: :func:`refuse`).

    Raises:
        ValueError: ``clip_grad_norm_: world rank W (pipeline rank P) refused its arguments: <its message>; no
            gradient was changed`` (the first refusing rank); the pipeline stays usable.
    """
    refusing = [r for r, row in enumerate(rows) if math.isnan(row[-2])]
    if not refusing:
        return
    grid, rank = pipe.grid, refusing[0]
    world = grid.pipeline_ranks(grid.dp_rank)[rank]
    store = dist.distributed_c10d._get_default_store()
    message = store.get(_refusal_key(pipe._pp_group, calls, world)).decode()
    raise ValueError(f"clip_grad_norm_: world rank {world} (pipeline rank {rank}) refused its arguments: {message}; "
                     f"no gradient was changed")


def clip_grad_norm_(pipe, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None) -> torch.Tensor:
    """:meth:`Pipeline.clip_grad_norm_ <pipesched.runtime.Pipeline.clip_grad_norm_>`: check, the anticipated
    parts or a gather, agree, scale. Arguments this rank refuses still join the other ranks' gather
    (:func:`refuse`), so a bad argument on one rank is a ``ValueError`` on every rank."""
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
            rows = pipe.run_collective(lambda pp_group, _: gather_parts(list(pipe.owned_parameters()), value,
                                                                        norm_type, foreach, pp_group, pipe.device,
                                                                        parts.calls, parts.fell_back))
            check_refusals(pipe, rows, parts.calls)  # before check_same: a refusal row carries no arguments
            check_same(rows)  # outside run_collective: a ValueError, the pipeline stays usable
        parts.wanted = (value, norm_type)  # the next steps anticipate these
        total = total_norm(rows, norm_type, pipe.device)
        if error_if_nonfinite and not bool(total.isfinite()):
            raise RuntimeError(nonfinite_message(norm_type))  # on every rank: the norm is the same everywhere
        _scale(list(pipe.parameters()), max_norm if isinstance(max_norm, torch.Tensor) else value, total, foreach)
    return total
