"""Attributes a user may set on a built object, and a clear error for any other: ``pipe.anticipate_clips = True``
(a typo), ``pipe.num_microbatches = 8`` or ``pipe.autocast = torch.bfloat16`` (fixed at construction) would
otherwise be accepted and ignored."""
from __future__ import annotations


class Sealed:
    """Once :meth:`_seal` has run, setting a public attribute other than the :attr:`_SETTABLE` ones raises
    ``AttributeError``: one set at construction (fixed: the object already acted on it) and, where sealed
    ``strict``, a name it does not have (a typo). Properties with a setter, methods and private names (``_x``) are
    set as usual; the object's own code updates fixed ones through :func:`update`. A subclass is sealed not
    strict, so it may keep its own state on the object."""

    _SETTABLE: tuple[str, ...] = ()  #: the public attributes a user may set, named by the error

    def _seal(self, strict: bool) -> None:
        """From now on the public attributes set so far (but :attr:`_SETTABLE`) are fixed, and, ``strict``, no new
        public name may be set."""
        object.__setattr__(self, "_fixed", frozenset(n for n in self.__dict__ if not n.startswith("_")))
        object.__setattr__(self, "_sealed", "strict" if strict else "fixed")

    def __setattr__(self, name: str, value) -> None:
        sealed = self.__dict__.get("_sealed")
        if sealed and not name.startswith("_") and name not in self._SETTABLE:
            kind = type(self).__name__
            if name in self._fixed:
                raise AttributeError(f"{kind}.{name} is fixed at construction (the {kind} was built with it): build "
                                     f"a new {kind} to change it; the settable attributes are "
                                     f"{', '.join(self._SETTABLE)}")
            if sealed == "strict" and not hasattr(type(self), name):
                raise AttributeError(f"{kind} has no attribute {name!r} to set; the settable ones are "
                                     f"{', '.join(self._SETTABLE)} (the rest is fixed at construction: build a new "
                                     f"{kind} to change it; to keep your own data on it, subclass {kind})")
        object.__setattr__(self, name, value)


def update(obj, **values) -> None:
    """Set attributes of a sealed object from its own code (e.g. the program a measured ``zb-auto`` step
    compiled), past the seal."""
    for name, value in values.items():
        object.__setattr__(obj, name, value)
