"""The text form of a Program (described in :mod:`pipesched.program_io`): :func:`to_text` writes it,
:func:`from_text` reads it strictly (each error names the line).
"""
from __future__ import annotations

import re
import sys

from .checks import check_program
from .errors import ProgramFormatError
from .ir import OVERLAP_PAIRS, Instr, Program
from .program_pairs import overlap_groups, with_groups

_HEADER_KEYS = ("schedule", "microbatches", "stage_to_rank", "dp_size", "forward_only", "ties", OVERLAP_PAIRS)
_RANK_LINE = re.compile(r"^rank\s+(\d+)\s*:(.*)$", re.ASCII)
# the start of a row of torch's schedule CSV (`0F0,0SEND_F0,...`, `(0F5;5B2)OVERLAP_F_B`): only for a hint
_TORCH_CSV_ROW = re.compile(
    r"^\(?\d+(?:F|B|I|W|SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD)\d*\s*(?:[,;)]|$)", re.ASCII)


def to_text(program: Program) -> str:
    """The text form, one instruction per line so that diffs of two schedules read line by line.

    Raises:
        TypeError: ``program`` is not a :class:`~pipesched.ir.Program`."""
    check_program(program)
    lines = [
        "# pipesched program",
        f"schedule: {program.schedule}",
        f"microbatches: {program.num_microbatches}",
        "stage_to_rank: " + " ".join(str(r) for r in program.stage_to_rank),
        f"dp_size: {program.dp_size}",
    ] + (["forward_only: true"] if program.forward_only else [])
    if program.ties:
        lines.append("ties: " + " ".join(",".join(map(str, tie)) for tie in program.ties))
    groups = overlap_groups(program)
    if groups:
        lines.append(f"{OVERLAP_PAIRS}: " + " ".join("+".join(map(str, group)) for group in groups))
    for rank, stream in enumerate(program.ranks):
        lines.append(f"rank {rank}:")
        lines.extend(f"  {instr}" for instr in stream)
    return "\n".join(lines) + "\n"


def from_text(text: str) -> Program:
    """Parse the text form. Raises ``ProgramFormatError`` with the line number of the first bad line."""
    header: dict[str, str] = {}
    header_line: dict[str, int] = {}  # where each header was given
    ranks: dict[int, list[Instr]] = {}
    current: int | None = None
    first_rank_line: int | None = None
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        rank_match = _RANK_LINE.match(line)
        try:
            if rank_match:
                current = int(rank_match[1])
                if current in ranks:
                    raise ValueError(f"rank {current} appears twice")
                first_rank_line = first_rank_line or lineno
                ranks[current] = [Instr.parse(tok) for tok in rank_match[2].split()]
            elif ":" in line and line.split(":", 1)[0].strip() in _HEADER_KEYS:
                key, value = (part.strip() for part in line.split(":", 1))
                if first_rank_line is not None:
                    also = f"; '{key}' is also given on line {header_line[key]}" if key in header else ""
                    raise ValueError(f"header '{key}: {value}' after the rank sections (the first 'rank N:' is on "
                                     f"line {first_rank_line}){also}; the headers come before the first 'rank N:' line")
                if key in header:  # a second value would silently override the first
                    raise ValueError(f"header '{key}' given twice (first on line {header_line[key]}); give each "
                                     f"header once")
                header[key], header_line[key] = value, lineno
            elif current is not None:
                ranks[current].extend(Instr.parse(tok) for tok in line.split())
            else:
                hint = (" (this looks like `pipesched show`'s grid, a picture for reading: write the program with "
                        "`pipesched show ... --format text` or `--json`)" if line.split()[:1] == ["step"] else
                        " (this looks like a torch.distributed.pipelining schedule CSV: read it with "
                        "pipesched.interop.from_torch_csv, or `pipesched validate --torch-csv FILE`)"
                        if _TORCH_CSV_ROW.match(line) else "")
                raise ValueError(f"expected a header ({', '.join(_HEADER_KEYS)}) or 'rank N:', got {line!r}{hint}")
        except ValueError as exc:
            raise ProgramFormatError(f"line {lineno}: {exc}") from None
    return _assemble(header, ranks)


def _assemble(header: dict[str, str], ranks: dict[int, list[Instr]]) -> Program:
    for key in ("microbatches", "stage_to_rank"):
        if key not in header:
            raise ProgramFormatError(f"missing header line '{key}: ...'")
    if sorted(ranks) != list(range(len(ranks))):
        raise ProgramFormatError(f"ranks must be numbered 0..P-1 without gaps, got {sorted(ranks)}")
    try:
        groups = tuple(tuple(Instr.parse(tok) for tok in group.split("+"))
                       for group in header.get(OVERLAP_PAIRS, "").split())
    except ValueError as exc:
        raise ProgramFormatError(f"bad header value: {OVERLAP_PAIRS}: {exc}") from None
    try:
        program = Program(
            ranks=tuple(tuple(ranks[r]) for r in range(len(ranks))),
            stage_to_rank=tuple(_text_int("stage_to_rank", x, 0, "one rank number >= 0 per stage, e.g. 0 1 1 0")
                                for x in header["stage_to_rank"].split()),
            num_microbatches=_text_int("microbatches", header["microbatches"], 1),
            dp_size=_text_int("dp_size", header.get("dp_size", "1"), 1),
            schedule=header.get("schedule", "custom"),
            forward_only=_flag(header.get("forward_only", "false")),
            ties=tuple(tuple(_text_int("ties", s, 0, "groups of stage numbers joined by ',', e.g. 0,3 1,2")
                             for s in tie.split(",")) for tie in header.get("ties", "").split()),
        )
    except ValueError as exc:
        raise ProgramFormatError(f"bad header value: {exc}") from None
    return with_groups(program, groups)

_DIGITS = re.compile(r"[0-9]+")


def _text_int(key: str, text: str, minimum: int, valid: str = "") -> int:
    """A header's integer: ASCII digits only (no sign, ``_``, point or other script's digits), >= ``minimum``.
    Raises ``ValueError`` naming the header, the value and what is valid."""
    limit = sys.get_int_max_str_digits()
    if limit and len(text) > limit and _DIGITS.fullmatch(text):  # int() would raise Python's own ValueError
        raise ValueError(f"{key}: an integer of {len(text)} digits, more than Python reads (at most {limit} digits)")
    if _DIGITS.fullmatch(text) is None or int(text) < minimum:
        raise ValueError(f"{key}: {text!r} is not an integer >= {minimum}" + (f" ({valid})" if valid else ""))
    return int(text)


def _flag(text: str) -> bool:
    """``true`` or ``false`` (a header value). Raises ``ValueError`` for anything else."""
    if text not in ("true", "false"):
        raise ValueError(f"forward_only must be true or false, got {text!r}")
    return text == "true"
