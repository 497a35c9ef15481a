"""ZB-H1 and ZB-H2: the handcrafted zero-bubble schedules of Qi et al., "Zero Bubble Pipeline Parallelism"
(arXiv:2401.10241, section 3), one stage per rank on the contiguous placement.

Both split every backward into ``I`` (the input gradient, which the previous rank waits for) and ``W`` (the
weight gradient, which nobody waits for) and place the ``W`` where a rank would otherwise idle. The builder's
split stands: ``compile_program(..., split_backward=...)`` finds no ``B`` to split and changes nothing.

Closed forms, exact in :func:`pipesched.simulate` with F = I = W (each ``t`` seconds) and free messages
(tested over a grid of p and m); makespan ``(3m + p - 1) t``, bubble fraction ``(p-1)/(3m+p-1)``: each rank
idles ``(p - 1) t``, a third of 1F1B's ``3(p - 1) t`` (B = 2t; bubble ``3(p-1)/(3m+3(p-1))``):

- ``zb-h1`` for m >= p. Peak in-flight activations (microbatch-stages whose ``W`` has not run) on every rank:
  ``min(p, m)``, 1F1B's peak (that of its rank 0) and no more; counted up to ``I``, where the activations only
  the input gradient needs are freed, rank ``r`` holds ``min(p - r, m)`` as in 1F1B.
- ``zb-h2`` for m >= 2p - 2 (and p = 1). Peak in-flight on rank r: ``min(m, max(2(p-r)-1, 2r))``, at most
  ``2p - 1`` (rank 0). In one synchronous step with these costs its makespan equals ZB-H1's (the bubble left is
  the fill and drain skew of the first and last microbatch); its extra in-flight forwards pay off when messages
  take time or ``W`` is cheaper than ``I``: p=4, m=8, F=I=W=1 s, latency 0.5 s: 1F1B 41 s (33 s with split
  backward), ZB-H1 33 s, ZB-H2 30 s.

Smaller m (any m >= 1 is accepted): the same rules give a valid program with a larger bubble (the warmup is cut
to m forwards); the peak formulas above still hold.
"""
from __future__ import annotations

from .. import placement
from ..ir import Instr, Op
from ._common import check_one_stage_sizes, forward, program


def build_zb_h1(num_ranks: int, num_microbatches: int, virtual_stages: int = 1):
    """ZB-H1 (arXiv:2401.10241, section 3.1): 1F1B with the ``W`` of rank ``r`` delayed by ``r`` microbatches.

    Rank ``r`` runs ``min(p - 1 - r, m)`` warmup forwards, then ``F``, ``I`` per microbatch with each ``W``
    ``r`` input gradients behind its ``I``, then the delayed ``W`` in the cooldown, where 1F1B idles.
    Bubble ``(p-1)/(3m+p-1)`` for m >= p under F = I = W; peak in-flight ``min(p, m)`` on every rank.

    Raises:
        ScheduleArgumentError: a size is not a positive integer, or ``virtual_stages != 1``.
    """
    p, m = check_one_stage_sizes("zb-h1", num_ranks, num_microbatches, virtual_stages)
    streams = [_h1_stream(r, p, m) for r in range(p)]
    return program("zb-h1", streams, placement.contiguous(p), m)


def build_zb_h2(num_ranks: int, num_microbatches: int, virtual_stages: int = 1):
    """ZB-H2 (arXiv:2401.10241, section 3.2): extra warmup forwards fill the bubble before the first ``I``;
    ``W`` deferred to the tail turns 1F1B's trapezoid into a parallelogram.

    Rank ``r`` runs ``min(2(p - r) - 1, m)`` warmup forwards, then ``I``, ``W``, ``F`` per microbatch; for the
    last ``2r`` input gradients it skips the ``W`` (so the gradients reach rank 0 sooner) and runs the skipped
    ``W`` at the end. Bubble ``(p-1)/(3m+p-1)`` for m >= 2p - 2 under F = I = W; peak in-flight
    ``min(m, max(2(p-r)-1, 2r))`` on rank r, at most ``2p - 1``.

    Raises:
        ScheduleArgumentError: a size is not a positive integer, or ``virtual_stages != 1``.
    """
    p, m = check_one_stage_sizes("zb-h2", num_ranks, num_microbatches, virtual_stages)
    streams = [_h2_stream(r, p, m) for r in range(p)]
    return program("zb-h2", streams, placement.contiguous(p), m)


def _h1_stream(rank: int, p: int, m: int) -> list:
    """Warmup forwards, then per microbatch k: F (while any remain), I(k), and W(k - rank) once it is due."""
    stream = [forward(rank, mb) for mb in range(min(p - 1 - rank, m))]
    next_forward = len(stream)
    for k in range(m):
        if next_forward < m:
            stream.append(forward(rank, next_forward))
            next_forward += 1
        stream.append(_instr(Op.I, rank, k))
        if k >= rank:
            stream.append(_instr(Op.W, rank, k - rank))
    stream.extend(_instr(Op.W, rank, mb) for mb in range(max(0, m - rank), m))
    return stream


def _h2_stream(rank: int, p: int, m: int) -> list:
    """Warmup forwards, then per microbatch k: I(k), the oldest pending W unless k is among the last ``2 rank``,
    F (while any remain); the skipped W at the end."""
    stream = [forward(rank, mb) for mb in range(min(2 * (p - rank) - 1, m))]
    next_forward, next_w = len(stream), 0
    for k in range(m):
        stream.append(_instr(Op.I, rank, k))
        if k < m - 2 * rank:
            stream.append(_instr(Op.W, rank, next_w))
            next_w += 1
        if next_forward < m:
            stream.append(forward(rank, next_forward))
            next_forward += 1
    stream.extend(_instr(Op.W, rank, mb) for mb in range(next_w, m))
    return stream


def _instr(op: Op, stage: int, microbatch: int) -> Instr:
    return Instr.trusted(op, stage, microbatch)
