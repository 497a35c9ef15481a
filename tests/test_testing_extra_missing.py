"""``import pipesched.testing`` without hypothesis (the ``test`` extra) says how to install it."""
import subprocess
import sys

_CODE = """\
import sys
sys.modules["hypothesis"] = None  # as if it were not installed
try:
    import pipesched.testing
except ModuleNotFoundError as exc:
    print(exc.name)
    print(exc)
"""


def test_missing_hypothesis_names_the_extra():
    done = subprocess.run([sys.executable, "-c", _CODE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "hypothesis",
        "pipesched.testing needs hypothesis, which is not installed: pip install 'pipesched[test]' "
        "(or pip install hypothesis)"]
