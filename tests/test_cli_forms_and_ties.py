"""Leftovers of issue 13 (torch-free): validate --torch-csv's --dp/--stage-to-rank and its REDUCE_GRAD report,
show --torch-csv with --json, zb-auto's cost options on every command that compiles a schedule by name, overlap
pairs in the text and JSON forms, a tie on one rank (the V's embedding and head), and ties in a user's program."""
import argparse
import json
import warnings

import pytest

import pipesched as ps
from pipesched import lower, program_io
from pipesched.cli import main, make_parser
from pipesched.errors import InvalidProgramError, ProgramFormatError
from pipesched.interop import OVERLAP_META, TorchCsvWarning, from_torch_csv, to_torch_csv
from pipesched.ir import OVERLAP_PAIRS, Instr, Op
from pipesched.user_programs import check_user_program, program_with_ties

from test_interop import ONE_F_ONE_B, write  # torch 2.13's 1F1B CSV (p=2, m=2) and its writer


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# ---- 1. validate --torch-csv: --dp, --stage-to-rank, REDUCE_GRAD reported or mapped --------------------------------

def test_reduce_grad_is_reported_when_dropped_and_mapped_to_all_reduce_with_dp(tmp_path):
    path = write(tmp_path, ONE_F_ONE_B)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TorchCsvWarning)
        program = from_torch_csv(path)
    assert [str(w.message).split(": ", 1)[1][:60] for w in caught] == [
        "dropped 2 UNSHARD, 2 RESHARD: FSDP-only actions (fetching an",
        "dropped 2 REDUCE_GRAD: with dp_size=1 there are no replicas "]
    assert program.ranks == ps.compile_program("1f1b", 2, 2).ranks
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TorchCsvWarning)
        mapped = from_torch_csv(path, dp_size=2)
    assert [str(w.message) for w in caught if "REDUCE_GRAD" in str(w.message)] == []  # mapped, not dropped
    # each REDUCE_GRAD (after its stage's last backward) is exactly where lowering puts the stage's ALL_REDUCE
    assert mapped.ranks == ps.compile_program("1f1b", 2, 2, dp_size=2).ranks and mapped.dp_size == 2


def test_cli_validate_torch_csv_takes_dp_and_reports_what_it_dropped(tmp_path, capsys):
    path = write(tmp_path, ONE_F_ONE_B)
    code, out, err = run(capsys, "validate", "--torch-csv", path)
    assert code == 0 and ", 2 microbatches, 16 instructions;" in out
    assert f"note: {path}: dropped 2 REDUCE_GRAD: with dp_size=1" in err and "--dp N" in err
    code, out, err = run(capsys, "validate", "--torch-csv", path, "--dp", "2")
    assert code == 0 and ", 2 microbatches, 2 data-parallel replicas, 18 instructions;" in out
    assert "REDUCE_GRAD" not in err and "dropped 2 UNSHARD, 2 RESHARD" in err
    code, out, _ = run(capsys, "validate", "--torch-csv", path, "--dp", "2", "--json")
    assert code == 0 and json.loads(out)["dp_size"] == 2 and json.loads(out)["instructions"] == 18


def test_cli_validate_torch_csv_takes_stage_to_rank(tmp_path, capsys):
    path = tmp_path / "zbv.csv"
    to_torch_csv(ps.compile_program("zbv", 2, 3), path)
    code, out, _ = run(capsys, "validate", "--torch-csv", path, "--stage-to-rank", "0,1,1,0")
    assert code == 0 and out.startswith(f"valid: {path}: 2 ranks, 4 stages")
    code, _, err = run(capsys, "validate", "--torch-csv", path, "--stage-to-rank", "0,1,0,1")
    assert code == 2 and err.startswith("error: --stage-to-rank 0,1,0,1: ")
    assert "(rank 0, 3RECV_F0): stage_to_rank gives stage 3 rank 1, but this action of it is on rank 0" in err
    code, _, err = run(capsys, "validate", "--torch-csv", path, "--stage-to-rank", "0,1,1,2")
    assert code == 2 and "error: --stage-to-rank 0,1,1,2: " in err and "names a rank outside 0..1" in err


def test_cli_validate_refuses_dp_and_stage_to_rank_with_a_program_file_and_bad_values(tmp_path, capsys):
    path = tmp_path / "p.txt"
    path.write_text(ps.to_text(ps.compile_program("1f1b", 2, 2)))
    code, _, err = run(capsys, "validate", path, "--dp", "2")
    assert code == 2 and f"error: --dp applies to --torch-csv FILE; a program in pipesched's form ({path})" in err
    code, _, err = run(capsys, "validate", path, "--stage-to-rank", "0,1")
    assert code == 2 and "error: --stage-to-rank applies to --torch-csv FILE" in err
    for flag, value, message in (("--dp", "0", "expected an integer >= 1 (data-parallel replicas), got '0'"),
                                 ("--stage-to-rank", "0,x", "expected the rank (an integer >= 0) of each stage")):
        with pytest.raises(SystemExit):
            main(["validate", "--torch-csv", str(path), flag, value])
        assert message in capsys.readouterr().err


# ---- 2. show --torch-csv OUT with --json ---------------------------------------------------------------------------

def test_show_torch_csv_with_json_prints_the_json_form_and_writes_the_same_file(tmp_path, capsys):
    argv = ["show", "zbv", "-p", "2", "-m", "3", "--torch-csv"]
    code, out, err = run(capsys, *argv, tmp_path / "a.csv", "--json")
    assert code == 0 and json.loads(out) == program_io.to_json_dict(ps.compile_program("zbv", 2, 3))
    assert err.startswith(f"wrote {tmp_path / 'a.csv'}: zbv, 2 ranks, 4 stages")
    code, out, _ = run(capsys, *argv, tmp_path / "b.csv")  # without --json: the line on stdout, the same file
    assert code == 0 and out.startswith(f"wrote {tmp_path / 'b.csv'}")
    assert (tmp_path / "a.csv").read_bytes() == (tmp_path / "b.csv").read_bytes()
    code, out, _ = run(capsys, "show", "zbv", "-p", "2", "-m", "3", "--compute-only", "--json",
                       "--torch-csv", tmp_path / "c.csv")
    assert code == 0 and json.loads(out) == program_io.to_json_dict(ps.build("zbv", 2, 3))


# ---- 3. zb-auto's cost options on show, simulate and render --------------------------------------------------------

def _commands():
    parser = make_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: sub.choices[name] for name in ("show", "simulate", "render")}


def test_every_command_that_compiles_a_schedule_by_name_takes_the_cost_options_and_memory_limit():
    options = {name: set(p._option_string_actions) for name, p in _commands().items()}
    cost = {"--forward", "--backward", "--input-grad", "--weight-grad", "--recompute-cost", "--latency", "--bandwidth",
            "--activation-bytes", "--stash-bytes", "--input-bytes", "--recompute-bytes", "--grad-bytes", "--tie-bytes",
            "--memory-limit", "--ranks", "--ties", "--schedule-module"}
    for name, flags in options.items():
        assert cost <= flags, (name, cost - flags)
    shared = options["show"] & options["simulate"] & options["render"]
    assert cost <= shared


def test_show_builds_zb_auto_for_the_cost_options_as_compile_program_does(capsys):
    costs = ps.CostModel(forward=1.0, backward=4.0, weight_grad=3.0, latency=0.5)
    expect = ps.compile_program("zb-auto", 4, 8, costs=costs, memory_limit=2)
    default = ps.compile_program("zb-auto", 4, 8, costs=ps.CostModel(), memory_limit=2)
    assert expect != default  # the costs change the program: a show that ignored them would fail below
    code, out, _ = run(capsys, "show", "zb-auto", "-p", "4", "-m", "8", "--backward", "4", "--weight-grad", "3",
                       "--latency", "0.5", "--memory-limit", "2", "--json")
    assert code == 0 and program_io.from_json_dict(json.loads(out)) == expect
    code, out, _ = run(capsys, "show", "zb-auto", "-p", "4", "-m", "8", "--backward", "4", "--weight-grad", "3",
                       "--latency", "0.5", "--memory-limit", "2", "--compute-only", "--json")
    assert code == 0 and program_io.from_json_dict(json.loads(out)) == ps.build("zb-auto", 4, 8, costs=costs,
                                                                                 memory_limit=2)


def test_show_refuses_cost_options_for_a_schedule_built_without_costs(capsys):
    code, _, err = run(capsys, "show", "1f1b", "-p", "2", "--latency", "0.5")
    assert code == 2 and err.startswith("error: --latency 0.5 sets a cost that a schedule built from costs (zb-auto)")
    assert "1f1b is built without costs" in err
    code, _, err = run(capsys, "show", "zb-auto", "-p", "2", "--forward", "1,2,3")
    assert code == 2 and "--forward: cost forward has 3 values but the program has 2 stages" in err


def test_simulate_and_render_build_zb_auto_for_their_costs(capsys, tmp_path):
    costs = ps.CostModel(forward=1.0, backward=4.0, weight_grad=3.0, latency=0.5)
    makespan = ps.simulate(ps.compile_program("zb-auto", 4, 8, costs=costs, memory_limit=2), costs).makespan
    argv = ["zb-auto", "-p", "4", "-m", "8", "--backward", "4", "--weight-grad", "3", "--latency", "0.5",
            "--memory-limit", "2"]
    code, out, _ = run(capsys, "simulate", *argv, "--json")
    assert code == 0 and json.loads(out)["makespan"] == makespan
    code, out, _ = run(capsys, "render", *argv, "-o", tmp_path / "t.json")
    assert code == 0
    events = json.loads((tmp_path / "t.json").read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    assert max(e["ts"] + e.get("dur", 0) for e in events if "ts" in e) == pytest.approx(makespan * 1e6)


# ---- 4. overlap pairs in the text and JSON forms -------------------------------------------------------------------

@pytest.mark.parametrize("p, m", [(2, 4), (3, 7), (4, 8)])
def test_overlap_pairs_survive_the_text_and_json_forms(p, m):
    program = ps.compile_program("dualpipev", p, m)
    pairs = program.meta[OVERLAP_PAIRS]
    assert pairs and all(len(g) == 2 for g in pairs)
    for loaded in (ps.loads(ps.to_text(program)), ps.loads(ps.to_json(program))):
        assert loaded == program and loaded.meta[OVERLAP_PAIRS] == pairs
        assert ps.to_text(loaded) == ps.to_text(program)
    line = next(x for x in ps.to_text(program).splitlines() if x.startswith("overlap_pairs: "))
    assert line.split(": ")[1].split()[0] == "+".join(map(str, pairs[0]))


def test_a_file_without_overlap_pairs_still_loads_and_a_program_without_them_writes_none():
    text = ps.to_text(ps.compile_program("dualpipev", 2, 4))
    old = "\n".join(x for x in text.splitlines() if not x.startswith("overlap_pairs:")) + "\n"
    assert old != text and OVERLAP_PAIRS not in ps.loads(old).meta
    assert ps.loads(old) == ps.loads(text)
    assert "overlap_pairs" not in ps.to_text(ps.compile_program("zbv", 2, 4))
    assert "overlap_pairs" not in ps.to_json(ps.compile_program("zbv", 2, 4))
    only_forward = ps.compile_program("dualpipev", 2, 4, forward_only=True)  # the pairs' B are gone: none written
    assert "overlap_pairs" not in ps.to_text(only_forward) and ps.loads(ps.to_text(only_forward)) == only_forward


@pytest.mark.parametrize("pairs, message", [
    ("F0.3+B9.1", "overlap_pairs: F0.3\\+B9.1: B9.1 is not an instruction of the program"),
    ("F0.3+F1.0", "overlap_pairs: F0.3\\+F1.0: its instructions are on ranks 0 and 1"),
    ("F0.3", "overlap_pairs: F0.3: a pair joins exactly 2 instructions, this one 1"),
    ("F0.3+F0.2+B3.1", "overlap_pairs: F0.3\\+F0.2\\+B3.1: a pair joins exactly 2 instructions, this one 3"),
    ("F0.3+Q1", "bad header value: overlap_pairs: cannot parse instruction 'Q1'"),
])
def test_a_bad_overlap_pair_is_refused_naming_it(pairs, message):
    text = ps.to_text(ps.compile_program("dualpipev", 2, 4))
    lines = [f"overlap_pairs: {pairs}" if x.startswith("overlap_pairs:") else x for x in text.splitlines()]
    with pytest.raises(ProgramFormatError, match=message):
        ps.loads("\n".join(lines))


def test_a_torch_overlap_group_survives_our_text_form_back_to_torch(tmp_path):
    path = write(tmp_path, "0F0,1F0,(0F1;1B0)OVERLAP_F_B,1F1,1B1,0B0,0B1\r\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TorchCsvWarning)
        program = from_torch_csv(path)
    loaded = ps.loads(ps.to_text(program))
    assert loaded.meta[OVERLAP_META] == ((Instr(Op.F, 0, 1), Instr(Op.B, 1, 0)),)
    # the text form keeps the overlap group, not where the program was read from: a program on one rank is written
    # compute_comms (with its REDUCE_GRAD) unless asked otherwise
    to_torch_csv(loaded, tmp_path / "back.csv", comms=False)
    assert (tmp_path / "back.csv").read_bytes() == path.read_bytes()
    to_torch_csv(program, tmp_path / "direct.csv")  # read from a compute_only file: written back as one
    assert (tmp_path / "direct.csv").read_bytes() == path.read_bytes()


# ---- 5. a tie on one rank ------------------------------------------------------------------------------------------

def test_a_tie_on_one_rank_needs_no_tie_reduce_and_is_accepted():
    zbv = ps.compile_program("zbv", 2, 4)  # placement 0 1 1 0: stages 0 and 3 on rank 0
    assert lower.add_tie_reduce(zbv, [(0, 3)]) == zbv
    assert ps.compile_program("zbv", 2, 4, ties=[(3, 0)]) == zbv
    both = ps.compile_program("zbv", 2, 4, ties=[(0, 3), (0, 1, 2)])
    assert both == ps.compile_program("zbv", 2, 4, ties=[(0, 1, 2)]) and both.ties == ((0, 1, 2),)
    tie_reduce = [[str(i) for i in s if i.op is Op.TIE_REDUCE] for s in both.ranks]
    assert tie_reduce == [["TIE_REDUCE0"], ["TIE_REDUCE1"]]  # the V: rank 1's stage 1 ends its backward last
    assert ps.compile_program("dualpipev", 3, 6, ties=[(0, 5)]).ties == ()
    with pytest.raises(ps.ScheduleArgumentError, match=r"ties: a tie is given twice"):  # still checked
        ps.compile_program("zbv", 2, 4, ties=[(0, 3), (3, 0)])
    program = ps.compile_program("zbv", 2, 4)  # a Program's own ties are the ones that need a collective
    with pytest.raises(InvalidProgramError, match=r"the program's ties: the stages \(0, 3\) are all on rank 0"):
        ps.validate(ps.Program(program.ranks, program.stage_to_rank, 4, ties=[(0, 3)]))


def test_the_command_line_accepts_a_tie_on_one_rank_with_a_note(capsys):
    code, out, err = run(capsys, "show", "zbv", "-p", "2", "-m", "4", "--ties", "0,3", "--format", "text")
    assert code == 0 and out == ps.to_text(ps.compile_program("zbv", 2, 4))
    assert err == ("note: --ties 0,3: stages 0 and 3 are all on rank 0, where autograd sums the uses of the shared "
                   "parameter: no TIE_REDUCE needed\n")
    code, out, _ = run(capsys, "show", "zbv", "-p", "2", "-m", "4", "--ties", "0,3", "0,1", "--compute-only",
                       "--format", "text")
    assert code == 0 and "ties: 0,1\n" in out and out.count("TIE_REDUCE") == 2
    code, _, err = run(capsys, "simulate", "zbv", "-p", "2", "--ties", "0,3", "--tie-bytes", "5")
    assert code == 2 and "has no ties to reduce; its --ties are each on one rank (no TIE_REDUCE): drop" in err


# ---- 6. ties in a user's program (torch-free part; the runtime's in tests/runtime/test_one_rank_and_user_ties.py) -------

def test_a_users_program_with_ties_is_checked_against_the_models():
    plain = ps.compile_program("interleaved-1f1b", 2, 4, 2)
    model = ((0, 3), (0, 1, 2))  # the order the model lists them in
    added = program_with_ties(plain, model)
    assert added == ps.compile_program("interleaved-1f1b", 2, 4, 2, ties=model)  # as lowering adds them
    same = ps.compile_program("interleaved-1f1b", 2, 4, 2, ties=[(0, 1, 2), (0, 3)])
    assert check_user_program(same, 2, 4, None, 1) is same and program_with_ties(same, model) is same
    assert program_with_ties(plain, ()) is plain
    fewer = ps.compile_program("interleaved-1f1b", 2, 4, 2, ties=[(0, 3)])
    with pytest.raises(ValueError) as raised:
        program_with_ties(fewer, model)
    assert str(raised.value) == (
        "the program's ties ((0, 3)) differ from the model's (stages sharing a parameter on two ranks or more: (0, 3), "
        "(0, 1, 2)); give the program without ties and TIE_REDUCE (the Pipeline adds them for the model), or compile "
        "it with ties=[(0, 3), (0, 1, 2)]")
    with pytest.raises(ValueError, match=r"the program's ties \(\(0, 3\)\) differ from the model's \(.*: none\)"):
        program_with_ties(fewer, ())
