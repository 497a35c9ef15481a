"""Tied parameters in the core: the TIE_REDUCE pass, its proof, its text and JSON forms, its simulated cost and its
pictures (torch-free)."""
import pytest

import pipesched as ps
from pipesched import lower
from pipesched.errors import DependencyError, InvalidProgramError, ScheduleArgumentError
from pipesched.ir import Instr, Op, Program
from pipesched.validate import validate


def _reduces(program):
    return {rank: [(pos, str(i)) for pos, i in enumerate(stream) if i.op is Op.TIE_REDUCE]
            for rank, stream in enumerate(program.ranks)}


def _edit(program, rank, stream):
    streams = list(program.ranks)
    streams[rank] = tuple(stream)
    return program.replace(streams)


def test_the_pass_puts_one_tie_reduce_after_the_last_backward_of_each_ranks_tied_stages():
    program = ps.compile_program("1f1b", 4, 4, ties=[(0, 3)])
    assert program.ties == ((0, 3),)
    rank0, rank3 = program.ranks[0], program.ranks[3]
    assert rank0[-1] == Instr(Op.TIE_REDUCE, 0) and rank0[-2] == Instr(Op.B, 0, 3)  # stage 0 sends no gradient
    assert rank3[-2:] == (Instr(Op.SEND_B, 3, 3, 2), Instr(Op.TIE_REDUCE, 3))  # after the send that follows B3.3
    assert _reduces(program)[1] == _reduces(program)[2] == []  # ranks 1 and 2 hold no tied stage


def test_interleaved_a_rank_holding_two_tied_stages_reduces_once_naming_the_one_whose_backward_ends_last():
    # p=2, v=2: stages 0, 2 on rank 0; 1, 3 on rank 1. Backwards run from the last chunk to the first, so stage 0
    # (rank 0) and stage 1 (rank 1) end last
    program = ps.compile_program("interleaved-1f1b", 2, 4, ties=[(0, 2, 3), (1, 2)], split_backward=True,
                                 dp_size=2)
    assert [[i for _, i in r] for r in _reduces(program).values()] == [["TIE_REDUCE0"], ["TIE_REDUCE1"]]
    stream = program.ranks[0]
    assert stream.index(Instr(Op.TIE_REDUCE, 0)) == len(stream) - 1  # after B0.3 and ALL_REDUCE0
    assert stream[-2] == Instr(Op.ALL_REDUCE, 0)


def test_compile_program_with_ties_equals_the_pass_applied_to_the_program_without():
    plain = ps.compile_program("gpipe", 2, 3, recompute=True)
    assert validate(lower.add_tie_reduce(plain, [(1, 0)])) == ps.compile_program("gpipe", 2, 3, recompute=True,
                                                                                ties=[(0, 1)])


@pytest.mark.parametrize("ties, message", [
    ([(0,)], r"ties: \(0,\) must name 2 or more distinct stages"),
    ([(0, 0)], r"ties: \(0, 0\) must name 2 or more distinct stages"),
    ([(0, 9)], r"ties: \(0, 9\) names a stage that is not an integer in 0\.\.3"),
    ([(0, 1), (1, 0)], r"ties: a tie is given twice"),
    ("0,1", r"ties must be a sequence of stage groups"),
])
def test_bad_ties_are_refused_naming_the_argument(ties, message):
    with pytest.raises(ScheduleArgumentError, match=message) as raised:
        ps.compile_program("interleaved-1f1b", 2, 4, ties=ties)  # a tie on one rank: tests/test_cli_forms_and_ties.py
    assert raised.value.argument == "ties"


def test_the_pass_refuses_a_forward_only_program_and_a_second_application():
    program = ps.compile_program("1f1b", 2, 2, ties=[(0, 1)])
    with pytest.raises(ValueError, match="already has ties"):
        lower.add_tie_reduce(program, [(0, 1)])
    with pytest.raises(ValueError, match="forward-only"):
        lower.add_tie_reduce(lower.forward_only(ps.compile_program("1f1b", 2, 2)), [(0, 1)])


def test_the_validator_rejects_a_missing_tie_reduce():
    program = ps.compile_program("1f1b", 2, 2, ties=[(0, 1)])
    dropped = _edit(program, 1, [i for i in program.ranks[1] if i.op is not Op.TIE_REDUCE])
    with pytest.raises(InvalidProgramError, match=r"rank 1 holds tied stages \[1\] \(ties \[\(0, 1\)\]\) but has no "
                                                  r"TIE_REDUCE"):
        validate(dropped)


def test_the_validator_rejects_a_tie_reduce_before_a_backward_of_its_tied_stages():
    program = ps.compile_program("1f1b", 2, 2, ties=[(0, 1)])
    stream = [i for i in program.ranks[0] if i.op is not Op.TIE_REDUCE]
    stream.insert(stream.index(Instr(Op.B, 0, 1)), Instr(Op.TIE_REDUCE, 0))  # before the last backward
    with pytest.raises(DependencyError, match=r"rank 0, TIE_REDUCE0: comes before the last backward of tied stage 0 "
                                              r"\(B0\.1\)"):
        validate(_edit(program, 0, stream))


def test_interleaved_a_tie_reduce_after_one_tied_stage_but_before_the_other_is_misplaced():
    program = ps.compile_program("interleaved-1f1b", 2, 4, ties=[(0, 2, 3)])
    stream = [i for i in program.ranks[0] if i.op is not Op.TIE_REDUCE]
    last_b2 = max(k for k, i in enumerate(stream) if i.op is Op.B and i.stage == 2)
    stream.insert(last_b2 + 1, Instr(Op.TIE_REDUCE, 2))  # after stage 2's backwards, before stage 0's last
    with pytest.raises(DependencyError, match=r"comes before the last backward of tied stage 0 \(B0\.3\)"):
        validate(_edit(program, 0, stream))
    stream = [i for i in program.ranks[0] if i.op is not Op.TIE_REDUCE] + [Instr(Op.TIE_REDUCE, 2)]
    with pytest.raises(InvalidProgramError, match="must name stage 0, the tied stage of rank 0 whose backward ends"):
        validate(_edit(program, 0, stream))


def test_the_validator_rejects_a_second_or_a_stray_tie_reduce():
    program = ps.compile_program("interleaved-1f1b", 2, 4, ties=[(0, 3)])
    second = _edit(program, 0, program.ranks[0] + (Instr(Op.TIE_REDUCE, 2),))
    with pytest.raises(InvalidProgramError, match="a second TIE_REDUCE on rank 0"):
        validate(second)
    untied = ps.compile_program("1f1b", 2, 2)
    stray = _edit(untied, 0, untied.ranks[0] + (Instr(Op.TIE_REDUCE, 0),))
    with pytest.raises(InvalidProgramError, match="TIE_REDUCE in rank 0, which holds no tied stage"):
        validate(stray)
    bad_ties = Program(program.ranks, program.stage_to_rank, 4, ties=((0, 2),))  # both on rank 0
    with pytest.raises(InvalidProgramError, match=r"the program's ties: the stages \(0, 2\) are all on rank 0"):
        validate(bad_ties)


def test_forward_only_and_early_receive_programs_keep_the_ties_and_the_forward_one_has_no_tie_reduce():
    programs = ps.step_programs(ps.compile_program("1f1b", 2, 4, ties=[(0, 1)]), "gloo")
    for program in programs[:4]:
        assert program.ties == ((0, 1),)
    assert _reduces(programs.forward) == _reduces(programs.learn_forward) == {0: [], 1: []}
    assert [[i for _, i in r] for r in _reduces(programs.train).values()] == [["TIE_REDUCE0"], ["TIE_REDUCE1"]]


@pytest.mark.parametrize("form", ["text", "json"])
def test_text_and_json_round_trip(form):
    program = ps.compile_program("interleaved-1f1b", 2, 4, dp_size=2, ties=[(0, 3), (1, 2)])
    text = str(program) if form == "text" else ps.to_json(program)
    assert ("ties: 0,3 1,2" in text) if form == "text" else ('"ties": [[0, 3], [1, 2]]' in text)
    again = ps.loads(text)
    assert again == program and again.ties == ((0, 3), (1, 2))
    assert "ties" not in str(ps.compile_program("1f1b", 2, 2))  # left out without ties
    assert Instr.parse("TIE_REDUCE3") == Instr(Op.TIE_REDUCE, 3)
    with pytest.raises(ValueError, match="TIE_REDUCE takes no microbatch or peer"):
        Instr(Op.TIE_REDUCE, 0, 1)


def test_the_simulator_times_the_tie_reduce_from_the_last_rank_to_start_it():
    # 1f1b p=2 m=4 dp=2, F=1 B=2: rank 0 starts TIE_REDUCE0 at 17, rank 1 its TIE_REDUCE1 at 14.5 (after latency
    # 0.5 messages); the sum over k = 2 ranks x 2 replicas lasts 0.5 + 1.5 * bytes / 1e6 s from the later start
    program = ps.compile_program("1f1b", 2, 4, dp_size=2, ties=[(0, 1)])
    timeline = ps.simulate(program, ps.CostModel(latency=0.5, bandwidth=1e6, tie_bytes=[1e6, 2e6]))
    spans = {str(e.instr): (e.start, e.end) for e in timeline.events if e.instr.op is Op.TIE_REDUCE}
    assert spans == {"TIE_REDUCE0": (17.0, 19.0), "TIE_REDUCE1": (14.5, 20.5)}
    assert timeline.makespan == 20.5
    free = ps.simulate(program)  # default costs: free, so the step is unchanged
    assert free.makespan == ps.simulate(ps.compile_program("1f1b", 2, 4, dp_size=2)).makespan


def test_the_gantt_chart_and_the_trace_draw_it():
    pytest.importorskip("matplotlib")
    from pipesched.viz.gantt import plot_timeline
    from pipesched.viz.trace import to_chrome_trace

    timeline = ps.simulate(ps.compile_program("1f1b", 2, 4, ties=[(0, 1)]), ps.CostModel(latency=0.5))
    fig = plot_timeline(timeline)
    gids = [p.get_gid() or "" for ax in fig.axes for p in ax.patches]
    assert sorted(g for g in gids if "TIE_REDUCE" in g) == ["allreduce:0:TIE_REDUCE0", "allreduce:1:TIE_REDUCE1"]
    labels = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
    assert "tied-gradient sum" in labels
    events = [e for e in to_chrome_trace(timeline)["traceEvents"] if e.get("cat") == "tie-reduce"]
    assert [e["name"] for e in events] == ["TIE_REDUCE0", "TIE_REDUCE1"]


def test_the_command_line_shows_and_simulates_ties(capsys):
    from pipesched.cli import main

    assert main(["show", "1f1b", "-p", "2", "-m", "2", "--ties", "0,1", "--format", "text"]) == 0
    out = capsys.readouterr().out
    assert "ties: 0,1" in out and out.count("TIE_REDUCE") == 2
    assert main(["simulate", "1f1b", "-p", "2", "-m", "4", "--dp", "2", "--ties", "0,1", "--latency", "0.5",
                 "--tie-bytes", "1e6", "--bandwidth", "1e6"]) == 0
    assert "makespan         19 s" in capsys.readouterr().out  # rank 0 starts it at 17, the sum takes 2 s
    assert main(["simulate", "1f1b", "-p", "2", "--tie-bytes", "5"]) == 2
    assert "--tie-bytes 5 sets the size of the tied gradients, but this program has no ties" in capsys.readouterr().err
    assert main(["show", "interleaved-1f1b", "-p", "2", "-m", "2", "--ties", "0,1", "--ties", "2,3", "--format",
                 "text"]) == 0  # repeated: both kept, as one list
    assert "ties: 0,1 2,3" in capsys.readouterr().out
    assert main(["show", "1f1b", "-p", "2", "--ties", "0,0"]) == 2
    assert "--ties 0,0: ties: (0, 0) must name 2 or more distinct stages" in capsys.readouterr().err
