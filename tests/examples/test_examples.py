"""The examples run end to end: the GPT trains across 2 pipeline ranks and writes its timelines."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.multiprocess


def test_train_gpt_short_run(tmp_path):
    out = tmp_path / "demo"
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--ranks", "2", "--steps", "30",
         "--width", "32", "--depth", "2", "--heads", "2", "--context", "32", "--batch", "8",
         "--corpus-bytes", "200000", "--seed", "3", "--out", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"step +\d+/30 +loss (\S+)", result.stdout)]
    assert len(losses) == 3 and all(loss == loss and loss < 10 for loss in losses)  # finite
    assert losses[-1] < losses[0]
    start, end = map(float, re.search(r"validation loss (\S+) -> (\S+) \(fell\)", result.stdout).groups())
    assert end < start
    assert "sample:" in result.stdout
    for name in ("timeline.png", "trace.json", "measured.json"):
        assert (out / name).stat().st_size > 0, name


def test_quickstart():
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py")],
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    first, last = map(float, re.search(r"loss (\S+) -> (\S+) in 20 steps", result.stdout).groups())
    assert 0 < last < first


@pytest.mark.parametrize("argv, message", [
    (["--ranks", "0"], "--ranks must be >= 1, got 0"),
    (["--heads", "3"], "--width 128 must be a multiple of --heads 3"),
    (["--batch", "2", "--microbatches", "4"], "--batch 2 must be >= --microbatches 4"),
    (["--balance", "foo"], "--balance must be 'params', 'layers' or layer counts"),
    (["--data", "/nonexistent/text"], "--data '/nonexistent/text': no such file or folder"),
])
def test_train_gpt_options_are_checked_before_any_rank_starts(argv, message, capsys):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import train_gpt
    finally:
        sys.path.pop(0)
    with pytest.raises(SystemExit) as info:
        train_gpt.options(argv, prog="pipesched demo")
    assert info.value.code == 2
    assert f"pipesched demo: error: {message}" in capsys.readouterr().err
