"""Argument checks shared by the schedule builders, the compiler and the runtime; errors name the argument."""
from __future__ import annotations

import numbers

from .errors import ScheduleArgumentError


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
