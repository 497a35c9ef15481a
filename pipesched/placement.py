"""Stage-to-rank maps: which pipeline rank holds which stage."""
from __future__ import annotations


def contiguous(num_ranks: int) -> tuple[int, ...]:
    """One stage per rank: stage ``s`` on rank ``s`` (GPipe, 1F1B)."""
    return tuple(range(num_ranks))


def looped(num_ranks: int, virtual_stages: int) -> tuple[int, ...]:
    """``v`` stages per rank, round robin: stage ``s`` on rank ``s % p`` (interleaved 1F1B, Megatron)."""
    return tuple(s % num_ranks for s in range(num_ranks * virtual_stages))

