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
and the JSON key ``"ties": [[0, 3], [1, 2]]``; both are left out when it has none.
"""
from __future__ import annotations

import hashlib
import json
import re

from .errors import ProgramFormatError
from .ir import Instr, Program

_HEADER_KEYS = ("schedule", "microbatches", "stage_to_rank", "dp_size", "forward_only", "ties")
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
                raise ValueError(f"expected a header ({', '.join(_HEADER_KEYS)}) or 'rank N:', got {line!r}")
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
        return Program(
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
            [{"op": i.op.value, "stage": i.stage, "microbatch": i.microbatch, "peer": i.peer} for i in stream]
            for stream in program.ranks
        ],
    }
    if program.forward_only:
        data["forward_only"] = True
    if program.ties:
        data["ties"] = [list(tie) for tie in program.ties]
    return data


def from_json_dict(data: dict) -> Program:
    """Build a Program from the JSON form. Raises ``ProgramFormatError`` naming the missing or bad field."""
    for key in ("ranks", "num_microbatches", "stage_to_rank"):
        if key not in data:
            raise ProgramFormatError(f"JSON program lacks the key {key!r} (needs ranks, num_microbatches, stage_to_rank)")
    try:
        ranks = tuple(
            tuple(Instr(d["op"], d["stage"], d.get("microbatch"), d.get("peer")) for d in stream)
            for stream in data["ranks"]
        )
        return Program(
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
