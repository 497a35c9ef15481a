"""Argument checks shared by the schedule builders, the compiler and the runtime; errors name the argument."""
from __future__ import annotations

import numbers
import os
import reprlib

from .errors import ScheduleArgumentError

_SHORT = reprlib.Repr()  # short reprs for messages (Python 3.11's Repr takes no arguments)
_SHORT.maxstring = _SHORT.maxother = 60
_SHORT.maxlong = 40


def as_int(value) -> int | None:
    """``value`` as a plain ``int`` if it is an integer that is not a bool (an ``int``, a numpy integer, any
    ``numbers.Integral``), else ``None``: so that a numpy integer never reaches a program, JSON or torch."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def is_real(value) -> bool:
    """A real number: an int or float, numpy's too (``np.int64``, ``np.float32``: any ``numbers.Real``), but not a
    bool (numpy's ``bool_`` is no ``numbers.Real``)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def plain_number(value):
    """A real number (:func:`is_real`) as a plain ``int`` (an integer) or ``float``: so that no numpy number reaches
    a timeline, JSON or torch."""
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def check_positive(name: str, value, minimum: int = 1, where: str = "") -> int:
    """``value`` as a plain ``int`` if it is an integer (not a bool; numpy integers and any ``numbers.Integral``
    are) >= ``minimum``. Callers use the returned value, not ``value``.

    Raises:
        ScheduleArgumentError: anything else; the message (after ``where``) names ``name``, the value and what is
            valid, and ``argument`` is ``name``.
    """
    number = as_int(value)
    if number is None or number < minimum:
        kind = " (a bool is not a count)" if isinstance(value, bool) else ""
        raise ScheduleArgumentError(f"{where}{name} must be an integer >= {minimum}, got {value!r}{kind}",
                                    argument=name)
    return number


def described(value) -> str:
    """``value`` for a message: its type and a short repr (``int 3``, ``str '1f1b'``, ``dict {'forward': 1}``)."""
    return f"{type(value).__name__} {short(value)}"


#: The most ``num_ranks x num_microbatches x virtual_stages`` (``p * m * v``: one per stage and microbatch) a
#: program may have; :func:`check_program_size` refuses more before anything is built. A compiled program holds
#: about 6 instructions per stage and microbatch (F, B, a SEND/RECV pair each way): measured on one CPU core,
#: ``interleaved-1f1b`` at p=64, m=1024, v=4 (262,144, the largest configuration pipesched is meant for) compiles
#: to 1,568,768 instructions in ~10 s and ~450 MB; at this limit (twice that, p=128: 3,141,632 instructions)
#: ~29 s and ~0.8 GB (the CLI shows progress on a terminal meanwhile). Beyond it compile time and memory grow in proportion (m=10**30 would never finish).
MAX_PROGRAM_SIZE = 2 ** 19
#: The most timed (``repeat``) or untimed (``warmup``) runs per measurement :func:`~pipesched.runtime.profile_layers`
#: takes: far past any use (the median of 5 is the default), well short of never finishing.
MAX_RUNS = 10_000


def short(value) -> str:
    """A short repr of ``value`` for a message (an int past Python's digit limit is shown by its size)."""
    try:
        return _SHORT.repr(value)
    except Exception:  # noqa: BLE001 - an int past Python's digit limit, a repr that raises
        bits = value.bit_length() if isinstance(value, int) else None
        return f"(an int of {bits} bits)" if bits is not None else "(no repr)"


def check_program_size(num_ranks: int, num_microbatches: int, virtual_stages: int = 1, where: str = "",
                       names=("num_ranks", "num_microbatches", "virtual_stages")) -> None:
    """Refuse a program too big to build in reasonable time and memory: ``num_ranks * num_microbatches *
    virtual_stages`` (ints >= 1) above :data:`MAX_PROGRAM_SIZE`. Called before anything is built or read.

    Raises:
        ScheduleArgumentError: naming the arguments, their values, their product and the limit;
            ``argument`` is the largest one's name.
    """
    sizes = (num_ranks, num_microbatches, virtual_stages)
    if num_ranks * num_microbatches * virtual_stages <= MAX_PROGRAM_SIZE:
        return
    shown = " x ".join(f"{name}={short(value)}" for name, value in zip(names, sizes))
    largest = names[max(range(3), key=lambda i: sizes[i])]
    raise ScheduleArgumentError(
        f"{where}{shown} is too big a program: {' x '.join(names)} must be at most {MAX_PROGRAM_SIZE:,} (one per "
        f"stage and microbatch, ~6 instructions each; e.g. p=64, m=1024, v=4 is 262,144 and compiles in ~10 s); "
        f"use fewer microbatches or ranks", argument=largest)


def check_path(value, name: str = "path", where: str = ""):
    """``value`` if it names a file: a ``str``, ``bytes`` or ``os.PathLike``. Callers check before ``open``.

    Raises:
        TypeError: anything else, naming ``name``, the value and what is valid; notably an int, which ``open`` takes
            as a file descriptor: it would read the caller's descriptor and then close it.
    """
    if isinstance(value, (str, bytes, os.PathLike)):
        return value
    raise TypeError(f"{where}{name} must be a str or os.PathLike, got {described(value)}")


def check_flag(value, name: str, where: str = "", none: str = ""):
    """``value`` if it is ``True`` or ``False`` (or ``None`` when ``none`` says what ``None`` means): a flag, where
    a truthy ``"no"``, ``1`` or ``nan`` must not pass for ``True``.

    Raises:
        TypeError: anything else, naming ``name``, the value and what is valid.
    """
    if isinstance(value, bool) or (none and value is None):
        return value
    valid = f"True, False or None ({none})" if none else "True or False"
    raise TypeError(f"{where}{name} must be {valid}, got {described(value)}")


def check_program(value, name: str = "program", where: str = ""):
    """``value`` if it is a :class:`~pipesched.ir.Program`.

    Raises:
        TypeError: anything else, naming ``name``, the value and what is valid (for a string: how to compile a
            schedule name into a program).
    """
    from .ir import Program  # ir is the base of every module; imported here, not at the top

    if isinstance(value, Program):
        return value
    hint = (f" (a schedule name? compile it first: pipesched.compile_program({value!r}, num_ranks, "
            f"num_microbatches))" if isinstance(value, str) else "")
    raise TypeError(f"{where}{name} must be a pipesched.Program, got {described(value)}{hint}")


def check_cost(value, name: str = "cost", where: str = ""):
    """``value`` if it is a :class:`~pipesched.cost.CostModel` or ``None`` (the default costs).

    Raises:
        TypeError: anything else, naming ``name``, the value and what is valid.
    """
    from .cost import CostModel

    if value is None or isinstance(value, CostModel):
        return value
    hint = " (make one: pipesched.CostModel(**costs))" if isinstance(value, dict) else ""
    raise TypeError(f"{where}{name} must be a pipesched.CostModel or None (the default costs), got "
                    f"{described(value)}{hint}")


def check_timeline(value, name: str = "timeline", where: str = ""):
    """``value`` if it is a :class:`~pipesched.timeline.Timeline`: what the drawing and export functions check first
    (``None`` would fail deep inside them with an AttributeError).

    Raises:
        TypeError: anything else, naming ``name``, the value and what is valid.
    """
    from .timeline import Timeline  # as check_program: imported here, not at the top

    if isinstance(value, Timeline):
        return value
    raise TypeError(f"{where}{name} must be a pipesched.Timeline, got {described(value)}")


def check_callable(value, name: str, where: str = "", none: str = ""):
    """``value`` if it is callable (or ``None`` when ``none`` says what ``None`` means).

    Raises:
        TypeError: anything else, naming ``name``, the value and what is valid.
    """
    if callable(value) or (none and value is None):
        return value
    valid = f"callable or None ({none})" if none else "callable"
    raise TypeError(f"{where}{name} must be {valid}, got {described(value)}")
