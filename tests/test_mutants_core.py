"""Tests written to kill mutants that survived a mutation-testing pass (helper-86): each pins one exact value
that a realistic one-line bug in the schedules, the validator, the timing or the lowering would change."""
import pytest

from pipesched import CostModel, build, simulate, validate
from pipesched.errors import InvalidProgramError
from pipesched.ir import Instr, Op
from pipesched.lower import add_send_recv, split_backward
from pipesched.schedules.zb_auto import timed_makespan


def _streams(program):
    return [" ".join(str(i) for i in stream) for stream in program.ranks]


def test_split_backward_splits_only_stages_whose_input_gradient_another_rank_waits_for():
    # one rank holding both stages: no input gradient crosses ranks, so nothing is split
    assert _streams(split_backward(build("interleaved-1f1b", 1, 2, 2))) == [
        "F0.0 F1.0 B1.0 F0.1 B0.0 F1.1 B1.1 B0.1"]
    # DualPipe-V, p=2: rank 1 holds stages 1 and 2, so B2 (its input gradient stays on rank 1) stays whole while
    # B1 (rank 0 waits for its input gradient) and B3 on rank 0 are split; B0 has no previous stage
    assert _streams(split_backward(build("dualpipev", 2, 4))) == [
        "F0.0 F0.1 F0.2 F3.0 I3.0 W3.0 F3.1 F0.3 I3.1 W3.1 F3.2 B0.0 I3.2 W3.2 F3.3 B0.1 I3.3 W3.3 I0.2 W0.2 I0.3 W0.3",
        "F1.0 F2.0 F1.1 F2.1 F1.2 B2.0 F2.2 I1.0 W1.0 F1.3 B2.1 F2.3 I1.1 W1.1 B2.2 I1.2 W1.2 I2.3 I1.3 W2.3 W1.3",
    ]


def test_interleaved_with_m_not_a_multiple_of_p_runs_its_larger_round_first():
    # p=2, m=5: two rounds of sizes 3 then 2 (larger first); rank r warms up with (v-1)*3 + 2*(p-1-r) forwards
    assert _streams(build("interleaved-1f1b", 2, 5, 2)) == [
        "F0.0 F0.1 F0.2 F2.0 F2.1 F2.2 B2.0 F0.3 B2.1 F0.4 B2.2 F2.3 B0.0 F2.4 B0.1 B0.2 B2.3 B2.4 B0.3 B0.4",
        "F1.0 F1.1 F1.2 F3.0 B3.0 F3.1 B3.1 F3.2 B3.2 F1.3 B1.0 F1.4 B1.1 F3.3 B1.2 F3.4 B3.3 B3.4 B1.3 B1.4",
    ]


def test_a_send_between_two_stages_of_one_rank_is_refused_by_the_structure_check():
    # stages 0 and 1 both on rank 0: a SEND_F/RECV_F between them would run (the receive is posted first), but
    # no message is needed there, and the validator must say so
    program = build("interleaved-1f1b", 1, 1, 2)
    s = program.ranks[0]
    bad = program.replace([(s[0], Instr(Op.RECV_F, 1, 0, 0), Instr(Op.SEND_F, 0, 0, 0)) + tuple(s[1:])])
    with pytest.raises(InvalidProgramError, match=r"^rank 0, RECV_F1.0<0: stage 0 is on this same rank; "
                                                  r"no RECV_F is needed"):
        validate(bad)


def test_a_receive_posted_after_its_message_landed_ends_when_it_is_posted():
    # F0.1 ends at 2 and its message lands then; rank 1 posts RECV_F1.1 only at 4 (after F1.0, 3 s): the receive
    # takes no time, it ends at 4 (not at the arrival, 2, before its own start)
    cost = CostModel(forward=[1, 3], backward=[2, 6])
    program = add_send_recv(build("gpipe", 2, 2), cost)
    assert _streams(program)[1] == "RECV_F1.0<0 F1.0 RECV_F1.1<0 F1.1 B1.0 SEND_B1.0>0 B1.1 SEND_B1.1>0"
    timeline = simulate(program, cost)
    assert [(str(e.instr), e.start, e.end) for e in timeline.events if e.rank == 1] == [
        ("RECV_F1.0<0", 0, 1), ("F1.0", 1, 4), ("RECV_F1.1<0", 4, 4), ("F1.1", 4, 7),
        ("B1.0", 7, 13), ("SEND_B1.0>0", 13, 13), ("B1.1", 13, 19), ("SEND_B1.1>0", 19, 19)]
    assert all(e.end >= e.start for e in timeline.events)
    assert timeline.makespan == 21  # B0.1 runs 19..21 once the gradient lands


@pytest.mark.parametrize("name, p, m, seconds", [("zb-h1", 2, 2, 8.0), ("zb-h1", 3, 4, 18.0),
                                                 ("zb-h1", 4, 8, 33.0), ("zb-h2", 4, 8, 30.0)])
def test_zb_auto_scores_message_latency_both_ways_as_the_simulator_does(name, p, m, seconds):
    # F = I = W = 1 s, latency 0.5 s on every message, activations forward and input gradients back
    # (p=4, m=8: the 33 s and 30 s of ZB-H1 and ZB-H2 in pipesched.schedules.zero_bubble's docstring)
    cost = CostModel(forward=1, input_grad=1, weight_grad=1, latency=0.5)
    program = build(name, p, m)
    assert timed_makespan(program, cost) == seconds
    assert simulate(program, cost).makespan == seconds
