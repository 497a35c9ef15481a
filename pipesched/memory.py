"""Activation memory a program holds per rank, from its order alone (bytes from the cost model)."""
from __future__ import annotations

from .deps import STASH_CHANGE
from .ir import Op, Program


def peak_activation_bytes(program: Program, cost) -> tuple[float, ...] | None:
    """Per rank, the most bytes held for backward at any point of its stream.

    What holds and frees memory is :data:`pipesched.deps.STASH_CHANGE`: a forward ``F(s, mb)`` keeps
    ``stash_bytes[s]`` — or only ``input_bytes[s]`` when (s, mb) is recomputed; ``R(s, mb)`` raises that to
    ``recompute_bytes[s]`` (input and re-saved activations); the end of the backward (``B``, or ``W`` for a
    split backward) frees it. Returns ``None`` when no size that matters is
    given: every stash size is 0 and, for a program that recomputes, every input and recompute size too.
    A forward-only program (:attr:`~pipesched.ir.Program.forward_only`) holds nothing: its forwards run
    without autograd, so its peaks are 0.
    """
    S = program.num_stages
    stash = cost.per_stage("stash_bytes", S)
    inputs = cost.per_stage("input_bytes", S)
    redone = cost.per_stage("recompute_bytes", S)
    if not any(stash) and not (any(inputs) or any(redone)):
        return None  # no size given (checked first: finding the recomputed pairs reads every instruction)
    recomputed = program.recomputed()
    if not any(stash) and not recomputed:
        return None
    if program.forward_only:
        return (0.0,) * program.num_ranks
    return tuple(rank_peak(((i.op, i.stage, i.microbatch) for i in stream), stash, inputs, redone,
                           lambda s, mb: (s, mb) in recomputed) for stream in program.ranks)


def rank_peak(items, stash, inputs, redone, recomputed) -> float:
    """The most bytes one rank holds for backward over its compute ``items`` (``(op, stage, microbatch)`` in stream
    order), by :data:`pipesched.deps.STASH_CHANGE`: ``F`` keeps ``stash[s]``, or ``inputs[s]`` when
    ``recomputed(s, mb)``; ``R`` raises that to ``redone[s]``; the end of the backward frees it."""
    held: dict = {}
    live = peak = 0.0
    for op, s, mb in items:
        key, change = (s, mb), STASH_CHANGE[op]
        if change > 0:
            held[key] = inputs[s] if recomputed(s, mb) else stash[s]
            live += held[key]
        elif change < 0:
            live -= held.pop(key, 0.0)
        elif op is Op.R:
            live += redone[s] - held.get(key, 0.0)
            held[key] = redone[s]
        peak = max(peak, live)
    return peak
