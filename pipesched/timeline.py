"""Timeline: when each instruction ran on each rank — the one shape shared by the simulator and the runtime.

A timeline is a flat list of :class:`Event` (rank, instruction, start, end in seconds from the step's start)
plus labels. Everything the visualizer and the bubble statistics need is derived from the events, so a
simulated and a measured run of the same program are analysed by the same code.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate, islice, repeat
from operator import and_, attrgetter, eq, gt, itemgetter, le

from . import strict_json
from .checks import check_path, described
from .deps import STASH_CHANGE
from .ir import COMPUTE_OPS, Instr
from .timeline_checks import SOURCES, Event, InTimelineOrder, check_fields

#: the public names; ``Event``, ``SOURCES`` and ``InTimelineOrder`` live in :mod:`pipesched.timeline_checks`
__all__ = ["Event", "InTimelineOrder", "SOURCES", "Timeline", "events_from_columns", "in_timeline_order",
           "peak_inflight", "peak_of", "ties_in_order", "timeline_order"]

_BY_RANK_AND_TIME = attrgetter("rank", "start", "end")


def timeline_order(starts, ends, lo: int, hi: int) -> list[int]:
    """Numbers ``lo``..``hi - 1`` (one rank's instructions) in the order a :class:`Timeline` lists their
    events, given every instruction's start and end: by start, then end, then number."""
    if in_timeline_order(starts, ends, lo, hi):
        return list(range(lo, hi))
    return list(map(itemgetter(2), sorted(zip(starts[lo:hi], ends[lo:hi], range(lo, hi)))))


def in_timeline_order(starts, ends, lo: int, hi: int) -> bool:
    """Whether numbers ``lo``..``hi - 1`` are already in :func:`timeline_order`: starts never decrease,
    and where two neighbours start together, ends do not decrease either."""
    s = starts[lo:hi]
    return all(map(le, s, islice(s, 1, None))) and ties_in_order(starts, ends, lo, hi)


def ties_in_order(starts, ends, lo: int, hi: int) -> bool:
    """Whether, among numbers ``lo``..``hi - 1``, neighbours that start together have ends that do not
    decrease: :func:`in_timeline_order` for starts known not to decrease (a simulated rank's)."""
    s, e = starts[lo:hi], ends[lo:hi]
    return not any(map(and_, map(eq, s, islice(s, 1, None)), map(gt, e, islice(e, 1, None))))


def events_from_columns(ranks, instrs, starts, ends) -> list[Event]:
    """``[Event(*row) for row in zip(ranks, instrs, starts, ends)]``, without a Python-level call per
    event (a simulated timeline has one event per instruction)."""
    return list(map(tuple.__new__, repeat(Event), zip(ranks, instrs, starts, ends)))


@dataclass(frozen=True)
class Timeline:
    """Start and end of every instruction of one step, on every rank.

    Attributes:
        events: every executed instruction, ordered by (rank, start).
        num_ranks: pipeline ranks (rows of a Gantt chart).
        source: ``"simulated"`` or ``"measured"``.
        meta: free labels shown on pictures: schedule, p, m, v, cost assumptions, ...
        peak_inflight: per rank, the most microbatches whose forward ran and whose backward
            (``B``, or ``W`` for a split backward) has not yet finished.
        peak_activation_bytes: per rank, the most bytes of activations held for backward
            (``None`` where unknown).
        ranks: the ranks whose events this timeline holds (``None``: every rank). A measured timeline of one
            rank (``Pipeline.timeline()``) holds only that rank: the others' bubbles are unknown (NaN), not 100%.

    Numpy numbers are taken and held as plain ones; ``peak_inflight``, ``peak_activation_bytes`` and ``ranks`` are
    held as tuples.

    Raises:
        TypeError: a field of the wrong type: ``num_ranks`` not an int (``2.7``, ``"2"``, ``True``), an event not an
            :class:`Event` or with a rank that is not an int, an instr that is not an ``Instr`` or a time that is not
            a number (a ``bool`` time passes this quick check as 0 or 1; :meth:`from_json_dict` refuses ``true``),
            ``source`` not a str, ``meta`` not a dict, ``peak_inflight`` / ``peak_activation_bytes`` /
            ``ranks`` not a list or tuple (``peak_activation_bytes``, ``ranks``: or None) or holding a non-number.
        ValueError: ``num_ranks`` < 1; an event's rank outside ``0 .. num_ranks - 1`` (or, with ``ranks``, not one
            of them), the peer of a SEND/RECV outside ``0 .. num_ranks - 1``, a start or end not finite, an end
            before its start, a span (an event's ``end - start``, or the first start to the last end) that
            overflows a float (``start=-1e308, end=1e308``: the makespan would be inf); ``source`` not
            ``"simulated"`` or ``"measured"``; ``peak_inflight`` not empty or one int >= 0 per rank;
            ``peak_activation_bytes`` not one finite number >= 0 (or NaN: unknown) per rank; ``ranks`` giving a
            rank twice or one outside ``0 .. num_ranks - 1``. Each message names the field (an event by its index
            in ``events`` as given, and its instruction), its value and what is valid.
    """

    events: tuple[Event, ...]
    num_ranks: int
    source: str = "simulated"
    meta: dict = field(default_factory=dict)
    peak_inflight: tuple[int, ...] = ()
    peak_activation_bytes: tuple[float, ...] | None = None
    ranks: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        events, labels = check_fields(self.events, self.num_ranks, self.source, self.meta, self.peak_inflight,
                                  self.peak_activation_bytes, self.ranks, "Timeline: ")
        for name, value in labels.items():
            object.__setattr__(self, name, value)
        if not isinstance(events, InTimelineOrder):
            events = sorted(events, key=_BY_RANK_AND_TIME)
        object.__setattr__(self, "events", tuple(events))

    @cached_property  # the events are frozen; the bubble of each rank asks for it again
    def makespan(self) -> float:
        """Seconds from the first start to the last end over all ranks (0 for an empty timeline)."""
        if not self.events:
            return 0.0
        return max(e.end for e in self.events) - min(e.start for e in self.events)

    def busy_per_rank(self) -> tuple[float, ...]:
        """Seconds each rank spent computing (F, B, I, W, R); waiting on communication is not busy. Compute
        events of one rank that overlap (an executor running a pair of them at once) count their union, so idle
        time stays makespan - busy."""
        busy = [0.0] * self.num_ranks
        reach = [-math.inf] * self.num_ranks  # how far each rank's computes so far reach (events in start order)
        for event in self.events:
            if event.instr.op in COMPUTE_OPS:
                r = event.rank
                busy[r] += max(0.0, event.end - max(event.start, reach[r]))
                reach[r] = max(reach[r], event.end)
        return tuple(busy)

    def bubble_per_rank(self) -> tuple[float, ...]:
        """Per rank, idle seconds / makespan (idle = makespan - compute), in [0, 1]; NaN for a rank this
        timeline does not hold (see ``ranks``)."""
        span = self.makespan
        held = range(self.num_ranks) if self.ranks is None else self.ranks
        return tuple((max(0.0, span - busy) / span if span > 0 else 0.0) if rank in held else math.nan
                     for rank, busy in enumerate(self.busy_per_rank()))

    @property
    def bubble_fraction(self) -> float:
        """Total idle rank-seconds / (ranks x makespan), the field's bubble fraction, over the ranks held."""
        per_rank = [b for b in self.bubble_per_rank() if not math.isnan(b)]
        return sum(per_rank) / len(per_rank) if per_rank else 0.0

    def summary(self) -> dict:
        """Plain numbers for ``--json`` output and reports."""
        return {
            "source": self.source,
            "makespan": self.makespan,
            "bubble_fraction": self.bubble_fraction,
            "bubble_per_rank": list(self.bubble_per_rank()),
            "peak_inflight": list(self.peak_inflight),
            "peak_activation_bytes": None if self.peak_activation_bytes is None else list(self.peak_activation_bytes),
            "meta": self.meta,
        }

    def to_json_dict(self) -> dict:
        """A JSON-ready dict that :meth:`from_json_dict` reads back (used for saved measured runs)."""
        data = self.summary()
        data["num_ranks"] = self.num_ranks
        data["ranks"] = None if self.ranks is None else list(self.ranks)
        data["bubble_per_rank"] = [None if math.isnan(b) else b for b in data["bubble_per_rank"]]
        if self.peak_activation_bytes is not None:  # NaN (a rank not held) is not JSON: written as null
            data["peak_activation_bytes"] = [None if math.isnan(b) else b for b in self.peak_activation_bytes]
        data["events"] = [[e.rank, str(e.instr), e.start, e.end] for e in self.events]
        return data

    @classmethod
    def from_json_dict(cls, data: dict) -> "Timeline":
        """A timeline from its :meth:`to_json_dict` form, read strictly: ``events`` (``[rank, instruction text,
        start, end]`` rows) and ``num_ranks`` are needed; ``source`` (default ``"measured"``), ``meta``,
        ``peak_inflight``, ``peak_activation_bytes`` (``null`` for a rank: unknown) and ``ranks`` may be left out;
        ``makespan``, ``bubble_fraction`` and ``bubble_per_rank`` (written by :meth:`summary`) are recomputed from
        the events, their values not read. Integers must be JSON integers (not ``2.7``, ``2.0``, ``"2"`` or
        ``true``), times JSON numbers.

        Raises:
            ValueError: ``data`` is not a dict; a key is unknown (a typo such as ``num_rank``: named, with the
                closest known key) or missing; a field has the wrong type or value (as the constructor refuses it,
                see :class:`Timeline`); an event row is not ``[rank, instruction, start, end]`` or its instruction
                text does not parse. The message starts ``Timeline JSON:`` and names the field (``events[3]``: the
                row's index), its value and what is valid.
        """
        return cls._from_json(data, "Timeline JSON: ")

    @classmethod
    def _from_json(cls, data, where: str) -> "Timeline":
        """:meth:`from_json_dict`, its messages starting with ``where``."""
        strict_json.check_json_object(data, _JSON_KEYS, "a saved Timeline's", where,
                                      "the top level must be a JSON object (as Timeline.save writes)")
        missing = [key for key in ("events", "num_ranks") if key not in data]
        if missing:
            raise ValueError(f"{where}missing key{'s' if len(missing) > 1 else ''} "
                             f"{', '.join(map(repr, missing))} (a saved Timeline needs events and num_ranks)")
        rows = data["events"]
        if not isinstance(rows, list):
            raise ValueError(f"{where}events must be a list of [rank, instruction, start, end] rows, got "
                             f"{described(rows)}")
        events = []
        for i, row in enumerate(rows):
            if not isinstance(row, list) or len(row) != 4:
                raise ValueError(f"{where}events[{i}] must be a [rank, instruction, start, end] row, got "
                                 f"{described(row)}")
            rank, text, start, end = row
            if not isinstance(text, str):
                raise ValueError(f"{where}events[{i}]: the instruction must be its text (e.g. \"F0.1\"), got "
                                 f"{described(text)}")
            try:
                instr = Instr.parse(text)
            except ValueError as exc:
                raise ValueError(f"{where}events[{i}]: {exc}") from None
            events.append(Event(rank, instr, start, end))
        peak_bytes = data.get("peak_activation_bytes")
        if isinstance(peak_bytes, list):  # null for a rank: unknown (NaN is not JSON)
            peak_bytes = [math.nan if b is None else b for b in peak_bytes]
        fields = dict(num_ranks=data["num_ranks"], source=data.get("source", "measured"), meta=data.get("meta", {}),
                      peak_inflight=data.get("peak_inflight", ()), peak_activation_bytes=peak_bytes,
                      ranks=data.get("ranks"))
        try:  # checked here, to name the file; the constructor checks again (quickly: they pass)
            events, labels = check_fields(events, *fields.values(), where, thorough=True)
        except TypeError as exc:  # a JSON value of the wrong type: a bad value of the file
            raise ValueError(str(exc)) from None
        return cls(events=tuple(events), **dict(fields, **labels))

    def save(self, path) -> None:
        """Write the timeline as JSON to ``path``. Raises TypeError: ``path`` not a ``str`` or ``os.PathLike``."""
        check_path(path)
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(self.to_json_dict(), handle)

    @classmethod
    def load(cls, path) -> "Timeline":
        """Read a timeline written by :meth:`save` (strictly, as :meth:`from_json_dict` reads it).

        Raises:
            OSError: the file cannot be read. json.JSONDecodeError: not JSON (names ``path`` and the line).
            pipesched.strict_json.DuplicateKeyError: a JSON object gives a key twice (a ValueError naming the key
                and where it is; ``json.load`` would keep the last value silently).
            ValueError: not a saved timeline: a missing, unknown or bad field, as :meth:`from_json_dict` refuses
                it; the message starts ``<path> is not a saved Timeline:`` and names the field, its value and what
                is valid. TypeError: ``path`` is not a ``str`` or ``os.PathLike`` (an int would be taken as a file
                descriptor, read and closed).
        """
        check_path(path)
        return cls._from_json(strict_json.load_file(path, "Timeline.save"), f"{path} is not a saved Timeline: ")


#: the keys of :meth:`Timeline.to_json_dict`'s form; the last three are recomputed, not read
_JSON_KEYS = ("events", "num_ranks", "source", "meta", "peak_inflight", "peak_activation_bytes", "ranks", "makespan",
              "bubble_fraction", "bubble_per_rank")


def peak_inflight(streams) -> tuple[int, ...]:
    """Per rank, the most microbatch-stages whose ``F`` ran and whose ``B`` (or ``W``) has not.

    Order-only: it depends on each rank's stream, not on timing.
    """
    return tuple(peak_of(map(_OP, stream)) for stream in streams)


def peak_of(ops) -> int:
    """The most microbatch-stages in flight along one rank's instruction kinds (see :func:`peak_inflight`)."""
    return max(accumulate(map(STASH_CHANGE.__getitem__, ops), initial=0))


_OP = attrgetter("op")
