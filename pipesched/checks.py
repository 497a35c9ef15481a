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
