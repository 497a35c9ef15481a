"""Discrete-event simulator: a program plus a cost model gives a timeline (seconds), bubble and memory.

Events are instructions. When each starts and ends is :mod:`pipesched.timing`'s (an instruction starts when
its rank is free and its inputs are there, in the execution order of :mod:`pipesched.engine`: the model the
validator proves, so running out of events with work left raises the same
:class:`~pipesched.errors.DeadlockError`; the compute that waits for a message is bubble). This module makes the
:class:`~pipesched.timeline.Timeline` of them: events, makespan, bubble fraction, peak in-flight activations and
bytes.
"""
from __future__ import annotations

import math
from itertools import accumulate

from .checks import check_cost, check_flag, check_positive, check_program
from .cost import CostModel
from . import engine, progress
from .deps import STASH_CHANGE
from .gcpause import paused_gc
from .ir import Program
from .memory import peak_activation_bytes
from .timeline import InTimelineOrder, Timeline, events_from_columns, ties_in_order
from .timing import time_instructions


@paused_gc()
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
        ValueError: a cost does not fit the program (wrong length, negative); CostError (a ValueError): costs so
            large that the step's seconds or held bytes add up past the largest float (names the fields).
        TypeError: ``program`` is not a :class:`Program`, ``cost`` not a :class:`CostModel` or None, or ``check`` not
            a bool.
        ScheduleArgumentError (a ValueError): with ``check=False``, the program's ``num_microbatches`` or ``dp_size``
            is not an integer >= 1 (``check=True`` reports it as an InvalidProgramError).
    """
    check_program(program)
    cost = check_cost(cost) or CostModel()
    check_flag(check, "check", where="simulate: ")  # not truthiness: check="no" would validate, check=0 would not
    progress.note(f"simulating: timing {len(program)} instructions")
    plan, starts, ends, peak_bytes = _timed(program, cost, check)
    progress.note(f"simulating: the timeline of {len(ends)} instructions")
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
        peak_activation_bytes=peak_bytes,
    )


@paused_gc()
def makespan(program: Program, cost: CostModel | None = None, check: bool = True) -> float:
    """``simulate(program, cost, check).makespan`` (the same float, and the same errors) without making the
    :class:`Timeline`: for callers that rank many programs by their makespan (``zb-auto``'s candidates)."""
    check_program(program)
    _, starts, ends, _ = _timed(program, check_cost(cost) or CostModel(), check)
    return max(ends) - min(starts) if ends else 0.0  # Timeline.makespan: one event per instruction


def _timed(program: Program, cost: CostModel, check: bool):
    """The plan, starts, ends and peak activation bytes of :func:`simulate`, with its overflow checks."""
    if not check:  # else validate() refuses them; unchecked, m=0 or dp_size=0 would divide by zero deep inside
        for name in ("num_microbatches", "dp_size"):
            check_positive(name, getattr(program, name), where="simulate(check=False): the program's ")
    plan, starts, ends = time_instructions(program, cost, check)
    if max(ends, default=0.0) == math.inf:  # finite costs whose sum overflows: never an inf makespan, silently
        raise cost.overflow_error(program.num_stages, len(ends))
    peak_bytes = peak_activation_bytes(program, cost)
    if peak_bytes is not None and max(peak_bytes, default=0.0) == math.inf:
        raise cost.overflow_error(program.num_stages, program.num_microbatches, seconds=False)
    return plan, starts, ends, peak_bytes


def _peak_inflight(plan: engine.Plan) -> tuple[int, ...]:
    """:func:`~pipesched.timeline.peak_inflight` of the plan's program, from its rules."""
    change = [STASH_CHANGE[op] for op in plan.rules.op]  # per rule
    return tuple(max(accumulate(map(change.__getitem__, plan.rule[lo:hi]), initial=0))
                 for lo, hi in zip(plan.first, plan.first[1:]))
