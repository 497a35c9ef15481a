"""Stage-to-rank maps: which pipeline rank holds which stage."""
from __future__ import annotations


def contiguous(num_ranks: int) -> tuple[int, ...]:
    """One stage per rank: stage ``s`` on rank ``s`` (GPipe, 1F1B)."""
    return tuple(range(num_ranks))


def looped(num_ranks: int, virtual_stages: int) -> tuple[int, ...]:
    """``v`` stages per rank, round robin: stage ``s`` on rank ``s % p`` (interleaved 1F1B, Megatron)."""
    return tuple(s % num_ranks for s in range(num_ranks * virtual_stages))



def vshape(num_ranks: int) -> tuple[int, ...]:
    """Two stages per rank in a V: rank ``r`` holds stages ``r`` and ``2p - 1 - r`` (ZB-V, DualPipe-V), so stage
    ``s`` is on rank ``s`` for ``s < p`` and on rank ``2p - 1 - s`` after; the first and the last stage share rank 0."""
    return tuple(s if s < num_ranks else 2 * num_ranks - 1 - s for s in range(2 * num_ranks))
