"""A collective call whose arguments do not fit its signature (a misspelled keyword, one argument too many) on one
rank only. Python raises that ``TypeError`` before the method's body runs, so the rank never meets the others: a
rank that catches it and goes on (a loop that skips a bad batch) would run its next call against the others'
current one -- its ``step()`` on batch k+1 with theirs on batch k, every rank learning from mismatched data without
an error. :func:`refused_on_misfit` binds the arguments first and hands a misfit to the call's own refusal path,
which carries it to every rank in the call's first collective row, as the call's other own checks are
(:func:`~pipesched.runtime.refusals.judge_own_checks`, :mod:`~pipesched.runtime.call_args`,
:func:`~pipesched.runtime.clipping.refuse`): every rank raises it and the ranks stay in step."""
from __future__ import annotations

import functools
import inspect


def misfit_error(method, signature: inspect.Signature, args: tuple, kwargs: dict) -> TypeError | None:
    """The ``TypeError`` Python would raise for ``method(*args, **kwargs)`` (``args`` with ``self`` first), in
    :meth:`inspect.Signature.bind`'s words, with the class of ``self`` (``Pipeline.step() got an unexpected keyword
    argument 'targets'``, also for a method a mixin defines); ``None`` where the arguments fit."""
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        if "." not in method.__qualname__:  # a function: its own name
            return TypeError(f"{method.__name__}() {exc}")
        owner = type(args[0]).__name__ if args else method.__qualname__.rpartition(".")[0]
        return TypeError(f"{owner}.{method.__name__}() {exc}")
    return None


def _self(args: tuple, kwargs: dict):
    return args[0] if args else None


def refused_on_misfit(refuse, owner=_self):
    """Decorator of a collective method (or function): a call whose arguments do not fit runs ``refuse(obj,
    error)`` instead (``error``: :func:`misfit_error`'s ``TypeError``; ``obj``: ``owner(args, kwargs)``, by default
    ``self``), which must carry ``error`` to the other ranks the way the call carries its own checks' refusals, and
    raise. ``obj`` ``None`` (not given): ``error`` is raised here. The signature stays the call's (``inspect``,
    ``help``); binding costs a few microseconds per call."""

    def wrap(method):
        signature = inspect.signature(method)

        @functools.wraps(method)
        def call(*args, **kwargs):
            error = misfit_error(method, signature, args, kwargs)
            if error is None:
                return method(*args, **kwargs)
            obj = owner(args, kwargs)
            if obj is not None:
                refuse(obj, error)
            raise error  # refuse() raises; this guards a refusal path that returned

        call.misfit_refusal = (refuse, owner)  # what guard_overrides gives a subclass's override of it
        return call

    return wrap


def guard_overrides(cls) -> None:
    """Guard the methods ``cls`` overrides of a guarded one (its ``__init_subclass__`` calls this): a subclass's
    ``step(self, x, y, tag=None)`` is what Python binds first, so a misfit call of it never reached the guarded
    ``Pipeline.step`` (a rank that caught it ran its next step against the others' current one)."""
    for name, value in list(vars(cls).items()):
        if not inspect.isfunction(value) or hasattr(value, "misfit_refusal"):
            continue
        inherited = next((base.__dict__[name] for base in cls.__mro__[1:] if name in base.__dict__), None)
        guard = getattr(inherited, "misfit_refusal", None)
        if guard is not None:
            setattr(cls, name, refused_on_misfit(*guard)(value))
