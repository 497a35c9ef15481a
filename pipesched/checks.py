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


def check_positive(name: str, value, minimum: int = 1) -> int:
    """``value`` as a plain ``int`` if it is an integer (not a bool; numpy integers and any ``numbers.Integral``
    are) >= ``minimum``. Callers use the returned value, not ``value``.

    Raises:
        ScheduleArgumentError: anything else; the message names ``name``, the value and what is valid, and
            ``argument`` is ``name``.
    """
    number = as_int(value)
    if number is None or number < minimum:
        kind = " (a bool is not a count)" if isinstance(value, bool) else ""
        raise ScheduleArgumentError(f"{name} must be an integer >= {minimum}, got {value!r}{kind}", argument=name)
    return number


def described(value) -> str:
    """``value`` for a message: its type and a short repr (``int 3``, ``str '1f1b'``, ``dict {'forward': 1}``)."""
    try:
        shown = _SHORT.repr(value)
    except Exception:  # noqa: BLE001 - an int past Python's digit limit, a repr that raises: the type alone
        shown = "(no repr)"
    return f"{type(value).__name__} {shown}"


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
