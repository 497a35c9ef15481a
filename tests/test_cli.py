"""The command line: each subcommand's output and exit code, including --json for tools."""
import json
from pathlib import Path

import pytest

from pipesched.cli import main

EXAMPLES = Path(__file__).resolve().parents[1] / "schedules" / "examples"


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_list(capsys):
    code, out, _ = run(capsys, "list")
    assert code == 0 and [line.split()[0] for line in out.splitlines()] == ["gpipe", "1f1b", "interleaved-1f1b",
                                                                               "zb-h1", "zb-h2", "zbv", "dualpipev", "zb-auto"]


def test_show_json_is_the_program(capsys):
    code, out, _ = run(capsys, "show", "1f1b", "--ranks", "2", "--microbatches", "3", "--json")
    data = json.loads(out)
    assert code == 0 and data["num_microbatches"] == 3 and data["stage_to_rank"] == [0, 1]
    assert data["ranks"][1][0] == {"op": "RECV_F", "stage": 1, "microbatch": 0, "peer": 0}


def test_show_grid(capsys):
    code, out, _ = run(capsys, "show", "gpipe", "-p", "2", "-m", "1", "--compute-only")
    assert code == 0 and out.splitlines()[2].split() == ["0", "F0.0", "F1.0"]


def test_simulate_json(capsys):
    code, out, _ = run(capsys, "simulate", "1f1b", "-p", "4", "-m", "8", "--json")
    data = json.loads(out)
    assert code == 0
    assert data["bubble_fraction"] == pytest.approx(3 / 11)
    assert data["makespan"] == pytest.approx(33.0)
    assert data["peak_inflight"] == [4, 3, 2, 1]


def test_simulate_cost_options(capsys):
    code, out, _ = run(capsys, "simulate", "gpipe", "-p", "2", "-m", "1", "--forward", "1,3", "--backward", "2,6",
                       "--json")
    assert code == 0 and json.loads(out)["makespan"] == 12


def test_validate_good_and_broken(capsys):
    code, out, _ = run(capsys, "validate", str(EXAMPLES / "handwritten-1f1b-p2-m3.txt"))
    assert code == 0 and out.startswith("valid:")
    code, _, err = run(capsys, "validate", str(EXAMPLES / "broken-deadlock.txt"))
    assert code == 1 and "deadlock" in err and "<-- here" in err
    code, out, _ = run(capsys, "validate", str(EXAMPLES / "broken-deadlock.txt"), "--json")
    assert code == 1 and json.loads(out)["cause"] == "deadlock"


def test_validate_json_form_file(tmp_path, capsys):
    path = tmp_path / "p.json"
    run(capsys, "show", "interleaved-1f1b", "-p", "2", "-m", "3", "--json")
    main(["show", "interleaved-1f1b", "-p", "2", "-m", "3", "--json"])
    path.write_text(capsys.readouterr().out)
    code, out, _ = run(capsys, "validate", str(path), "--json")
    assert code == 0 and json.loads(out)["valid"] is True


def test_bad_arguments_exit_2_with_the_reason(capsys):
    code, _, err = run(capsys, "show", "nope", "-p", "2", "-m", "2")
    assert code == 2 and "valid names: 1f1b, dualpipev, gpipe, interleaved-1f1b" in err
    code, _, err = run(capsys, "simulate", "1f1b", "-p", "0", "-m", "2")
    assert code == 2 and "num_ranks must be an integer >= 1, got 0" in err


def test_missing_file(capsys):
    code, _, err = run(capsys, "validate", "/nonexistent/prog.txt")
    assert code == 2 and "cannot read" in err


def test_validate_says_when_a_program_is_compute_only(tmp_path, capsys):
    path = tmp_path / "compute-only.txt"
    path.write_text("microbatches: 1\nstage_to_rank: 0 1\nrank 0: F0.0 B0.0\nrank 1: F1.0 B1.0\n")
    code, out, _ = run(capsys, "validate", str(path))
    assert code == 0 and "1 microbatch," in out and "as a compute-only program" in out
    code, out, _ = run(capsys, "validate", str(path), "--json")
    assert code == 0 and json.loads(out)["compute_only"] is True


def test_bad_cost_option_is_named(capsys):
    code, _, err = run(capsys, "simulate", "1f1b", "-p", "2", "-m", "2", "--bandwidth", "0")
    assert code == 2 and "--bandwidth: cost bandwidth must be a number of bytes/s > 0" in err
    with pytest.raises(SystemExit):
        main(["simulate", "1f1b", "--forward", "abc"])
    assert "expected a number or a comma list of numbers, one per stage" in capsys.readouterr().err


def test_split_backward_flag_shows_i_and_w_and_shortens_a_latency_bound_1f1b(capsys):
    code, out, _ = run(capsys, "show", "1f1b", "-p", "2", "-m", "2", "--split-backward", "--format", "text")
    ops = {line.strip() for line in out.splitlines()}
    assert code == 0 and {"I1.0", "SEND_B1.0>0", "W1.0", "B0.0"} <= ops and "B1.0" not in ops
    spans = []
    for extra in ((), ("--split-backward",)):
        code, out, _ = run(capsys, "simulate", "1f1b", "-p", "2", "-m", "4", "--latency", "0.5", "--json", *extra)
        spans.append(json.loads(out)["makespan"])
    assert spans == [17.0, 15.0]


def test_input_and_weight_grad_costs_need_a_split_program(capsys):
    code, _, err = run(capsys, "simulate", "1f1b", "-p", "2", "-m", "4", "--weight-grad", "1.5")
    assert code == 2
    assert "--weight-grad 1.5 sets the cost of I/W, but this program runs fused B backwards (no I or W); " \
           "add --split-backward, or drop --weight-grad" in err
    code, out, _ = run(capsys, "simulate", "1f1b", "-p", "2", "-m", "4", "--split-backward", "--input-grad", "0.5",
                       "--weight-grad", "1.5", "--latency", "0.5", "--json")
    assert code == 0 and json.loads(out)["makespan"] == 14.5


@pytest.mark.parametrize("argv, message", [
    (("simulate", "1f1b", "-p", "2", "-m", "0"), "--microbatches 0: num_microbatches must be an integer >= 1, got 0"),
    (("show", "1f1b", "-p", "0", "-m", "2"), "--ranks 0: num_ranks must be an integer >= 1, got 0"),
    (("simulate", "1f1b", "-p", "2", "-m", "4", "--split-backward", "--input-grad", "1,2,3"),
     "--input-grad: cost input_grad has 3 values but the program has 2 stages"),
])
def test_size_and_cost_errors_name_the_option(capsys, argv, message):
    code, _, err = run(capsys, *argv)
    assert code == 2 and message in err


def test_recompute_cost_needs_recompute(capsys):
    code, _, err = run(capsys, "simulate", "1f1b", "-p", "2", "-m", "4", "--recompute-cost", "0.5")
    assert code == 2 and "--recompute-cost 0.5 sets the cost of R, but this program recomputes nothing; " \
                         "add --recompute, or drop --recompute-cost" in err
    code, out, _ = run(capsys, "simulate", "1f1b", "-p", "2", "-m", "4", "--recompute", "--recompute-cost", "0.5",
                       "--json")
    assert code == 0 and json.loads(out)["makespan"] == 17.0  # 1 + 4 x (F + R + B on rank 1) + B = 15 + 4 x 0.5


def test_version_is_the_installed_distributions(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out == f"pipesched {version('pipesched')}\n"


def _peaks(capsys, *extra):
    code, out, err = run(capsys, "simulate", "1f1b", "-p", "4", "-m", "8", "--json", *extra)
    assert code == 0, err
    return json.loads(out)["peak_activation_bytes"]


def test_every_memory_field_of_the_cost_model_is_an_option(capsys):
    # 1F1B, p=4, m=8: rank r holds 4-r microbatches at its peak; with --recompute each keeps its input, and the one
    # being recomputed what its R re-saves (at most one per rank at a time)
    assert _peaks(capsys, "--stash-bytes", "100") == [400, 300, 200, 100]
    assert _peaks(capsys, "--stash-bytes", "100", "--recompute") == [100, 100, 100, 100]  # inputs of 0 B
    assert _peaks(capsys, "--stash-bytes", "100", "--input-bytes", "10", "--recompute") == [130, 120, 110, 100]
    assert _peaks(capsys, "--stash-bytes", "100", "--input-bytes", "10", "--recompute-bytes", "110",
                  "--recompute") == [140, 130, 120, 110]
    assert _peaks(capsys, "--input-bytes", "10", "--recompute") == [40, 30, 20, 10]  # no stash given: still shown


def test_recompute_never_holds_more_than_the_stash_by_default(capsys):
    # a stash (10 B) smaller than the message (100 B): the default input is at most the stash (the stage's first
    # layer saves its input), so recompute holds what no recompute holds, not 10x more (it gave 400, 300, 200, 100)
    assert _peaks(capsys, "--activation-bytes", "100", "--stash-bytes", "10") == [40, 30, 20, 10]
    assert _peaks(capsys, "--activation-bytes", "100", "--stash-bytes", "10", "--recompute") == [40, 30, 20, 10]
    # a stage whose stash does not hold its input: say so with --input-bytes
    assert _peaks(capsys, "--activation-bytes", "100", "--stash-bytes", "10", "--input-bytes", "100",
                  "--recompute") == [400, 300, 200, 100]


@pytest.mark.parametrize("argv, message", [
    (("--input-bytes", "10"), "--input-bytes 10 sets what a recomputing stage keeps per microbatch, but this "
                              "program recomputes nothing; add --recompute, or drop --input-bytes"),
    (("--recompute-bytes", "1,2"), "--recompute-bytes 1,2 sets what a stage holds after its R, but this program "
                                   "recomputes nothing; add --recompute, or drop --recompute-bytes"),
    (("--recompute", "--input-bytes", "1,2"), "--input-bytes: cost input_bytes has 2 values but the program has 4 "
                                              "stages"),
    (("--recompute", "--recompute-bytes", "-1"), "--recompute-bytes: cost recompute_bytes must be a finite number"),
    (("--recompute", "--input-bytes", "10", "--recompute-bytes", "20,20,5,20"),
     "--recompute-bytes: cost recompute_bytes (5 for stage 2) must be >= input_bytes (10)"),
])
def test_input_and_recompute_bytes_errors_name_the_option(capsys, argv, message):
    code, _, err = run(capsys, "simulate", "1f1b", "-p", "4", "-m", "8", *argv)
    assert code == 2 and message in err


def test_every_cost_field_has_an_option_and_errors_carry_their_field():
    import dataclasses
    import pickle

    from pipesched.cli_costs import COST_FLAGS
    from pipesched.cost import CostError, CostModel

    assert set(COST_FLAGS) == {f.name for f in dataclasses.fields(CostModel)}
    with pytest.raises(CostError) as info:
        CostModel(recompute_bytes=[1.0, -1.0])
    assert info.value.field == "recompute_bytes" and isinstance(info.value, ValueError)
    with pytest.raises(CostError) as info:
        CostModel(input_grad=[1.0, 2.0]).per_stage("input_grad", 3)
    assert info.value.field == "input_grad"
    copy = pickle.loads(pickle.dumps(info.value))
    assert (copy.field, str(copy)) == ("input_grad", str(info.value))


def test_the_cli_names_the_option_from_the_errors_field_not_its_text(capsys, monkeypatch):
    # the messages here name no field at all: the option can only come from the attributes
    import pipesched.cli as cli
    import pipesched.cli_costs as cli_costs
    from pipesched.cost import CostError
    from pipesched.errors import ScheduleArgumentError

    def bad_cost(**_):
        raise CostError("grad_bytes", "too many bytes")

    monkeypatch.setattr(cli_costs, "CostModel", bad_cost)
    code, _, err = run(capsys, "simulate", "1f1b", "-p", "2", "-m", "2")
    assert code == 2 and "error: --grad-bytes: too many bytes" in err

    def bad_size(*_, **__):
        raise ScheduleArgumentError("too few for this schedule", argument="num_microbatches")

    monkeypatch.setattr(cli, "compile_program", bad_size)
    code, _, err = run(capsys, "show", "1f1b", "-p", "2", "-m", "3")
    assert code == 2 and "error: --microbatches 3: too few for this schedule" in err


def test_size_errors_carry_the_argument_they_name():
    import pickle

    from pipesched import ScheduleArgumentError, compile_program

    for kwargs, argument in ((dict(num_ranks=0), "num_ranks"), (dict(num_microbatches=-1), "num_microbatches"),
                             (dict(virtual_stages=2), "virtual_stages"), (dict(dp_size=0), "dp_size"),
                             (dict(recompute=[True]), "recompute")):
        sizes = dict(schedule="1f1b", num_ranks=2, num_microbatches=2) | kwargs
        with pytest.raises(ScheduleArgumentError) as info:
            compile_program(**sizes)
        assert info.value.argument == argument, kwargs
        assert pickle.loads(pickle.dumps(info.value)).argument == argument


def test_recompute_bytes_below_input_bytes_is_refused_per_stage():
    from pipesched.cost import CostError, CostModel

    CostModel(input_bytes=[10, 0], recompute_bytes=[10, 0])  # equal is fine: R re-saves nothing beyond the input
    with pytest.raises(CostError) as info:
        CostModel(input_bytes=[10, 30], recompute_bytes=25)
    assert info.value.field == "recompute_bytes" and "(25 for stage 1) must be >= input_bytes (30)" in str(info.value)


def test_the_cost_line_of_a_picture_names_the_byte_costs_given():
    from pipesched.cost import CostModel

    assert CostModel().describe() == "F=1 B=2"
    line = CostModel(activation_bytes=[100, 0], recompute=0.5, input_bytes=4, latency=0.1).describe()
    assert line == "F=1 B=2 R=0.5 act=[100,0]B input=4B latency=0.1s"


def test_options_a_forward_only_program_would_ignore_are_refused(capsys):
    code, _, err = run(capsys, "simulate", "1f1b", "-p", "2", "-m", "2", "--forward-only", "--dp", "2",
                       "--grad-bytes", "100")
    assert code == 2 and err.strip() == ("error: --grad-bytes with --forward-only: a forward-only program has no "
                                         "backward, so no recompute and no gradient all-reduce; drop --grad-bytes")
    code, _, err = run(capsys, "simulate", "1f1b", "-p", "2", "-m", "2", "--forward-only", "--recompute")
    assert code == 2 and "--recompute with --forward-only" in err
    code, out, _ = run(capsys, "simulate", "1f1b", "-p", "2", "-m", "2", "--forward-only", "--dp", "2")
    assert code == 0 and "peak in-flight 0" in out


@pytest.mark.parametrize("extra, other", [(["--json", "--format", "grid"], "--json"),
                                         (["--format", "text", "--torch-csv", "out.csv"], "--torch-csv")])
def test_show_refuses_format_next_to_another_form(capsys, tmp_path, monkeypatch, extra, other):
    # --format was ignored silently next to --json (a hunt's finding); --json with --torch-csv is one form (JSON
    # on stdout, the file written: tests/test_cli_forms_and_ties.py)
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, "show", "1f1b", "-p", "2", "-m", "2", *extra)
    assert code == 2
    assert err.strip().splitlines()[-1] == (f"error: show prints the program in one form; --format and {other} were "
                                            f"given: keep one")
    assert not (tmp_path / "out.csv").exists()
