"""The examples run end to end: the demo GPT trains across 2 pipeline ranks from an installed (not editable)
copy of the package, run from another folder, and writes its timelines; the quickstart trains."""
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipesched.demo.options import options

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """``pip install --no-deps --target`` of a copy of the source (the build leaves nothing in the checkout):
    the package as a user installs it, without examples/ or anything else outside the package."""
    base = tmp_path_factory.mktemp("install")
    source = base / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "pipesched", source / "pipesched", ignore=shutil.ignore_patterns("__pycache__"))
    target = base / "site"
    offline = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []  # else pip fetches it
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", *offline, "--no-compile",
                    "--target", str(target), str(source)], check=True, capture_output=True, timeout=300)
    elsewhere = base / "elsewhere"  # no pipesched/ or examples/ next to the working directory
    elsewhere.mkdir()
    return target, elsewhere


def _run_installed(installed, *argv, timeout=300):
    target, cwd = installed
    env = dict(os.environ, PYTHONPATH=str(target))
    return subprocess.run([sys.executable, "-m", "pipesched", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def test_the_demo_runs_from_an_installed_package(installed):
    target, cwd = installed
    assert not (target / "examples").exists()
    where = subprocess.run([sys.executable, "-c", "import pipesched.demo.train as t; print(t.__file__)"], cwd=cwd,
                           env=dict(os.environ, PYTHONPATH=str(target)), capture_output=True, text=True, check=True)
    assert Path(where.stdout.strip()).is_relative_to(target)  # the installed copy, not this checkout
    result = _run_installed(installed, "demo", "--help", timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("usage: pipesched demo") and "--virtual-stages" in result.stdout
    out = cwd / "demo"
    result = _run_installed(installed, "demo", "--ranks", "2", "--steps", "30", "--width", "32", "--depth", "2",
                            "--heads", "2", "--context", "32", "--batch", "8", "--corpus-bytes", "200000",
                            "--seed", "3", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"step +\d+/30 +loss (\S+)", result.stdout)]
    assert len(losses) == 3 and all(loss == loss and loss < 10 for loss in losses)  # finite
    assert losses[-1] < losses[0]
    start, end = map(float, re.search(r"validation loss (\S+) -> (\S+) \(fell\)", result.stdout).groups())
    assert end < start
    assert "sample:" in result.stdout
    for name in ("timeline.png", "trace.json", "measured.json"):
        assert (out / name).stat().st_size > 0, name


def test_the_demo_resumes_from_its_checkpoint_as_if_never_stopped(tmp_path):
    # 10 steps straight == 5 steps, stop, a new run with --resume for 5 more: the same loss at step 10 and the same
    # validation loss (the step loss printed to 6 decimals, the validation loss to 3; the library's own test compares
    # weights bitwise)
    tiny = ["--ranks", "2", "--width", "32", "--depth", "2", "--heads", "2", "--context", "16", "--batch", "4",
            "--corpus-bytes", "100000", "--checkpoint-every", "5", "--out", str(tmp_path / "out")]

    def demo(*argv):
        result = subprocess.run([sys.executable, "-m", "pipesched", "demo", *tiny, *argv], capture_output=True,
                                text=True, timeout=300, check=False)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout

    straight = demo("--steps", "10", "--checkpoint-dir", str(tmp_path / "a"))
    first = demo("--steps", "5", "--checkpoint-dir", str(tmp_path / "b"))
    resumed = demo("--steps", "10", "--checkpoint-dir", str(tmp_path / "b"), "--resume")
    assert f"saved {tmp_path / 'b' / 'step-000005'}" in first
    assert f"resumed from {tmp_path / 'b' / 'step-000005'} (step 5)" in resumed
    assert "(embedding tied to the head)" in straight and "clip 1.0" in straight
    final = re.compile(r"step   10/10  loss (\S+)|validation loss \S+ -> (\S+)")
    assert final.findall(resumed) == final.findall(straight) != []
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["step-000005", "step-000010"]
    done = demo("--steps", "8", "--checkpoint-dir", str(tmp_path / "b"), "--resume")  # at step 10 already
    assert done == (f"resumed from {tmp_path / 'b' / 'step-000010'} (step 10)\nnothing to do: the checkpoint is at "
                    f"step 10 and --steps is 8 (raise --steps to train further)\n")


def test_a_killed_rank_ends_the_demo_with_one_error_line_and_the_resume_hint(tmp_path):
    # README: stop it at any point (Ctrl-C or a killed rank), --resume continues. A SIGKILLed rank ended the demo with
    # the launcher's whole traceback (a new user's trial, s14); now one line naming the rank, then the hint, exit 1
    folder = tmp_path / "ck"
    demo = subprocess.Popen([sys.executable, "-m", "pipesched", "demo", "--ranks", "2", "--width", "32", "--depth", "2",
                             "--heads", "2", "--context", "16", "--batch", "4", "--corpus-bytes", "100000",
                             "--steps", "2000", "--checkpoint-every", "2", "--checkpoint-dir", str(folder),
                             "--out", str(tmp_path / "out")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # its own group: the finally can stop every rank
    try:
        deadline = time.monotonic() + 240
        while not (folder / "step-000002").is_dir() and demo.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        children = subprocess.run(["pgrep", "-P", str(demo.pid)], capture_output=True, text=True).stdout.split()
        ranks = [pid for pid in children if not any(  # the rank processes, not multiprocessing's helpers
            helper in Path(f"/proc/{pid}/cmdline").read_bytes() for helper in (b"resource_tracker", b"forkserver"))]
        assert (folder / "step-000002").is_dir() and len(ranks) == 2, (children, ranks, demo.poll())
        os.kill(int(ranks[-1]), signal.SIGKILL)
        out, err = demo.communicate(timeout=120)
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait()
    assert demo.returncode == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert re.search(r"error: launch: rank \d exited with code -9 without reporting \(killed by signal 9\)", err), err
    assert err.rstrip().endswith(f"continue from the newest checkpoint in {folder} with the same command and "
                                 f"--resume"), err[-3000:]


def test_train_gpt_is_the_demo_as_a_script():
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--help"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("usage: train_gpt.py") and "--virtual-stages" in result.stdout


def test_quickstart():
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py")],
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    first, last = map(float, re.search(r"loss (\S+) -> (\S+) in 20 steps", result.stdout).groups())
    assert 0 < last < first


TINY = Path(__file__).parent / "tiny_corpus"  # two files of 6 bytes


@pytest.mark.parametrize("argv, message", [
    (["--ranks", "0"], "--ranks must be >= 1, got 0"),
    (["--heads", "3"], "--width 128 must be a multiple of --heads 3"),
    (["--batch", "2", "--microbatches", "4"], "--batch 2 must be >= --microbatches 4"),
    (["--balance", "foo"], "--balance must be 'params', 'layers' or layer counts"),
    (["--data", "/nonexistent/text"], "--data '/nonexistent/text': no such file or folder"),
    (["--data", str(TINY)], f"--data '{TINY}' has only 12 bytes of text; the demo needs at least 10000"),
    (["--corpus-bytes", "500"], "--corpus-bytes 500: the demo needs at least 10000 bytes of text"),
    (["--clip", "-1"], "--clip must be a global gradient norm >= 0 (0: no clipping), got -1.0"),
    (["--resume"], "--resume needs --checkpoint-dir (the folder whose newest checkpoint to continue from)"),
    (["--checkpoint-every", "0"], "--checkpoint-every must be >= 1, got 0"),
])
def test_demo_options_are_checked_before_any_rank_starts(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        options(argv, prog="pipesched demo")
    assert info.value.code == 2
    assert f"pipesched demo: error: {message}" in capsys.readouterr().err


def test_demo_checks_its_folders_before_any_rank_starts(tmp_path, capsys):
    (tmp_path / "file").write_text("not a folder")
    (tmp_path / "empty").mkdir()
    file, missing = str(tmp_path / "file"), str(tmp_path / "typo")
    for argv, message in [
        (["--checkpoint-dir", file], f"--checkpoint-dir {file!r} is a file, not a folder"),
        (["--checkpoint-dir", file + "/ckpt"], f"--checkpoint-dir {file + '/ckpt'!r} cannot be created: {file!r} "
                                               f"is a file, not a folder"),
        (["--checkpoint-dir", missing, "--resume"], f"--checkpoint-dir {missing!r} does not exist, so --resume has "
                                                   f"nothing to continue from (check the name, or leave --resume out "
                                                   f"to start from step 1)"),
        (["--out", file], f"--out {file!r} is a file, not a folder"),
    ]:
        with pytest.raises(SystemExit) as info:
            options(argv, prog="pipesched demo")
        assert info.value.code == 2
        assert f"pipesched demo: error: {message}\n" in capsys.readouterr().err
    # usable: a folder to be made (nothing is made while checking), an existing empty one to resume from (step 1)
    assert options(["--checkpoint-dir", missing + "/a/b"]).checkpoint_dir == missing + "/a/b"
    assert options(["--checkpoint-dir", str(tmp_path / "empty"), "--resume"]).resume is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "file"]


def _demo_options(argv):
    return options(argv, prog="pipesched demo")


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
    (["--schedule", "zigzag"], "--schedule: unknown schedule 'zigzag'; valid names: 1f1b, dualpipev, gpipe, "
                                 "interleaved-1f1b"),
    (["--balance", "3,2,2,2"], "--balance 3,2,2,2: needs 4 layer counts (one per stage) summing to the model's 7 "
                               "layers, got 4 summing to 9"),
])
def test_demo_refuses_a_model_that_does_not_fit_before_any_rank_starts(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        _demo_options(argv)
    assert info.value.code == 2
    assert f"pipesched demo: error: {message}" in capsys.readouterr().err


def test_the_readmes_launch_example_runs_as_written(tmp_path):
    """The README's ``launch(fn, N)`` script, copied from the README into a file and run with ``python``: two ranks,
    zbv, the same loss returned by both (a spawned rank imports that file, so this also checks its ``__main__``
    guard)."""
    text = (ROOT / "README.md").read_text()
    start = text.index("```python\n", text.index("Or without torchrun, from a script or a notebook")) + len("```python\n")
    script = tmp_path / "launch_example.py"
    script.write_text(text[start:text.index("```", start)])
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    losses = [float(v) for v in re.fullmatch(r"\[([-0-9.e]+), ([-0-9.e]+)\]\n", done.stdout).groups()]
    assert losses[0] == losses[1] and 0 < losses[0] < 2, done.stdout


def test_chunked_gpipe_run_as_a_script_shows_what_it_registers():
    # it printed nothing (a new user's trial): registering is all importing it does
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "chunked_gpipe.py")], capture_output=True,
                         text=True, timeout=120, check=True).stdout.splitlines()
    assert out[0].startswith("registered 'chunked-gpipe' in this process")
    assert out[2].split() == ["0", "F0.0", "RECV_F1.0<0"]
    assert out[-1] == "simulated bubble fraction (unit costs): 0.333"  # each chunk a GPipe of p: (p-1)/(2p-1)


def test_demo_plan_that_nothing_fits_names_the_memory_option():
    # it said memory_per_rank=1 KiB, the planner's argument, where `pipesched plan` says --memory (a new user's trial)
    run = subprocess.run([sys.executable, "-m", "pipesched.cli", "demo", "--plan", "--memory", "1KiB", "--ranks", "2",
                          "--steps", "1", "--width", "32", "--depth", "2", "--context", "32", "--batch", "8",
                          "--corpus-bytes", "3e4"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 1, run.stderr[-2000:]
    assert run.stderr.strip().splitlines()[-1].startswith(
        "error: --memory=1 KiB: no configuration fits; the smallest memory per rank that fits is ")
