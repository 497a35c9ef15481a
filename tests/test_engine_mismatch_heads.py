"""fire_all stops at a SEND that matches a RECV posted for another message: the Run names the pair, leaves the
SEND's rank at the SEND (not fired, after what that rank fired in the same turn) and the other rank where it
blocked, and keeps what fired before."""
from pipesched import PairingError, engine, loads

# rank 0 posts the receive of microbatch 1's gradient before microbatch 0's: rank 1's first SEND_B matches it
CROSSED = """microbatches: 2
stage_to_rank: 0 1
rank 0: F0.0 SEND_F0.0>1 F0.1 SEND_F0.1>1 RECV_B0.1<1 RECV_B0.0<1 B0.0 B0.1
rank 1: RECV_F1.0<0 F1.0 RECV_F1.1<0 F1.1 B1.0 SEND_B1.0>0 B1.1 SEND_B1.1>0
"""


def test_a_mismatch_stops_with_the_send_at_its_rank_head():
    plan = engine.Plan(loads(CROSSED))
    done = engine.fire_all(plan)
    assert done.mismatch == (13, 4)  # SEND_B1.0>0 (flat 8 + 5) matched RECV_B0.1<1 (flat 4)
    assert done.heads == [6, 13]  # rank 0 at B0.0 (waits for its gradient), rank 1 at the SEND, after F1.1, B1.0
    assert done.order == [0, 8, 1, 2, 9, 10, 3, 4, 5, 11, 12]
    assert [(g, r) for g, r in enumerate(done.partner) if r >= 0] == [(1, 8), (3, 10), (13, 4)]
    assert done.unmatched == [5]  # RECV_B0.0<1 is left on the channel 1 -> 0


def test_run_reports_the_mismatch_at_the_send():
    program = loads(CROSSED)  # a Plan holds its program weakly
    try:
        engine.run(engine.Plan(program))
    except PairingError as error:
        assert (error.rank, str(error.instr)) == (1, "SEND_B1.0>0")
    else:
        raise AssertionError("no PairingError")
