"""Sizes too big to build are refused at once, naming the arguments, their values and the limit
(pipesched.checks.MAX_PROGRAM_SIZE), before anything is built or read: compile, the CLI, from_torch_csv, the
planner; to_json's indent is checked. No test here builds a big program: each refusal would hang if the check
came after the building, and the boundary is checked on the check itself and, with the limit lowered, end to end."""
import io
import sys

import pytest

import pipesched
from pipesched import checks
from pipesched.api import build
from pipesched.cli import main
from pipesched.errors import ScheduleArgumentError
from pipesched.interop import from_torch_csv
from pipesched.planner import plan, predict
from pipesched.profile import LayerProfile

HUGE = 10**30
LIMIT_TEXT = "must be at most 524,288 (one per stage and microbatch, ~6 instructions each; e.g. p=64, m=1024, v=4 " \
             "is 262,144 and compiles in ~10 s); use fewer microbatches or ranks"


def test_the_limit_is_the_documented_one():
    assert checks.MAX_PROGRAM_SIZE == 524_288
    assert 64 * 1024 * 4 <= checks.MAX_PROGRAM_SIZE  # the largest configuration pipesched is meant for


def test_boundary_on_the_check_itself():
    checks.check_program_size(2, 262_144, 1)  # exactly at the limit: allowed
    checks.check_program_size(128, 1024, 4)
    with pytest.raises(ScheduleArgumentError) as info:
        checks.check_program_size(2, 262_145, 1)
    assert str(info.value) == ("num_ranks=2 x num_microbatches=262145 x virtual_stages=1 is too big a program: "
                               "num_ranks x num_microbatches x virtual_stages " + LIMIT_TEXT)
    assert info.value.argument == "num_microbatches"


@pytest.mark.parametrize("args, argument, shown", [
    (("1f1b", HUGE, 4), "num_ranks", f"num_ranks={HUGE} x num_microbatches=4 x virtual_stages=1"),
    (("1f1b", 4, HUGE), "num_microbatches", f"num_ranks=4 x num_microbatches={HUGE} x virtual_stages=1"),
    (("interleaved-1f1b", 4, 8, HUGE), "virtual_stages", f"num_ranks=4 x num_microbatches=8 x virtual_stages={HUGE}"),
    (("1f1b", 2, 262_145), "num_microbatches", "num_ranks=2 x num_microbatches=262145 x virtual_stages=1"),
])
def test_compile_program_refuses_huge_sizes(args, argument, shown):
    with pytest.raises(ScheduleArgumentError) as info:
        pipesched.compile_program(*args)
    assert str(info.value) == f"{shown} is too big a program: num_ranks x num_microbatches x virtual_stages {LIMIT_TEXT}"
    assert info.value.argument == argument


def test_int_past_the_digit_limit_is_shown_by_its_size():
    with pytest.raises(ScheduleArgumentError, match=r"^num_ranks=4 x num_microbatches=\(an int of 33220 bits\) x"):
        pipesched.compile_program("1f1b", 4, 10**10000)


def test_boundary_end_to_end_with_a_lowered_limit(monkeypatch):
    """The check runs in build(), before the schedule's builder: every entry point that builds goes through it."""
    monkeypatch.setattr(checks, "MAX_PROGRAM_SIZE", 24)
    assert len(pipesched.compile_program("1f1b", 2, 12)) == 2 * 12 * 4  # p * m = 24: compiles
    assert len(build("interleaved-1f1b", 2, 6, 2).ranks) == 2  # 2 x 6 x 2 = 24
    with pytest.raises(ScheduleArgumentError, match=r"^num_ranks=2 x num_microbatches=13 x virtual_stages=1 is too"):
        pipesched.compile_program("1f1b", 2, 13)
    with pytest.raises(ScheduleArgumentError, match=r"^num_ranks=2 x num_microbatches=7 x virtual_stages=2 is too"):
        build("interleaved-1f1b", 2, 7, 2)


def test_bad_types_still_get_their_own_messages():
    with pytest.raises(ScheduleArgumentError, match="num_microbatches"):
        pipesched.compile_program("1f1b", 4, "many")


def test_cli_simulate_refuses_huge_microbatches(capsys):
    assert main(["simulate", "1f1b", "-m", "99999999999999999999"]) == 2
    err = capsys.readouterr().err
    assert err == ("error: --microbatches 99999999999999999999: num_ranks=4 x num_microbatches=99999999999999999999 x "
                   "virtual_stages=1 is too big a program: num_ranks x num_microbatches x virtual_stages "
                   + LIMIT_TEXT + "\n")


def test_from_torch_csv_refuses_huge_num_ranks_before_reading(tmp_path):
    path = tmp_path / "s.csv"
    path.write_text("0F0,0B0\n")
    with pytest.raises(ScheduleArgumentError) as info:
        from_torch_csv(path, num_ranks=HUGE)
    assert str(info.value) == (f"from_torch_csv: num_ranks={HUGE} x num_microbatches=1 x virtual_stages=1 is too big "
                               f"a program: num_ranks x num_microbatches x virtual_stages " + LIMIT_TEXT)
    assert info.value.argument == "num_ranks"
    with pytest.raises(ScheduleArgumentError, match="^from_torch_csv: num_ranks=2 x num_microbatches=262145 x"):
        from_torch_csv(tmp_path / "missing.csv", num_ranks=2, num_microbatches=262_145)  # refused before opening


def test_from_torch_csv_stage_to_rank_str_message(tmp_path):
    path = tmp_path / "s.csv"
    path.write_text("0F0,0B0\n")
    with pytest.raises(ValueError) as info:
        from_torch_csv(path, stage_to_rank=("2",))
    assert str(info.value) == ("from_torch_csv: stage_to_rank=('2',) must hold integer ranks (one per stage): "
                               "str '2' is not an integer")
    with pytest.raises(ValueError) as info:
        from_torch_csv(path, stage_to_rank=(True,))
    assert str(info.value) == ("from_torch_csv: stage_to_rank=(True,) must hold integer ranks (one per stage): "
                               "bool True is not an integer (a bool is not a rank)")


def profile6() -> LayerProfile:
    L, MiB = 6, 2**20
    return LayerProfile(forward=[1e-3] * L, input_grad=[1e-3] * L, weight_grad=[1e-3] * L,
                        activation_bytes=[8 * MiB] * L, output_bytes=[MiB] * L, param_bytes=[4 * MiB] * L,
                        microbatch_size=1, latency=1e-5, bandwidth=1e9)


def test_planner_refuses_huge_microbatches():
    with pytest.raises(ScheduleArgumentError) as info:
        plan(profile6(), 2, 1e12, HUGE, max_microbatches=HUGE)
    assert str(info.value) == (f"pp=1 x max_microbatches={HUGE} x virtual_stages=1 is too big a program: "
                               f"pp x max_microbatches x virtual_stages " + LIMIT_TEXT)
    assert info.value.argument == "max_microbatches"
    with pytest.raises(ScheduleArgumentError) as info:
        predict(profile6(), HUGE, "1f1b", 2, num_microbatches=HUGE)
    assert str(info.value).startswith(f"pp=2 x num_microbatches={HUGE} x virtual_stages=1 is too big a program")
    assert info.value.argument == "num_microbatches"


@pytest.mark.parametrize("indent, exc, shown", [
    (HUGE, ValueError, str(HUGE)), (-1, ValueError, "-1"), (65, ValueError, "65"),
    (2.0, TypeError, "float 2.0"), (True, TypeError, "bool True"), ("2", TypeError, "str '2'"),
])
def test_to_json_indent(indent, exc, shown):
    program = pipesched.compile_program("1f1b", 2, 2)
    with pytest.raises(exc) as info:
        pipesched.to_json(program, indent=indent)
    assert type(info.value) is exc
    assert str(info.value) == f"to_json: indent must be None (one line) or an int 0..64 (spaces per level), got {shown}"


def test_to_json_indent_accepted():
    program = pipesched.compile_program("1f1b", 2, 2)
    assert pipesched.to_json(program, indent=64).startswith("{\n" + " " * 64 + '"')
    assert pipesched.to_json(program, indent=0).startswith("{\n\"")
    assert "\n" not in pipesched.to_json(program)


def test_profile_layers_run_counts_and_loss_fn_message():
    torch = pytest.importorskip("torch")
    from pipesched.runtime.profiling import profile_layers

    model, x = torch.nn.Sequential(torch.nn.Linear(4, 4)), torch.randn(2, 4)
    for kwargs, text in (({"repeat": HUGE}, f"repeat must be an int 1..10,000 (runs per measurement), got {HUGE}"),
                         ({"warmup": 10_001}, "warmup must be an int 0..10,000 (runs per measurement), got 10001")):
        with pytest.raises(ValueError) as info:
            profile_layers(model, x, **kwargs)
        assert str(info.value) == text
    with pytest.raises(TypeError) as info:
        profile_layers(model, x, loss_fn="mse")
    assert str(info.value) == "loss_fn must be callable, got str 'mse'"


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_plan_shows_progress_on_a_terminal_only(tmp_path, capsys, monkeypatch):
    from pipesched import progress

    path = tmp_path / "profile.json"
    profile6().save(path)
    argv = ["plan", "--profile", str(path), "--world-size", "2", "--memory", "1GiB", "--batch", "8", "--top", "1"]
    monkeypatch.setattr(progress, "AFTER_SECONDS", 0.0)
    assert main(argv) == 0
    plain = capsys.readouterr()
    assert plain.err == ""  # not a terminal: nothing
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(argv) == 0
    assert capsys.readouterr().out == plain.out  # stdout as is
    shown = terminal.getvalue()
    assert shown.startswith("\r\x1b[K[0 s] simulating: timing ") and shown.endswith("\r\x1b[K") and "\n" not in shown
