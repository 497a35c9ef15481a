"""The oddities of a torch schedule CSV that :func:`~pipesched.interop.from_torch_csv` names rather than reads
silently: lines without actions (a rank without work, as torch reads a blank line, or a stray line), and a stage
or microbatch number no action has below the largest (the first action past the gap is the likely typo)."""
from __future__ import annotations

from .errors import ProgramFormatError


def idle_note(rows, lines, used: int | None = None) -> str:
    """What the rows without actions are read as (``""`` if none): with ``used`` (the rows up to the last with
    actions), the warning of :func:`~pipesched.interop.from_torch_csv`; without, a note for the error of a
    ``num_ranks`` too small. ``lines``: the line each row ends on."""
    idle = [r for r, row in enumerate(rows) if not row]
    if not idle:
        return ""
    one = len(idle) == 1
    where = (f"line{'' if one else 's'} {', '.join(str(lines[r]) for r in idle)} "
             f"{'has' if one else 'have'} no actions")
    stray = "it is a stray line, delete it" if one else "they are stray lines, delete them"
    if used is None:
        return f"; {where}: torch reads {'it as a rank' if one else 'them as ranks'} without work too; if {stray}"
    trailing = [r for r in idle if r >= used]
    after = ("" if not trailing else f", or pass num_ranks={used} to ignore "
             + ("it" if one else "those after the last row with actions" if len(trailing) < len(idle) else "them"))
    return (f"{where}: read as rank{'' if one else 's'} {', '.join(map(str, idle))}, "
            f"{'a rank' if one else 'ranks'} without work, as torch's _load_csv reads a blank line (its _dump_csv "
            f"writes a rank without actions so); if {stray} (each row is a rank, in order){after}")


def refuse_gap(rows, what: str, number, path, why: tuple[str, str], argument: str) -> None:
    """Raise where the ``what`` numbers (``number(leaf)``: ``stage`` or ``microbatch``) of the file's actions do not
    run 0..max: names the first action past the gap, why the number matters (``why``: words after "has no action"
    and after the numbers that appear) and the ``argument`` that reads the file as it is.

    Raises:
        ProgramFormatError: naming the file, line, column and action past the gap.
    """
    gap = _gap(rows, number)
    if gap is None:
        return
    missing, past, count, appear = gap
    plural = "microbatches" if what == "microbatch" else f"{what}s"
    raise ProgramFormatError(f"{past.where(path)}: {what} {missing} has no action{why[0]} ({plural} {appear} "
                             f"appear{why[1]}; {_past_the_gap(count, what, missing)}); pass {argument} to read the "
                             f"file as it is")


def _gap(rows, number):
    """``None`` if the numbers (``number(leaf)``: a stage or a microbatch) of the file's actions run 0..max without a
    gap, else ``(the first number missing, the first cell in the file of the least number past it, how many
    actions are past it, the numbers that appear as ranges)``: that cell is where a typo would most likely be."""
    cells: dict = {}  # number -> the cells of the actions with it
    for row in rows:
        for cell in row:
            for leaf in cell.leaves():
                if number(leaf) is not None:
                    cells.setdefault(number(leaf), []).append(cell)
    missing = next((n for n in range(max(cells) + 1) if n not in cells), None) if cells else None
    if missing is None:
        return None
    past = min(n for n in cells if n > missing)
    count = sum(len(c) for n, c in cells.items() if n > missing)
    return missing, min(cells[past], key=lambda c: (c.line, c.column)), count, _ranges(sorted(cells))


def _past_the_gap(count: int, what: str, missing: int) -> str:
    plural = "microbatches" if what == "microbatch" else f"{what}s"
    return (f"this is the only action of a {what} above {missing}: a typo?" if count == 1 else
            f"this is the first of the {count} actions of {plural} above {missing}")


def _ranges(numbers: list[int]) -> str:
    """``[0, 1, 2, 3, 9]`` as ``"0..3, 9"``."""
    out, start = [], 0
    for k in range(1, len(numbers) + 1):
        if k == len(numbers) or numbers[k] != numbers[k - 1] + 1:
            a, b = numbers[start], numbers[k - 1]
            out.append(str(a) if a == b else f"{a}, {b}" if b == a + 1 else f"{a}..{b}")
            start = k
    return ", ".join(out)
