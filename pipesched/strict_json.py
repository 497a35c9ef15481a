"""Reading JSON a user writes: :func:`loads` is ``json.loads`` that refuses a key given twice in one object.

``json.loads`` keeps the last value of a repeated key and drops the others without a word: a second
``"overlap_pairs": []`` in a hand-edited program would drop every pair, ``{"op": "B", "op": "F"}`` would read as
an ``F``. The program reader (:mod:`pipesched.program_io`), :meth:`pipesched.timeline.Timeline.load` and
:meth:`pipesched.profile.LayerProfile.load` read through :func:`loads`, and each turns a
:class:`DuplicateKeyError` into its own error, naming the key and where it is.
"""
from __future__ import annotations

import difflib
import json
import re
import sys
from collections import Counter

from .checks import described, short


class DuplicateKeyError(ValueError):
    """A JSON object gives one key more than once.

    Attributes:
        key: the repeated key.
        times: how many times the object gives it.
        path: where the object is: ``()`` for the top level, else its keys and list indices from the top
            (``("ranks", 0, 3)``).
        where: ``path`` in words: ``"at the top level"`` or ``"in ranks[0][3]"``.
    """

    def __init__(self, key: str, times: int, path: tuple) -> None:
        self.key, self.times, self.path = key, times, tuple(path)
        self.where = "at the top level" if not self.path else f"in {format_path(self.path)}"
        super().__init__(f"duplicate key {json.dumps(key)} {self.where} (given {_times(times)}: only the last "
                         f"would be kept); give each key once")


def _times(n: int) -> str:
    return "twice" if n == 2 else f"{n} times"


def format_path(path) -> str:
    """``("ranks", 0, 3, "op")`` as ``ranks[0][3].op`` (a key that is not a Python name as ``["a b"]``)."""
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
        elif part.isidentifier():
            text += f".{part}" if text else part
        else:
            text += f"[{json.dumps(part)}]"
    return text


class _Repeated(dict):
    """An object that gave some keys more than once (the last value kept, as ``json.loads`` keeps it); ``repeated``:
    those keys and how many times each, in the order of their first appearance."""

    __slots__ = ("repeated",)


def loads(text: str):
    """``json.loads(text)``, except that an object giving a key more than once raises :class:`DuplicateKeyError`
    naming the key and where the object is (the first such object in document order, an object before those it
    holds: a repeated key there may have dropped a value holding another repeat), and that a leading UTF-8 byte
    order mark (``"\\ufeff"``, which some editors write) is skipped, where ``json.loads`` refuses it.

    Raises:
        json.JSONDecodeError: ``text`` is not JSON, or nests arrays or objects deeper than Python's recursion limit.
        DuplicateKeyError: a key given twice in one object.
    """
    seen = []  # set when an object repeats a key: then (and only then) the document is searched for where

    def pairs_hook(pairs):
        data = dict(pairs)
        if len(data) == len(pairs):
            return data
        repeated = _Repeated(pairs)
        repeated.repeated = {k: n for k, n in Counter(k for k, _ in pairs).items() if n > 1}
        seen.append(repeated)
        return repeated

    text = text.removeprefix("\ufeff")  # a byte order mark: skipped
    try:
        data = json.loads(text, object_pairs_hook=pairs_hook)
    except RecursionError:  # arrays or objects nested thousands deep: the decoder recurses once per level
        raise json.JSONDecodeError("nested deeper than this reader allows (Python's recursion limit)", text,
                                   0) from None
    except json.JSONDecodeError:
        raise
    except ValueError:  # int(): an integer longer than Python converts (sys.get_int_max_str_digits()), no position
        found = _long_integer(text)
        if found is None:
            raise
        raise json.JSONDecodeError(f"an integer of {found[1]} digits, more than Python reads (at most "
                                   f"{sys.get_int_max_str_digits()} digits)", text, found[0]) from None
    if seen:
        # one is in the document: a repeating object not in it was dropped by a repeated key of the object holding it
        obj, path = _first_repeat(data, ())
        key, times = next(iter(obj.repeated.items()))
        raise DuplicateKeyError(key, times, path)
    return data


_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|-?[0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?', re.ASCII)


def _long_integer(text: str):
    """``(position, digits)`` of the first JSON integer (outside strings) longer than Python converts, or None."""
    limit = sys.get_int_max_str_digits()
    for match in _TOKEN.finditer(text) if limit else ():
        token = match[0].removeprefix("-")
        if token.isdigit() and len(token) > limit:
            return match.start(), len(token)
    return None


def is_json(text: str) -> bool:
    """Whether ``text`` is a JSON document of any kind (an object, a list, a number, a string, true, false or null),
    a leading byte order mark skipped as :func:`loads` skips it."""
    try:
        json.loads(text.removeprefix("\ufeff"))
    except ValueError:
        return False
    except RecursionError:  # JSON nested too deep to read: JSON all the same (loads says so)
        return True
    return True


def _first_repeat(value, path: tuple):
    """``(object, path)`` of the first object that repeats a key, in document order (an object before what it
    holds); ``None`` if none does."""
    stack = [(value, path)]
    while stack:
        value, path = stack.pop()
        if isinstance(value, _Repeated):
            return value, path
        if isinstance(value, dict):
            stack.extend(reversed([(v, path + (k,)) for k, v in value.items()]))
        elif isinstance(value, list):
            stack.extend(reversed([(v, path + (i,)) for i, v in enumerate(value)]))
    return None


def load_file(path, writer: str):
    """:func:`loads` of the UTF-8 file at ``path``; a file that is not JSON raises a ``json.JSONDecodeError``
    saying so with the file and what writes such files (``writer``, e.g. ``"Timeline.save"``):
    ``t.txt is not JSON (Expecting value); expected a file written by Timeline.save: line 1 column 1 (char 0)``
    (its ``lineno``/``colno`` kept); so does a file that is not UTF-8 text (a picture given by mistake).
    OSError: the file cannot be read. DuplicateKeyError: as :func:`loads` (the caller names the file)."""
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except UnicodeDecodeError as exc:  # a picture or other binary file given by mistake
        raise json.JSONDecodeError(f"{path}: {not_text(exc)}; expected a file written by {writer}", "", 0) from None
    try:
        return loads(text)
    except json.JSONDecodeError as exc:
        raise json.JSONDecodeError(f"{path} is not JSON ({exc.msg}); expected a file written by {writer}",
                                   exc.doc, exc.pos) from None


def not_text(exc: UnicodeDecodeError) -> str:
    """What a file that fails to decode is, for a message naming it (``not UTF-8 text: byte 0x8a at offset 0``)."""
    return f"not UTF-8 text: byte {exc.object[exc.start]:#04x} at offset {exc.start}"


def unknown_keys_message(data: dict, valid, whose: str) -> str | None:
    """Why ``data`` (a JSON object) is refused for keys not in ``valid``, or None if it has none: the unknown keys,
    the closest valid key to the first (a typo such as ``num_rank``) and ``whose`` keys are valid:
    ``unknown key 'num_rank' (did you mean 'num_ranks'?); a saved Timeline's keys are events, num_ranks, ...``."""
    unknown = [key for key in data if key not in valid]
    if not unknown:
        return None
    close = difflib.get_close_matches(unknown[0], valid, n=1) if isinstance(unknown[0], str) else []
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(short(key) for key in unknown)}{hint}; "
            f"{whose} keys are {', '.join(valid)}")


def check_json_object(data, valid, whose: str, where: str, form: str) -> None:
    """Refuse ``data`` unless it is a JSON object (a dict) whose keys are all in ``valid``.

    Raises:
        ValueError: ``where`` + ``form`` + what ``data`` is, for a non-object (``form``: what it must be, e.g. ``"a
            cost model is a JSON object (as CostModel.to_json_dict writes)"``); ``where`` +
            :func:`unknown_keys_message` for a key not in ``valid``.
    """
    if not isinstance(data, dict):
        raise ValueError(f"{where}{form}, got {described(data)}")
    unknown = unknown_keys_message(data, valid, whose)
    if unknown:
        raise ValueError(where + unknown)
