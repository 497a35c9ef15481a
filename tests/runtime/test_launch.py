"""``launch`` where a new user calls it: a notebook-like ``__main__`` (``python -c``, stdin), a script without
an ``if __name__ == "__main__":`` guard, a lambda; and the error when a child dies without reporting."""
import re
import subprocess
import sys
import textwrap

import pytest

from pipesched.runtime import launch
from pipesched.runtime.launch import choose_start_method

pytestmark = pytest.mark.multiprocess

_SCRIPT = textwrap.dedent("""\
    from pipesched.runtime.launch import choose_start_method, launch
    def fn(rank):
        return rank
    print(choose_start_method(fn, None), launch(fn, 2, timeout=120))
    try:
        launch(fn, 2, start_method="spawn")
    except ValueError as exc:
        print(exc)
    """)


def _run(argv, stdin=None) -> list[str]:
    done = subprocess.run([sys.executable, *argv], input=stdin, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


def test_fn_defined_in_python_c_runs_forked_and_spawn_says_why_it_cannot():
    chosen, refused = _run(["-c", _SCRIPT])
    assert chosen == "fork [0, 1]"
    assert refused == ("launch cannot use start_method='spawn' for this fn: fn fn is defined in __main__ of a "
                       "notebook, python -c or a script read from stdin, which a spawned child cannot import; define "
                       "fn in a module (a .py file) and import it; or leave start_method=None, which forks the "
                       "children instead (CPU only)")


def test_fn_of_a_script_read_from_stdin_runs_forked():
    chosen, refused = _run(["-"], stdin=_SCRIPT)
    assert chosen == "fork [0, 1]"
    assert "fn fn is defined in __main__ of a notebook, python -c or a script read from stdin" in refused


def test_a_script_without_main_guard_runs_forked_and_spawn_names_the_line(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(_SCRIPT)
    chosen, refused = _run([str(script)])
    assert chosen == "fork [0, 1]"
    assert refused == (f"launch cannot use start_method='spawn' for this fn: launch is called at line 6 of {script} "
                       f"outside an `if __name__ == \"__main__\":` block, and a spawned child re-runs that script's "
                       f"top level, which would launch again; put the call under that block; or leave "
                       f"start_method=None, which forks the children instead (CPU only)")


def test_a_guarded_script_still_spawns(tmp_path):
    script = tmp_path / "guarded.py"
    script.write_text(textwrap.dedent("""\
        from pipesched.runtime.launch import choose_start_method
        def fn(rank):
            return rank
        if __name__ == "__main__":
            print(choose_start_method(fn, None))
        """))
    assert _run([str(script)]) == ["spawn"]


def test_a_lambda_cannot_be_spawned_and_the_error_says_why():
    with pytest.raises(ValueError) as info:
        launch(lambda rank: rank, 2, start_method="spawn")
    assert str(info.value) == (
        "launch cannot use start_method='spawn' for this fn: fn test_a_lambda_cannot_be_spawned_and_the_error_says_"
        "why.<locals>.<lambda> is a lambda or is defined inside a function, so a spawned child cannot import it; "
        "define fn with def at the top level of a module; or leave start_method=None, which forks the children "
        "instead (CPU only)")


def test_a_lambda_is_forked_by_default():
    assert choose_start_method(lambda rank: rank, None) == "fork"
    assert choose_start_method(_returns_rank, None) == "spawn"  # importable: spawned as before


def test_fork_refuses_threads_after_torch_was_imported():
    with pytest.raises(ValueError) as info:
        choose_start_method(lambda rank: rank, None, threads=2)
    assert str(info.value) == (
        "launch cannot start children for this fn: fn test_fork_refuses_threads_after_torch_was_imported.<locals>."
        "<lambda> is a lambda or is defined inside a function, so a spawned child cannot import it; define fn with "
        "def at the top level of a module; and it cannot fork them, as it would otherwise: threads=2 after this "
        "process imported torch: a forked child running more than one OpenMP thread can hang (GNU OpenMP's thread "
        "pool does not survive fork); use threads=1")


def test_fork_is_refused_once_cuda_is_initialized(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(ValueError) as info:
        choose_start_method(_returns_rank, "fork")
    assert str(info.value) == ("launch cannot fork its children: CUDA is initialized in this process, and a forked "
                               "child cannot use it; call launch before anything touches CUDA, or make fn importable "
                               "so that launch spawns")
    assert choose_start_method(_returns_rank, None) == "spawn"


def _returns_rank(rank):
    return rank


def _vanishes(rank):
    import os
    import time

    if rank == 1:
        sys.stderr.write("rank 1 is about to vanish\n")
        sys.stderr.flush()
        os._exit(3)
    time.sleep(600)


def test_a_child_that_dies_without_reporting_is_quoted():
    with pytest.raises(RuntimeError) as info:
        launch(_vanishes, 2, timeout=120, grace=2.0)  # rank 0 sleeps: it gets the grace, then ends
    assert str(info.value) == ("launch: rank 1 exited with code 3 without reporting; the end of its stderr:\n"
                               "rank 1 is about to vanish")


def _explode():
    raise RuntimeError("this argument cannot be rebuilt in the child")


class _Unbuildable:
    def __reduce__(self):
        return (_explode, ())


def _takes(rank, arg):
    return rank


def test_a_spawned_child_failing_before_fn_runs_is_quoted():
    """The child fails while unpickling its arguments, before any code of launch runs there."""
    with pytest.raises(RuntimeError) as info:
        launch(_takes, 2, _Unbuildable(), timeout=120)
    text = str(info.value)
    assert re.match(r"launch: rank [01] exited with code 1 without reporting; the end of its stderr:\n"
                    r"Traceback \(most recent call last\):\n", text), text
    assert text.endswith("\nRuntimeError: this argument cannot be rebuilt in the child"), text
