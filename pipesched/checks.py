"""Argument checks shared by the schedule builders, the compiler and the runtime; errors name the argument."""
from __future__ import annotations

from .errors import ScheduleArgumentError


def check_positive(name: str, value, minimum: int = 1) -> int:
    """``value`` if it is an integer (not a bool) >= ``minimum``.

    Raises:
        ScheduleArgumentError: anything else; the message names ``name``, the value and what is valid, and
            ``argument`` is ``name``.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ScheduleArgumentError(f"{name} must be an integer >= {minimum}, got {value!r}", argument=name)
    return value
