"""Activation memory a program holds per rank, from its order alone (bytes from the cost model)."""
from __future__ import annotations

from .ir import Op, Program


def peak_activation_bytes(program: Program, cost) -> tuple[float, ...] | None:
    """Per rank, the most bytes held for backward at any point of its stream.

    A forward ``F(s, mb)`` keeps ``stash_bytes[s]`` — or only ``input_bytes[s]`` when (s, mb) is
    recomputed; ``R(s, mb)`` raises that to ``recompute_bytes[s]`` (input and re-saved activations);
    the backward (``B``, or ``W`` for a split backward) frees it. Returns ``None`` when no size that matters is
    given: every stash size is 0 and, for a program that recomputes, every input and recompute size too.
    """
    S = program.num_stages
    stash = cost.per_stage("stash_bytes", S)
    inputs = cost.per_stage("input_bytes", S)
    redone = cost.per_stage("recompute_bytes", S)
    recomputed = {(i.stage, i.microbatch) for st in program.ranks for i in st if i.op is Op.R}
    if not any(stash) and not (recomputed and (any(inputs) or any(redone))):
        return None
    peaks = []
    for stream in program.ranks:
        held: dict = {}
        live = peak = 0.0
        for instr in stream:
            key = (instr.stage, instr.microbatch)
            if instr.op is Op.F:
                held[key] = inputs[instr.stage] if key in recomputed else stash[instr.stage]
                live += held[key]
            elif instr.op is Op.R:
                live += redone[instr.stage] - held.get(key, 0.0)
                held[key] = redone[instr.stage]
            elif instr.op in (Op.B, Op.W):
                live -= held.pop(key, 0.0)
            peak = max(peak, live)
        peaks.append(peak)
    return tuple(peaks)
