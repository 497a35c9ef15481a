"""Faults a new-user trial found on the command line: a builder that raises, a verdict lost to a closed pipe,
errors under --json, option names in messages, binary files."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import pipesched as ps
from pipesched.cli import main
from pipesched.errors import BuilderError, ScheduleError

ROOT = Path(__file__).resolve().parents[1]
BROKEN = ROOT / "schedules" / "examples" / "broken-deadlock.txt"


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def boom():
    def build(p, m, v):
        return {}["missing"]

    ps.register_schedule("boom-faults", build, "raises KeyError")
    yield "boom-faults"
    ps.unregister_schedule("boom-faults")


def test_builder_exception_is_a_schedule_error_naming_the_schedule(boom):
    with pytest.raises(BuilderError) as caught:
        ps.compile_program(boom, 2, 4)
    assert isinstance(caught.value, ScheduleError) and isinstance(caught.value.__cause__, KeyError)
    assert str(caught.value).startswith("schedule 'boom-faults': its builder ")
    assert "raised KeyError: 'missing' (asked for num_ranks=2, num_microbatches=4, virtual_stages=1)" in str(caught.value)


def test_builder_exception_on_the_command_line_is_one_line_exit_2(capsys, boom):
    for argv in (("show", boom, "-p", "2", "-m", "4"), ("simulate", boom, "-p", "2", "-m", "4")):
        code, out, err = run(capsys, *argv)
        assert code == 2 and out == ""
        assert err.startswith("error: schedule 'boom-faults': its builder ") and "raised KeyError" in err
        assert "Traceback" not in err and len(err.splitlines()) == 1


def test_builder_argument_error_passes_through_unwrapped():
    def build(p, m, v):
        raise ps.ScheduleArgumentError("needs m >= 2p", argument="num_microbatches")

    ps.register_schedule("picky-faults", build, "refuses sizes")
    try:
        with pytest.raises(ps.ScheduleArgumentError) as caught:
            ps.compile_program("picky-faults", 2, 2)
        assert not isinstance(caught.value, BuilderError) and caught.value.argument == "num_microbatches"
    finally:
        ps.unregister_schedule("picky-faults")


def _run_into_closed_pipe(*argv) -> int:
    """Run the command line with stdout and stderr on a pipe nobody reads any more (`... | head -1` after head
    exited): every write raises BrokenPipeError."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run([sys.executable, "-m", "pipesched", *argv], stdout=write, stderr=write, cwd=ROOT,
                              timeout=120).returncode
    finally:
        os.close(write)


def test_closed_pipe_keeps_the_invalid_verdict():
    assert _run_into_closed_pipe("validate", str(BROKEN)) == 1
    assert _run_into_closed_pipe("validate", "--json", str(BROKEN)) == 1


def test_closed_pipe_keeps_a_bad_argument_exit_2_and_a_success_0():
    assert _run_into_closed_pipe("simulate", "no-such-schedule") == 2
    assert _run_into_closed_pipe("show", "1f1b", "-p", "2", "-m", "2") == 0


def test_json_errors_are_json_on_stdout_too(capsys):
    code, out, err = run(capsys, "simulate", "no-such-schedule", "--json")
    assert code == 2 and err.startswith("error: unknown schedule 'no-such-schedule'")
    data = json.loads(out)
    assert data["exit_status"] == 2 and data["error"].startswith("unknown schedule 'no-such-schedule'")
    code, out, _ = run(capsys, "simulate", "no-such-schedule")
    assert code == 2 and out == ""  # without --json stdout stays empty


def test_plan_names_its_top_option(capsys, tmp_path):
    code, _, err = run(capsys, "plan", "--profile", str(_profile(tmp_path)), "--world-size", "2", "--memory", "1GiB",
                       "--batch", "4", "--top", "0")
    assert code == 2 and err.startswith("error: --top must be an integer >= 1, got 0")


def _profile(tmp_path):
    layers = 4
    profile = ps.LayerProfile(forward=[1e-3] * layers, input_grad=[1e-3] * layers, weight_grad=[1e-3] * layers,
                              activation_bytes=[1000] * layers, output_bytes=[100] * layers, param_bytes=[1000] * layers,
                              microbatch_size=1)
    path = tmp_path / "profile.json"
    profile.save(path)
    return path


def test_stage_to_rank_beyond_the_file_names_no_api_argument(capsys, tmp_path):
    csv = tmp_path / "ok.csv"
    from pipesched.interop import to_torch_csv

    to_torch_csv(ps.compile_program("1f1b", 2, 2), csv)
    code, _, err = run(capsys, "validate", "--torch-csv", str(csv), "--stage-to-rank", "0,1,2")
    assert code == 2 and err.startswith("error: --stage-to-rank 0,1,2: ")
    assert "num_ranks" not in err and "from_torch_csv" not in err


@pytest.mark.parametrize("torch_csv", [False, True])
def test_binary_file_is_named(capsys, tmp_path, torch_csv):
    path = tmp_path / "binary.bin"
    path.write_bytes(b"\x8a\xff\x00garbage")
    argv = ("validate", "--torch-csv", str(path)) if torch_csv else ("validate", str(path))
    code, _, err = run(capsys, *argv)
    assert code == 1 and f"{path}: not UTF-8 text: byte 0x8a at offset 0" in err and "codec" not in err
    with pytest.raises(ps.ProgramFormatError, match="binary.bin: not UTF-8 text"):
        from pipesched.interop import from_torch_csv

        from_torch_csv(path)


def test_binary_profile_is_named(capsys, tmp_path):
    path = tmp_path / "profile.json"
    path.write_bytes(b"\x8a\xff\x00")
    code, _, err = run(capsys, "plan", "--profile", str(path), "--world-size", "2", "--memory", "1GiB", "--batch", "4")
    assert code == 2 and err.startswith(f"error: --profile: {path}: not UTF-8 text: byte 0x8a at offset 0; expected "
                                        f"a file written by LayerProfile.save")
