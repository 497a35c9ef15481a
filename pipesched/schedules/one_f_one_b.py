"""1F1B (PipeDream-Flush): warmup forwards, then one forward one backward, then cooldown backwards."""
from __future__ import annotations

from .. import placement
from ._common import backward, check_one_stage_sizes, forward, program


def build_1f1b(num_ranks: int, num_microbatches: int, virtual_stages: int = 1):
    """1F1B / PipeDream-Flush (Narayanan et al., 2021, arXiv:2006.09503).

    Rank ``r`` runs ``w = min(p - r - 1, m)`` warmup forwards, then alternates one forward and one
    backward (steady state) until its forwards are done, then the remaining backwards (cooldown).
    Bubble fraction with uniform costs: (p-1)/(m+p-1), the same as GPipe; peak in-flight activations
    on rank r: min(p - r, m) instead of m.

    Any m >= 1 works. With m < p the warmup takes every microbatch, so the order degrades to GPipe's
    (all forwards, then all backwards) on the first ranks; it stays correct and deadlock-free.

    Raises:
        ScheduleArgumentError: a size is not a positive integer, or ``virtual_stages != 1``.
    """
    p, m = check_one_stage_sizes("1f1b", num_ranks, num_microbatches, virtual_stages)
    return program("1f1b", [_rank_stream(r, p, m) for r in range(p)], placement.contiguous(p), m)


def _rank_stream(rank: int, p: int, m: int) -> list:
    warmup = min(p - rank - 1, m)
    stream = [forward(rank, mb) for mb in range(warmup)]
    for i in range(m - warmup):  # steady: F(warmup + i) then B(i)
        stream.append(forward(rank, warmup + i))
        stream.append(backward(rank, i))
    stream.extend(backward(rank, mb) for mb in range(m - warmup, m))
    return stream
