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
(:func:`~pipesched.runtime.clip_args.check_same`) instead of clipping differently; one gather, not an all-reduce,
because the reduction (SUM or MAX) would depend on the very ``norm_type`` the ranks may disagree on. Both ways combine
the same rows with the same code, so they give bitwise the same total and gradients.

Data-parallel replicas hold identical gradients after the step's all-reduce: only the pipeline group is reduced
over, so nothing is counted twice. But the replicas must clip alike, so with data parallelism the collective way
adds ONE small all-gather over the data-parallel group (:mod:`~pipesched.runtime.clip_replicas`):
each rank sends what its pipeline decided (its error, or the arguments all its ranks passed), so every rank of the
job raises the same ``ValueError`` when any rank refused or the replicas passed different arguments, before any
gradient is scaled. The norm counts each parameter of the unsplit model once,
:meth:`Pipeline.owned_parameters <pipesched.runtime.Pipeline.owned_parameters>` (a tied parameter on its owning
stage's rank only); every parameter of this rank is scaled.

This module holds the call itself: the norm (torch's functions, or the same computation before torch 2.6), this rank's
row, the pipeline group's gather, the total and the refusal. The arguments' checks and the pipeline ranks' rulings on
them are in :mod:`~pipesched.runtime.clip_args`, the replicas' agreement in :mod:`~pipesched.runtime.clip_replicas`;
their names are importable from here too.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .clip_args import (EINF, FOREACH, FOREACH_CODES, NORM_DTYPES, check_clip_arguments, check_refusals, check_same,
                        refusal_key)
from .clip_args import MAX_NORM, NORM_TYPE, mismatch_message, refusal_message  # noqa: F401 - re-exported
from .clip_replicas import agree_replicas, judge_replicas
from .clip_replicas import bits_float, float_bits  # noqa: F401 - re-exported
from .failure import CommError
from .handshake import CLIP_MARK, ROW_LEN, check_rows_meet


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
    """This rank's row of the reduction, a float64 tensor of shape ``(4 + len(NORM_DTYPES),)`` on ``device``:
    ``[norm (this rank's norm_type-norm, in float64), 1 if the norm is nan, a 1 at the index of the norm's dtype, ...,
    max_norm, norm_type]`` (the norm, nan and dtype entries all zeros when no parameter here has a ``.grad``). The norm
    itself, not its power, so that a row scales exactly with its gradients (GradScaler.unscale_, norm_parts).

    Raises:
        TypeError: the norm's dtype is not one of float16, bfloat16, float32, float64.
    """
    # a sparse gradient's norm is that of its coalesced values (torch's get_total_norm has no sparse kernel)
    grads = [p.grad.coalesce().values() if p.grad.is_sparse else p.grad for p in params if p.grad is not None]
    part = torch.zeros(4 + len(NORM_DTYPES), dtype=torch.float64, device=device)
    part[-2], part[-1] = max_norm, norm_type
    if not grads:
        return part
    norm = _norm_of(grads, norm_type, foreach)
    if norm.dtype not in NORM_DTYPES:
        raise TypeError(f"clip_grad_norm_ supports gradients whose norm is one of {NORM_DTYPES}, got {norm.dtype}")
    flag = 2 + NORM_DTYPES.index(norm.dtype)
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
    present = [d for k, d in enumerate(NORM_DTYPES) if any(row[2 + k] > 0 for row in rows)]
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
        store.set(refusal_key(pp_group, parts.calls, pipe.grid.world_rank), str(error))
        collect(pipe, [], math.nan, math.nan, False, None, pp_group, dp_group, parts.calls)

    pipe._collective(work, False, "clip_grad_norm_")  # clip's rows meet the others'


def collect(pipe, params, max_norm: float, norm_type: float, error_if_nonfinite: bool, foreach, pp_group,
            dp_group, calls: int, fell_back: bool = False) -> tuple[list, list | None]:
    """The collective part of a call (inside :meth:`Pipeline.run_collective`): :func:`gather_parts` over the
    pipeline group, then with data parallelism :func:`agree_replicas` over the data-parallel group (one more small
    all-gather, so that the replicas agree as the pipeline ranks do). Returns ``(rows, replicas or None)``."""
    rows = gather_parts(params, max_norm, norm_type, foreach, pp_group, pipe.device, calls, fell_back,
                        error_if_nonfinite)
    return rows, (None if dp_group is None else agree_replicas(pipe, rows, calls, dp_group))


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
            rows, replicas = pipe._collective(
                lambda pp_group, dp_group: collect(pipe, list(pipe.owned_parameters()), value, norm_type,
                                                   error_if_nonfinite, foreach, pp_group, dp_group, parts.calls,
                                                   parts.fell_back), False, "clip_grad_norm_")
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
