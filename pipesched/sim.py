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

from .cost import CostModel
from .engine import execute, has_comm, remote_needs, sent_item
from .ir import RECV_OPS, SEND_OPS, Op, Program
from .memory import peak_activation_bytes
from .timeline import Event, Timeline, peak_inflight
from .validate import validate

_COST_FIELD = {Op.F: "forward", Op.B: "backward", Op.I: "input_grad", Op.W: "weight_grad", Op.R: "recompute"}


def simulate(program: Program, cost: CostModel | None = None, check: bool = True) -> Timeline:
    """Simulate one training step of ``program``.

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
    if check:
        validate(program)
    times = _run(program, cost)
    events = tuple(
        Event(rank, program.ranks[rank][pos], start, end) for (rank, pos), (start, end) in times.items()
    )
    meta = {
        "schedule": program.schedule,
        "ranks": program.num_ranks,
        "microbatches": program.num_microbatches,
        "virtual_stages": program.num_stages // max(1, program.num_ranks),
        "dp_size": program.dp_size,
        "cost": cost.describe(),
    }
    return Timeline(
        events=events,
        num_ranks=program.num_ranks,
        source="simulated",
        meta=meta,
        peak_inflight=peak_inflight(program.ranks),
        peak_activation_bytes=peak_activation_bytes(program, cost),
    )


def _run(program: Program, cost: CostModel) -> dict:
    S = program.num_stages
    dur = {op: cost.per_stage(name, S) for op, name in _COST_FIELD.items()}
    msg = [cost.message_seconds(b) for b in cost.per_stage("activation_bytes", S)]
    ring = 2 * (program.dp_size - 1) / program.dp_size
    allreduce = [cost.message_seconds(ring * b) for b in cost.per_stage("grad_bytes", S)]
    free = [0.0] * program.num_ranks
    times: dict = {}
    ready_at: dict = {}  # item -> time it lands on the rank that consumes it
    remote = remote_needs(program)
    lowered = has_comm(program)

    def on_fire(rank: int, pos: int, partner) -> None:
        instr = program.ranks[rank][pos]
        start = free[rank]
        if instr.op in RECV_OPS:
            times[(rank, pos)] = (start, start)  # posted now; its end is set when the message lands
            return
        if instr.op in SEND_OPS:
            arrival = start + msg[instr.stage if instr.op is Op.SEND_F else instr.stage - 1]
            times[(rank, pos)] = (start, start)
            recv_rank, recv_pos = partner
            posted_at = times[(recv_rank, recv_pos)][0]
            times[(recv_rank, recv_pos)] = (posted_at, max(posted_at, arrival))
            ready_at[sent_item(instr)] = arrival
            return
        if instr.op is Op.ALL_REDUCE:
            times[(rank, pos)] = (start, start + allreduce[instr.stage])
            return
        start = max([start] + [ready_at[item] for item in remote[rank][pos]])
        end = start + dur[instr.op][instr.stage]
        times[(rank, pos)] = (start, end)
        free[rank] = end
        if not lowered and instr.op in (Op.F, Op.B, Op.I):
            boundary = instr.stage if instr.op is Op.F else instr.stage - 1
            kind = "act" if instr.op is Op.F else "grad"
            if boundary >= 0:
                ready_at[(kind, instr.stage, instr.microbatch)] = end + msg[boundary]

    execute(program, on_fire)
    return times
