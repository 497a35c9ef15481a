"""``launch`` from a script read from stdin (``python - < script.py``, a heredoc): multiprocessing's spawn re-runs the
main script from ``__main__.__file__``, which is ``'<stdin>'``, no file, so every spawned child died with
``FileNotFoundError`` even for an importable ``fn`` (found in session 11). ``start_method=None`` now forks there, and
``"spawn"`` is refused before any child starts, saying why."""
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multiprocess

_SCRIPT = """
import operator
from pipesched.runtime import launch
if __name__ == "__main__":
    print(launch(operator.neg, 2, timeout=120))
    try:
        launch(operator.neg, 2, start_method="spawn")
    except ValueError as exc:
        print(exc)
"""


def test_launch_from_a_script_read_from_stdin_forks_and_refuses_spawn_saying_why():
    run = subprocess.run([sys.executable, "-"], input=_SCRIPT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines() == [
        "[0, -1]",
        "launch cannot use start_method='spawn' for this fn: this process's main script was read from '<stdin>' "
        "(stdin), which a spawned child would try to re-run as a file; run it from a .py file; or leave "
        "start_method=None, which forks the children instead (CPU only)"]
