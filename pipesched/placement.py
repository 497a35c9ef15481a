"""Stage-to-rank maps: which pipeline rank holds which stage."""
from __future__ import annotations


def contiguous(num_ranks: int) -> tuple[int, ...]:
    """One stage per rank: stage ``s`` on rank ``s`` (GPipe, 1F1B)."""
    return tuple(range(num_ranks))


def looped(num_ranks: int, virtual_stages: int) -> tuple[int, ...]:
    """``v`` stages per rank, round robin: stage ``s`` on rank ``s % p`` (interleaved 1F1B, Megatron)."""
    return tuple(s % num_ranks for s in range(num_ranks * virtual_stages))


def vshape(num_ranks: int) -> tuple[int, ...]:
    """Two stages per rank folded into a V: stages 0..p-1 go down the ranks, p..2p-1 come back up.

    Rank 0 holds the first and the last stage, so the loss is computed where the input entered.
    """
    return tuple(range(num_ranks)) + tuple(reversed(range(num_ranks)))
