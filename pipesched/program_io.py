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

The text form is written and read in :mod:`pipesched.program_text`, the JSON form in :mod:`pipesched.program_json`,
the overlapped pairs both carry in :mod:`pipesched.program_pairs`; this module re-exports their functions and reads
either form (:func:`loads`, :func:`load`).
"""
from __future__ import annotations

import hashlib
import json
import os

from . import strict_json
from .checks import check_path, described
from .errors import ProgramFormatError
from .ir import Program
from .program_json import from_json_dict, to_json, to_json_dict
from .program_pairs import overlap_groups
from .program_text import from_text, to_text

__all__ = ["to_text", "from_text", "to_json_dict", "from_json_dict", "to_json", "overlap_groups", "fingerprint",
           "loads", "load"]


def fingerprint(program: Program) -> int:
    """A 56-bit integer that differs, with overwhelming probability, between two programs whose text forms
    differ (schedule, sizes, placement, every instruction); equal programs give equal fingerprints in every
    process (unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(to_text(program).encode(), digest_size=7).digest(), "big")


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
