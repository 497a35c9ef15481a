"""Which multiprocessing start method :func:`~pipesched.runtime.launch` can use for a function: spawn when a child
can import it and re-running the main script is safe, else fork when forking is safe here, else a ``ValueError``
saying why and what to do."""
from __future__ import annotations

import ast
import multiprocessing as mp
import os
import pickle
import pickletools
import sys


def choose_start_method(fn, start_method: str | None, threads: int = 1) -> str:
    """The multiprocessing start method :func:`launch` uses for ``fn`` (see its docstring).

    Raises:
        ValueError: ``start_method`` cannot run ``fn`` in this process; the message says why and what to do.
    """
    if start_method not in (None, "spawn", "fork", "forkserver"):
        raise ValueError(f"start_method must be None, 'spawn', 'fork' or 'forkserver', got {start_method!r}")
    obstacle = spawn_obstacle(fn) if start_method != "fork" else None
    if start_method is None:
        if obstacle is None:
            return "spawn"
        unsafe = fork_obstacle(threads)
        if unsafe is None:
            return "fork"
        raise ValueError(f"launch cannot start children for this fn: {obstacle}; and it cannot fork them, as it "
                         f"would otherwise: {unsafe}")
    if start_method == "fork":
        unsafe = fork_obstacle(threads)
        if unsafe is not None:
            raise ValueError(f"launch cannot fork its children: {unsafe}")
        return "fork"
    if obstacle is not None:
        raise ValueError(f"launch cannot use start_method={start_method!r} for this fn: {obstacle}; or leave "
                         f"start_method=None, which forks the children instead (CPU only)")
    return start_method


def spawn_obstacle(fn) -> str | None:
    """Why a spawned child could not run ``fn`` (``None`` if it can): it must import ``fn`` by module and
    name, and it re-runs the main script's top level (as ``__mp_main__``) when this process has one."""
    main = sys.modules.get("__main__")
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    try:
        modules = {arg.split(" ")[0] for op, arg, _ in pickletools.genops(pickle.dumps(fn, protocol=2))
                   if op.name == "GLOBAL"}
    except Exception as exc:  # noqa: BLE001 - any pickling error means a spawned child cannot get fn
        if "<lambda>" in name or "<locals>" in name:
            return (f"fn {name} is a lambda or is defined inside a function, so a spawned child cannot import it; "
                    f"define fn with def at the top level of a module")
        return f"fn {name} cannot be pickled for a spawned child ({type(exc).__name__}: {exc})"
    script = _main_script(main)
    if "__main__" in modules and script is None:
        return (f"fn {name} is defined in __main__ of a notebook, python -c or a script read from stdin, which "
                f"a spawned child cannot import; define fn in a module (a .py file) and import it")
    named = getattr(main, "__file__", None) if getattr(main, "__spec__", None) is None else None
    if named and script is None:  # multiprocessing's spawn re-runs __main__ from that path, which is no file
        return (f"this process's main script was read from {named!r} (stdin), which a spawned child would try to "
                f"re-run as a file; run it from a .py file")
    line = _unguarded_call_line(main, script)
    if line is not None:
        return (f"launch is called at line {line} of {script} outside an `if __name__ == \"__main__\":` block, and "
                f"a spawned child re-runs that script's top level, which would launch again; put the call under "
                f"that block")
    return None


def fork_obstacle(threads: int) -> str | None:
    """Why forking this process's children would be unsafe now (``None`` if it is not)."""
    if "fork" not in mp.get_all_start_methods():
        return "fork is not available on this platform"
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    if torch.cuda.is_initialized():
        return ("CUDA is initialized in this process, and a forked child cannot use it; call launch before "
                "anything touches CUDA, or make fn importable so that launch spawns")
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return "this process already has a default process group, which a forked child would inherit"
    if threads > 1:
        return (f"threads={threads} after this process imported torch: a forked child running more than one "
                f"OpenMP thread can hang (GNU OpenMP's thread pool does not survive fork); use threads=1")
    return None


def _main_script(main) -> str | None:
    """The file a spawned child re-runs as ``__mp_main__`` (``None``: a notebook, ``-c``, stdin)."""
    if getattr(main, "__spec__", None) is not None:
        return getattr(main, "__file__", None) or main.__spec__.name
    path = getattr(main, "__file__", None)
    return path if path and os.path.isfile(path) else None


def _unguarded_call_line(main, script: str | None) -> int | None:
    """The line of the main script's top level that is calling :func:`launch` now, if it is not inside an
    ``if __name__ == "__main__":`` block (``None``: guarded, not called from there, or the source is unreadable)."""
    if script is None or main is None:
        return None
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)):
        frame = frame.f_back
    if frame is None:
        return None
    line = frame.f_lineno
    try:
        with open(frame.f_code.co_filename, encoding="utf-8") as handle:
            tree = ast.parse(handle.read())
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_main_test(node.test) and node.body:
            if node.body[0].lineno <= line <= node.body[-1].end_lineno:
                return None
    return line


def _is_main_test(test) -> bool:
    """``__name__ == "__main__"`` (either way round)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = (test.left, test.comparators[0])
    return (any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
            and any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides))
