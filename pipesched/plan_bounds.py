"""What the planner knows about a configuration before simulating it: closed-form lower bounds on its step time
and memory, and the exact activation peaks of any per-stage recompute choice from its compute order.

All values are per microbatch-stage seconds and bytes (:class:`StageCosts`); a rank is a pipeline rank. Torch-free.
The bounds are valid for every schedule (a test checks them against the simulator), so the planner may skip
any configuration whose bound is already worse than what it has simulated.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

from .ir import BACKWARD_OPS, Op
from .memory import rank_peak


@dataclass(frozen=True)
class StageCosts:
    """Per stage, one microbatch: seconds of F, I, W (B = I + W), message seconds of its output (0 when the next
    stage is on the same rank; the gradient coming back is as large), and bytes: ``stash`` (held for backward),
    ``inputs`` (held instead when recomputed), ``redone`` (held after its R), ``params`` (its parameters); plus the
    seconds of its data-parallel all-reduce (0 without dp)."""

    forward: tuple[float, ...]
    input_grad: tuple[float, ...]
    weight_grad: tuple[float, ...]
    hop: tuple[float, ...]
    stash: tuple[float, ...]
    inputs: tuple[float, ...]
    redone: tuple[float, ...]
    params: tuple[float, ...]
    allreduce: tuple[float, ...]


def stage_costs(cost, stage_to_rank, dp_size: int) -> StageCosts:
    """:class:`StageCosts` of a :class:`~pipesched.CostModel` for a placement ``stage_to_rank`` and ``dp_size``
    replicas (all-reduce seconds as the simulator times them: latency + 2(d-1)/d x gradient bytes / bandwidth)."""
    S = len(stage_to_rank)
    act = cost.per_stage("activation_bytes", S)
    hop = tuple(cost.message_seconds(act[s]) if s + 1 < S and stage_to_rank[s] != stage_to_rank[s + 1] else 0.0
                for s in range(S))
    ring = 2 * (dp_size - 1) / dp_size
    grads = cost.per_stage("grad_bytes", S)
    allreduce = tuple(cost.message_seconds(ring * g) if dp_size > 1 else 0.0 for g in grads)
    return StageCosts(cost.per_stage("forward", S), cost.per_stage("input_grad", S), cost.per_stage("weight_grad", S),
                      hop, cost.per_stage("stash_bytes", S), cost.per_stage("input_bytes", S),
                      cost.per_stage("recompute_bytes", S), grads, allreduce)


def step_time_bound(c: StageCosts, stage_to_rank, num_microbatches: int, split: bool) -> float:
    """A lower bound (seconds) on the simulated step time of any schedule on this placement, recompute or not.

    Per rank ``r`` holding stages ``S_r``: nothing runs there before ``head_r`` (microbatch 0's forwards and
    messages up to its first stage); it then runs ``m * sum(F + B)`` seconds of work; after its last
    backward (``B``, or ``I`` when ``split``: the program has I/W) the input gradient still has to cross the stages
    below it (``tail_r``: their B, or I, and messages); after its last compute, one all-reduce of one of its
    stages (dp > 1). The bound is the largest over ranks of ``head_r + max(work + all-reduce, work up to the last
    backward + tail_r)`` and of the path of one microbatch through every stage and back.
    """
    m, S = num_microbatches, len(stage_to_rank)
    F, I, W, hop = c.forward, c.input_grad, c.weight_grad, c.hop
    back = I if split else tuple(i + w for i, w in zip(I, W))
    head = list(accumulate((F[s] + hop[s] for s in range(S)), initial=0.0))  # head[s]: before stage s's first F
    tail = list(accumulate((back[s] + hop[s] for s in range(S)), initial=0.0))  # tail[s]: below stage s
    bound = head[S] + tail[S - 1] + back[S - 1] + (W[0] if split else 0.0)  # microbatch 0's path
    ranks: dict[int, list[int]] = {}
    for s, r in enumerate(stage_to_rank):
        ranks.setdefault(r, []).append(s)
    for stages in ranks.values():
        first = stages[0]
        work = m * sum(F[s] + I[s] + W[s] for s in stages)
        until_back = m * sum(F[s] + back[s] for s in stages)
        reduce_ = min(c.allreduce[s] for s in stages)
        bound = max(bound, head[first] + max(work + reduce_, until_back + tail[first]))
    return bound


def static_bytes(c: StageCosts, stage_to_rank, num_ranks: int, optimizer_states: float) -> tuple[float, ...]:
    """Per rank, bytes that do not depend on the schedule: parameters, their gradients and the optimizer state
    (``optimizer_states`` x parameter bytes; AdamW: 2)."""
    out = [0.0] * num_ranks
    for s, r in enumerate(stage_to_rank):
        out[r] += c.params[s] * (2.0 + optimizer_states)
    return tuple(out)


def activation_bound(c: StageCosts, stage_to_rank, num_ranks: int) -> tuple[float, ...]:
    """Per rank, a lower bound on its peak activation bytes whatever the schedule, m and recompute: the
    backward of each of its stages holds at least that stage's stash (recomputed: re-saved) for one microbatch."""
    out = [0.0] * num_ranks
    for s, r in enumerate(stage_to_rank):
        out[r] = max(out[r], min(c.stash[s], c.redone[s]))
    return tuple(out)


def compute_order(program) -> list[list[tuple[Op, int, int]]]:
    """Per rank, its compute instructions ``(op, stage, microbatch)`` in order (what activation memory follows)."""
    keep = {Op.F, Op.B, Op.I, Op.W}
    return [[(i.op, i.stage, i.microbatch) for i in stream if i.op in keep] for stream in program.ranks]


def activation_peak(order, c: StageCosts, recompute) -> float:
    """Peak activation bytes of one rank's compute ``order`` if the stages flagged in ``recompute`` (one bool per
    stage) recompute: exactly what :func:`pipesched.memory.peak_activation_bytes` gives the program that
    :func:`pipesched.lower.add_recompute` makes (its R sits right before the stage's B or I), by the same walk
    (:func:`~pipesched.memory.rank_peak`)."""
    return rank_peak(_with_recompute(order, recompute), c.stash, c.inputs, c.redone, lambda s, mb: recompute[s])


def _with_recompute(order, recompute):
    """``order`` with an ``R`` right before each ``B`` or ``I`` of a stage flagged in ``recompute``."""
    for op, s, mb in order:
        if op in BACKWARD_OPS and recompute[s]:
            yield Op.R, s, mb
        yield op, s, mb


def choose_recompute(orders, c: StageCosts, stage_to_rank, static, budget: float) \
        -> tuple[tuple[bool, ...], tuple[float, ...]] | None:
    """The stages to recompute so that each rank's ``static[r]`` bytes plus its activation peak fit ``budget``, and
    the activation peaks.

    Per rank, stages are added in order of bytes saved per microbatch per second of forward they cost again
    (``(stash - input) / F``, ties: lower stage first) until its peak fits. Returns ``None`` when recomputing
    every stage of some rank does not fit it.
    """
    S = len(stage_to_rank)
    flags = [False] * S
    peaks = []
    for r, order in enumerate(orders):
        peak = activation_peak(order, c, flags)
        mine = sorted((s for s in range(S) if stage_to_rank[s] == r and c.stash[s] > c.inputs[s]),
                      key=lambda s: (-(c.stash[s] - c.inputs[s]) / max(c.forward[s], 1e-12), s))
        for s in mine:
            if static[r] + peak <= budget:
                break
            flags[s] = True
            peak = activation_peak(order, c, flags)
        if static[r] + peak > budget:
            return None
        peaks.append(peak)
    return tuple(flags), tuple(peaks)
