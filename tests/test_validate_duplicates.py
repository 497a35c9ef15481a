"""Every instruction at most once: a duplicated SEND/RECV pair (which matches itself, so pairing and the deadlock
check pass it), ALL_REDUCE or TIE_REDUCE is refused by the completeness check naming the second copy, by the fast
check and the exact scan alike, and step_programs reports the same error (new-user trial B, item 1)."""
import dataclasses
import importlib

import pytest

import pipesched as ps
from pipesched import engine
from pipesched.cli import main
from pipesched.deps import message
from pipesched.errors import InvalidProgramError, PairingError
from pipesched.ir import COMM_OPS, RECV_OPS, SEND_OPS, Instr, Op

checks = importlib.import_module("pipesched.validate")  # the module (``pipesched.validate`` is the function)

HEADER = "schedule: t\nmicrobatches: 1\nstage_to_rank: 0 1\ndp_size: 1\n"
DUP_SEND = HEADER + """rank 0:
  F0.0 SEND_F0.0>1 SEND_F0.0>1 RECV_B0.0<1 B0.0
rank 1:
  RECV_F1.0<0 RECV_F1.0<0 F1.0 B1.0 SEND_B1.0>0
"""


def _refused_as_duplicate(program, rank, instr):
    plan = engine.Plan(program)
    assert not checks.COMPLETENESS.passes(program, plan)  # the fast decision
    with pytest.raises(InvalidProgramError) as info:
        ps.validate(program)
    assert (info.value.rank, str(info.value.instr)) == (rank, instr)
    assert info.value.reason == f"{instr} appears twice (each instruction runs at most once)"
    assert "<-- here" in str(info.value)
    return info.value


def test_a_duplicated_send_recv_pair_is_refused_naming_the_second_send():
    _refused_as_duplicate(ps.loads(DUP_SEND), 0, "SEND_F0.0>1")


def test_a_duplicated_gradient_pair_is_refused():
    text = HEADER + "rank 0: F0.0 SEND_F0.0>1 RECV_B0.0<1 RECV_B0.0<1 B0.0\n" \
                    "rank 1: RECV_F1.0<0 F1.0 B1.0 SEND_B1.0>0 SEND_B1.0>0\n"
    _refused_as_duplicate(ps.loads(text), 0, "RECV_B0.0<1")


def _with_copy(program, rank, pos):
    """``program`` with the instruction at ``rank, pos`` given again right after it."""
    streams = [list(s) for s in program.ranks]
    streams[rank].insert(pos + 1, streams[rank][pos])
    return program.replace(streams)


@pytest.mark.parametrize("name, kwargs", [("1f1b", {"dp_size": 2}), ("interleaved-1f1b", {"split_backward": True}),
                                          ("zbv", {"ties": [(0, 1)]}), ("dualpipev", {"recompute": True})])
def test_every_instruction_of_a_compiled_program_given_twice_is_refused(name, kwargs):
    program = ps.compile_program(name, 2, 4, **kwargs)
    kinds = set()
    for rank, stream in enumerate(program.ranks):
        for pos, instr in enumerate(stream):
            copy = _with_copy(program, rank, pos)
            if instr.op in COMM_OPS:  # the message's other end too, so that the sends and receives still match
                other = next((r, k) for r, s in enumerate(copy.ranks) for k, i in enumerate(s)
                             if i.op in COMM_OPS and i.op not in (SEND_OPS if instr.op in SEND_OPS else RECV_OPS)
                             and r == instr.peer and message(i) == message(instr))
                copy = _with_copy(copy, *other)
            # the first second copy in validate's scan (rank by rank): the copy, or its message's other end
            r, k = next((r, k) for r, s in enumerate(copy.ranks) for k, i in enumerate(s) if s.index(i) != k)
            _refused_as_duplicate(copy, r, str(copy.ranks[r][k]))
            kinds.add(instr.op)
    assert kinds >= {Op.F, Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B}


def test_collectives_given_twice_are_refused():
    reduced = ps.compile_program("1f1b", 2, 2, dp_size=2)
    rank, pos = next((r, k) for r, s in enumerate(reduced.ranks) for k, i in enumerate(s) if i.op is Op.ALL_REDUCE)
    _refused_as_duplicate(_with_copy(reduced, rank, pos), rank, str(reduced.ranks[rank][pos]))
    tied = ps.compile_program("1f1b", 2, 2, ties=[(0, 1)])
    rank, pos = next((r, k) for r, s in enumerate(tied.ranks) for k, i in enumerate(s) if i.op is Op.TIE_REDUCE)
    _refused_as_duplicate(_with_copy(tied, rank, pos), rank, str(tied.ranks[rank][pos]))


def test_step_programs_reports_the_duplicate_not_an_early_receive_hint():
    with pytest.raises(InvalidProgramError) as info:
        ps.step_programs(ps.loads(DUP_SEND), "gloo")
    assert str(info.value.instr) == "SEND_F0.0>1" and "appears twice" in info.value.reason
    assert "early_receives" not in str(info.value) and "valid" not in info.value.reason


def test_the_cli_refuses_it_with_exit_1(tmp_path, capsys):
    path = tmp_path / "dup.txt"
    path.write_text(DUP_SEND)
    assert main(["validate", str(path)]) == 1
    out = capsys.readouterr()
    assert "SEND_F0.0>1 appears twice" in out.out + out.err


def test_a_receive_without_its_send_is_still_a_pairing_error():
    text = HEADER + "rank 0: F0.0 RECV_B0.0<1 B0.0\nrank 1: RECV_F1.0<0 F1.0 B1.0 SEND_B1.0>0\n"
    with pytest.raises(PairingError, match="has no matching send on rank 0"):
        ps.validate(ps.loads(text))


@pytest.mark.parametrize("field, value", [("num_microbatches", 2.0), ("dp_size", True), ("stage_to_rank", (0, "1"))])
def test_a_program_made_in_python_with_a_non_integer_size_is_refused(field, value):
    program = dataclasses.replace(ps.compile_program("1f1b", 2, 2), **{field: value})
    with pytest.raises(InvalidProgramError, match=r"must be an integer, got"):
        ps.validate(program)


def test_instructions_take_integers_only():
    import numpy as np

    assert Instr(Op.F, np.int64(1), np.int32(2)) == Instr(Op.F, 1, 2)
    assert type(Instr(Op.F, np.int64(1), 0).stage) is int
    for fields, name in [((0.0, 0), "stage"), ((0, False), "microbatch"), (("0", 0), "stage"), ((0, 0.0), "microbatch")]:
        with pytest.raises(ValueError, match=f"{name} must be an integer"):
            Instr(Op.F, *fields)
    with pytest.raises(ValueError, match="peer must be an integer"):
        Instr(Op.SEND_F, 0, 0, 1.0)
