"""When each instruction of a program starts and ends under a cost model (seconds): the timing shared by the
simulator (:mod:`pipesched.sim`, which turns it into a :class:`~pipesched.timeline.Timeline`) and lowering
(:func:`pipesched.lower.add_send_recv`, which places messages by it).

Instructions are timed in the execution order of :mod:`pipesched.engine`. Timing follows what the
executor does: a compute takes its rank's time once its inputs are there; a SEND takes its rank's time for
``send_overhead`` (0 by default: then it is asynchronous) and its message lands ``latency + bytes / bandwidth``
after the SEND ends; a RECV posts the receive (no rank time;
it ends when the message lands); an ALL_REDUCE starts asynchronously and ends
``latency + 2(d-1)/d * grad_bytes / bandwidth`` later, a TIE_REDUCE ``latency + 2(k-1)/k * tie_bytes / bandwidth``
after the latest start among its tie's ranks (k: the tie's ranks x dp_size). A compute-only program (no
SEND/RECV) gets the same message delay on each cross-rank edge, plus ``send_overhead`` (no SEND to charge it to).
"""
from __future__ import annotations

from .cost import CostModel
from . import engine
from .deps import boundary
from .engine import COMPUTE, RECV
from .ir import Op, Program
from .ties import tie_ranks, ties_of
from .validate import check_static

#: the cost model field that gives the seconds of each compute kind
COST_FIELD = {Op.F: "forward", Op.B: "backward", Op.I: "input_grad", Op.W: "weight_grad", Op.R: "recompute"}


def time_instructions(program: Program, cost: CostModel, check: bool = True) -> tuple[engine.Plan, list, list]:
    """The program's :class:`~pipesched.engine.Plan` and the start and end of every instruction, by flat number.

    ``check``: validate first; the simulation's own execution is then the deadlock check, so the program
    runs once, not twice. A program :func:`~pipesched.validate.validate` passed is not checked or run
    again: its remembered execution is timed. Raises as :func:`pipesched.simulate` (an invalid program before a
    bad cost with ``check``, a bad cost before a deadlock without).
    """
    done = engine.proven_run(program)
    if done is not None:
        return done.plan, *_times(done, _rule_seconds(done.plan, cost))
    if check:
        done = engine.run(check_static(program))
        return done.plan, *_times(done, _rule_seconds(done.plan, cost))
    plan = engine.Plan(program)
    seconds = _rule_seconds(plan, cost)
    return plan, *_times(engine.run(plan), seconds)


def _times(run: engine.Run, seconds: tuple[list, list, list]) -> tuple[list[float], list[float]]:
    """Time the instructions in the engine's firing order (any valid order gives the same times)."""
    plan = run.plan
    facts = _timing_facts(plan, seconds)
    rule, mb, partner, rank_of = plan.rule, plan.mb, run.partner, plan.rank_of()
    free = [0.0] * plan.program.num_ranks
    starts, ends = [0.0] * len(rule), [0.0] * len(rule)
    ready_at = [0.0] * plan.rules.num_items  # per item, when it lands on the rank that consumes it
    for g in run.order:
        kind, busy, delay, wait, give = facts[rule[g]]
        rank = rank_of[g]
        start = free[rank]
        if kind == _WORK:
            if wait >= 0 and ready_at[wait + mb[g]] > start:
                start = ready_at[wait + mb[g]]
            free[rank] = end = start + busy
            starts[g], ends[g] = start, end
            if give >= 0:  # a compute-only program: its message lands on the other rank after delay
                ready_at[give + mb[g]] = end + delay
        elif kind == RECV:
            starts[g] = ends[g] = start  # posted now; its end is set when the message lands
        elif kind == _ASYNC:
            starts[g], ends[g] = start, start + busy  # the rank moves on
        else:  # a SEND: its rank is busy for the send overhead, then the message travels
            starts[g], ends[g] = start, start + busy
            free[rank] = ends[g]
            ready_at[give + mb[g]] = arrival = ends[g] + delay
            recv = partner[g]
            if arrival > starts[recv]:
                ends[recv] = arrival
            else:
                ends[recv] = starts[recv]
    if Op.TIE_REDUCE in plan.ops:
        _join_ties(plan, seconds[1], starts, ends)
    return starts, ends


def _join_ties(plan: engine.Plan, lasts: list, starts: list, ends: list) -> None:
    """A tie's sum ends only once every rank of the tie has started it: each ``TIE_REDUCE`` ends its duration after
    the latest start of the ``TIE_REDUCE`` of the ranks it shares a tie with (nothing in a stream waits for it)."""
    program, rank_of = plan.program, plan.rank_of()
    where = {rank_of[g]: g for g, t in enumerate(plan.rule) if plan.rules.op[t] is Op.TIE_REDUCE}
    for rank, g in where.items():
        partners = {r for k in ties_of(program, rank) for r in tie_ranks(program, k)}
        joined = max(starts[where[r]] for r in partners if r in where)
        ends[g] = joined + lasts[plan.rule[g]]


_SENDS = (Op.SEND_F, Op.SEND_B)
_WORK, _ASYNC = -1, -2  # how _times treats a compute that takes rank time, and an ALL_REDUCE


def _timing_facts(plan: engine.Plan, seconds: tuple[list, list, list]) -> list[tuple]:
    """Per rule: how :func:`_times` treats it (``_WORK``, ``_ASYNC``, ``RECV`` or ``SEND``), the seconds
    it takes (of rank time, or for an ALL_REDUCE without it), the delay of its message, the item it
    waits for and the item it hands over."""
    facts = []
    for kind, busy, lasts, delay, wait, give in zip(plan.kind, *seconds, plan.wait, plan.give):
        if kind == COMPUTE:
            kind, busy = (_ASYNC, lasts) if busy is None else (_WORK, busy)
        facts.append((kind, busy, delay, wait, give))
    return facts


def _rule_seconds(plan: engine.Plan, cost: CostModel) -> tuple[list, list, list]:
    """Per rule: seconds of rank time it takes (a compute's cost, a SEND's ``send_overhead``; None: none), seconds
    it lasts without taking rank time (ALL_REDUCE), and the delay of the message it sends (None: none), sized by
    the stage whose output the message's tensor is (:func:`~pipesched.deps.boundary`); a compute that hands its
    output to another rank itself (a compute-only program) adds ``send_overhead`` to that delay."""
    program, rules = plan.program, plan.rules
    S = program.num_stages
    dur = {op: cost.per_stage(name, S) for op, name in COST_FIELD.items()}
    msg = [cost.message_seconds(b) for b in cost.per_stage("activation_bytes", S)]
    ring = 2 * (program.dp_size - 1) / program.dp_size
    allreduce = [cost.message_seconds(ring * b) for b in cost.per_stage("grad_bytes", S)]
    tie_reduce = _tie_seconds(program, cost)
    overhead = float(cost.send_overhead)
    busy, lasts, delay = [], [], []
    for op, stage, give in zip(rules.op, rules.stage, plan.give):
        busy.append(dur[op][stage] if op in dur else overhead if op in _SENDS else None)
        lasts.append(allreduce[stage] if op is Op.ALL_REDUCE else tie_reduce[stage] if op is Op.TIE_REDUCE else 0.0)
        carried = msg[boundary(rules.item(give))] if give >= 0 else None
        delay.append(carried + overhead if carried is not None and op in dur else carried)
    return busy, lasts, delay


def _tie_seconds(program: Program, cost: CostModel) -> list[float]:
    """Per stage, how long a ``TIE_REDUCE`` naming it lasts: ``latency + 2(k-1)/k * tie_bytes / bandwidth``, with k
    the most ranks (x ``dp_size``: a tie's group spans the replicas) of a tie its rank holds."""
    sizes = [0] * program.num_stages
    for s, rank in enumerate(program.stage_to_rank):
        k = max((len(tie_ranks(program, t)) * program.dp_size for t in ties_of(program, rank)), default=1)
        sizes[s] = k
    tie_bytes = cost.per_stage("tie_bytes", program.num_stages)
    return [cost.message_seconds(2 * (k - 1) / k * b) for k, b in zip(sizes, tie_bytes)]
