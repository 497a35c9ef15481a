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


def _store_host_returns_first(rank):
    """World rank 0 (which hosts the store) returns at once; rank 1 uses the store 0.5 s later."""
    import time

    import torch.distributed as dist

    if rank == 0:
        return "early"
    time.sleep(0.5)
    store = dist.distributed_c10d._get_default_store()
    store.set("late", "still here")
    return store.get("late").decode()


def test_the_store_host_stays_until_the_other_ranks_fn_has_ended():
    # before: rank 1 got DistNetworkError "Broken pipe" (rank 0's process, the store, was gone)
    assert launch(_store_host_returns_first, 2, timeout=120) == ["early", "still here"]


def _origin_lingers_while_peer_blocks(rank, sentinel):
    """Rank 1 fails as a Pipeline origin would (a record nobody reads: it lingers); rank 0 waits on it in a
    collective. Rank 0 must see the closed connection at once, not when rank 1's linger ends."""
    import torch
    import torch.distributed as dist

    from pipesched.runtime.failure import FailureChannel, FailureRecord

    if rank == 1:
        channel = FailureChannel(dist.distributed_c10d._get_default_store(), ["test"])
        record = FailureRecord.local(1, None, ValueError("origin"))
        channel.publish(record)
        channel.keep_alive_for(record, 2, 600.0)  # only rank 1 reads it: it would linger the whole grace
        raise ValueError("rank 1 failed")
    try:
        dist.all_reduce(torch.ones(1))
    except Exception as exc:  # noqa: BLE001 - what rank 0 saw, for the test
        with open(sentinel, "w") as handle:
            handle.write(type(exc).__name__)
        raise


def test_a_lingering_failed_rank_does_not_hold_its_peers(tmp_path):
    sentinel = tmp_path / "rank0"
    with pytest.raises(ValueError, match="^rank 1 failed$"):
        launch(_origin_lingers_while_peer_blocks, 2, str(sentinel), timeout=40, grace=600)
    # before: launch gave up at the 40 s timeout with rank 0 still blocked (no sentinel) on the lingering rank 1
    assert sentinel.read_text() == "RuntimeError"  # gloo: the connection to rank 1 was closed


_INTERRUPTED = textwrap.dedent("""\
    import os, signal, sys, time
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a shell's background job starts with SIGINT ignored
    from pipesched.runtime import launch
    def fn(rank):
        os.write(1, f"ready {os.getpid()}\\n".encode())  # one write: the two ranks' lines do not interleave
        time.sleep(600)
    if __name__ == "__main__":
        try:
            launch(fn, 2, timeout=300)
        except KeyboardInterrupt:
            sys.exit(130)
    """)


def test_ctrl_c_prints_one_line_and_stops_every_rank(tmp_path):
    import os
    import signal

    script = tmp_path / "interrupted.py"
    script.write_text(_INTERRUPTED)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        lines = [proc.stdout.readline() for _ in range(2)]
        assert all(line.startswith("ready ") for line in lines), lines
        pids = [int(line.split()[1]) for line in lines]
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the parent and its children
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert (proc.returncode, err) == (130, "interrupted: stopping 2 ranks\n")
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize("kwargs, message", [
    ({"timeout": 0}, "timeout must be a number of seconds > 0 (inf: no limit), got 0"),
    ({"timeout": "10"}, "timeout must be a number of seconds > 0 (inf: no limit), got '10'"),
    ({"timeout": float("nan")}, "timeout must be a number of seconds > 0 (inf: no limit), got nan"),
    ({"grace": -1}, "grace must be a finite number of seconds >= 0, got -1"),
    ({"grace": float("inf")}, "grace must be a finite number of seconds >= 0, got inf"),
    ({"threads": 0}, "threads must be an integer >= 1 (torch threads per rank), got 0"),
    ({"threads": 1.5}, "threads must be an integer >= 1 (torch threads per rank), got 1.5"),
])
def test_bad_launch_arguments_are_refused_before_any_child_starts(kwargs, message):
    with pytest.raises(ValueError) as caught:
        launch(print, 2, **kwargs)
    assert str(caught.value) == message
