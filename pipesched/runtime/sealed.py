"""Attributes a user may set on a built object, and a clear error for any other: ``pipe.anticipate_clips = True``
(a typo) or ``pipe.num_microbatches = 8`` (fixed at construction) would otherwise be accepted and ignored."""
from __future__ import annotations


class Sealed:
    """Once :meth:`_seal` has run, setting a public attribute the object does not have raises ``AttributeError``
    naming it and the :attr:`_SETTABLE` ones. Attributes it has (set during construction), properties with a
    setter, methods and private names (``_x``) are set as usual."""

    _SETTABLE: tuple[str, ...] = ()  #: the public attributes a user may set, named by the error

    def _seal(self) -> None:
        object.__setattr__(self, "_sealed", True)

    def __setattr__(self, name: str, value) -> None:
        if (self.__dict__.get("_sealed") and not name.startswith("_") and name not in self.__dict__
                and not hasattr(type(self), name)):
            raise AttributeError(
                f"{type(self).__name__} has no attribute {name!r} to set; the settable ones are "
                f"{', '.join(self._SETTABLE)} (the rest is fixed at construction: build a new "
                f"{type(self).__name__} to change it)")
        object.__setattr__(self, name, value)
