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


def _demo_options(argv):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import train_gpt
    finally:
        sys.path.pop(0)
    return train_gpt.options(argv, prog="pipesched demo")


@pytest.mark.parametrize("argv, virtual_stages, depth", [
    ([], 1, 4),                                                              # 1f1b: 4 blocks, 7 layers >= 4 stages
    (["--schedule", "interleaved-1f1b"], 2, 8),                              # the library's default v=2: 8 stages
    (["--schedule", "interleaved-1f1b", "--virtual-stages", "3"], 3, 12),    # 12 stages: one block each
    (["--schedule", "interleaved-1f1b", "--ranks", "2"], 2, 4),              # 4 stages: the default 4 blocks fit
    (["--schedule", "interleaved-1f1b", "--depth", "5"], 2, 5),              # 8 layers: enough for 8 stages
])
def test_demo_takes_the_schedules_virtual_stages_and_sizes_the_model_to_fit(argv, virtual_stages, depth):
    args = _demo_options(argv)
    assert (args.virtual_stages, args.depth) == (virtual_stages, depth)


def test_demo_under_torchrun_sizes_the_model_for_world_size_over_dp(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    args = _demo_options(["--schedule", "interleaved-1f1b", "--dp", "2"])  # 4 pipeline ranks x v=2
    assert (args.virtual_stages, args.depth) == (2, 8)


@pytest.mark.parametrize("argv, message", [
    (["--schedule", "interleaved-1f1b", "--depth", "2"],
     "--depth 2 gives the model 5 layers (embedding, 2 blocks, final norm, head) but 4 ranks x 2 virtual stages = 8 "
     "stages need at least 8: use --depth 5 or more (or leave --depth out), or fewer --ranks or --virtual-stages"),
    (["--virtual-stages", "2"], "--schedule 1f1b with --virtual-stages 2: virtual_stages=2: 1f1b places one stage "
                                "per rank"),
    (["--schedule", "zigzag"], "--schedule: unknown schedule 'zigzag'; valid names: 1f1b, gpipe, interleaved-1f1b"),
    (["--balance", "3,2,2,2"], "--balance 3,2,2,2: needs 4 layer counts (one per stage) summing to the model's 7 "
                               "layers, got 4 summing to 9"),
])
def test_demo_refuses_a_model_that_does_not_fit_before_any_rank_starts(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        _demo_options(argv)
    assert info.value.code == 2
    assert f"pipesched demo: error: {message}" in capsys.readouterr().err
