"""Text and JSON forms of a Program: print, diff, save and load schedules as plain data.

Text form (``#`` starts a comment; instructions may share a line or take one each)::

    # pipesched program
    schedule: 1f1b
    microbatches: 2
    stage_to_rank: 0 1
    dp_size: 1
    rank 0:
      F0.0 SEND_F0.0>1
      ...
    rank 1:
      RECV_F1.0<0 F1.0 ...

JSON form::

    {"schedule": "1f1b", "num_microbatches": 2, "stage_to_rank": [0, 1], "dp_size": 1,
     "ranks": [[{"op": "F", "stage": 0, "microbatch": 0, "peer": null}, ...], ...]}

``num_microbatches``, ``stage_to_rank`` and ``ranks`` are required; ``dp_size`` defaults to 1 and
``schedule`` to ``"custom"``; other keys are ignored. A forward-only program
(:attr:`~pipesched.ir.Program.forward_only`) has the header line ``forward_only: true`` and the JSON key
``"forward_only": true``; both are left out for a training program (the default). A program with ties
(:attr:`~pipesched.ir.Program.ties`) has the header line ``ties: 0,3 1,2`` (each tie's stages joined by commas)
and the JSON key ``"ties": [[0, 3], [1, 2]]``; both are left out when it has none. A program with overlapped
instruction groups (``program.meta[OVERLAP_PAIRS]``, :data:`pipesched.ir.OVERLAP_PAIRS`: DualPipe-V's pairs, torch's
``OVERLAP_F_B``) has the header line ``overlap_pairs: F0.5+B3.1 F3.6+I0.2`` (each group's instructions joined by
``+``) and the JSON key ``"overlap_pairs"`` (a list of groups, each a list of instructions in the form of
``"ranks"``); both are left out when it has none, and a file without them (older ones) loads without pairs. Each
instruction of a group must be an instruction of one rank's stream (a ``ProgramFormatError`` otherwise).
"""
from __future__ import annotations

import hashlib
import json
import re

from .errors import ProgramFormatError
from .ir import OVERLAP_PAIRS, Instr, Program

_HEADER_KEYS = ("schedule", "microbatches", "stage_to_rank", "dp_size", "forward_only", "ties", OVERLAP_PAIRS)
_RANK_LINE = re.compile(r"^rank\s+(\d+)\s*:(.*)$")


def to_text(program: Program) -> str:
    """The text form, one instruction per line so that diffs of two schedules read line by line."""
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


def fingerprint(program: Program) -> int:
    """A 56-bit integer that differs, with overwhelming probability, between two programs whose text forms
    differ (schedule, sizes, placement, every instruction); equal programs give equal fingerprints in every
    process (unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(to_text(program).encode(), digest_size=7).digest(), "big")


def from_text(text: str) -> Program:
    """Parse the text form. Raises ``ProgramFormatError`` with the line number of the first bad line."""
    header: dict[str, str] = {}
    ranks: dict[int, list[Instr]] = {}
    current: int | None = None
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
                ranks[current] = [Instr.parse(tok) for tok in rank_match[2].split()]
            elif ":" in line and line.split(":", 1)[0].strip() in _HEADER_KEYS:
                key, value = (part.strip() for part in line.split(":", 1))
                header[key] = value
            elif current is not None:
                ranks[current].extend(Instr.parse(tok) for tok in line.split())
            else:
                hint = (" (this looks like `pipesched show`'s grid, a picture for reading: write the program with "
                        "`pipesched show ... --format text` or `--json`)" if line.split()[:1] == ["step"] else "")
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
            stage_to_rank=tuple(int(x) for x in header["stage_to_rank"].split()),
            num_microbatches=int(header["microbatches"]),
            dp_size=int(header.get("dp_size", "1")),
            schedule=header.get("schedule", "custom"),
            forward_only=_flag(header.get("forward_only", "false")),
            ties=tuple(tuple(int(s) for s in tie.split(",")) for tie in header.get("ties", "").split()),
        )
    except ValueError as exc:
        raise ProgramFormatError(f"bad header value: {exc}") from None
    return _with_groups(program, groups)


def overlap_groups(program: Program) -> tuple[tuple[Instr, ...], ...]:
    """The groups of ``program.meta[OVERLAP_PAIRS]`` the text and JSON forms carry: those whose instructions are all
    in one rank's stream (a pass that removes one, e.g. :func:`~pipesched.lower.forward_only` removing the
    backward of a pair, leaves a group the program no longer runs: it is left out)."""
    groups = program.meta.get(OVERLAP_PAIRS) or ()
    if not groups:
        return ()
    where = _rank_of(program)
    return tuple(tuple(g) for g in groups if len(g) >= 2 and all(i in where for i in g)
                 and len({where[i] for i in g}) == 1)


def _rank_of(program: Program) -> dict:
    return {instr: rank for rank, stream in enumerate(program.ranks) for instr in stream}


def _with_groups(program: Program, groups) -> Program:
    """``program`` with ``meta[OVERLAP_PAIRS] = groups`` (none: unchanged).

    Raises:
        ProgramFormatError: a group with fewer than 2 instructions, or one not all in one rank's stream.
    """
    if not groups:
        return program
    where = _rank_of(program)
    for group in groups:
        text = "+".join(map(str, group))
        missing = [i for i in group if i not in where]
        if len(group) < 2 or missing or len({where[i] for i in group}) > 1:
            why = (f"{missing[0]} is not an instruction of the program" if missing else
                   "a group joins 2 or more instructions" if len(group) < 2 else
                   "its instructions are on ranks " + " and ".join(str(where[i]) for i in group))
            raise ProgramFormatError(f"{OVERLAP_PAIRS}: {text}: {why}; each group joins instructions of one rank "
                                     f"with '+', e.g. F0.5+B3.1")
    program.meta[OVERLAP_PAIRS] = tuple(groups)
    return program


def _flag(text: str) -> bool:
    """``true`` or ``false`` (a header value). Raises ``ValueError`` for anything else."""
    if text not in ("true", "false"):
        raise ValueError(f"forward_only must be true or false, got {text!r}")
    return text == "true"


def to_json_dict(program: Program) -> dict:
    """The JSON form as a dict (see the module docstring)."""
    data = {
        "schedule": program.schedule,
        "num_microbatches": program.num_microbatches,
        "stage_to_rank": list(program.stage_to_rank),
        "dp_size": program.dp_size,
        "ranks": [
            [_instr_dict(i) for i in stream] for stream in program.ranks
        ],
    }
    if program.forward_only:
        data["forward_only"] = True
    if program.ties:
        data["ties"] = [list(tie) for tie in program.ties]
    groups = overlap_groups(program)
    if groups:
        data[OVERLAP_PAIRS] = [[_instr_dict(i) for i in group] for group in groups]
    return data


def _instr_dict(i: Instr) -> dict:
    return {"op": i.op.value, "stage": i.stage, "microbatch": i.microbatch, "peer": i.peer}


def _instr_of(d: dict) -> Instr:
    return Instr(d["op"], d["stage"], d.get("microbatch"), d.get("peer"))


def from_json_dict(data: dict) -> Program:
    """Build a Program from the JSON form. Raises ``ProgramFormatError`` naming the missing or bad field."""
    for key in ("ranks", "num_microbatches", "stage_to_rank"):
        if key not in data:
            raise ProgramFormatError(f"JSON program lacks the key {key!r} (needs ranks, num_microbatches, stage_to_rank)")
    try:
        ranks = tuple(tuple(_instr_of(d) for d in stream) for stream in data["ranks"])
        groups = tuple(tuple(_instr_of(d) for d in group) for group in data.get(OVERLAP_PAIRS, ()))
        program = Program(
            ranks=ranks,
            stage_to_rank=tuple(int(r) for r in data["stage_to_rank"]),
            num_microbatches=int(data["num_microbatches"]),
            dp_size=int(data.get("dp_size", 1)),
            schedule=str(data.get("schedule", "custom")),
            forward_only=_json_flag(data.get("forward_only", False)),
            ties=tuple(tuple(int(s) for s in tie) for tie in data.get("ties", ())),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ProgramFormatError(f"bad instruction or field in JSON program: {exc!r}") from None
    return _with_groups(program, groups)


def _json_flag(value) -> bool:
    """The JSON ``forward_only`` value. Raises ``TypeError`` unless it is a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"forward_only must be true or false, got {value!r}")
    return value


def to_json(program: Program, indent: int | None = None) -> str:
    return json.dumps(to_json_dict(program), indent=indent)


def loads(text: str) -> Program:
    """Parse either form: JSON when the text starts with ``{``, the text form otherwise."""
    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProgramFormatError(f"invalid JSON: {exc}") from None
        return from_json_dict(data)
    return from_text(text)


def load(path) -> Program:
    """Read a program file in either form."""
    with open(path, encoding="utf-8") as handle:
        return loads(handle.read())
