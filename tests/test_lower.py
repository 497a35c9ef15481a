"""Each lowering pass alone: what it inserts, where, and that its output validates."""
import pytest

from pipesched import (CostModel, DeadlockError, Instr, Op, add_all_reduce, add_recompute, add_send_recv, build,
                       validate)
from pipesched.ir import Program


def _streams(program):
    return [" ".join(str(i) for i in stream) for stream in program.ranks]


def test_send_recv_for_every_cross_rank_edge():
    program = add_send_recv(build("1f1b", 2, 2))
    assert _streams(program) == [
        "F0.0 SEND_F0.0>1 F0.1 SEND_F0.1>1 RECV_B0.0<1 B0.0 RECV_B0.1<1 B0.1",
        "RECV_F1.0<0 F1.0 RECV_F1.1<0 B1.0 SEND_B1.0>0 F1.1 B1.1 SEND_B1.1>0",
    ]
    validate(program)


def test_no_messages_between_stages_on_the_same_rank():
    program = add_send_recv(build("interleaved-1f1b", 1, 2, 3))
    assert not any(i.op not in (Op.F, Op.B) for i in program.ranks[0])


def test_send_recv_refuses_a_lowered_program():
    with pytest.raises(ValueError, match="already has SEND/RECV"):
        add_send_recv(add_send_recv(build("gpipe", 2, 1)))


@pytest.mark.parametrize("cost, named", [
    (CostModel(forward=0, backward=0), "cost forward is 0 seconds at stage 0"),
    (CostModel(forward=[1.0, 0.0]), "cost forward is 0 seconds at stage 1"),
    (CostModel(backward=[2.0, 0.0]), "cost backward is 0 seconds at stage 1"),
])
def test_send_recv_refuses_zero_length_computes(cost, named):
    # a zero-length producer's message key (end, 0, ...) sorted before its own (start, 1, ...): the SEND
    # went before the F that makes its data (reported bug)
    with pytest.raises(ValueError, match=named):
        add_send_recv(build("1f1b", 2, 2), cost)


def test_send_recv_refuses_only_the_costs_the_program_uses():
    program = add_send_recv(build("1f1b", 2, 2), CostModel(recompute=0.0, input_grad=0.0))
    validate(program)
    with pytest.raises(ValueError, match="cost recompute is 0 seconds at stage 0"):
        add_send_recv(add_recompute(build("1f1b", 2, 2)), CostModel(recompute=0.0))


def test_send_recv_unchecked_still_raises_a_deadlock():
    # rank 1 starts with microbatch 1, whose input rank 0 makes only after B0.0, which needs B1.0
    text = "F0.0 B0.0 F0.1 B0.1", "F1.1 B1.1 F1.0 B1.0"
    stuck = Program([[Instr.parse(t) for t in stream.split()] for stream in text], (0, 1), 2)
    for check in (True, False):
        with pytest.raises(DeadlockError):
            add_send_recv(stuck, check=check)


def test_all_reduce_after_last_backward_and_its_send():
    program = add_all_reduce(add_send_recv(build("1f1b", 2, 2)), 2)
    assert program.dp_size == 2
    assert _streams(program)[1].endswith("B1.1 SEND_B1.1>0 ALL_REDUCE1")
    assert _streams(program)[0].endswith("B0.1 ALL_REDUCE0")
    validate(program)


def test_all_reduce_per_stage_with_virtual_stages():
    program = add_all_reduce(add_send_recv(build("interleaved-1f1b", 2, 2, 2)), 3)
    reduces = [i for i in program.ranks[0] if i.op is Op.ALL_REDUCE]
    assert reduces == [Instr(Op.ALL_REDUCE, 2), Instr(Op.ALL_REDUCE, 0)]  # stage 2's backwards end first


def test_all_reduce_rejects_bad_dp():
    with pytest.raises(ValueError, match="dp_size must be an integer >= 1, got 0"):
        add_all_reduce(build("gpipe", 1, 1), 0)


def test_recompute_goes_right_before_each_backward():
    program = add_recompute(build("gpipe", 1, 2))
    assert _streams(program) == ["F0.0 F0.1 R0.0 B0.0 R0.1 B0.1"]


def test_recompute_per_stage_flags():
    program = add_recompute(build("1f1b", 2, 1), [False, True])
    assert _streams(program) == ["F0.0 B0.0", "F1.0 R1.0 B1.0"]
    with pytest.raises(ValueError, match="recompute has 3 flags but the program has 2 stages"):
        add_recompute(build("1f1b", 2, 1), [True, True, True])


def test_recompute_is_placed_before_the_gradient_receive():
    # the R overlaps the wait for the gradient instead of following it
    program = add_send_recv(add_recompute(build("1f1b", 2, 1)))
    assert _streams(program)[0] == "F0.0 SEND_F0.0>1 R0.0 RECV_B0.0<1 B0.0"
    validate(program)
