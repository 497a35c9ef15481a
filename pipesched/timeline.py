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
from typing import NamedTuple
from itertools import accumulate, islice, repeat
from operator import and_, attrgetter, eq, gt, itemgetter, le

from . import strict_json
from .checks import check_path
from .deps import STASH_CHANGE
from .ir import COMPUTE_OPS, Instr


class Event(NamedTuple):
    """One executed instruction. ``start`` and ``end`` are seconds from the step's start (``end >= start``).

    Immutable and hashable; a named tuple rather than a dataclass because a simulated timeline holds one
    per instruction, hundreds of thousands of them, and a tuple is made three times faster.
    """

    rank: int
    instr: Instr
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


_BY_RANK_AND_TIME = attrgetter("rank", "start", "end")


class InTimelineOrder(tuple):
    """Events known to be ordered by (rank, start, end) already, e.g. by the simulator: a
    :class:`Timeline` made from them keeps their order instead of sorting them again."""


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
    """

    events: tuple[Event, ...]
    num_ranks: int
    source: str = "simulated"
    meta: dict = field(default_factory=dict)
    peak_inflight: tuple[int, ...] = ()
    peak_activation_bytes: tuple[float, ...] | None = None
    ranks: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        events = self.events
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
        """Seconds each rank spent computing (F, B, I, W, R); waiting on communication is not busy."""
        busy = [0.0] * self.num_ranks
        for event in self.events:
            if event.instr.op in COMPUTE_OPS:
                busy[event.rank] += event.duration
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
        events = tuple(Event(int(r), Instr.parse(text), float(s), float(e)) for r, text, s, e in data["events"])
        peak_bytes = data.get("peak_activation_bytes")
        return cls(
            events=events,
            num_ranks=int(data["num_ranks"]),
            source=data.get("source", "measured"),
            meta=dict(data.get("meta", {})),
            peak_inflight=tuple(data.get("peak_inflight", ())),
            peak_activation_bytes=None if peak_bytes is None else tuple(math.nan if b is None else b for b in peak_bytes),
            ranks=None if data.get("ranks") is None else tuple(data["ranks"]),
        )

    def save(self, path) -> None:
        """Write the timeline as JSON to ``path``. Raises TypeError: ``path`` not a ``str`` or ``os.PathLike``."""
        check_path(path)
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(self.to_json_dict(), handle)

    @classmethod
    def load(cls, path) -> "Timeline":
        """Read a timeline written by :meth:`save`.

        Raises:
            OSError: the file cannot be read. json.JSONDecodeError: not JSON (names ``path`` and the line).
            pipesched.strict_json.DuplicateKeyError: a JSON object gives a key twice (a ValueError naming the key
                and where it is; ``json.load`` would keep the last value silently).
            KeyError, TypeError: a missing or bad field; TypeError: ``path`` is not a ``str`` or ``os.PathLike``
                (an int would be taken as a file descriptor, read and closed).
        """
        check_path(path)
        return cls.from_json_dict(strict_json.load_file(path, "Timeline.save"))


def peak_inflight(streams) -> tuple[int, ...]:
    """Per rank, the most microbatch-stages whose ``F`` ran and whose ``B`` (or ``W``) has not.

    Order-only: it depends on each rank's stream, not on timing.
    """
    return tuple(peak_of(map(_OP, stream)) for stream in streams)


def peak_of(ops) -> int:
    """The most microbatch-stages in flight along one rank's instruction kinds (see :func:`peak_inflight`)."""
    return max(accumulate(map(STASH_CHANGE.__getitem__, ops), initial=0))


_OP = attrgetter("op")
