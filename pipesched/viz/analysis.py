"""Where the bubble is: each rank's idle time cut into warmup, steady, cooldown, sending, communication, imbalance.

Pure (no matplotlib): the numbers behind the pictures, for simulated and measured timelines alike.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import replace

from ..checks import check_timeline
from ..deps import message, needs
from ..ir import BACKWARD_OPS, COMPUTE_OPS, RECV_OPS, SEND_OPS, Op
from ..timeline import Event, Timeline

CATEGORIES = ("warmup", "steady", "cooldown", "sending", "communication", "imbalance")
#: two instants closer than this times the makespan are one instant (float rounding of sums of op times): relative,
#: so that the parts add up to the bubble whatever the time unit (op times of 1e-15 s as of 1e12 s)
_REL_EPS = 1e-12


def bubble_breakdown(timeline: Timeline) -> dict:
    """Cut every rank's idle time into six disjoint parts that add up to the bubble (seconds).

    The step runs from ``T0`` (first event start) to ``T1 = T0 + makespan``. On rank ``r`` the idle time
    is ``makespan - busy_r``: the instants in ``[T0, T1]`` not covered by a compute event (F, B, I, W, R).
    Precedence: an idle instant inside one of the rank's own send calls is ``sending``, else one while
    a message it waits for is in flight ``communication``, else it is labelled by position; ``imbalance``
    is then an amount taken out of the positional parts.

    - ``sending``: idle instants covered by one of the rank's own ``SEND_F``/``SEND_B`` events: the rank
      is inside a send call (its own activity: not computing, not waiting for a message). Simulated with
      ``CostModel.send_overhead`` (LogP's o), measured as the send call's duration (gloo's blocks its rank
      about 0.1-0.2 ms); 0 where SEND events take no time.
    - ``communication``: the other idle instants while a message the rank waits for is in flight. For
      the idle gap that ends where a compute ``c`` starts, the message is the one ``c`` consumes
      (:func:`pipesched.deps.needs`: ``RECV_F(s, mb)`` for ``F(s, mb)``, ``RECV_B(s, mb)`` for
      ``B``/``I(s, mb)``); it is in flight from
      its ``SEND``'s start (with no ``SEND`` event in the timeline: from when the receive was posted) to
      the ``RECV``'s end (when it landed). For the trailing gap after the rank's last compute it is the
      time the rank's ``ALL_REDUCE`` events are still running. A compute-only timeline (no SEND/RECV
      events) has no communication wait.
    - ``imbalance``: ``min(max_k busy_k - busy_r, idle_r - sending_r - communication_r)``: the idle the
      rank has because it computes less than the busiest rank — no schedule can remove it. It is 0 when every
      rank does the same work (equal stage costs). It is taken out of the positional parts below in
      the order steady, cooldown, warmup (a slower neighbour shows first in the steady phase).
    - The other idle instants are labelled by position on the rank's own timeline:
      ``warmup`` before its first backward (``B``/``I``) starts (the pipeline filling: forwards and the
      first gradients travelling back; all idle of a rank with no backward), ``cooldown`` after its
      last forward (``F``) ends and its first backward has started (the pipeline draining), and
      ``steady`` in between (1F1B-style steady phase: the schedule's own steady-state gaps and delays
      passed on from other ranks' communication waits).

    Returns:
        ``{"makespan": s, "idle": rank-seconds, "seconds": {category: rank-seconds, "total": ...},
        "fraction": {category: rank-seconds / (ranks * makespan), "total": bubble fraction},
        "per_rank": [{category: seconds, "idle": seconds}, ...]}``. ``fraction["total"]`` equals
        ``timeline.bubble_fraction`` and the categories sum to it, in any time unit: instants closer than
        :func:`tolerance` (1e-12 x the makespan, not an absolute time) count as one. A timeline of some ranks only
        (``timeline.ranks``, e.g. ``Pipeline.timeline()``) is broken down over those: ``per_rank`` has
        ``None`` for the others.
    Raises:
        TypeError: ``timeline`` is not a :class:`~pipesched.timeline.Timeline`.
    """
    span = check_timeline(timeline, where="bubble_breakdown: ").makespan
    held = range(timeline.num_ranks) if timeline.ranks is None else timeline.ranks
    shared = _Shared(timeline)
    rows = [_split_rank(timeline, rank, shared)[0] if rank in held else None for rank in range(timeline.num_ranks)]
    per_rank = [row for row in rows if row is not None]
    most = max((row["busy"] for row in per_rank), default=0.0)
    for row in per_rank:
        excess = min(most - row.pop("busy"), row["idle"] - row["sending"] - row["communication"])
        for name in ("steady", "cooldown", "warmup"):
            taken = min(excess, row[name])
            row[name] -= taken
            row["imbalance"] += taken
            excess -= taken
    seconds = {name: sum(row[name] for row in per_rank) for name in CATEGORIES}
    seconds["total"] = sum(row["idle"] for row in per_rank)
    denominator = len(per_rank) * span
    fraction = {name: (value / denominator if denominator > 0 else 0.0) for name, value in seconds.items()}
    return {"makespan": span, "idle": seconds["total"], "seconds": seconds, "fraction": fraction,
            "per_rank": rows}


def communication_waits(timeline: Timeline) -> list[list[tuple[float, float, str]]]:
    """Per rank, the idle intervals ``(start, end, kind)`` in seconds spent waiting on communication.

    ``kind`` is ``"p2p"`` (a SEND/RECV message in flight) or ``"all-reduce"``; the intervals are those
    :func:`bubble_breakdown` counts as ``communication``, ordered by start (the rank's own send calls cut
    out of them: see :func:`send_intervals`). TypeError: ``timeline`` is not a Timeline.
    """
    return waits_and_sends(check_timeline(timeline, where="communication_waits: "))[0]


def send_intervals(timeline: Timeline) -> list[list[tuple[float, float]]]:
    """Per rank, the idle intervals ``(start, end)`` in seconds the rank spends inside its own send calls.

    They are the parts of the rank's ``SEND_F``/``SEND_B`` events that no compute event covers: those
    :func:`bubble_breakdown` counts as ``sending``, ordered by start; none where SEND events take no time.
    TypeError: ``timeline`` is not a Timeline.
    """
    return waits_and_sends(check_timeline(timeline, where="send_intervals: "))[1]


def send_seconds(timeline: Timeline) -> list[float]:
    """The duration in seconds (``end - start``) of every ``SEND_F``/``SEND_B`` event, in ``timeline.events`` order.

    Measured, a SEND event is the sending rank's time inside its send call (LogP's ``o``: what
    :func:`~pipesched.viz.compare.fit_cost` reads as ``send_overhead``, the median); simulated, it is
    ``CostModel.send_overhead``. Unlike :func:`send_intervals` nothing is cut out (a compute overlapping a send
    does not shorten it), and zero-length SEND events count as 0.0. ``[]`` without SEND events. TypeError:
    ``timeline`` is not a Timeline.
    """
    return [e.duration for e in check_timeline(timeline, where="send_seconds: ").events if e.instr.op in SEND_OPS]


def waits_and_sends(timeline: Timeline) -> tuple[list, list]:
    """``(communication_waits(timeline), send_intervals(timeline))``, the timeline split once."""
    shared = _Shared(timeline)
    splits = [_split_rank(timeline, rank, shared) for rank in range(timeline.num_ranks)]
    return [split[1] for split in splits], [split[2] for split in splits]


def starts_after_receives(timeline: Timeline) -> Timeline:
    """A copy where each compute event starts no earlier than the message it consumes has landed.

    The timeline contract: a compute that needs another rank's data starts after its ``RECV`` ends. A
    recorder that timestamps a compute before waiting for its input folds that wait into the compute
    (the box then covers idle time and the bubble reads too small); this moves such a start to the
    ``RECV``'s end (never past the event's own end). Events already keeping the contract are unchanged.
    """
    flights = MessageFlights(timeline)
    events = []
    for e in timeline.events:
        window = flights.of(e)
        start = min(e.end, max(e.start, window[1])) if window else e.start
        events.append(e if start == e.start else Event(e.rank, e.instr, start, e.end))
    return replace(timeline, events=tuple(events))


def compute_events(timeline: Timeline, rank: int | None = None) -> list[Event]:
    """The compute events (F, B, I, W, R) of ``rank`` (or of every rank), ordered by (rank, start)."""
    return [e for e in timeline.events if e.instr.op in COMPUTE_OPS and (rank is None or e.rank == rank)]


def stage_chunks(timeline: Timeline) -> dict[tuple[int, int], int]:
    """``(rank, stage) -> chunk``: the index of ``stage`` among the stages ``rank`` runs (the virtual stage)."""
    stages: dict[int, set] = {}
    for event in timeline.events:
        stages.setdefault(event.rank, set()).add(event.instr.stage)
    return {(rank, stage): k for rank, held in stages.items() for k, stage in enumerate(sorted(held))}


def _bounds(timeline: Timeline) -> tuple[float, float]:
    if not timeline.events:
        return 0.0, 0.0
    t0 = min(e.start for e in timeline.events)
    return t0, t0 + timeline.makespan


def tolerance(timeline: Timeline) -> float:
    """Seconds under which the breakdown takes two instants of ``timeline`` as one: ``1e-12 * makespan``."""
    return _REL_EPS * timeline.makespan


def _merge(intervals, eps: float) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1] + eps:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _overlap(a: float, b: float, c: float, d: float, eps: float) -> tuple[float, float] | None:
    lo, hi = max(a, c), min(b, d)
    return (lo, hi) if hi > lo + eps else None


class MessageFlights:
    """When each message a rank's compute consumes was in flight: from its ``SEND``'s start (with no ``SEND``
    event, from when its ``RECV`` was posted) to its ``RECV``'s end. A message is keyed by the receiving rank
    and :func:`pipesched.deps.message` (the same item for the SEND and the RECV); the compute that consumes
    it is the one that :func:`pipesched.deps.needs` it."""

    def __init__(self, timeline: Timeline) -> None:
        events = timeline.events
        #: message -> its SEND's start; (receiving rank, message) -> (in flight from, landed)
        self.sent = {message(e.instr): e.start for e in events if e.instr.op in SEND_OPS}
        self.windows = {(e.rank, message(e.instr)): (self.sent.get(message(e.instr), e.start), e.end)
                        for e in events if e.instr.op in RECV_OPS}
        self.num_stages = stage_count(timeline)


    def of(self, event: Event) -> tuple[float, float] | None:
        """The flight window of the message the compute ``event`` consumes from another rank, or ``None``."""
        if event.instr.op not in COMPUTE_OPS:
            return None
        for item in needs(event.instr, self.num_stages, 0):
            window = self.windows.get((event.rank, item))
            if window is not None:
                return window
        return None

    def durations(self) -> list[float]:
        """Seconds from each SEND's start to its RECV's end, for the messages with both events."""
        return [max(0.0, landed - start) for (_, item), (start, landed) in self.windows.items() if item in self.sent]


def stage_count(timeline: Timeline) -> int:
    """How many stages the timeline's program has, also where it holds some ranks only (``Pipeline.timeline()``):
    a ``SEND_F`` or ``RECV_B`` of stage ``s`` says stage ``s + 1`` exists, and ``meta``'s ranks x virtual stages is
    a floor. (The highest stage seen alone made a rank without the last stage take its own for the last: its
    compute then needed no gradient message, so its waits for one were read as warmup or cooldown.)"""
    seen = 1 + max((e.instr.stage + (e.instr.op in (Op.SEND_F, Op.RECV_B)) for e in timeline.events), default=-1)
    meta = timeline.meta or {}
    ranks, virtual = meta.get("ranks"), meta.get("virtual_stages")
    floor = ranks * virtual if isinstance(ranks, int) and isinstance(virtual, int) else 0
    return max(seen, floor)


class _Shared:
    """What every rank's :func:`_split_rank` reads, computed once per timeline (not once per rank: a
    p=64, m=256 timeline has ~10^5 events): its bounds, message flights, compute events, reduces and send
    calls (those that take time, merged) per rank."""

    def __init__(self, timeline: Timeline) -> None:
        self.bounds = _bounds(timeline)
        self.eps = eps = tolerance(timeline)
        self.flights = MessageFlights(timeline)
        self.computes: dict[int, list[Event]] = {}
        self.reduces: dict[int, list[tuple[float, float]]] = {}
        sends: dict[int, list[tuple[float, float]]] = {}
        for e in timeline.events:  # in timeline order, as compute_events(timeline, rank) keeps them
            if e.instr.op in COMPUTE_OPS:
                self.computes.setdefault(e.rank, []).append(e)
            elif e.instr.op in (Op.ALL_REDUCE, Op.TIE_REDUCE):
                self.reduces.setdefault(e.rank, []).append((e.start, e.end))
            elif e.instr.op in SEND_OPS and e.end > e.start + eps:
                sends.setdefault(e.rank, []).append((e.start, e.end))
        self.sends = {rank: _merge(calls, eps) for rank, calls in sends.items()}


def _split_rank(timeline: Timeline, rank: int, shared: _Shared | None = None) -> tuple[dict, list, list]:
    """Idle of one rank: seconds per category, the communication-wait intervals and the send-call intervals."""
    shared = shared or _Shared(timeline)
    t0, t1 = shared.bounds
    eps = shared.eps
    computes = shared.computes.get(rank, [])
    busy = _merge(((e.start, e.end) for e in computes), eps)
    starts = {}
    for e in computes:
        starts.setdefault(e.start, e)
    flights = shared.flights
    reduces = shared.reduces.get(rank, [])
    sends = shared.sends.get(rank, [])
    send_ends = [end for _, end in sends]  # merged: disjoint, so ordered by start and by end
    backward_starts = [e.start for e in computes if e.instr.op in BACKWARD_OPS]
    warm_end = min(backward_starts) if backward_starts else t1
    forward_ends = [e.end for e in computes if e.instr.op is Op.F]
    cool_start = max([warm_end] + forward_ends)
    result = dict.fromkeys(CATEGORIES, 0.0)
    waits: list = []
    sending: list = []
    cursor = t0
    gaps = []
    for start, end in busy + [(t1, t1)]:
        if start > cursor + eps:
            gaps.append((cursor, start))
        cursor = max(cursor, end)
    for a, b in gaps:
        comm = _gap_waits(a, b, starts.get(b), flights, reduces, eps)
        own = _within(a, b, sends, send_ends, eps) if sends else []
        if own:  # the rank's own send calls come first: cut them out of the waits
            comm = [(lo, hi, kind) for c0, c1, kind in comm for lo, hi in _subtract(c0, c1, own) if hi > lo + eps]
            sending.extend(own)
            result["sending"] += sum(hi - lo for lo, hi in own)
        waits.extend(comm)
        for lo, hi in _subtract(a, b, own + [(c0, c1) for c0, c1, _ in comm]):
            result["warmup"] += _length(lo, hi, t0, warm_end)
            result["steady"] += _length(lo, hi, warm_end, cool_start)
            result["cooldown"] += _length(lo, hi, cool_start, t1)
        result["communication"] += sum(c1 - c0 for c0, c1, _ in comm)
    result["idle"] = sum(b - a for a, b in gaps)
    result["busy"] = sum(b - a for a, b in busy)
    return result, waits, sending


def _gap_waits(a, b, next_compute, flights: MessageFlights, reduces, eps: float) -> list:
    if next_compute is None:  # the trailing gap: waiting for the step's all-reduces
        found = [_overlap(a, b, c, d, eps) for c, d in _merge(reduces, eps)]
        return [(lo, hi, "all-reduce") for lo, hi in filter(None, found)]
    window = flights.of(next_compute)
    hit = window and _overlap(a, b, *window, eps)
    return [(hit[0], hit[1], "p2p")] if hit else []


def _within(a: float, b: float, spans: list, ends: list, eps: float) -> list[tuple[float, float]]:
    """The parts of the disjoint, ordered ``spans`` (``ends`` their ends) inside ``[a, b]`` (a binary search:
    a rank of a p=64, m=256 timeline has ~500 idle gaps and as many send calls)."""
    found = []
    for i in range(bisect_right(ends, a), len(spans)):
        c, d = spans[i]
        if c >= b:
            break
        hit = _overlap(a, b, c, d, eps)
        if hit:
            found.append(hit)
    return found


def _subtract(a: float, b: float, holes) -> list[tuple[float, float]]:
    pieces, cursor = [], a
    for lo, hi in sorted(holes):
        if lo > cursor:
            pieces.append((cursor, lo))
        cursor = max(cursor, hi)
    if b > cursor:
        pieces.append((cursor, b))
    return pieces


def _length(lo: float, hi: float, c: float, d: float) -> float:
    return max(0.0, min(hi, d) - max(lo, c))


def chunk_counts(chunks: dict) -> dict[int, int]:
    """Virtual stages per rank, from :func:`stage_chunks`' ``{(rank, stage): chunk}``: ``{rank: chunks}``."""
    counts: dict[int, int] = {}
    for (rank, _), k in chunks.items():
        counts[rank] = max(counts.get(rank, 0), k + 1)
    return counts
