"""User schedules: named schedule builders registered next to the built-in ones.

The built-ins (:data:`pipesched.schedules.SCHEDULES`) are an immutable mapping. A schedule of your own lives in a
:class:`Registry`: an explicit object that holds what was registered into it. :data:`REGISTRY` is the one
instance every name lookup of the package consults (:func:`pipesched.get_schedule`, so ``compile_program``,
``Pipeline(schedule=NAME)`` and the command line): registration is **per process**, like ``codecs.register``;
a builder is code, so each process that uses the name (every rank of a job, the command line) registers it, by
importing the module that registers it (``--schedule-module MODULE`` on the command line) or through the
``pipesched.schedules`` entry point group, which is read lazily when a name is not found::

    # pyproject.toml of your package
    [project.entry-points."pipesched.schedules"]
    my-1f1b = "mypkg.schedules:build_my_1f1b"    # a builder: registered under the entry point's name

A builder is ``builder(num_ranks, num_microbatches, virtual_stages) -> Program``, the compute-only program (F and
B, or I and W, and R if it recomputes; no SEND/RECV: :func:`pipesched.compile_program` lowers and proves it).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import os
import re
import sys
import warnings
from pathlib import Path
from types import MappingProxyType
from typing import Callable, Mapping

from .checks import check_positive
from .engine import has_comm
from .errors import BuilderError, BuilderResultError, ScheduleArgumentError, ScheduleError, UnknownScheduleError
from .ir import Program
from .schedules import SCHEDULES, ScheduleInfo

#: the entry point group whose entries name schedules (``name = "module:builder"``)
ENTRY_POINT_GROUP = "pipesched.schedules"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


def build_checked(name: str, builder: Callable, num_ranks, num_microbatches, virtual_stages) -> Program:
    """``builder(num_ranks, num_microbatches, virtual_stages)`` with the sizes checked first and the result checked
    after: what a registered user schedule's :attr:`ScheduleInfo.build` runs.

    Raises:
        ScheduleArgumentError: a size is not a positive integer (names it), or the builder's own.
        BuilderError (a ScheduleError): the builder raised something else (names the schedule, its builder and the
            sizes; the builder's exception is chained).
        BuilderResultError (a TypeError): the builder returned something other than a :class:`~pipesched.ir.Program`.
        ScheduleArgumentError: the program has another number of ranks or microbatches than asked for, or
            already has SEND/RECV (a builder returns the compute-only program).
    """
    p = check_positive("num_ranks", num_ranks)
    m = check_positive("num_microbatches", num_microbatches)
    v = check_positive("virtual_stages", virtual_stages)
    try:
        program = builder(p, m, v)
    except ScheduleError:  # the builder's own ScheduleArgumentError etc. already says what is wrong
        raise
    except Exception as exc:  # noqa: BLE001 - any error of the user's builder, named, the original chained
        raise BuilderError(f"schedule {name!r}: its builder {_qualname(builder)} raised {type(exc).__name__}: "
                           f"{exc} (asked for num_ranks={p}, num_microbatches={m}, virtual_stages={v})") from exc
    if not isinstance(program, Program):
        raise BuilderResultError(f"schedule {name!r}: its builder {_qualname(builder)} returned "
                                 f"{type(program).__name__}, not a pipesched.Program (it must return the compute-only "
                                 f"program)")
    sizes = (("num_ranks", program.num_ranks, p), ("num_microbatches", program.num_microbatches, m),
             ("virtual_stages", program.num_stages // max(program.num_ranks, 1), v))
    for what, got, want in sizes:
        if got != want:
            raise ScheduleArgumentError(f"schedule {name!r}: asked for {what}={want}, its builder "
                                        f"{_qualname(builder)} returned a program with {got}", argument=what)
    if has_comm(program):
        raise ScheduleArgumentError(f"schedule {name!r}: its builder {_qualname(builder)} returned a program with "
                                    f"SEND/RECV; a builder returns the compute-only program (F, B or I and W, R) "
                                    f"and compile_program adds the communication")
    return program if program.schedule == name else dataclasses.replace(program, schedule=name)


def _qualname(obj) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"


class Registry:
    """Named schedules: the built-ins (immutable, never changed here) and those registered into this object.

    Args:
        builtins: the immutable built-in schedules (default :data:`pipesched.schedules.SCHEDULES`).
        entry_point_group: the entry point group read when a name is unknown (``None``: none).
    """

    def __init__(self, builtins: Mapping[str, ScheduleInfo] = SCHEDULES,
                 entry_point_group: str | None = ENTRY_POINT_GROUP) -> None:
        self._builtins = builtins
        self._user: dict[str, ScheduleInfo] = {}
        self._group = entry_point_group

    def register(self, name: str, builder: Callable[[int, int, int], Program], description: str, *,
                 default_virtual_stages: int = 1, paper: str = "user schedule", bubble: str = "",
                 inflight: str = "", microbatches: str = "", replace: bool = False) -> ScheduleInfo:
        """Add the schedule ``name``, built by ``builder(num_ranks, num_microbatches, virtual_stages)``, which
        returns the compute-only :class:`~pipesched.ir.Program`. Registering the same builder and fields under the
        same name again does nothing.

        Args:
            name: letters, digits and ``. _ + -``, starting with a letter or digit; not a built-in name.
            description: one line for ``pipesched list``.
            default_virtual_stages: stages per rank when the caller gives none (``Pipeline``, ``compile_program``).
            paper, bubble, inflight, microbatches: free text shown by ``pipesched list --json``.
            replace: replace a user schedule already registered under ``name`` (else that is an error).
        Returns:
            The :class:`~pipesched.schedules.ScheduleInfo` now registered.
        Raises:
            ValueError: ``name`` is a built-in name, ill-formed, or registered already with another builder
                (without ``replace``); ``default_virtual_stages`` is not an integer >= 1.
            TypeError: ``builder`` is not callable, or ``description`` (or a free-text field) is not a string.
        """
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"schedule name must be a string of letters, digits and '._+-' starting with a letter or "
                             f"digit, got {name!r}")
        if name in self._builtins:
            raise ValueError(f"schedule name {name!r} is a built-in schedule and cannot be registered again; built-in "
                             f"names: {', '.join(sorted(self._builtins))}. Choose another name")
        if not callable(builder):
            raise TypeError(f"schedule {name!r}: builder must be callable as builder(num_ranks, num_microbatches, "
                            f"virtual_stages) -> Program, got {type(builder).__name__}")
        for field, value in (("description", description), ("paper", paper), ("bubble", bubble),
                             ("inflight", inflight), ("microbatches", microbatches)):
            if not isinstance(value, str):
                raise TypeError(f"schedule {name!r}: {field} must be a string, got {type(value).__name__}")
        try:
            v = check_positive("default_virtual_stages", default_virtual_stages)
        except ScheduleArgumentError as exc:
            raise ValueError(f"schedule {name!r}: {exc}") from None
        info = ScheduleInfo(name, functools.partial(build_checked, name, builder), description, paper, v,
                            bubble, inflight, microbatches)
        old = self._user.get(name)
        if old is not None and _same(old, info):
            return old
        if old is not None and not replace:
            raise ValueError(f"schedule {name!r} is already registered (builder {_qualname(old.build.args[1])}) with "
                             f"other fields (only an identical registration is a no-op); pass replace=True to "
                             f"replace it, or choose another name")
        self._user[name] = info
        return info

    def unregister(self, name: str) -> None:
        """Remove the user schedule ``name``.

        Raises:
            ValueError: ``name`` is a built-in (never removed); KeyError (:class:`UnknownScheduleError`): not
                registered here.
        """
        if name in self._builtins:
            raise ValueError(f"{name!r} is a built-in schedule; only user schedules can be unregistered")
        if name not in self._user:
            raise UnknownScheduleError(f"no user schedule {name!r} is registered; registered: "
                                       f"{', '.join(sorted(self._user)) or 'none'}")
        del self._user[name]

    def get(self, name: str) -> ScheduleInfo:
        """The schedule ``name``: a built-in, else a registered one, else the entry point of that name (loaded and
        registered now).

        Raises:
            UnknownScheduleError: no such name (the message lists the valid names), or its entry point failed
                to load (quotes the error).
        """
        if isinstance(name, str):
            info = self._builtins.get(name) or self._user.get(name)
            if info is None and self._load_entry_point(name):
                info = self._user.get(name)
            if info is not None:
                return info
        raise UnknownScheduleError(f"unknown schedule {name!r}; valid names: {', '.join(sorted(self.names()))} "
                                   f"(a schedule of your own: import the module that registers it first, at the "
                                   f"top of your script, not under `if __name__ == '__main__':`: each rank process "
                                   f"of launch() or torchrun imports it afresh; on the command line, "
                                   f"--schedule-module MODULE)")

    def registered(self) -> tuple[str, ...]:
        """The names registered into this object (user schedules, including those loaded from entry points)."""
        return tuple(self._user)

    def names(self) -> list[str]:
        """Every name known without importing anything: built-ins, registered ones, entry point names."""
        return list(self._builtins) + [n for n in self._user if n not in self._builtins] + [
            ep.name for ep in self._entry_points() if ep.name not in self._builtins and ep.name not in self._user]

    def all(self) -> Mapping[str, ScheduleInfo]:
        """Every schedule, built-ins first (read-only view). Loads every entry point of the group first; one that
        fails to load is skipped with a ``UserWarning`` quoting its error."""
        for ep in self._entry_points():
            if ep.name not in self._builtins and ep.name not in self._user:
                try:
                    self._load_entry_point(ep.name)
                except UnknownScheduleError as exc:
                    warnings.warn(str(exc), stacklevel=2)
        return MappingProxyType({**self._builtins, **self._user})

    def import_module(self, module: str) -> tuple[str, ...]:
        """Import ``module`` (a dotted module name, or the path of a ``.py`` file) so that it registers its
        schedules here; returns the names it registered (those new after the import). A dotted name is also
        looked up in the current directory (appended to ``sys.path``, as ``python -m`` finds it); a ``.py`` file
        can import the modules next to it (its folder is on ``sys.path`` while it is imported).

        Raises:
            ImportError: it cannot be imported (names ``module``; the cause is chained).
        """
        before = set(self._user)
        try:
            if module.endswith(".py") or "/" in module or "\\" in module:
                _import_file(Path(module))
            else:
                _current_dir_on_sys_path()  # as under ``python -m``: a module of the current directory is found
                importlib.import_module(module)
        except ImportError as exc:
            raise ImportError(f"cannot import schedule module {module!r}: {exc}") from exc
        return tuple(n for n in self._user if n not in before)

    def _entry_points(self):
        if self._group is None:
            return ()
        return importlib.metadata.entry_points(group=self._group)

    def _load_entry_point(self, name: str) -> bool:
        """Load the entry point ``name`` and register what it gives; ``False`` if there is none."""
        found = [ep for ep in self._entry_points() if ep.name == name]
        if not found:
            return False
        ep = found[0]
        try:
            target = ep.load()
        except Exception as exc:  # noqa: BLE001 - a broken plug-in is reported, named
            raise UnknownScheduleError(f"schedule {name!r} comes from entry point '{ep.name} = {ep.value}' "
                                       f"(group {self._group}), which failed to load: {type(exc).__name__}: {exc}"
                                       ) from exc
        if name not in self._user:  # a module registers on import; a callable is the builder itself
            if not callable(target):
                raise UnknownScheduleError(f"entry point '{ep.name} = {ep.value}' (group {self._group}) names "
                                           f"{type(target).__name__}, neither a builder nor a module registering "
                                           f"{name!r}")
            doc = (getattr(target, "__doc__", None) or "").strip().splitlines()
            self.register(name, target, doc[0] if doc else f"from {ep.value}", paper=f"entry point {ep.value}")
        return True


def _same(a: ScheduleInfo, b: ScheduleInfo) -> bool:
    """The same builder (the same object) and the same fields."""
    return a.build.args[1] is b.build.args[1] and a.build.args[0] == b.build.args[0] and all(
        getattr(a, f) == getattr(b, f) for f in ("summary", "paper", "default_virtual_stages", "bubble",
                                                 "inflight", "microbatches"))


def _import_file(path: Path) -> None:
    """Import a ``.py`` file as a module named after it (kept in ``sys.modules`` so pickling finds it)."""
    if not path.is_file():
        raise ImportError(f"no such file: {path}")
    name = path.stem
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(path.resolve()):
        return
    spec = importlib.util.spec_from_file_location(name, path.resolve())
    if spec is None:  # no loader for the suffix: importlib knows .py (and compiled) files only
        raise ImportError(f"{path} is not a Python source file (.py): give a .py file or an importable module name")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    folder = str(path.resolve().parent)
    added = folder not in sys.path
    if added:  # while it is imported, the modules next to it can be imported (as when it runs as a script)
        sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        if added and folder in sys.path:
            sys.path.remove(folder)


def _current_dir_on_sys_path() -> None:
    """Put the current directory on ``sys.path`` (last: it never hides an installed module) if it is not there;
    the ``pipesched`` console script, unlike ``python -m``, does not put it there."""
    here = os.getcwd()
    if not any(os.path.abspath(entry or os.curdir) == here for entry in sys.path):
        sys.path.append(here)


#: The registry every name lookup in this process consults (:func:`pipesched.get_schedule`); the package's one
#: mutable object, on purpose: registrations are per process (see the module docstring).
REGISTRY = Registry()


def get_schedule(name: str) -> ScheduleInfo:
    """The schedule ``name``, built-in or registered in this process (:data:`REGISTRY`, :meth:`Registry.get`): what
    :func:`pipesched.build`, :func:`pipesched.compile_program` and ``Pipeline`` look names up with.

    Raises:
        UnknownScheduleError: no such name (lists the valid names), or its entry point failed to load.
    """
    return REGISTRY.get(name)


def register_schedule(name: str, builder: Callable[[int, int, int], Program], description: str,
                      **options) -> ScheduleInfo:
    """Register a schedule in this process (:data:`REGISTRY`): then ``name`` works wherever a schedule name does
    (``compile_program``, ``build``, ``Pipeline(schedule=name)``, ``pipesched list/show/simulate/render``).
    Arguments, result and errors: :meth:`Registry.register`."""
    return REGISTRY.register(name, builder, description, **options)


def unregister_schedule(name: str) -> None:
    """Remove a user schedule from :data:`REGISTRY` (:meth:`Registry.unregister`)."""
    REGISTRY.unregister(name)
