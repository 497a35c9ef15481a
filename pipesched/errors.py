"""Errors raised for bad programs, each carrying the schedule grid with the failing spot marked."""
from __future__ import annotations

from collections.abc import Mapping

_WINDOW = 6  # grid rows shown on each side of a marked spot


class ScheduleError(Exception):
    """Base of every error about a schedule or program.

    Attributes:
        rank: the rank whose instruction fails (``None`` when the error is not about one rank).
        instr: the failing instruction, or ``None``.
        reason: one sentence saying what is wrong.
        grid: the rendered program with the failing spot(s) marked ``<-- here`` (may be empty).
    """

    def __init__(self, reason: str, rank: int | None = None, instr=None, grid: str = "") -> None:
        self.reason, self.rank, self.instr, self.grid = reason, rank, instr, grid
        where = f"rank {rank}, {instr}: " if rank is not None and instr is not None else ""
        message = where + reason
        super().__init__(message + ("\n" + grid if grid else ""))


class ProgramFormatError(ScheduleError):
    """The text or JSON form of a program cannot be parsed."""


class UnknownScheduleError(ScheduleError, KeyError):
    """No schedule is registered under the requested name."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.args[0]


class ScheduleArgumentError(ScheduleError, ValueError):
    """A schedule was asked for with sizes it cannot run (names the argument, its value, what is valid).

    Attributes:
        argument: the name of the argument at fault (``"num_ranks"``, ``"num_microbatches"``,
            ``"virtual_stages"``, ``"dp_size"``, ...), or ``None``; front ends map it to their own option names.
    """

    def __init__(self, reason: str, argument: str | None = None) -> None:
        super().__init__(reason)
        self.argument = argument

    def __reduce__(self):  # keep ``argument`` across processes (``launch`` re-raises a child's error)
        return (type(self), (self.reason, self.argument))


class BuilderResultError(ScheduleError, TypeError):
    """A schedule's builder returned something other than a :class:`~pipesched.ir.Program` (a ``TypeError``, and a
    ``ScheduleError`` so that front ends report it as one line)."""


class BuilderError(ScheduleError):
    """A schedule's builder raised (a ``KeyError``, an ``IndexError``, ...): the message names the schedule, the
    builder and the sizes asked for; the builder's own exception is chained (``__cause__``)."""


class InvalidProgramError(ScheduleError):
    """An instruction is malformed for its program: bad stage, wrong rank, wrong peer, missing or duplicated work."""


class DependencyError(ScheduleError):
    """An instruction comes before something it needs in its rank's stream."""


class PairingError(ScheduleError):
    """A send has no matching receive, or a pair of ranks posts receives in another order than the sends."""


class DeadlockError(ScheduleError):
    """No rank can make progress and work remains (a send blocks until its receive is posted)."""


def render_grid(ranks, marks: Mapping[int, int] | None = None, window: int = _WINDOW, max_columns: int = 8) -> str:
    """Render per-rank streams as columns, one row per stream position.

    Args:
        ranks: sequence of per-rank instruction sequences.
        marks: ``{rank: position}`` of the spots to mark with ``<-- here``.
        window: rows shown around the marked rows; the rest is elided. All rows if no marks.
        max_columns: with marks and more ranks than this, only the marked ranks and their neighbours show.
    Returns:
        The grid as text, with a header row naming the ranks.
    """
    marks = dict(marks or {})
    columns = _columns_to_show(len(ranks), marks, max_columns)
    depth = max((len(ranks[r]) for r in columns), default=0)
    rows = _rows_to_show(depth, marks.values(), window)
    width = max([len(str(i)) for r in columns for i in ranks[r]] + [6]) + (11 if marks else 2)
    lines = ["step  " + "".join(f"rank {r}".ljust(width) for r in columns).rstrip()]
    previous = -1
    for row in rows:
        if row != previous + 1:
            lines.append("  ...")
        cells = []
        for rank in columns:
            stream = ranks[rank]
            cell = str(stream[row]) if row < len(stream) else ""
            if marks.get(rank) == row:
                cell += " <-- here"
            cells.append(cell.ljust(width))
        lines.append(f"{row:>4}  " + "".join(cells).rstrip())
        previous = row
    if rows and rows[-1] != depth - 1:
        lines.append("  ...")
    return "\n".join(lines)


def _columns_to_show(num_ranks: int, marks: dict, max_columns: int) -> list[int]:
    if not marks or num_ranks <= max_columns:
        return list(range(num_ranks))
    keep = set()
    for rank in sorted(marks):
        for r in (rank - 1, rank, rank + 1):
            if 0 <= r < num_ranks and len(keep) < max_columns:
                keep.add(r)
    return sorted(keep)


def _rows_to_show(depth: int, marked, window: int) -> list[int]:
    marked = list(marked)
    if not marked:
        return list(range(depth))
    keep: set[int] = set()
    for pos in marked:
        keep.update(range(max(0, pos - window), min(depth, pos + window + 1)))
    return sorted(keep)


def failure_at(cls, program, rank: int, pos: int, reason: str):
    """A ``cls`` error (a :class:`ScheduleError` subclass) about the instruction at ``pos`` of ``rank``'s stream of
    ``program``, with the grid and that spot marked."""
    return cls(reason, rank, program.ranks[rank][pos], render_grid(program.ranks, {rank: pos}))
