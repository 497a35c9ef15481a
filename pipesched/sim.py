"""Discrete-event simulator: a program plus a cost model gives a timeline (seconds), bubble and memory.

Events are instructions; an instruction starts when its rank is free and its inputs are there, in the
execution order of :mod:`pipesched.engine` (the same model the validator proves, so running out of
events with work left raises the same :class:`~pipesched.errors.DeadlockError`). Timing follows what the
executor does: a SEND is asynchronous (takes no rank time; the message lands ``latency + bytes /
bandwidth`` later), a RECV posts the receive (no rank time; its event ends when the message lands),
the compute that needs the message waits for it (that wait is bubble), an ALL_REDUCE starts asynchronously and ends ``latency + 2(d-1)/d * grad_bytes / bandwidth`` later.
A compute-only program (no SEND/RECV) is simulated with the same message delay on each cross-rank edge.
"""
from __future__ import annotations

from itertools import accumulate

from .cost import CostModel
from . import engine
from .deps import STASH_CHANGE, boundary
from .engine import COMPUTE, RECV
from .ir import Op, Program
from .memory import peak_activation_bytes
from .timeline import InTimelineOrder, Timeline, events_from_columns, ties_in_order
from .validate import check_static

#: the cost model field that gives the seconds of each compute kind
COST_FIELD = {Op.F: "forward", Op.B: "backward", Op.I: "input_grad", Op.W: "weight_grad", Op.R: "recompute"}


@engine.paused_gc()
def simulate(program: Program, cost: CostModel | None = None, check: bool = True) -> Timeline:
    """Simulate one step of ``program``: a training step, or a forward-only one for a forward-only program
    (no in-flight activations: its forwards keep nothing for backward).

    Args:
        program: a compute-only or lowered program.
        cost: per-stage seconds and message sizes; default :class:`CostModel` () (F=1, B=2, free messages).
        check: validate the program first (pass False only for a program :func:`validate` already passed).
    Returns:
        A :class:`Timeline` with every instruction's start/end in seconds, its makespan, bubble fraction
        and peak in-flight activations (count and bytes) per rank.
    Raises:
        ScheduleError: the program is invalid (see :func:`pipesched.validate.validate`).
        DeadlockError: the program cannot complete.
        ValueError: a cost does not fit the program (wrong length, negative).
    """
    cost = cost or CostModel()
    plan, starts, ends = simulate_plan(program, cost, check)
    events = events_from_columns(plan.rank_of(), plan.instrs, starts, ends)
    # a rank's simulated starts never decrease (each instruction starts when its rank is free, or
    # later), so its events are in timeline order unless two that start together have decreasing ends
    if all(ties_in_order(starts, ends, lo, hi) for lo, hi in zip(plan.first, plan.first[1:])):
        events = InTimelineOrder(events)  # the usual case: the Timeline need not sort them
    meta = {
        "schedule": program.schedule,
        "ranks": program.num_ranks,
        "microbatches": program.num_microbatches,
        "virtual_stages": program.num_stages // max(1, program.num_ranks),
        "dp_size": program.dp_size,
        "step": "forward" if program.forward_only else "train",
        "cost": cost.describe(),
    }
    return Timeline(
        events=events,
        num_ranks=program.num_ranks,
        source="simulated",
        meta=meta,
        peak_inflight=(0,) * program.num_ranks if program.forward_only else _peak_inflight(plan),  # no_grad
        peak_activation_bytes=peak_activation_bytes(program, cost),
    )


def simulate_plan(program: Program, cost: CostModel, check: bool = True) -> tuple[engine.Plan, list, list]:
    """The program's :class:`~pipesched.engine.Plan` and the start and end of every instruction, by flat number.

    ``check``: validate first; the simulation's own execution is then the deadlock check, so the program
    runs once, not twice. A program :func:`~pipesched.validate.validate` passed is not checked or run
    again: its remembered execution is timed. Raises as :func:`simulate` (an invalid program before a
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
        else:
            starts[g] = ends[g] = start
            ready_at[give + mb[g]] = arrival = start + delay
            recv = partner[g]
            if arrival > starts[recv]:
                ends[recv] = arrival
            else:
                ends[recv] = starts[recv]
    return starts, ends


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


def _peak_inflight(plan: engine.Plan) -> tuple[int, ...]:
    """:func:`~pipesched.timeline.peak_inflight` of the plan's program, from its rules."""
    change = [STASH_CHANGE[op] for op in plan.rules.op]  # per rule
    return tuple(max(accumulate(map(change.__getitem__, plan.rule[lo:hi]), initial=0))
                 for lo, hi in zip(plan.first, plan.first[1:]))


def _rule_seconds(plan: engine.Plan, cost: CostModel) -> tuple[list, list, list]:
    """Per rule: seconds of rank time it takes (None: none), seconds it lasts without taking rank time
    (ALL_REDUCE), and the delay of the message it sends (None: none), sized by the stage whose output the
    message's tensor is (:func:`~pipesched.deps.boundary`)."""
    program, rules = plan.program, plan.rules
    S = program.num_stages
    dur = {op: cost.per_stage(name, S) for op, name in COST_FIELD.items()}
    msg = [cost.message_seconds(b) for b in cost.per_stage("activation_bytes", S)]
    ring = 2 * (program.dp_size - 1) / program.dp_size
    allreduce = [cost.message_seconds(ring * b) for b in cost.per_stage("grad_bytes", S)]
    busy, lasts, delay = [], [], []
    for op, stage, give in zip(rules.op, rules.stage, plan.give):
        busy.append(dur[op][stage] if op in dur else None)
        lasts.append(allreduce[stage] if op is Op.ALL_REDUCE else 0.0)
        delay.append(msg[boundary(rules.item(give))] if give >= 0 else None)
    return busy, lasts, delay
