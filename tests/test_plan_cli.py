"""``pipesched plan``: the table, the JSON form, the picture, and the exit statuses (1: nothing fits, 2: bad
option)."""
import json

import pytest

from pipesched.cli import main
from pipesched.plan_cli import parse_bytes
from pipesched.planner import format_bytes, plan
from pipesched.profile import LayerProfile

MiB = 2**20


@pytest.fixture
def profile_file(tmp_path):
    layers = 8
    profile = LayerProfile(forward=[1e-3] * layers, input_grad=[1e-3] * layers, weight_grad=[1e-3] * layers,
                           activation_bytes=[8 * MiB] * layers, output_bytes=[MiB] * layers,
                           param_bytes=[4 * MiB] * layers, microbatch_size=1, latency=1e-5, bandwidth=1e9)
    path = tmp_path / "profile.json"
    profile.save(path)
    return path, profile


def test_table(profile_file, capsys):
    path, profile = profile_file
    assert main(["plan", "--profile", str(path), "--world-size", "4", "--memory", "1GiB", "--batch", "32",
                 "--top", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:6] == ["#", "schedule", "pp", "dp", "m", "v"]
    assert len(out) == 5 and out[-1].startswith("winner: ")
    best = plan(profile, 4, 2**30, 32, top=3).best
    assert out[1].split()[1:6] == [best.schedule, str(best.pp), str(best.dp), str(best.num_microbatches),
                                   str(best.virtual_stages)]
    # the winner's peak in the table's unit (was "peak 0.000514 GiB" under a table in KiB: a new user's trial, s14)
    assert f"peak {format_bytes(max(best.peak_memory))})" in out[-1]


def test_json_is_the_plan(profile_file, capsys):
    path, profile = profile_file
    assert main(["plan", "--profile", str(path), "--world-size", "4", "--memory", "512MiB", "--batch", "32",
                 "--json", "--schedules", "1f1b", "zbv"]) == 0
    data = json.loads(capsys.readouterr().out)
    expected = plan(profile, 4, 512 * MiB, 32, schedules=["1f1b", "zbv"]).to_json()
    assert data == expected
    first = data["candidates"][0]
    assert set(first) == {"schedule", "pp", "dp", "num_microbatches", "virtual_stages", "balance", "recompute",
                          "split_backward", "microbatch_size", "step_time", "bubble_fraction", "peak_memory", "costs"}
    assert {c["schedule"] for c in data["candidates"]} <= {"1f1b", "zbv"}


def test_nothing_fits_exits_1_naming_the_smallest_memory(profile_file, capsys):
    path, profile = profile_file
    assert main(["plan", "--profile", str(path), "--world-size", "2", "--memory", "1e6", "--batch", "8"]) == 1
    err = capsys.readouterr().err
    try:
        plan(profile, 2, 1e6, 8)
    except ValueError as exc:
        smallest = exc.smallest
    assert "the smallest memory per rank that fits is" in err and f"({int(-(-smallest // 1))} bytes)" in err
    assert "--memory=977 KiB" in err and "pp=" in err


def test_render_draws_the_winner(profile_file, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path, _ = profile_file
    out = tmp_path / "pics" / "winner.png"
    assert main(["plan", "--profile", str(path), "--world-size", "2", "--memory", "1GiB", "--batch", "8",
                 "--render", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args, words", [
    (["--world-size", "0"], ["--world-size", "0"]),
    (["--memory", "lots"], ["--memory", "'lots'", "16GiB"]),
    (["--memory", "0GiB"], ["--memory"]),
    (["--batch", "3", "--world-size", "16"], ["--batch=3", "divisible by 2"]),
    (["--schedules", "nope"], ["--schedules", "nope"]),
])
def test_bad_options_exit_2(profile_file, capsys, args, words):
    path, _ = profile_file
    base = {"--world-size": "4", "--memory": "1GiB", "--batch": "32"}
    argv = ["plan", "--profile", str(path)]
    for key, value in base.items():
        if key not in args:
            argv += [key, value]
    assert main(argv + args) == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err


def test_missing_profile_exits_2(tmp_path, capsys):
    assert main(["plan", "--profile", str(tmp_path / "none.json"), "--world-size", "2", "--memory", "1GiB",
                 "--batch", "8"]) == 2
    assert "--profile" in capsys.readouterr().err


@pytest.mark.parametrize("text, value", [("16GiB", 16 * 2**30), ("512MiB", 512 * MiB), ("1e9", 1e9), ("2GB", 2e9),
                                         ("1.5 gib", 1.5 * 2**30), ("4096", 4096)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


def test_demo_plan_exits_1_naming_the_smallest_memory_when_nothing_fits(capsys):
    from pipesched.demo.train import main as demo_main

    with pytest.raises(SystemExit) as info:
        demo_main(["--plan", "--memory", "1KiB", "--ranks", "2", "--width", "32", "--context", "16", "--batch", "4"])
    assert info.value.code == 1
    assert "smallest" in capsys.readouterr().err


def test_demo_plan_options(capsys):
    from pipesched.demo.options import options

    args = options(["--plan", "--memory", "2GiB", "--ranks", "2"])
    assert args.plan and args.memory == 2 * 2**30 and args.plan_top == 5
    for argv, words in ((["--memory", "2GiB"], "--memory is the budget of --plan"),
                        (["--plan", "--memory", "much"], "--memory 'much'"),
                        (["--plan", "--plan-top", "0"], "--plan-top must be >= 1"),
                        (["--plan", "--schedule", "zbv", "--microbatches", "3", "--recompute"],
                         "--schedule zbv, --microbatches 3, --recompute True: --plan decides the schedule"),
                        (["--plan", "--balance", "2,2,2,1"], "--balance 2,2,2,1: --plan decides")):
        with pytest.raises(SystemExit) as info:
            options(argv)
        assert info.value.code == 2 and words in capsys.readouterr().err


def test_format_bytes_never_prints_an_exponent():
    # 1000-1023 of a unit printed as 1.02e+03 KiB in the plan table (a new user's trial)
    assert format_bytes(1044480) == "1020 KiB"
    assert format_bytes(1024000) == "1000 KiB"
    assert format_bytes(1023 * 2**30) == "1023 GiB"
    assert format_bytes(17179869184) == "16 GiB"
    assert format_bytes(1.5 * 2**20) == "1.5 MiB"
    assert format_bytes(10.25 * 2**20) == "10.2 MiB"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(2**20 - 1) == "1 MiB" and format_bytes(1023.4 * 2**10) == "1023 KiB"
