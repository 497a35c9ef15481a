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
``schedule`` to ``"custom"``; any other key (top level or in an instruction) is a ``ProgramFormatError`` naming it,
where it is and the valid keys, as an unknown text header line is; so is a key given twice in one object
(``json.loads`` would keep the last value silently: a second ``"overlap_pairs": []`` would drop every pair), and a
JSON document that is not an object (a list holding a program: JSON of the wrong shape). Both readers are strict about types: an integer
field is a JSON integer (not ``true``, ``0.0`` or ``"0"``; a list where a list is meant) or, in the text form,
ASCII digits; in the text form each header line comes once, before the first ``rank N:`` line. Anything else is a
``ProgramFormatError`` naming the field (``ranks[0][3].microbatch``) or line, the value and what is valid. A forward-only program
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
import os
import re
import sys

from . import strict_json
from .checks import as_int, check_path, check_program, described
from .errors import ProgramFormatError
from .ir import OVERLAP_PAIRS, Instr, Op, Program

_HEADER_KEYS = ("schedule", "microbatches", "stage_to_rank", "dp_size", "forward_only", "ties", OVERLAP_PAIRS)
_RANK_LINE = re.compile(r"^rank\s+(\d+)\s*:(.*)$", re.ASCII)
#: the keys of the JSON form: the program's (top level) and an instruction's; any other is refused
_JSON_KEYS = ("schedule", "num_microbatches", "stage_to_rank", "dp_size", "ranks", "forward_only", "ties",
              OVERLAP_PAIRS)
_INSTR_KEYS = ("op", "stage", "microbatch", "peer")
_REQUIRED_KEYS = ("ranks", "num_microbatches", "stage_to_rank")


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


def fingerprint(program: Program) -> int:
    """A 56-bit integer that differs, with overwhelming probability, between two programs whose text forms
    differ (schedule, sizes, placement, every instruction); equal programs give equal fingerprints in every
    process (unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(to_text(program).encode(), digest_size=7).digest(), "big")


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
        ProgramFormatError: a group of other than 2 instructions (a pair: :data:`~pipesched.ir.OVERLAP_PAIRS`), or
            one not all in one rank's stream.
    """
    if not groups:
        return program
    where = _rank_of(program)
    for group in groups:
        text = "+".join(map(str, group))
        missing = [i for i in group if i not in where]
        if len(group) != 2 or missing or len({where[i] for i in group}) > 1:
            why = (f"{missing[0]} is not an instruction of the program" if missing else
                   f"a pair joins exactly 2 instructions, this one {len(group)}" if len(group) != 2 else
                   "its instructions are on ranks " + " and ".join(str(where[i]) for i in group))
            raise ProgramFormatError(f"{OVERLAP_PAIRS}: {text}: {why}; each pair joins two instructions of one rank "
                                     f"with '+', e.g. F0.5+B3.1")
    program.meta[OVERLAP_PAIRS] = tuple(groups)
    return program


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


def to_json_dict(program: Program) -> dict:
    """The JSON form as a dict (see the module docstring). Raises ``TypeError``: ``program`` is not a Program."""
    check_program(program)
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


def _shown(value) -> str:
    """``value`` as JSON writes it (``true``, ``0.0``, ``"01"``), or its repr if it is not JSON data."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _json_int(where: str, value, minimum: int) -> int:
    """A JSON integer field as a plain ``int``: an integer (a numpy one too, from :func:`from_json_dict`'s Python
    callers), not a bool, a float such as ``0.0`` or a string, >= ``minimum``."""
    number = as_int(value)
    if number is None or number < minimum:
        raise ProgramFormatError(f"JSON program: {where} must be an integer >= {minimum}, got {_shown(value)}")
    return number


def _json_list(where: str, value, of: str) -> list:
    if not isinstance(value, (list, tuple)):
        raise ProgramFormatError(f"JSON program: {where} must be a list of {of}, got {_shown(value)}")
    return value


def _instr_of(where: str, d) -> Instr:
    """An instruction object ``{"op": "F", "stage": 0, "microbatch": 0, "peer": null}`` (``microbatch`` and ``peer``
    may be left out where null)."""
    if not isinstance(d, dict) or "op" not in d or "stage" not in d:
        raise ProgramFormatError(f"JSON program: {where} must be an instruction object with at least \"op\" and "
                                 f"\"stage\", e.g. {{\"op\": \"F\", \"stage\": 0, \"microbatch\": 0, \"peer\": null}}, "
                                 f"got {_shown(d)}")
    _refuse_unknown_keys(d, _INSTR_KEYS, f"in {where}", "an instruction's")
    op = d["op"]
    if not isinstance(op, str) or op not in Op.__members__:
        raise ProgramFormatError(f"JSON program: {where}.op must be one of {', '.join(Op.__members__)}, "
                                 f"got {_shown(op)}")
    fields = [_json_int(f"{where}.stage", d["stage"], 0)]
    for name in ("microbatch", "peer"):
        value = d.get(name)
        fields.append(None if value is None else _json_int(f"{where}.{name}", value, 0))
    try:
        return Instr(op, *fields)
    except ValueError as exc:
        raise ProgramFormatError(f"JSON program: {where} {_shown(d)}: {exc}") from None


def _refuse_unknown_keys(data: dict, valid: tuple[str, ...], where: str, whose: str) -> None:
    """Raise ``ProgramFormatError`` naming the keys of ``data`` not in ``valid`` (a typo such as ``overlap_pair`` would
    otherwise be dropped silently), ``where`` they are, the closest valid key and the valid keys."""
    unknown = [key for key in data if key not in valid]
    if not unknown:
        return
    import difflib

    named = ", ".join(_shown(key) for key in unknown)
    close = difflib.get_close_matches(unknown[0], valid, n=1) if isinstance(unknown[0], str) else []
    hint = f" (did you mean {_shown(close[0])}?)" if close else ""
    raise ProgramFormatError(f"JSON program: unknown key{'s' if len(unknown) > 1 else ''} {named} {where}{hint}; "
                             f"{whose} keys are {', '.join(valid)}")


def from_json_dict(data: dict) -> Program:
    """Build a Program from the JSON form. Raises ``ProgramFormatError`` naming the missing or bad field, its
    value and what is valid: integers must be JSON integers (not ``true``, ``1.0`` or ``"1"``)."""
    if not isinstance(data, dict):
        raise ProgramFormatError(_not_an_object(data))
    _refuse_unknown_keys(data, _JSON_KEYS, "at the top level", "a program's")  # first: a typo explains a missing key
    for key in ("ranks", "num_microbatches", "stage_to_rank"):
        if key not in data:
            raise ProgramFormatError(f"JSON program lacks the key {key!r} (needs ranks, num_microbatches, stage_to_rank)")
    ranks = tuple(tuple(_instr_of(f"ranks[{r}][{k}]", d)
                        for k, d in enumerate(_json_list(f"ranks[{r}]", stream, "instruction objects")))
                  for r, stream in enumerate(_json_list("ranks", data["ranks"], "lists (one per rank)")))
    groups = tuple(tuple(_instr_of(f"{OVERLAP_PAIRS}[{g}][{k}]", d)
                         for k, d in enumerate(_json_list(f"{OVERLAP_PAIRS}[{g}]", group, "instruction objects")))
                   for g, group in enumerate(_json_list(OVERLAP_PAIRS, data.get(OVERLAP_PAIRS, []),
                                                        "groups (lists of instruction objects)")))
    schedule = data.get("schedule", "custom")
    if not isinstance(schedule, str):
        raise ProgramFormatError(f"JSON program: schedule must be a string, got {_shown(schedule)}")
    try:
        forward_only = _json_flag(data.get("forward_only", False))
    except TypeError as exc:
        raise ProgramFormatError(f"JSON program: {exc}") from None
    program = Program(
        ranks=ranks,
        stage_to_rank=tuple(_json_int(f"stage_to_rank[{s}]", r, 0) for s, r in enumerate(
            _json_list("stage_to_rank", data["stage_to_rank"], "rank numbers (one per stage)"))),
        num_microbatches=_json_int("num_microbatches", data["num_microbatches"], 1),
        dp_size=_json_int("dp_size", data.get("dp_size", 1), 1),
        schedule=schedule,
        forward_only=forward_only,
        ties=tuple(tuple(_json_int(f"ties[{t}][{k}]", s, 0) for k, s in enumerate(
            _json_list(f"ties[{t}]", tie, "stage numbers"))) for t, tie in enumerate(
            _json_list("ties", data.get("ties", []), "ties (lists of stage numbers)"))),
    )
    return _with_groups(program, groups)


def _not_an_object(data) -> str:
    """Why ``data`` (JSON's top level) is no program: a program is one JSON object."""
    if isinstance(data, (list, tuple)):
        kind = f"a list of {len(data)} item{'s' if len(data) != 1 else ''}" if data else "an empty list"
        if any(isinstance(d, dict) for d in data):
            kind += " (a list holding a program? write the program's object itself, one program per file)"
    else:
        kind = {str: "a string", bool: "true or false", type(None): "null"}.get(
            type(data), "a number" if isinstance(data, (int, float)) else f"a {type(data).__name__}")
    optional = ", ".join(k for k in _JSON_KEYS if k not in _REQUIRED_KEYS)
    return (f"JSON program of the wrong shape: the JSON is {kind}; a program is a JSON object with the keys "
            f"{', '.join(_REQUIRED_KEYS)} (and optionally {optional}), e.g. "
            f'{{"num_microbatches": 2, "stage_to_rank": [0, 1], "ranks": [[...], [...]]}}')


def _json_flag(value) -> bool:
    """The JSON ``forward_only`` value. Raises ``TypeError`` unless it is a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"forward_only must be true or false, got {value!r}")
    return value


def to_json(program: Program, indent: int | None = None) -> str:
    return json.dumps(to_json_dict(program), indent=indent)


def loads(text: str) -> Program:
    """Parse either form: JSON when the text starts with ``{`` or ``[`` or is JSON all the same (a bare number, string,
    true, false or null; JSON but an object is refused as JSON of the wrong shape), the text form otherwise; a leading
    byte order mark is skipped. A JSON object giving a key twice is refused (``json.loads`` keeps the last silently).

    Raises:
        TypeError: ``text`` is not a ``str`` (a file's name or bytes: :func:`load` reads a file).
        ProgramFormatError: not a program in either form (names the line, field or value)."""
    if not isinstance(text, str):
        hint = " (to read a file, use pipesched.load(path))" if isinstance(text, (bytes, os.PathLike)) else ""
        raise TypeError(f"text must be a str (a program's text or JSON form), got {described(text)}{hint}")
    text = text.removeprefix("\ufeff")  # a UTF-8 byte order mark (some editors write one): no part of either form
    if text.lstrip()[:1] not in ("{", "[") and not strict_json.is_json(text):
        return from_text(text)
    try:
        data = strict_json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProgramFormatError(f"invalid JSON: {exc}") from None
    except strict_json.DuplicateKeyError as exc:
        raise ProgramFormatError(f"JSON program: {exc}") from None
    return from_json_dict(data)


def load(path) -> Program:
    """Read a program file in either form.

    Raises:
        TypeError: ``path`` is not a ``str`` or ``os.PathLike`` (an int would be taken as a file descriptor, read
            and closed). OSError: the file cannot be read. ProgramFormatError: as :func:`loads`."""
    check_path(path)
    with open(path, encoding="utf-8") as handle:
        return loads(handle.read())
