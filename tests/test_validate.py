"""The validator rejects hand-made bad programs, each with the expected error, rank and instruction."""
import pytest

from pipesched import (DeadlockError, DependencyError, InvalidProgramError, PairingError, ScheduleError, loads,
                       validate)

HEADER = "microbatches: {m}\nstage_to_rank: 0 1\n"
GOOD = HEADER.format(m=1) + """
rank 0: F0.0 SEND_F0.0>1 RECV_B0.0<1 B0.0
rank 1: RECV_F1.0<0 F1.0 B1.0 SEND_B1.0>0
"""


def _check(text, error, rank, instr, reason):
    with pytest.raises(error) as info:
        validate(loads(text))
    assert isinstance(info.value, ScheduleError)
    assert info.value.rank == rank
    assert str(info.value.instr) == instr
    assert reason in info.value.reason
    assert "<-- here" in str(info.value) or not info.value.grid
    return info.value


def test_good_program_passes():
    program = loads(GOOD)
    assert validate(program) is program


def test_missing_receive():
    text = HEADER.format(m=1) + """
rank 0: F0.0 SEND_F0.0>1 RECV_B0.0<1 B0.0
rank 1: F1.0 B1.0 SEND_B1.0>0
"""
    _check(text, DependencyError, 1, "F1.0", "no RECV_F receives it")


def test_send_without_receive():
    text = HEADER.format(m=1) + """
rank 0: F0.0 SEND_F0.0>1 SEND_F0.0>1 RECV_B0.0<1 B0.0
rank 1: RECV_F1.0<0 F1.0 B1.0 SEND_B1.0>0
"""
    _check(text, PairingError, 0, "SEND_F0.0>1", "has no matching receive on rank 1")


def test_swapped_pair_deadlocks():
    error = _check(open_example("broken-deadlock.txt"), DeadlockError, 0, "SEND_F0.1>1", "deadlock")
    assert "rank 1 blocked at SEND_B1.0>0" in error.reason
    assert str(error).count("<-- here") == 2


def test_backward_before_forward():
    text = HEADER.format(m=1) + """
rank 0: B0.0 F0.0 SEND_F0.0>1 RECV_B0.0<1
rank 1: RECV_F1.0<0 F1.0 B1.0 SEND_B1.0>0
"""
    _check(text, DependencyError, 0, "B0.0", "the forward F0.0, which comes later in this stream")


def test_receives_out_of_send_order_between_a_pair():
    # per-kind matching would accept this; FIFO matching between a pair of ranks (NCCL's) does not
    text = HEADER.format(m=2) + """
rank 0: F0.0 SEND_F0.0>1 F0.1 SEND_F0.1>1 RECV_B0.0<1 B0.0 RECV_B0.1<1 B0.1
rank 1: RECV_F1.1<0 RECV_F1.0<0 F1.0 B1.0 SEND_B1.0>0 F1.1 B1.1 SEND_B1.1>0
"""
    _check(text, PairingError, 0, "SEND_F0.0>1", "out of the order of its sends")


ONE_RANK = "microbatches: {m}\nstage_to_rank: 0\nrank 0: {stream}\n"


@pytest.mark.parametrize("text, error, instr, reason", [
    (ONE_RANK.format(m=2, stream="F0.0 F0.1 B0.0"), InvalidProgramError, "B0.1", "its backward is missing"),
    (ONE_RANK.format(m=1, stream="F0.0 F0.0 B0.0"), InvalidProgramError, "F0.0", "appears twice"),
    (HEADER.format(m=1) + "rank 0: F0.0 F1.0 B1.0 B0.0\nrank 1:\n", InvalidProgramError, "F1.0",
     "stage 1 is placed on rank 1, not on rank 0"),
    (HEADER.format(m=1) + "rank 0: F0.0 SEND_F0.0>0 RECV_B0.0<1 B0.0\nrank 1: RECV_F1.0<0 F1.0 B1.0 SEND_B1.0>0\n",
     InvalidProgramError, "SEND_F0.0>0", "peer must be rank 1"),
    (ONE_RANK.format(m=1, stream="F0.0 I0.0"), InvalidProgramError, "W0.0", "has an I but no W"),
    (ONE_RANK.format(m=1, stream="F0.0 W0.0 I0.0"), DependencyError, "W0.0", "the input-gradient backward I0.0"),
], ids=["missing-backward", "duplicate-forward", "wrong-rank", "wrong-peer", "i-without-w", "w-before-i"])
def test_ill_formed_program_names_rank_0_the_instruction_and_the_reason(text, error, instr, reason):
    _check(text, error, 0, instr, reason)


def test_compute_only_program_that_deadlocks():
    # rank 0 waits for microbatch 0's gradient before the forward of microbatch 1, which rank 1 runs first
    text = HEADER.format(m=2) + "rank 0: F0.0 B0.0 F0.1 B0.1\nrank 1: F1.1 F1.0 B1.0 B1.1\n"
    error = _check(text, DeadlockError, 0, "B0.0", "deadlock")
    assert "rank 1 blocked at F1.1" in error.reason


def test_compute_only_program_passes_without_comm():
    validate(loads(HEADER.format(m=1) + "rank 0: F0.0 B0.0\nrank 1: F1.0 B1.0\n"))


def test_all_reduce_needs_dp():
    text = "microbatches: 1\nstage_to_rank: 0\nrank 0: F0.0 B0.0 ALL_REDUCE0\n"
    _check(text, InvalidProgramError, 0, "ALL_REDUCE0", "dp_size=1")


def open_example(name):
    from pathlib import Path

    return (Path(__file__).resolve().parents[1] / "schedules" / "examples" / name).read_text()
