"""The strict checks of a :class:`~pipesched.timeline.Timeline`'s fields, and the event they check.

:class:`Event` (re-exported by :mod:`pipesched.timeline`), :data:`SOURCES`, :class:`InTimelineOrder` and
:func:`check_fields`: the timeline's constructor and its JSON reader call it, and it raises naming the field, its
value and what is valid. Kept apart from :mod:`pipesched.timeline` (what a timeline computes: makespan, bubbles,
its JSON form); this module imports nothing of it.
"""
from __future__ import annotations

import math
from operator import attrgetter, itemgetter, le
from typing import NamedTuple

from .checks import as_int, described, is_real, plain_number, short
from .ir import Instr


class Event(NamedTuple):
    """One executed instruction. ``start`` and ``end`` are seconds from the step's start (``end >= start``).

    Immutable and hashable; a named tuple rather than a dataclass because a simulated timeline holds one
    per instruction, hundreds of thousands of them, and a tuple is made three times faster. For the same
    reason an Event checks nothing itself: a :class:`~pipesched.timeline.Timeline` checks its events (``rank`` an
    int in ``0 .. num_ranks - 1``, ``instr`` an :class:`~pipesched.ir.Instr` whose peer, for a SEND/RECV, is in
    ``0 .. num_ranks - 1`` too, ``start`` and ``end`` finite numbers, ``end >= start``; ``end == start`` is fine:
    a measured send often takes no time).
    """

    rank: int
    instr: Instr
    start: float
    end: float

    @property
    def duration(self) -> float:
        """Seconds the instruction took: ``end - start`` (0.0 for one that took no time)."""
        return self.end - self.start


_RANK, _INSTR, _START, _END = (itemgetter(k) for k in range(4))  # an Event's fields (itemgetter: faster)
_PEER = attrgetter("peer")
#: what ``Timeline.source`` may be
SOURCES = ("simulated", "measured")


class InTimelineOrder(tuple):
    """Events known to be ordered by (rank, start, end) already, e.g. by the simulator: a
    :class:`~pipesched.timeline.Timeline` made from them keeps their order instead of sorting them again, and
    trusts them as it trusts their order: it checks only that the first and last ranks are in
    ``0 .. num_ranks - 1`` (the simulator's events are right by construction, and checking each would cost more
    than making the Timeline)."""


def check_fields(events, num_ranks, source, meta, peak_inflight, peak_bytes, ranks, where: str,
                 thorough: bool = False):
    """``(events, labels)``: a :class:`~pipesched.timeline.Timeline`'s fields checked (see its Raises; messages
    start with ``where``),
    ``labels`` the other fields as held (plain numbers, tuples). ``events`` comes back as given (a list or tuple;
    an iterator made a tuple), or rebuilt of plain numbers where an event held numpy ones. ``thorough``: each event
    checked in Python (JSON: a ``true`` time is refused, which the quick C-level check takes for 1)."""
    n = as_int(num_ranks)
    if n is None:
        raise TypeError(f"{where}num_ranks must be an int >= 1 (pipeline ranks), got {described(num_ranks)}")
    if n < 1:
        raise ValueError(f"{where}num_ranks must be an int >= 1 (pipeline ranks), got {short(num_ranks)}")
    if source not in SOURCES:
        kind = ValueError if isinstance(source, str) else TypeError
        raise kind(f"{where}source must be 'simulated' or 'measured', got {described(source)}")
    if not isinstance(meta, dict):
        raise TypeError(f"{where}meta must be a dict (free labels), got {described(meta)}")
    labels = {"num_ranks": n,
              "peak_inflight": _per_rank(peak_inflight, n, "peak_inflight", where, _count, "an int >= 0", True),
              "peak_activation_bytes": None if peak_bytes is None else _per_rank(
                  peak_bytes, n, "peak_activation_bytes", where, _nbytes,
                  "a finite number >= 0 (bytes) or NaN (unknown)", False),
              "ranks": None if ranks is None else _held(ranks, n, where)}
    held = labels["ranks"]
    if isinstance(events, (str, bytes, dict)):
        raise TypeError(f"{where}events must be a sequence of pipesched.Event, got {described(events)}")
    if not isinstance(events, (tuple, list)):
        try:
            events = tuple(events)
        except TypeError:
            raise TypeError(f"{where}events must be a sequence of pipesched.Event, got {described(events)}") from None
    if isinstance(events, InTimelineOrder):  # trusted (the simulator's): its first and last ranks are checked
        if events and not (held is None and _ranks_in_range(events[0].rank, events[-1].rank, n)):
            events = InTimelineOrder(_each_checked(events, n, held, where))
    elif events and (thorough or not _plainly_valid(events, n, held)):
        events = _each_checked(events, n, held, where)  # raises naming the first bad event
    if not isinstance(events, InTimelineOrder):
        _refuse_repeats(events, where)
        _refuse_endless_span(events, where)
    return events, labels


def _refuse_repeats(events, where: str) -> None:
    """Raise ValueError naming the first instruction a rank runs twice (a timeline is one step: each instruction
    once per rank; a repeat, e.g. from two files merged, counted its time twice in the busy time and the bubble)."""
    pairs = [(e.rank, e.instr) for e in events]
    if len(set(pairs)) == len(pairs):
        return
    seen: dict = {}
    for i, pair in enumerate(pairs):
        if pair in seen:
            raise ValueError(f"{where}events[{i}] ({pair[1]}): rank {pair[0]} runs {pair[1]} twice (also "
                             f"events[{seen[pair]}]); a timeline is one step, each instruction once per rank")
        seen[pair] = i


def _refuse_endless_span(events, where: str) -> None:
    """Raise ValueError if the time from the first start to the last end of ``events`` (checked: finite times,
    ``end >= start``) is not a finite float: the makespan would be inf (``start=-1e308, end=1e308``) and every
    bubble NaN. Names the first event whose own span overflows, else the first start's and the last end's events.
    Two C-level passes (a span within the timeline's is finite when the timeline's is)."""
    if not events:
        return
    first, last = min(map(_START, events)), max(map(_END, events))
    if _finite(last - first):
        return
    for i, event in enumerate(events):
        if not _finite(event.end - event.start):
            raise ValueError(f"{where}events[{i}] ({event.instr}): its span end - start = {event.end!r} - "
                             f"{event.start!r} overflows (not a finite float); an event's span must be finite "
                             f"(seconds)")
    at_first = next(i for i, event in enumerate(events) if event.start == first)
    at_last = next(i for i, event in enumerate(events) if event.end == last)
    raise ValueError(f"{where}the timeline's span from the first start {first!r} (events[{at_first}]) to the last "
                     f"end {last!r} (events[{at_last}]) overflows (not a finite float); the makespan must be finite "
                     f"(seconds)")


def _plainly_valid(events, num_ranks: int, held) -> bool:
    """Whether ``events`` (not empty) surely pass :func:`_each_checked` unchanged: C-level passes over the events
    and their columns instead of a Python loop (a timeline has up to hundreds of thousands of events; these passes
    cost about what sorting them in order does). False does not mean that one is bad (e.g. sums that overflow, a
    numpy number): :func:`_each_checked` then looks at each. A ``bool`` start or end passes (as 0 or 1): telling it
    from an int would take two more passes."""
    if set(map(type, events)) != {Event}:
        return False
    ranks, instrs, starts, ends = zip(*events)
    if set(map(type, ranks)) != {int} or set(map(type, instrs)) != {Instr}:
        return False
    try:  # finite sums: no inf or NaN (nor a str: TypeError); a plain int or float: no numpy number in them
        first, last = sum(starts), sum(ends)
    except TypeError:
        return False
    if type(first) not in (int, float) or type(last) not in (int, float) \
            or not (_finite(first) and _finite(last)) or not all(map(le, starts, ends)):
        return False
    peers = set(map(_PEER, instrs))
    peers.discard(None)
    if peers and (set(map(type, peers)) != {int} or not _ranks_in_range(min(peers), max(peers), num_ranks)):
        return False
    seen = set(ranks)
    return seen <= set(held) if held is not None else _ranks_in_range(min(seen), max(seen), num_ranks)


def _finite(value) -> bool:
    """``math.isfinite(value)``, False for an int too large for a float (which isfinite raises OverflowError on)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _ranks_in_range(lowest, highest, num_ranks: int) -> bool:
    return type(lowest) is int and type(highest) is int and 0 <= lowest and highest < num_ranks


def _each_checked(events, num_ranks: int, held, where: str) -> list:
    """``events`` checked one by one, numpy numbers made plain (a Python loop: when :func:`_plainly_valid` is not
    sure). Raises TypeError or ValueError naming the first bad event by its index in ``events`` (a SEND/RECV's
    peer outside the ranks: once every event's own fields are good)."""
    checked = []
    for i, event in enumerate(events):
        at = f"{where}events[{i}]"
        if not isinstance(event, Event):
            raise TypeError(f"{at} must be a pipesched.Event(rank, instr, start, end), got {described(event)}")
        rank, instr, start, end = event
        if not isinstance(instr, Instr):
            raise TypeError(f"{at}: instr must be a pipesched.Instr, got {described(instr)}")
        at = f"{at} ({instr})"
        number = as_int(rank)
        if number is None:
            raise TypeError(f"{at}: rank must be an int, got {described(rank)}")
        if not 0 <= number < num_ranks:
            raise ValueError(f"{at}: rank {number} is outside 0..{num_ranks - 1} (num_ranks={num_ranks})")
        if held is not None and number not in held:
            raise ValueError(f"{at}: rank {number} is not one of the ranks the timeline holds (ranks={held})")
        for name, value in (("start", start), ("end", end)):
            if not is_real(value):
                raise TypeError(f"{at}: {name} must be a number (seconds), got {described(value)}")
            if not _finite(value):
                raise ValueError(f"{at}: {name} must be finite (seconds from the step's start), got {short(value)}")
        if end < start:
            raise ValueError(f"{at}: end {end!r} is before start {start!r} (an event's end must be >= its start)")
        plain = (number, instr, plain_number(start), plain_number(end))
        checked.append(event if all(map(_same, plain, event)) else Event(*plain))
    for i, event in enumerate(checked):  # after every rank is known good: an event's own rank is named first
        peer = event.instr.peer
        if peer is not None and not (type(peer) is int and 0 <= peer < num_ranks):
            raise ValueError(f"{where}events[{i}] ({event.instr}): peer rank {short(peer)} is outside "
                             f"0..{num_ranks - 1} (num_ranks={num_ranks}); a SEND/RECV's peer must be a rank of the "
                             f"timeline")
    return checked


def _same(a, b) -> bool:
    return a is b or (type(a) is type(b) and a == b)


def _count(value):
    number = as_int(value)
    return number if number is not None and number >= 0 else None


def _nbytes(value):
    if is_real(value) and (math.isnan(value) or (math.isfinite(value) and value >= 0)):
        return plain_number(value)
    return None


def _per_rank(values, num_ranks: int, name: str, where: str, each, one: str, empty: bool) -> tuple:
    """``values`` (a list or tuple: one per rank, or none if ``empty``) as a tuple of ``each(value)`` (None: not
    ``one``, what each must be)."""
    valid = f"a list of {num_ranks} (one per rank){' or an empty one (unknown)' if empty else ''}"
    if not isinstance(values, (tuple, list)):
        raise TypeError(f"{where}{name} must be {valid}, got {described(values)}")
    if len(values) != num_ranks and not (empty and not values):
        raise ValueError(f"{where}{name} must be {valid}, got {len(values)}: {short(values)}")
    result = tuple(map(each, values))
    for i, (value, plain) in enumerate(zip(values, result)):
        if plain is None:
            kind = ValueError if is_real(value) else TypeError
            raise kind(f"{where}{name}[{i}] must be {one}, got {described(value)}")
    return result


def _held(ranks, num_ranks: int, where: str) -> tuple[int, ...]:
    """``ranks`` (a list or tuple of distinct ranks in ``0 .. num_ranks - 1``) as a tuple of plain ints."""
    valid = f"None (every rank) or a list of distinct ranks in 0..{num_ranks - 1}"
    if not isinstance(ranks, (tuple, list)):
        raise TypeError(f"{where}ranks must be {valid}, got {described(ranks)}")
    result = []
    for i, rank in enumerate(ranks):
        number = as_int(rank)
        if number is None:
            raise TypeError(f"{where}ranks[{i}] must be an int (ranks: {valid}), got {described(rank)}")
        if not 0 <= number < num_ranks or number in result:
            why = "given twice" if number in result else f"outside 0..{num_ranks - 1} (num_ranks={num_ranks})"
            raise ValueError(f"{where}ranks[{i}] = {number} is {why}; ranks must be {valid}")
        result.append(number)
    return tuple(result)
