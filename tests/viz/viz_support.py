"""Shared builders for the viz tests: simulated timelines and a hand-made measured-like one."""

from pipesched import CostModel, Event, Instr, Timeline, compile_program, simulate


def sim(name="1f1b", p=4, m=8, v=None, cost=None, **kwargs):
    """(program, timeline) of a built-in schedule."""
    program = compile_program(name, p, m, v, **kwargs)
    return program, simulate(program, cost or CostModel())


def measured_like() -> Timeline:
    """A 2-rank, 1-microbatch run written by hand as the runtime would save it (ms scale, jittery).

    rank 0: F0.0 [0, 1.0] ms, SEND at 1.0, posts RECV_B at 1.0, gradient lands 4.8, B0.0 [4.9, 7.0],
            ALL_REDUCE0 [7.0, 8.0].
    rank 1: posts RECV_F at 0, activation lands 1.4, F1.0 [1.5, 2.6], B1.0 [2.6, 4.4], SEND_B at 4.4,
            ALL_REDUCE1 [4.4, 6.0].
    Makespan 8 ms; busy 3.1 and 2.9 ms; bubble = (4.9 + 5.1) / 16 = 0.625.
    """
    ms = 1e-3
    rows = [
        (0, "F0.0", 0.0, 1.0), (0, "SEND_F0.0>1", 1.0, 1.0), (0, "RECV_B0.0<1", 1.0, 4.8),
        (0, "B0.0", 4.9, 7.0), (0, "ALL_REDUCE0", 7.0, 8.0),
        (1, "RECV_F1.0<0", 0.0, 1.4), (1, "F1.0", 1.5, 2.6), (1, "B1.0", 2.6, 4.4),
        (1, "SEND_B1.0>0", 4.4, 4.4), (1, "ALL_REDUCE1", 4.4, 6.0),
    ]
    events = tuple(Event(r, Instr.parse(text), s * ms, e * ms) for r, text, s, e in rows)
    meta = {"schedule": "1f1b", "ranks": 2, "microbatches": 1, "virtual_stages": 1, "dp_size": 2}
    return Timeline(events, 2, source="measured", meta=meta)
