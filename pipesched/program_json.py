"""The JSON form of a Program (described in :mod:`pipesched.program_io`): :func:`to_json_dict` and :func:`to_json`
write it, :func:`from_json_dict` builds a Program from it strictly (each error names the field, its value and what
is valid).
"""
from __future__ import annotations

import json

from .checks import as_int, check_program, described, short
from .errors import ProgramFormatError
from .ir import OVERLAP_PAIRS, Instr, Op, Program
from .program_pairs import overlap_groups, with_groups

#: the keys of the JSON form: the program's (top level) and an instruction's; any other is refused
_JSON_KEYS = ("schedule", "num_microbatches", "stage_to_rank", "dp_size", "ranks", "forward_only", "ties",
              OVERLAP_PAIRS)
_INSTR_KEYS = ("op", "stage", "microbatch", "peer")
_REQUIRED_KEYS = ("ranks", "num_microbatches", "stage_to_rank")


def to_json_dict(program: Program) -> dict:
    """The JSON form as a dict (see :mod:`pipesched.program_io`). Raises ``TypeError``: ``program`` is not a Program."""
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
    return with_groups(program, groups)


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


#: the widest ``indent`` :func:`to_json` takes (spaces per level; a wider one only makes a huge file)
MAX_INDENT = 64


def to_json(program: Program, indent: int | None = None) -> str:
    """``program`` as JSON text; ``indent``: ``None`` (one line) or spaces per level, an int 0..:data:`MAX_INDENT`.

    Raises:
        TypeError: ``indent`` not None or an int (a bool, a float, a str). ValueError: an int outside 0..MAX_INDENT.
    """
    if indent is not None:
        number = as_int(indent)
        if number is None:
            raise TypeError(f"to_json: indent must be None (one line) or an int 0..{MAX_INDENT} (spaces per level), "
                            f"got {described(indent)}")
        if not 0 <= number <= MAX_INDENT:
            raise ValueError(f"to_json: indent must be None (one line) or an int 0..{MAX_INDENT} (spaces per level), "
                             f"got {short(number)}")
        indent = number
    return json.dumps(to_json_dict(program), indent=indent)
