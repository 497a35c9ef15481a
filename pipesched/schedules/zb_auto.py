"""``zb-auto``: a zero-bubble schedule built for a given :class:`~pipesched.cost.CostModel` and memory limit.

A greedy list scheduler in the spirit of the automatic scheduler of Qi et al., "Zero Bubble Pipeline
Parallelism" (arXiv:2401.10241, section 4): one stage per rank on the contiguous placement, every backward split
into ``I`` (input gradient, which the previous rank waits for) and ``W`` (weight gradient, which nobody waits for).
It times each rank with the cost model (per-stage F, I, W seconds; each message ``latency + bytes / bandwidth``
with the stage's ``activation_bytes``) and, each time some rank can act (earliest first), that rank runs:

1. ``I`` of its oldest microbatch whose gradient is there (it unblocks the previous rank: the critical path) --
   or, in the "alternate" order, the kind (``F`` or ``I``) it did not run last, as 1F1B's steady state does
   (rank 0's ``I`` unblocks nobody, its ``F`` feeds the pipe),
2. else ``F`` of its next microbatch whose input is there, while its in-flight count is under its limit and the
   ``F`` is at most ``a (p-1-r) + b`` microbatches ahead of its ``I`` (the warmup depth, :data:`WARMUPS`),
3. else a pending ``W`` (the oldest): ``W`` fills the time the rank would otherwise idle,

and finishes with the ``W`` left. In-flight is counted as everywhere in pipesched (:func:`pipesched.timeline.
peak_inflight`): microbatch-stages whose ``F`` ran and whose ``W`` has not. The memory limit is never exceeded.

**Guarantee** (tested with hypothesis, p <= 8, m <= 32, random per-stage costs and latency): the program
validates, its peak in-flight count on rank ``r`` is at most ``memory_limit[r]``, and its simulated makespan
(:func:`pipesched.simulate` of the program lowered by :func:`pipesched.lower.add_send_recv`, under the same
costs) is never larger than that of ``zb-h1`` whenever ``zb-h1`` fits the limit (always for the default). The
greedy alone can be worse (a ``W`` started just before a gradient arrives delays the ``I``), so the builder
scores several candidates -- the greedy for each warmup depth, order ("i-first", "alternate") and fill (``W`` into
any idle slot; ``W`` only when nothing is expected to be ready before it ends), then ``zb-h1`` and ``zb-h2`` when
they fit the limit -- and returns the fastest (first in that order on ties). ``program.meta["zb_auto"]`` says
which won and each candidate's makespan.
Candidates are ranked by ``score(program, costs) -> seconds``: :func:`pipesched.build` and
:func:`pipesched.compile_program` pass the simulator's makespan of the lowered program (this module, like every
builder, imports neither the simulator nor the passes); without one, :func:`timed_makespan` ranks them (the same
costs, messages as pure delays, no ``RECV`` ordering).

This builder takes its costs as given. ``Pipeline(..., schedule="zb-auto", costs=CostModel(...))`` compiles from
them; without ``costs`` the runtime measures F, I, W and the message latency during a first step run with a safe
program and compiles from what the ranks agreed on (``pipesched.runtime.measured_costs``). The limit counts
microbatch-stages, not bytes.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
from collections import deque
from itertools import accumulate
from operator import itemgetter
from typing import NamedTuple

from .. import placement, progress
from ..checks import check_callable, check_positive
from ..errors import ScheduleArgumentError
from ..ir import Instr, Op, Program
from ._common import check_one_stage_sizes, program
from .zero_bubble import build_zb_h1, build_zb_h2

NAME = "zb-auto"


def default_memory_limit(num_ranks: int, num_microbatches: int) -> tuple[int, ...]:
    """``min(p, m)`` on every rank: ZB-H1's peak in-flight count (``F`` to ``W``), 1F1B's peak (its rank 0)."""
    return (min(num_ranks, num_microbatches),) * num_ranks


def check_memory_limit(memory_limit, num_ranks: int, num_microbatches: int) -> tuple[int, ...]:
    """The per-rank limit: ``None`` -> :func:`default_memory_limit`; an int -> that on every rank; a sequence ->
    one int per rank.

    Raises:
        ScheduleArgumentError (``argument="memory_limit"``): not an integer >= 1 (bools refused), or a sequence
            whose length is not ``num_ranks``.
    """
    if memory_limit is None:
        return default_memory_limit(num_ranks, num_microbatches)
    if isinstance(memory_limit, (list, tuple)):
        if len(memory_limit) != num_ranks:
            raise ScheduleArgumentError(
                f"memory_limit={list(memory_limit)!r}: a per-rank limit needs one integer >= 1 per rank "
                f"({num_ranks}), got {len(memory_limit)}", argument="memory_limit")
        return tuple(_one_limit(x) for x in memory_limit)
    return (_one_limit(memory_limit),) * num_ranks


def _one_limit(value) -> int:
    try:
        return check_positive("memory_limit", value)
    except ScheduleArgumentError as exc:
        raise ScheduleArgumentError(f"{exc} (in-flight microbatches per rank: an integer >= 1, or a list of one "
                                    f"per rank)", argument="memory_limit") from None


def build_zb_auto(num_ranks: int, num_microbatches: int, virtual_stages: int = 1, costs=None, memory_limit=None,
                  score=None) -> Program:
    """zb-auto (arXiv:2401.10241, section 4's automatic scheduling, greedy): the fastest, under ``costs``, of the
    greedy's programs, ``zb-h1`` and ``zb-h2`` among those within ``memory_limit`` (see the module docstring).

    Args:
        costs: a :class:`~pipesched.cost.CostModel` (``None``: ``CostModel()``'s values, ``simulate``'s defaults:
            F = 1 s, I = W = 1 s, free messages); per-stage fields have one value per rank.
        memory_limit: peak in-flight microbatches (``F`` to ``W``) per rank: an int, or one per rank; ``None``:
            ``min(p, m)`` on every rank (ZB-H1's count, which the result then never exceeds).
        score: ``score(program, costs) -> seconds`` ranks the candidates (``None``: :func:`timed_makespan`).
    Returns:
        The compute-only program (F, I, W); ``meta["zb_auto"]``: ``chosen`` (the winner's name),
        ``memory_limit`` (per rank) and ``makespans`` (seconds, per candidate within the limit).
    Raises:
        ScheduleArgumentError: a size is not a positive integer, ``virtual_stages != 1``, or a bad ``memory_limit``.
        CostError: a per-stage cost whose length is not ``num_ranks``.
        TypeError: ``score`` is neither callable nor None (checked before any candidate is built).
    """
    check_callable(score, "score", where=f"{NAME}: ", none="the default: timed_makespan")
    p, m = check_one_stage_sizes(NAME, num_ranks, num_microbatches, virtual_stages)
    limit = check_memory_limit(memory_limit, p, m)
    score = timed_makespan if score is None else score
    scored, distinct = [], []  # distinct: (program, seconds) of each different program scored so far
    found = candidates(p, m, limit, costs)
    for number, (name, prog) in enumerate(found, 1):
        # candidates often coincide (e.g. "fill" and "fit" when no W ever has to wait): score each program once
        span = next((seconds for other, seconds in distinct if other.ranks == prog.ranks), None)
        if span is None:
            progress.note(f"zb-auto: scoring candidate {number} of {len(found)}")
            span = score(prog, costs)
            distinct.append((prog, span))
        scored.append((name, prog, span))
    name, best, _ = min(scored, key=lambda item: item[2])
    meta = {**best.meta, "zb_auto": {"chosen": name, "memory_limit": list(limit),
                                     "makespans": {n: span for n, _, span in scored}}}
    return dataclasses.replace(best, schedule=NAME, meta=meta)


def candidates(p: int, m: int, limit, costs) -> list:
    """``(name, compute-only program)`` of every candidate within ``limit``: the greedy for each warmup shape
    (:data:`WARMUPS`), order and fill, then ``zb-h1`` and ``zb-h2``."""
    times, runs = _stage_times(costs, p), {}

    def greedy(mode, ahead):
        # F runs only while fewer than limit[r] are held (F ran, W not), and held >= F's lead over I: a lead cap
        # of limit[r] - 1 or more never binds, so warmups that differ only above it give one same run
        key = (mode, tuple(min(a, cap - 1) for a, cap in zip(ahead, limit)))
        if key not in runs:
            progress.note(f"zb-auto: greedy candidate {len(runs) + 1} of at most {4 * len(WARMUPS)}")
            runs[key] = greedy_streams(p, m, limit, times, mode, ahead)
        return runs[key]

    found = [(f"greedy-{order}-{fill}-w{a}x+{b}", greedy((order, fill), warmup(p, a, b)))
             for a, b in WARMUPS for fill in ("fill", "fit") for order in ("alternate", "i-first")]
    found += [(name, build(p, m).ranks) for name, build in (("zb-h1", build_zb_h1), ("zb-h2", build_zb_h2))]
    return [(name, program(NAME, streams, placement.contiguous(p), m)) for name, streams in found
            if all(inflight_peak(stream) <= cap for stream, cap in zip(streams, limit))]


def inflight_peak(stream) -> int:
    """The most microbatch-stages in flight (``F`` ran, ``W`` not) along one rank's F/I/W stream."""
    return max(accumulate(map(_HELD_CHANGE.__getitem__, map(itemgetter(0), stream)), initial=0))  # one C loop


_HELD_CHANGE = {op: (op is Op.F) - (op is Op.W) for op in Op}  # per op, its change of the in-flight count


def timed_makespan(prog: Program, costs) -> float:
    """Seconds the compute-only F/I/W program of one stage per rank takes, each rank in its order, each
    instruction as soon as its rank is free and its inputs are there (messages: ``latency + bytes / bandwidth``)."""
    p, times = prog.num_ranks, _stage_times(costs, prog.num_ranks)
    end = {}
    pos, clock = [0] * p, [0.0] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pos[r] < len(prog.ranks[r]):
                instr = prog.ranks[r][pos[r]]
                ready = _ready(instr, r, p, end, times)
                if ready is None:
                    break
                clock[r] = max(clock[r], ready) + times[instr.op.value][r]
                end[instr.op.value, r, instr.microbatch] = clock[r]
                pos[r], progress = pos[r] + 1, True
    return max(clock)


def _ready(instr, r, p, end, times):
    """When ``instr`` (on rank/stage ``r``) has its inputs, or ``None`` if a producer has not run yet."""
    k, op = instr.microbatch, instr.op.value
    need = []
    if op == "F" and r > 0:
        need.append((("F", r - 1, k), times["msg"][r - 1]))
    if op == "I":
        need.append((("F", r, k), 0.0))
        if r < p - 1:
            need.append((("I", r + 1, k), times["msg"][r]))
    if op == "W":
        need.append((("I", r, k), 0.0))
    if any(key not in end for key, _ in need):
        return None
    return max((end[key] + delay for key, delay in need), default=0.0)


def _stage_times(costs, p: int) -> dict:
    """Per stage: F, I, W seconds, and the message seconds of its output (gradients back: the same size; the send
    overhead counted as delay: the greedy and :func:`timed_makespan` charge the sender nothing, the simulator that
    ranks the candidates does)."""
    if costs is None:  # CostModel()'s values
        return {"F": (1.0,) * p, "I": (1.0,) * p, "W": (1.0,) * p, "msg": (0.0,) * p}
    send = tuple(costs.send_overhead + costs.message_seconds(b) for b in costs.per_stage("activation_bytes", p))
    return {"F": costs.per_stage("forward", p), "I": costs.per_stage("input_grad", p),
            "W": costs.per_stage("weight_grad", p), "msg": send}


#: the greedy's warmup shapes ``(a, b)``: rank r runs ``F`` at most ``a (p-1-r) + b`` microbatches ahead of its ``I``
#: (1F1B/ZB-H1: (1, 0); ZB-H2: (2, 1); (0, p): only the memory limit), each also capped by the memory limit
WARMUPS = ((1, 0), (1, 1), (2, 1), (2, 2), (0, None))


def warmup(p: int, a: int, b) -> tuple:
    """Per rank, how many microbatches its ``F`` may run ahead of its ``I`` (``b=None``: unbounded)."""
    return tuple(math.inf if b is None else a * (p - 1 - r) + b for r in range(p))


def greedy_streams(p: int, m: int, limit, times: dict, mode, ahead) -> list:
    """The greedy list schedule's per-rank streams (see the module docstring). ``mode = (order, fill)``: order
    "i-first": a ready ``I`` before a ready ``F``; "alternate": the other kind than the rank's last of the two
    (1F1B's steady state: rank 0's ``I`` unblocks nobody, its ``F`` feeds the pipe); fill "fill": a pending ``W``
    runs whenever nothing is ready; "fit": only if nothing is expected to become ready before the ``W`` would end.
    An ``F`` runs only ``ahead[r]`` microbatches ahead of the rank's ``I`` at most (and within the limit)."""
    never = [math.inf] * m
    state = tuple.__new__(_GreedyState, (  # _GreedyState(...) without its Python-level __new__ (it is hot)
        [never[:] for _ in range(p)], [never[:] for _ in range(p)],  # f_end, i_end
        [0.0] * p, [0] * p, [0] * p, [deque() for _ in range(p)],  # clock, nf, ni, pending
        [False] * p,  # last_i: whether the last of F and I each rank ran was an I
        [False] * p))  # peeks: whether the rank's current choice read its neighbours' clocks and counts
    choose = _greedy_chooser(p, m, limit, times, mode, ahead, state)
    streams = _list_schedule(p, choose, times, state)
    if any(n < m for n in state.nf) or any(state.pending):  # cannot happen (every rank can always finish): a loud bug
        raise RuntimeError(f"zb-auto greedy stalled with work left (p={p}, m={m}, limit={limit})")
    return streams


class _GreedyState(NamedTuple):
    """The greedy's per-rank progress (lists, changed in place): ``F`` and ``I`` end times per microbatch, clock,
    ``F`` and ``I`` counts, microbatches whose ``W`` is pending, and the two flags above."""
    f_end: list
    i_end: list
    clock: list
    nf: list
    ni: list
    pending: list
    last_i: list
    peeks: list


def _greedy_chooser(p, m, limit, times, mode, ahead, state):
    """``choose(r)``: ``(start, rank, op)`` of rank ``r``'s next instruction, or ``None`` if it has nothing it can
    run yet (reads ``state``; sets ``state.peeks[r]``)."""
    order, fill = mode
    inf, fit, alternate = math.inf, fill != "fill", order == "alternate"
    t_w, msg = times["W"], times["msg"]
    f_end, i_end, clock, nf, ni, pending, last_i, peeks = state
    expected = _greedy_expected(p, m, times, state)

    def choose(r):
        t, n_f, n_i, waiting = clock[r], nf[r], ni[r], pending[r]
        ready_i = ready_f = inf
        if n_i < n_f:
            ready_i = f_end[r][n_i]
            if r < p - 1:
                grad = i_end[r + 1][n_i] + msg[r]
                ready_i = grad if grad > ready_i else ready_i  # max()
        room = n_f - (n_i - len(waiting)) < limit[r] and n_f - n_i <= ahead[r]  # held (F ran, W not) < limit
        if n_f < m and room:
            ready_f = 0.0 if r == 0 else f_end[r - 1][n_f] + msg[r - 1]
        if alternate and last_i[r]:
            if ready_f <= t:
                return (t, r, "F")
            if ready_i <= t:
                return (t, r, "I")
        else:
            if ready_i <= t:
                return (t, r, "I")
            if ready_f <= t:
                return (t, r, "F")
        soonest = ready_f if ready_f < ready_i else ready_i  # min()
        peeks[r] = fit and bool(waiting)  # the choice below then reads the neighbours' clocks and counts too
        if waiting and (not fit or expected(r, room, soonest) >= t + t_w[r]):
            return (t, r, "W")
        if soonest < inf:
            return (soonest, r, "I" if ready_i <= ready_f else "F")
        return (t, r, "W") if waiting else None

    return choose


def _greedy_expected(p, m, times, state):
    """``expected(r, room, guess)``: an optimistic guess of when rank ``r``'s next ``I`` or ``F`` can start:
    ``guess`` (a ready time already fixed) or the time a neighbour that runs the producer next would deliver it."""
    inf, t_f, t_i, msg = math.inf, times["F"], times["I"], times["msg"]
    f_end, clock, nf, ni = state.f_end, state.clock, state.nf, state.ni

    def expected(r, room, guess):
        k = nf[r]
        if room and r > 0 and k < m and nf[r - 1] == k and f_end[r - 1][k] == inf:
            guess = min(guess, clock[r - 1] + t_f[r - 1] + msg[r - 1])
        k = ni[r]
        if r < p - 1 and k < nf[r] and ni[r + 1] == k and f_end[r + 1][k] < inf:
            guess = min(guess, max(clock[r + 1], f_end[r + 1][k]) + t_i[r + 1] + msg[r])
        return guess

    return expected


def _list_schedule(p, choose, times, state) -> list:
    """Runs, until no rank can, the earliest of the ranks' choices (``choose``), updating ``state``; returns the
    per-rank streams. Every rank's current choice is in the heap (with stale ones, dropped when they reach its
    top), so its smallest current entry is min(choices) in O(log p). A rank's choice is a function of its own
    state, the F end its next F waits for (rank r - 1's), the I end its next I waits for (rank r + 1's) and, only
    when it peeks (a pending W in "fit"), its neighbours' clocks and counts: it is made again only when one changes."""
    t_f, t_i, t_w = times["F"], times["I"], times["W"]
    f_end, i_end, clock, nf, ni, pending, last_i, peeks = state
    ops, make = {"F": Op.F, "I": Op.I, "W": Op.W}, tuple.__new__  # Instr.trusted, inlined
    streams, choices, heap, stale = [[] for _ in range(p)], [None] * p, [], range(p)
    push, pop = heapq.heappush, heapq.heappop
    while True:
        for r in stale:
            choice = choices[r] = choose(r)
            if choice is not None:
                push(heap, choice)
        while heap and choices[heap[0][1]] != heap[0]:  # one current choice per rank, told apart by the rank
            pop(heap)
        if not heap:
            return streams
        start, r, op = pop(heap)
        stale = [r]
        if op == "F":
            k = nf[r]
            clock[r] = f_end[r][k] = start + t_f[r]
            nf[r], last_i[r] = k + 1, False
        elif op == "I":
            k = ni[r]
            clock[r] = i_end[r][k] = start + t_i[r]
            ni[r], last_i[r] = k + 1, True
            pending[r].append(k)
        else:
            k = pending[r].popleft()
            clock[r] = start + t_w[r]
        if r > 0 and (peeks[r - 1] or op == "I" and ni[r - 1] == k):
            stale.append(r - 1)
        if r + 1 < p and (peeks[r + 1] or op == "F" and nf[r + 1] == k):
            stale.append(r + 1)
        streams[r].append(make(Instr, (ops[op], r, k, None)))
