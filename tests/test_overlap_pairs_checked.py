"""Overlapped pairs (program.meta["overlap_pairs"], pipesched.ir.OVERLAP_PAIRS): the lowering passes carry them so
that no pair names an instruction the program lacks (split_backward: a split B becomes its I; forward_only: none
left) and a saved and reloaded program has the compiled one's pairs; validate refuses a pair that is not one
(new-user trial B, item 4)."""
import warnings

import pytest

import pipesched as ps
from pipesched import lower
from pipesched.errors import InvalidProgramError
from pipesched.interop import TorchCsvWarning, from_torch_csv
from pipesched.ir import OVERLAP_PAIRS, Instr, Op


def _round_trips(program):
    for loaded in (ps.loads(ps.to_text(program)), ps.loads(ps.to_json(program))):
        assert loaded == program and loaded.meta.get(OVERLAP_PAIRS) == program.meta.get(OVERLAP_PAIRS)
        assert ps.validate(loaded) is loaded


def test_split_backward_makes_a_split_b_of_a_pair_its_i():
    built = ps.build("dualpipev", 2, 4)  # V placement 0 1 1 0: stages 1 and 3 wait across ranks, so they split
    assert built.stage_to_rank == (0, 1, 1, 0)
    split = ps.compile_program("dualpipev", 2, 4, split_backward=True)
    expected = tuple((f, Instr(Op.I, b.stage, b.microbatch) if b.stage in (1, 3) else b)
                     for f, b in built.meta[OVERLAP_PAIRS])
    assert split.meta[OVERLAP_PAIRS] == expected
    assert {b.op for _, b in expected} == {Op.B, Op.I}  # both kinds present: some split, some not
    kept = {i for stream in split.ranks for i in stream}
    assert all(i in kept for pair in split.meta[OVERLAP_PAIRS] for i in pair)
    _round_trips(split)


def test_forward_only_has_no_pairs_and_round_trips():
    only = ps.compile_program("dualpipev", 2, 4, forward_only=True)
    assert OVERLAP_PAIRS not in only.meta
    _round_trips(only)
    assert lower.forward_only(ps.build("dualpipev", 2, 4)).meta.get(OVERLAP_PAIRS) is None


@pytest.mark.parametrize("kwargs", [{}, {"recompute": True}, {"split_backward": True, "recompute": True, "dp_size": 2},
                                    {"early_receives": 16}])
def test_lowered_dualpipev_keeps_valid_pairs(kwargs):
    program = ps.compile_program("dualpipev", 3, 7, **kwargs)
    assert len(program.meta[OVERLAP_PAIRS]) == len(ps.build("dualpipev", 3, 7).meta[OVERLAP_PAIRS])
    _round_trips(program)


def test_step_programs_accepts_dualpipev_with_its_pairs():
    program = ps.compile_program("dualpipev", 2, 4, split_backward=True, recompute=True)
    for backend in ("gloo", "nccl"):  # the learning step's proof moves forwards up to their receives: no pair there
        steps = ps.step_programs(program, backend)
        assert steps.learn_train == program and steps.learn_train.meta[OVERLAP_PAIRS] == program.meta[OVERLAP_PAIRS]
        assert OVERLAP_PAIRS not in steps.forward.meta and OVERLAP_PAIRS not in steps.learn_forward.meta


BASE = """schedule: t
microbatches: 2
stage_to_rank: 0 1
dp_size: 1
overlap_pairs: {pairs}
rank 0:
  F0.0 SEND_F0.0>1 F0.1 SEND_F0.1>1 RECV_B0.0<1 B0.0 RECV_B0.1<1 B0.1
rank 1:
  RECV_F1.0<0 F1.0 RECV_F1.1<0 B1.0 SEND_B1.0>0 F1.1 B1.1 SEND_B1.1>0
"""


def test_a_pair_with_only_messages_between_is_accepted():
    program = ps.loads(BASE.format(pairs="F0.1+B0.0"))
    assert ps.validate(program) is program


@pytest.mark.parametrize("pairs, rank, instr, says", [
    ("B0.0+F0.1", None, None, "a pair is an F followed by a B or I, got B then F"),
    ("F0.1+W0.0", None, None, None),  # W is not a pair's backward (checked as it loads: W0.0 is not in the program)
    ("F1.1+B1.1", 1, "B1.1", "both are of microbatch 1; a backward needs its own microbatch's forward"),
    ("F0.1+B0.0 F0.1+B0.0", 0, "F0.1", "F0.1 is also in the pair F0.1+B0.0; an instruction is in at most one pair"),
    ("F0.0+B0.1", 0, "F0.1", "F0.1 runs between them on rank 0; the backward directly follows the F"),
    ("F1.1+B1.0", 1, "B1.0", "B1.0 comes before F1.1 on rank 1; the F comes first"),
])
def test_validate_refuses_what_is_not_a_pair(pairs, rank, instr, says):
    if says is None:
        with pytest.raises(ps.ProgramFormatError, match="W0.0 is not an instruction of the program"):
            ps.loads(BASE.format(pairs=pairs))
        return
    program = ps.loads(BASE.format(pairs=pairs))
    with pytest.raises(InvalidProgramError) as info:
        ps.validate(program)
    assert info.value.reason.startswith(f"overlap pair {pairs.split()[-1]} (overlap_pairs: an F and the B or I")
    assert says in info.value.reason
    assert info.value.reason.endswith("; to run them apart, drop the pair from the program's overlap_pairs: line "
                                      "(program.meta['overlap_pairs'])")
    assert (info.value.rank, None if info.value.instr is None else str(info.value.instr)) == (rank, instr)


def test_the_loader_refuses_a_group_of_three():
    with pytest.raises(ps.ProgramFormatError, match="a pair joins exactly 2 instructions, this one 3"):
        ps.loads(BASE.format(pairs="F0.1+B0.0+B0.1"))


def test_validate_refuses_pairs_set_in_python():
    program = ps.compile_program("dualpipev", 2, 4)
    f, b = program.meta[OVERLAP_PAIRS][0]
    program.meta[OVERLAP_PAIRS] = ((f, b, f),)
    with pytest.raises(InvalidProgramError, match="a pair joins exactly two instructions, this group has 3"):
        ps.validate(program)
    program = ps.compile_program("dualpipev", 2, 4)
    program.meta[OVERLAP_PAIRS] = ((Instr(Op.F, 0, 0), Instr(Op.B, 1, 1)),)  # stage 0 on rank 0, stage 1 on rank 1
    with pytest.raises(InvalidProgramError, match="its instructions are on ranks 0 and 1; a pair is on one rank"):
        ps.validate(program)
    program = ps.compile_program("dualpipev", 2, 4)
    program.meta[OVERLAP_PAIRS] = ((Instr(Op.F, 0, 9), Instr(Op.B, 0, 1)),)
    with pytest.raises(InvalidProgramError, match="F0.9 is not an instruction of the program"):
        ps.validate(program)


def test_a_torch_overlap_group_of_three_is_refused_by_validate(tmp_path):
    path = tmp_path / "s.csv"
    path.write_text("(0F0;0B0;0F1)OVERLAP_F_B,0B1\r\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TorchCsvWarning)
        program = from_torch_csv(path)
    with pytest.raises(InvalidProgramError, match=r"overlap pair F0.0\+B0.0\+F0.1 .*exactly two instructions"):
        ps.validate(program)
