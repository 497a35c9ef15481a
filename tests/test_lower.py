"""Each lowering pass alone: what it inserts, where, and that its output validates."""
import pytest

from pipesched import (CostModel, DeadlockError, Instr, Op, ScheduleArgumentError, add_all_reduce, add_recompute,
                       add_send_recv, build, compile_program, simulate, split_backward, validate)
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
    with pytest.raises(ValueError, match=r"stages has 3 flags but the program has 2 stages \(pipeline ranks x "
                                         r"virtual stages\): give one bool per stage"):
        add_recompute(build("1f1b", 2, 1), [True, True, True])


def test_recompute_is_placed_before_the_gradient_receive():
    # the R overlaps the wait for the gradient instead of following it
    program = add_send_recv(add_recompute(build("1f1b", 2, 1)))
    assert _streams(program)[0] == "F0.0 SEND_F0.0>1 R0.0 RECV_B0.0<1 B0.0"
    validate(program)


# ---- split_backward ------------------------------------------------------------------------------------

def test_split_backward_puts_the_gradient_send_between_i_and_w():
    program = compile_program("1f1b", 2, 3, split_backward=True)
    rank1 = [str(i) for i in program.ranks[1]]
    for mb in range(3):
        at = rank1.index(f"I1.{mb}")
        assert rank1[at + 1:at + 3] == [f"SEND_B1.{mb}>0", f"W1.{mb}"] or \
            (rank1[at + 1].startswith("RECV_F") and rank1[at + 2:at + 4] == [f"SEND_B1.{mb}>0", f"W1.{mb}"])
    assert {i.op for i in program.ranks[0]} == {Op.F, Op.B, Op.SEND_F, Op.RECV_B}  # stage 0 sends no gradient


def test_split_backward_flags_per_stage_and_their_errors():
    base = build("gpipe", 2, 2)
    both = split_backward(base, [True, True])
    assert [str(i) for i in both.ranks[0]] == ["F0.0", "F0.1", "I0.0", "W0.0", "I0.1", "W0.1"]
    assert split_backward(base, False).ranks == base.ranks
    with pytest.raises(ValueError, match="stages has 3 flags but the program has 2 stages"):
        split_backward(base, [True, True, False])
    with pytest.raises(ValueError, match="split_backward takes a compute-only program"):
        split_backward(add_send_recv(base), True)
    with pytest.raises(ScheduleArgumentError, match=r"split_backward must be True, False or a list of one bool "
                                                    r"per stage, got 'yes'"):
        compile_program("gpipe", 2, 2, split_backward="yes")
    with pytest.raises(ScheduleArgumentError, match=r"recompute must hold only True or False \(one per stage\), "
                                                    r"got 'no' in \['no', 'no'\]"):
        compile_program("gpipe", 2, 2, recompute=["no", "no"])
    with pytest.raises(ScheduleArgumentError, match=r"split_backward has 1 flag but the program has 4 stages"):
        compile_program("interleaved-1f1b", 2, 2, split_backward=[True])


def test_recompute_on_a_split_backward_goes_before_the_input_gradient():
    # the backward that needs the recomputed activations is I (W needs only I's result): R goes before I, not W
    program = add_recompute(split_backward(build("1f1b", 2, 2)))
    assert _streams(program) == ["F0.0 F0.1 R0.0 B0.0 R0.1 B0.1", "F1.0 R1.0 I1.0 W1.0 F1.1 R1.1 I1.1 W1.1"]
    assert split_backward(add_recompute(build("1f1b", 2, 2))).ranks == program.ranks  # the passes commute
    lowered = add_send_recv(program)
    assert _streams(lowered)[1] == ("RECV_F1.0<0 F1.0 RECV_F1.1<0 R1.0 I1.0 SEND_B1.0>0 W1.0 F1.1 R1.1 I1.1 "
                                    "SEND_B1.1>0 W1.1")
    validate(lowered)
    # rank 1 holds one stage input (10 B) until R, then the stash (100 B) until W frees it
    assert simulate(lowered, CostModel(stash_bytes=100, input_bytes=10)).peak_activation_bytes == (110, 100)


def test_split_backward_shortens_1f1b_when_messages_take_time():
    # p=2, m=4, F=1, B=2 (I=W=1), latency 0.5: fused, each steady-state microbatch waits for rank 1's whole B
    # and two messages; split, rank 0 gets the gradient after rank 1's I, one W (1 s) sooner
    cost = CostModel(forward=1.0, backward=2.0, latency=0.5)
    fused = simulate(compile_program("1f1b", 2, 4), cost).makespan
    split = simulate(compile_program("1f1b", 2, 4, split_backward=True), cost).makespan
    assert (fused, split) == (17.0, 15.0)
