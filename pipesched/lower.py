"""Lowering passes, Program -> Program: recompute, sends and receives, data-parallel all-reduce.

Each pass takes a program and returns a new one; none decides *what* runs, only where the extra
instructions go. :func:`compile_program` in :mod:`pipesched.api` chains them.
"""
from __future__ import annotations

from itertools import repeat
from operator import itemgetter

from .cost import CostModel
from .deps import comm_for, consumer_stage, produces
from .engine import has_comm, paused_gc
from .ir import Instr, Op, Program
from .timeline import timeline_order

#: The cost model that orders communication: the usual backward = 2 x forward, free messages.
REFERENCE_COST = CostModel(forward=1.0, backward=2.0)


def add_recompute(program: Program, stages=True) -> Program:
    """Insert ``R(s, mb)`` right before each backward (``B`` or ``I``) of a recomputed stage.

    Args:
        program: a compute-only program (no SEND/RECV yet) without R.
        stages: ``True`` (every stage), ``False`` (none), or one bool per stage.
    Memory guarantee: an R sits directly before the backward it serves in its rank's compute order, so
    a rank holds the full activations of at most one recomputed microbatch-stage at a time; the others
    keep only their stage input. When :func:`add_send_recv` then places the gradient's RECV_B, it lands
    after the R whenever the R can run before the gradient arrives, so the recompute overlaps that wait.
    Raises:
        ValueError: ``stages`` has the wrong length, or the program already has SEND/RECV or R.
    """
    flags = _stage_flags(stages, program.num_stages)
    if has_comm(program) or any(i.op is Op.R for st in program.ranks for i in st):
        raise ValueError("add_recompute takes a compute-only program without R; apply it before add_send_recv")
    streams = []
    for stream in program.ranks:
        out = []
        for instr in stream:
            if instr.op in (Op.B, Op.I) and flags[instr.stage]:
                out.append(Instr(Op.R, instr.stage, instr.microbatch))
            out.append(instr)
        streams.append(tuple(out))
    return program.replace(streams)


def _stage_flags(stages, num_stages: int) -> list[bool]:
    if isinstance(stages, bool):
        return [stages] * num_stages
    flags = [bool(x) for x in stages]
    if len(flags) != num_stages:
        raise ValueError(f"recompute has {len(flags)} flags but the program has {num_stages} stages")
    return flags


@paused_gc()
def add_send_recv(program: Program, cost: CostModel = REFERENCE_COST) -> Program:
    """Add a SEND on the producer's rank and a RECV on the consumer's rank for every cross-rank edge.

    Placement: simulate the compute-only program under ``cost``; every compute instruction gets the key
    (start, 1, rank, position) and every message the key (time its producer ends, 0, producer rank,
    position, kind). The SEND goes right after its producer; the RECV is posted before the first compute
    of the consumer's rank that starts at or after that time. Posting never blocks (the consumer waits
    for the data, not the RECV), so an early post costs no time under any costs: simulated timelines of
    the lowered program equal those of the compute-only one plus message delays.

    Deadlock freedom: sort all compute instructions and messages of all ranks by key into one global
    sequence in which each SEND and its RECV form a single step. Each rank's new stream is that sequence
    restricted to the rank, so the sequence itself is a complete execution even when every send blocks
    until its receive is posted: every step is either a compute whose inputs were sent earlier
    (producers end before consumers start) or a pair whose RECV and SEND are both at their ranks' heads.
    Messages between two ranks appear in the same order on both, so FIFO matching pairs them correctly.
    The execution model is confluent (:mod:`pipesched.engine`), so one complete execution means every
    execution completes, whatever the timing.

    Raises:
        ValueError: the program already has SEND/RECV.
    """
    from .sim import simulate_plan  # the simulator needs validation, which needs nothing from here

    if has_comm(program):
        raise ValueError("add_send_recv takes a compute-only program; this one already has SEND/RECV")
    plan, starts, ends = simulate_plan(program, cost)
    routes = _routes(plan)
    instrs, rule, mb = plan.instrs, plan.rule, plan.mb
    keyed: list[list] = [[] for _ in program.ranks]
    for rank, mine in enumerate(keyed):
        by_time = timeline_order(starts, ends, plan.first[rank], plan.first[rank + 1])
        at = list(map(starts.__getitem__, by_time))
        mine += zip(zip(at, repeat(1), repeat(rank), at), map(instrs.__getitem__, by_time))
        for g in by_time:
            if routes[rule[g]] is not None:
                send_op, send_stage, recv_op, recv_stage, peer, kind = routes[rule[g]]
                key = (ends[g], 0, rank, starts[g], kind)
                mine.append((key, Instr(send_op, send_stage, mb[g], peer)))
                keyed[peer].append((key, Instr(recv_op, recv_stage, mb[g], rank)))
    streams = [tuple(map(itemgetter(1), sorted(items, key=itemgetter(0)))) for items in keyed]
    return program.replace(streams)


def _routes(plan) -> list:
    """Per rule of ``plan``: (send op, its stage, recv op, its stage, receiving rank, send op's name) if
    another rank consumes what its instructions produce (:func:`~pipesched.deps.produces`,
    :func:`~pipesched.deps.comm_for`), else ``None``."""
    s2r, S = plan.program.stage_to_rank, plan.program.num_stages
    routes = []
    for op, stage in zip(plan.rules.op, plan.rules.stage):
        probe = Instr(op, stage) if op is Op.ALL_REDUCE else Instr(op, stage, 0)
        found = None
        for item in produces(probe):
            route, consumer = comm_for(item), consumer_stage(item)
            if route is not None and 0 <= consumer < S and s2r[consumer] != s2r[stage]:
                found = (*route, s2r[consumer], route[0].value)
        routes.append(found)
    return routes


def add_all_reduce(program: Program, dp_size: int) -> Program:
    """Add ``ALL_REDUCE(s)`` after the last backward (B or W) of each stage, and after the sends that
    directly follow it, so the reduction overlaps the rank's remaining work without delaying a send.

    Deadlock freedom: ALL_REDUCE only starts an asynchronous collective over the data-parallel group;
    it never blocks the pipeline stream. The replicas of a pipeline rank run the same program, so they
    start their collectives in the same order, and every rank waits for them only after its stream ends.

    Raises:
        ValueError: ``dp_size`` is not an integer >= 1, or the program already has ALL_REDUCE.
    """
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"dp_size must be an integer >= 1, got {dp_size!r}")
    if any(i.op is Op.ALL_REDUCE for st in program.ranks for i in st):
        raise ValueError("the program already has ALL_REDUCE instructions")
    if dp_size == 1:
        return _with_dp(program, program.ranks, 1)
    streams = []
    for stream in program.ranks:
        last = {i.stage: pos for pos, i in enumerate(stream) if i.op in (Op.B, Op.W)}
        after: dict[int, list[int]] = {}
        for stage, pos in last.items():
            while pos + 1 < len(stream) and stream[pos + 1].op in (Op.SEND_B, Op.SEND_F):
                pos += 1
            after.setdefault(pos, []).append(stage)
        out = []
        for pos, instr in enumerate(stream):
            out.append(instr)
            out.extend(Instr(Op.ALL_REDUCE, s) for s in sorted(after.get(pos, ())))
        streams.append(tuple(out))
    return _with_dp(program, streams, dp_size)


def _with_dp(program: Program, streams, dp_size: int) -> Program:
    return Program(tuple(streams), program.stage_to_rank, program.num_microbatches, dp_size,
                   program.schedule, dict(program.meta))
