"""What pipesched shows against hand-computed values and an independent re-simulation from the README's
definitions: makespan, bubble fraction (idle rank-seconds / (ranks x makespan), compute = busy, SEND/RECV/ALL_REDUCE
idle), peak in-flight, the Gantt boxes, the Chrome trace (microseconds) and the cost line of a picture's title."""
import math

import pytest

import pipesched as ps
from pipesched.ir import Op
from pipesched.viz.analysis import bubble_breakdown
from pipesched.viz.style import cost_in_unit
from pipesched.viz.trace import to_chrome_trace

pytest.importorskip("matplotlib")

COMPUTE = (Op.F, Op.B, Op.I, Op.W, Op.R)


# ---- the title's cost line: seconds converted, bytes left alone ----------------------------------------------

def test_cost_in_unit_scales_seconds_not_the_recompute_bytes():
    text = "F=0.001 B=0.002 R=[0.001,0.002] act=4e+06B held after R=1e+06B held after R=[1e+06,2e+06]B"
    assert cost_in_unit(text, "ms", 1e3) == ("F=1 B=2 R=[1,2] act=4e+06B held after R=1e+06B "
                                             "held after R=[1e+06,2e+06]B")
    assert cost_in_unit("R=2e-06 held after R=3e+06B", "µs", 1e6) == "R=2 held after R=3e+06B"


def test_title_of_a_recompute_timeline_in_ms_keeps_the_held_bytes():
    from pipesched.viz.gantt import title_text

    cost = ps.CostModel(forward=1e-3, backward=2e-3, recompute=1e-3, recompute_bytes=1e6)
    timeline = ps.simulate(ps.compile_program("1f1b", 2, 2, recompute=True), cost)
    line = title_text(timeline).split("\n")[1]
    assert "ms per stage" in line and "R=1 " in line and "held after R=1000000B" in line  # whole bytes, line


# ---- hand-computed: 1f1b, p=2, m=2, F=1, B=2, latency 0.5, send overhead 0.1 -----------------------------------

HAND = {  # (rank, instr): (start, end), worked out from the README's timing rules
    (0, "F0.0"): (0.0, 1.0), (0, "SEND_F0.0>1"): (1.0, 1.1), (0, "F0.1"): (1.1, 2.1), (0, "SEND_F0.1>1"): (2.1, 2.2),
    (0, "RECV_B0.0<1"): (2.2, 5.2), (0, "B0.0"): (5.2, 7.2), (0, "RECV_B0.1<1"): (7.2, 8.3), (0, "B0.1"): (8.3, 10.3),
    (1, "RECV_F1.0<0"): (0.0, 1.6), (1, "F1.0"): (1.6, 2.6), (1, "RECV_F1.1<0"): (2.6, 2.7), (1, "B1.0"): (2.6, 4.6),
    (1, "SEND_B1.0>0"): (4.6, 4.7), (1, "F1.1"): (4.7, 5.7), (1, "B1.1"): (5.7, 7.7), (1, "SEND_B1.1>0"): (7.7, 7.8),
}


@pytest.fixture(scope="module")
def hand_timeline():
    cost = ps.CostModel(forward=1.0, backward=2.0, latency=0.5, send_overhead=0.1)
    return ps.simulate(ps.compile_program("1f1b", 2, 2), cost)


def test_hand_computed_numbers(hand_timeline):
    t = hand_timeline
    assert {(e.rank, str(e.instr)): (round(e.start, 9), round(e.end, 9)) for e in t.events} == HAND
    assert t.makespan == pytest.approx(10.3)
    assert t.busy_per_rank() == pytest.approx((6.0, 6.0))  # sends are not busy
    assert t.bubble_per_rank() == pytest.approx((4.3 / 10.3, 4.3 / 10.3))
    assert t.bubble_fraction == pytest.approx(4.3 / 10.3)
    assert t.peak_inflight == (2, 1)
    parts = bubble_breakdown(t)["per_rank"]
    assert parts[0]["sending"] == pytest.approx(0.2) and parts[1]["sending"] == pytest.approx(0.2)
    # rank 0 waits for SEND_B1.0 (4.6 -> 5.2) and SEND_B1.1 (7.7 -> 8.3); rank 1 for SEND_F0.0 (1.0 -> 1.6)
    assert parts[0]["communication"] == pytest.approx(1.2) and parts[1]["communication"] == pytest.approx(0.6)


def test_hand_computed_picture(hand_timeline):
    from pipesched.viz import plot_timeline

    fig = plot_timeline(hand_timeline)
    ax = fig.axes[0]
    boxes = {p.get_gid(): (p.get_x(), p.get_width(), p.get_y()) for p in ax.patches if p.get_gid()}
    for (rank, text), (start, end) in HAND.items():
        if text[0] in "FB":
            x, w, y = boxes[f"compute:{rank}:{text}"]
            assert (x, w, y) == pytest.approx((start, end - start, rank - 0.4)), text
    waits = sorted((round(p.get_x(), 9), round(p.get_width(), 9), p.get_gid()) for p in ax.patches
                   if (p.get_gid() or "").startswith("wait:"))
    assert waits == [(1.0, 0.6, "wait:1"), (4.6, 0.6, "wait:0"), (7.7, 0.6, "wait:0")]
    sends = sorted((round(p.get_x(), 9), round(p.get_width(), 9), p.get_gid()) for p in ax.patches
                   if (p.get_gid() or "").startswith("send:"))
    assert sends == [(1.0, 0.1, "send:0"), (2.1, 0.1, "send:0"), (4.6, 0.1, "send:1"), (7.7, 0.1, "send:1")]
    shown = {t.get_gid(): t.get_text() for t in ax.texts if t.get_gid()}
    assert shown == {"bubble-rank-0": " 41.7%          2", "bubble-rank-1": " 41.7%          1"}
    assert "bubble 41.75%" in ax.get_title(loc="left") and "makespan 10.3 s" in ax.get_title(loc="left")


def test_hand_computed_chrome_trace_is_in_microseconds(hand_timeline):
    trace = to_chrome_trace(hand_timeline)
    got = {(e["pid"], e["name"]): (round(e["ts"], 3), round(e["dur"], 3)) for e in trace["traceEvents"]
           if e["ph"] == "X"}
    assert got == {k: (round(s * 1e6, 3), round((e - s) * 1e6, 3)) for k, (s, e) in HAND.items()}
    assert trace["otherData"]["makespan_s"] == pytest.approx(10.3)


def test_hand_computed_data_parallel():
    """1f1b p=2 m=2 dp=2, latency 0.5, no bytes: each ALL_REDUCE lasts 0.5 s after its stage's last B."""
    t = ps.simulate(ps.compile_program("1f1b", 2, 2, dp_size=2), ps.CostModel(latency=0.5))
    reduces = {e.rank: (e.start, e.end) for e in t.events if e.instr.op is Op.ALL_REDUCE}
    assert reduces == {0: pytest.approx((10.0, 10.5)), 1: pytest.approx((7.5, 8.0))}
    assert t.makespan == pytest.approx(10.5)
    assert t.bubble_fraction == pytest.approx(4.5 / 10.5)
    rank1 = bubble_breakdown(t)["per_rank"][1]
    # SEND_F0.0 in flight 1.0 -> 1.5, then its own all-reduce 7.5 -> 8.0 in the trailing gap (the rest: cooldown)
    assert rank1["communication"] == pytest.approx(1.0) and rank1["cooldown"] == pytest.approx(2.5)
    assert to_chrome_trace(t)["otherData"]["dp_size"] == 2


# ---- an independent re-simulation over small programs -------------------------------------------------------

def _per(value, stage):
    return value[stage] if isinstance(value, (list, tuple)) else value


def _independent(program, cost):
    """Start and end of every instruction, from the README's rules, written without pipesched's engine."""
    num_stages, streams = program.num_stages, program.ranks
    pos, free, ready, times, posted = [0] * len(streams), [0.0] * len(streams), {}, {}, {}
    seconds = {Op.F: cost.forward, Op.B: cost.backward, Op.I: cost.input_grad, Op.W: cost.weight_grad,
               Op.R: cost.recompute}

    def duration(op, s):
        value = seconds[op]
        if value is None:  # the CostModel's defaults: I = W = B / 2, R = F
            value = _per(cost.backward, s) / 2 if op in (Op.I, Op.W) else _per(cost.forward, s)
        return _per(value, s)

    moved = True
    while moved:
        moved = False
        for rank, stream in enumerate(streams):
            while pos[rank] < len(stream):
                instr = stream[pos[rank]]
                op, s, mb = instr.op, instr.stage, instr.microbatch
                start = free[rank]
                if op in COMPUTE:
                    need = {Op.F: [("act", s - 1, mb)] if s > 0 else [], Op.W: [("igrad", s, mb)],
                            Op.R: [("fwd", s, mb)]}.get(op)
                    if need is None:  # B or I
                        need = [("fwd", s, mb)] + ([("grad", s + 1, mb)] if s < num_stages - 1 else [])
                    if any((k, rank) not in ready for k in need):
                        break
                    start = max([start] + [ready[(k, rank)] for k in need])
                    end = free[rank] = start + duration(op, s)
                    made = {Op.F: [("act", s, mb), ("fwd", s, mb)], Op.B: [("grad", s, mb)],
                            Op.I: [("grad", s, mb), ("igrad", s, mb)]}.get(op, [])
                    for k in made:
                        ready[(k, rank)] = end
                elif op in (Op.SEND_F, Op.SEND_B):
                    end = free[rank] = start + cost.send_overhead
                    tensor_stage = s if op is Op.SEND_F else s - 1
                    nbytes = _per(cost.activation_bytes, tensor_stage)
                    flight = cost.latency + (0.0 if math.isinf(cost.bandwidth) else nbytes / cost.bandwidth)
                    ready[(("act" if op is Op.SEND_F else "grad", s, mb), instr.peer)] = end + flight
                elif op in (Op.RECV_F, Op.RECV_B):
                    posted[(rank, ("act", s - 1, mb) if op is Op.RECV_F else ("grad", s + 1, mb))] = (instr, start)
                    end = None
                else:
                    assert op is Op.ALL_REDUCE
                    d = program.dp_size
                    nbytes = 2 * (d - 1) / d * _per(cost.grad_bytes, s)
                    end = start + cost.latency + (0.0 if math.isinf(cost.bandwidth) else nbytes / cost.bandwidth)
                if end is not None:
                    times[(rank, instr)] = (start, end)
                pos[rank] += 1
                moved = True
    assert all(p == len(stream) for p, stream in zip(pos, streams)), "the independent simulation got stuck"
    for (rank, item), (instr, start) in posted.items():
        times[(rank, instr)] = (start, max(start, ready[(item, rank)]))
    return times


def _independent_peaks(program):
    peaks = []
    for stream in program.ranks:
        held = most = 0
        for instr in stream:
            held += 1 if instr.op is Op.F else -1 if instr.op in (Op.B, Op.W) else 0
            most = max(most, held)
        peaks.append(most)
    return tuple(peaks)


CASES = [(name, v, p, m, variant) for name, v in (("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2), ("zbv", 2),
                                                  ("dualpipev", 2), ("zb-h1", 1))
         for p in (2, 3) for m in (1, 2, 4) for variant in ("plain", "split", "recompute", "dp")]


@pytest.mark.parametrize("name, v, p, m, variant", CASES)
def test_simulated_and_shown_numbers_match_an_independent_simulation(name, v, p, m, variant):
    try:
        program = ps.compile_program(name, p, m, v, dp_size=2 if variant == "dp" else 1,
                                     recompute=variant == "recompute", split_backward=variant == "split")
    except ps.ScheduleError:
        pytest.skip("size not accepted by the schedule")
    stages = p * v
    cost = ps.CostModel(forward=[1.0, 1.5, 0.7, 1.2, 0.9, 1.1][:stages], backward=[2.0, 2.5, 3.0, 1.7, 2.2, 2.1][:stages],
                        latency=0.25, send_overhead=0.05, activation_bytes=1e6, bandwidth=1e7, grad_bytes=3e6)
    t = ps.simulate(program, cost)
    expected = _independent(program, cost)
    got = {(e.rank, e.instr): (e.start, e.end) for e in t.events}
    assert got.keys() == expected.keys()
    for key, (start, end) in expected.items():
        assert got[key] == pytest.approx((start, end), abs=1e-9), key
    span = max(e for _, e in expected.values()) - min(s for s, _ in expected.values())
    busy = [0.0] * p
    for (rank, instr), (start, end) in expected.items():
        if instr.op in COMPUTE:
            busy[rank] += end - start
    assert t.makespan == pytest.approx(span)
    assert t.bubble_per_rank() == pytest.approx([(span - b) / span for b in busy])
    assert t.bubble_fraction == pytest.approx(sum(span - b for b in busy) / (p * span))
    assert t.peak_inflight == _independent_peaks(program)
    fractions = bubble_breakdown(t)["fraction"]
    assert fractions["total"] == pytest.approx(t.bubble_fraction)
    assert sum(v for k, v in fractions.items() if k != "total") == pytest.approx(t.bubble_fraction)
    trace = [e for e in to_chrome_trace(t)["traceEvents"] if e["ph"] == "X"]
    assert [(e["pid"], e["name"]) for e in trace] == [(e.rank, str(e.instr)) for e in t.events]
    assert [e["ts"] for e in trace] == pytest.approx([e.start * 1e6 for e in t.events])
    assert [e["dur"] for e in trace] == pytest.approx([e.duration * 1e6 for e in t.events])


# ---- a timeline of one rank (Pipeline.timeline()) is not fitted as if the other ranks' stages were free ---------

def _rank_one_only(timeline):
    from dataclasses import replace

    return replace(timeline, events=tuple(e for e in timeline.events if e.rank == 1), source="measured", ranks=(1,))


def test_fit_cost_and_simulate_like_refuse_a_timeline_of_some_ranks():
    from pipesched.viz.compare import fit_cost, simulate_like

    program = ps.compile_program("1f1b", 2, 2)
    one = _rank_one_only(ps.simulate(program, ps.CostModel(forward=1.0, backward=2.0, latency=0.5)))
    # rank 1 runs stage 1 only: fitted, stage 0 would cost 0 s and the prediction show rank 0 100% idle
    with pytest.raises(ValueError, match=r"holds ranks \[1\] of 2.*gather_timeline"):
        fit_cost(one)
    with pytest.raises(ValueError, match=r"holds ranks \[1\] of 2"):
        simulate_like(program, one)


def test_overlay_shows_a_rank_not_held_as_dashes_not_nan():
    from pipesched.viz.compare import plot_comparison

    program = ps.compile_program("1f1b", 2, 2)
    simulated = ps.simulate(program)
    fig = plot_comparison(simulated, _rank_one_only(simulated), mode="overlay")
    shown = {t.get_gid(): t.get_text() for ax in fig.axes for t in ax.texts if (t.get_gid() or "").startswith("bubble")}
    # F=1, B=2: makespan 9, 6 s busy on each rank; rank 1 alone: its RECV_F1.0 posted at 0 to its last B's end at 7
    assert shown == {"bubble-rank-0": " 33.3%\n    --", "bubble-rank-1": " 33.3%\n 14.3%"}
