"""Interleaved 1F1B: v model chunks per rank on a looped placement (Narayanan et al., 2021, arXiv:2104.04473)."""
from __future__ import annotations

from .. import placement
from ..checks import check_positive
from ..ir import Instr, Op
from ._common import program

F, B = Op.F, Op.B


def build_interleaved_1f1b(num_ranks: int, num_microbatches: int, virtual_stages: int = 2):
    """Interleaved 1F1B (Megatron-LM, arXiv:2104.04473, section 2.2.2).

    The model is cut into ``p * v`` stages; stage ``s`` lives on rank ``s % p`` (looped placement), so
    each rank holds ``v`` smaller chunks and the warmup/cooldown bubble shrinks by ``v``: with every stage
    costing the same, the bubble fraction is (p-1)/(v*m+p-1) when m is a multiple of p.

    Microbatches go through in *rounds*: a rank runs the forwards of one round for chunk 0, then for
    chunk 1, ..., then the next round; backwards mirror this with the chunks reversed. Rank ``r`` warms
    up with ``(v-1)*g + 2*(p-1-r)`` forwards (``g`` = size of the first round), then alternates one
    forward and one backward.

    Megatron and PyTorch need ``m`` to be a multiple of ``p`` (PyTorch: of ``m // p``) because their
    rounds all have the same size. We lift that: with ``k = max(1, m // p)`` rounds, the sizes differ by
    at most one and are each >= p (when m >= p), so every round still keeps all p ranks busy before
    the chunk changes; the last stage's first backward then never waits on a forward that is queued
    behind it. Any m >= 1 works; the checker proves each compiled program deadlock-free.

    Raises:
        ScheduleArgumentError: a size is not a positive integer.
    """
    p = check_positive("num_ranks", num_ranks)
    m = check_positive("num_microbatches", num_microbatches)
    v = check_positive("virtual_stages", virtual_stages)
    rounds = _round_sizes(p, m)
    streams = [_rank_stream(r, p, v, m, rounds) for r in range(p)]
    return program("interleaved-1f1b", streams, placement.looped(p, v), m, virtual_stages=v)


def _round_sizes(p: int, m: int) -> list[int]:
    """Split m microbatches into max(1, m // p) rounds whose sizes differ by at most one."""
    count = max(1, m // p)
    base, extra = divmod(m, count)
    return [base + 1 if i < extra else base for i in range(count)]


def _orders(rank: int, p: int, v: int, rounds: list[int]) -> tuple[list[Instr], list[Instr]]:
    """The rank's forwards and its backwards, each in the order the rank runs them."""
    stages = [chunk * p + rank for chunk in range(v)]  # the rank's stages, one per model chunk (looped placement)
    fwd, bwd, first = [], [], 0
    for size in rounds:
        mbs = range(first, first + size)
        for stage in stages:
            fwd += Instr.trusted_all((F, stage, mb, None) for mb in mbs)
        for stage in reversed(stages):
            bwd += Instr.trusted_all((B, stage, mb, None) for mb in mbs)
        first += size
    return fwd, bwd


def _rank_stream(rank: int, p: int, v: int, m: int, rounds: list[int]) -> list[Instr]:
    fwd, bwd = _orders(rank, p, v, rounds)
    total = len(fwd)
    warmup = min((v - 1) * rounds[0] + 2 * (p - 1 - rank), total)
    steady = [instr for pair in zip(fwd[warmup:], bwd) for instr in pair]  # F, B, F, B, ...
    return fwd[:warmup] + steady + bwd[total - warmup:]
