"""Measured timelines (2 gloo ranks) against what they must show: one clock for both ranks (a rank's gathered events
are its own, shifted by one offset, the earliest rank's by 0), no compute before the message it needs was sent,
every instruction once, the order-only peak in-flight, seconds (Chrome trace: microseconds), a forward()'s own
timeline, and bubble numbers that agree between Timeline, bubble_breakdown and the trace."""
import pytest

import pipesched as ps
from pipesched.deps import message, needs
from pipesched.ir import COMPUTE_OPS, RECV_OPS, SEND_OPS, Op
from pipesched.runtime import launch
from pipesched.timeline import Timeline

import rt_measured_truth

SCHEDULES = [schedule for schedule, _, _ in rt_measured_truth.CASES]


@pytest.fixture(scope="module")
def runs():
    return launch(rt_measured_truth.timelines, 2, timeout=240)


def _load(runs, schedule, kind, rank=0):
    return Timeline.from_json_dict(runs[rank][schedule][kind])


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("kind", ["gathered", "gathered_forward"])
def test_gathered_timeline_is_each_ranks_own_on_one_clock(runs, schedule, kind):
    gathered = _load(runs, schedule, kind)
    assert gathered.events == _load(runs, schedule, kind, rank=1).events  # both ranks got the same
    assert gathered.ranks is None and gathered.source == "measured"
    offsets = []
    for rank in range(2):
        local = _load(runs, schedule, kind.replace("gathered", "local"), rank=rank)
        assert local.ranks == (rank,)
        mine = [e for e in gathered.events if e.rank == rank]
        assert [e.instr for e in mine] == [e.instr for e in local.events]
        shifts = {round(g.start - e.start, 9) for g, e in zip(mine, local.events)}
        shifts |= {round(g.end - e.end, 9) for g, e in zip(mine, local.events)}
        assert len(shifts) == 1, shifts  # one offset per rank: the alignment moves, never stretches
        offsets.append(shifts.pop())
    assert min(offsets) == 0.0 and max(offsets) >= 0.0  # time 0: the earliest rank's step start
    assert min(e.start for e in gathered.events) >= 0.0


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("kind", ["gathered", "gathered_forward"])
def test_no_compute_before_its_input_was_sent_or_landed(runs, schedule, kind):
    t = _load(runs, schedule, kind)
    num_stages = 1 + max(e.instr.stage for e in t.events)
    sends = {message(e.instr): e for e in t.events if e.instr.op in SEND_OPS}
    recvs = {(e.rank, message(e.instr)): e for e in t.events if e.instr.op in RECV_OPS}
    made = {(e.instr.op, e.instr.stage, e.instr.microbatch): e for e in t.events if e.instr.op in COMPUTE_OPS}
    checked = 0
    for e in t.events:
        if e.instr.op not in COMPUTE_OPS:
            continue
        for item in needs(e.instr, num_stages, 0):
            if item not in sends:
                continue
            send, recv = sends[item], recvs[(e.rank, item)]
            producer = made[(Op.F, item[1], item[2])] if item[0] == "act" else \
                made.get((Op.B, item[1], item[2])) or made[(Op.I, item[1], item[2])]
            assert send.rank != e.rank and producer.rank == send.rank
            assert producer.end <= send.start <= e.start, (str(producer.instr), str(send.instr), str(e.instr))
            assert send.start <= recv.end <= e.start, (str(send.instr), str(recv.instr), str(e.instr))
            checked += 1
    assert checked > 0


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_each_instruction_once_and_order_only_peaks(runs, schedule):
    program = ps.loads(runs[0][schedule]["program"])
    step, forward = _load(runs, schedule, "gathered"), _load(runs, schedule, "gathered_forward")
    for rank in range(2):
        assert sorted(map(str, (e.instr for e in step.events if e.rank == rank))) == \
            sorted(map(str, program.ranks[rank]))
    peaks = []
    for stream in program.ranks:
        held = most = 0
        for instr in stream:
            held += 1 if instr.op is Op.F else -1 if instr.op in (Op.B, Op.W) else 0
            most = max(most, held)
        peaks.append(most)
    assert step.peak_inflight == tuple(peaks)
    assert step.meta["step"] == "train" and forward.meta["step"] == "forward"
    assert forward.peak_inflight == (0, 0)
    assert {e.instr.op for e in forward.events} == {Op.F, Op.SEND_F, Op.RECV_F}
    assert len([e for e in forward.events if e.instr.op is Op.F]) == program.num_stages * program.num_microbatches


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("kind", ["gathered", "gathered_forward", "local"])
def test_bubble_numbers_agree_and_the_trace_is_in_microseconds(runs, schedule, kind):
    from pipesched.viz.analysis import bubble_breakdown
    from pipesched.viz.trace import to_chrome_trace

    t = _load(runs, schedule, kind)
    held = range(2) if t.ranks is None else t.ranks
    span = max(e.end for e in t.events) - min(e.start for e in t.events)
    for rank in held:
        busy = sum(e.duration for e in t.events if e.rank == rank and e.instr.op in COMPUTE_OPS)
        assert t.bubble_per_rank()[rank] == pytest.approx((span - busy) / span)
    assert t.bubble_fraction == pytest.approx(sum(t.bubble_per_rank()[r] for r in held) / len(held))
    fractions = bubble_breakdown(t)["fraction"]
    assert fractions["total"] == pytest.approx(t.bubble_fraction)
    assert sum(v for k, v in fractions.items() if k != "total") == pytest.approx(t.bubble_fraction)
    trace = to_chrome_trace(t)
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [e["ts"] for e in xs] == pytest.approx([e.start * 1e6 for e in t.events])
    assert [e["dur"] for e in xs] == pytest.approx([e.duration * 1e6 for e in t.events])
    assert trace["otherData"]["bubble_fraction"] == t.bubble_fraction
