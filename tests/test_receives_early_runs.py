"""post_receives_early inside a run of sends and receives: every receive that came before a send stays ahead of it,
however many there are (a send that passes an earlier receive can deadlock when sends wait for their receives)."""
from __future__ import annotations

import pipesched as ps
from pipesched.errors import DeadlockError
from pipesched.ir import Instr, Program
import pytest

from pipesched.lower import post_receives_early

#: rank 0 receives two gradients, then sends F0.2's output; rank 1 sends both gradients before it posts the
#: receive of F0.2's output. Moved up one place, rank 0's run of messages is SEND_F0.0 RECV_B0.0 SEND_F0.1 RECV_B0.1
#: SEND_F0.2 (in the pass's key order): both receives came before SEND_F0.2 and must stay ahead of it.
TWO_RECVS_THEN_SEND = (
    "F0.0 F0.1 F0.2 SEND_F0.0>1 SEND_F0.1>1 RECV_B0.0<1 RECV_B0.1<1 SEND_F0.2>1 B0.0 B0.1 RECV_B0.2<1 B0.2",
    "RECV_F1.0<0 RECV_F1.1<0 F1.0 F1.1 B1.0 B1.1 SEND_B1.0>0 SEND_B1.1>0 RECV_F1.2<0 F1.2 B1.2 SEND_B1.2>0",
)


def _program(streams) -> Program:
    return Program(tuple(tuple(Instr.parse(t) for t in s.split()) for s in streams), (0, 1), 3)


def test_every_receive_before_a_send_in_one_run_stays_ahead_of_it():
    program = ps.validate(_program(TWO_RECVS_THEN_SEND))
    early = post_receives_early(program, window=1)
    assert [" ".join(map(str, s)) for s in early.ranks] == [  # only RECV_B0.2 moves, one place up
        "F0.0 F0.1 F0.2 SEND_F0.0>1 SEND_F0.1>1 RECV_B0.0<1 RECV_B0.1<1 SEND_F0.2>1 B0.0 RECV_B0.2<1 B0.1 B0.2",
        TWO_RECVS_THEN_SEND[1]]
    assert ps.validate(early) is early
    # the send passing the second receive, as a run that kept only one receive ahead would make: refused
    passed = TWO_RECVS_THEN_SEND[0].replace("RECV_B0.1<1 SEND_F0.2>1", "SEND_F0.2>1 RECV_B0.1<1")
    with pytest.raises(DeadlockError):
        ps.validate(_program((passed, TWO_RECVS_THEN_SEND[1])))


def test_receives_from_later_join_the_run_behind_the_sends_they_followed():
    program = ps.validate(_program(TWO_RECVS_THEN_SEND))
    early = post_receives_early(program, window=2)  # RECV_B0.2 joins the run, behind SEND_F0.2
    assert " ".join(map(str, early.ranks[0])) == (
        "F0.0 F0.1 F0.2 SEND_F0.0>1 SEND_F0.1>1 RECV_B0.0<1 RECV_B0.1<1 SEND_F0.2>1 RECV_B0.2<1 B0.0 B0.1 B0.2")
    assert ps.validate(early) is early
