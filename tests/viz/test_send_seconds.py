"""send_seconds (pipesched.viz.analysis): the duration in seconds of every SEND event, the one helper behind
fit_cost's send_overhead (a median) and the benchmarks' measured costs (bench_zero_bubble: a median; bubble_gap: a
mean). fit_cost on the repository's measured run is pinned to what it gave before the helper existed."""
import statistics
from pathlib import Path

import pytest

from pipesched import Event, Instr, Timeline
from pipesched.viz import send_seconds
from pipesched.viz.compare import fit_cost

from viz_support import measured_like

MEASURED = Path(__file__).resolve().parents[2] / "viz" / "measured" / "cpu-1f1b-p2-m8.json"


def test_every_send_event_in_event_order_and_nothing_else():
    rows = [(0, "F0.0", 0.0, 1.0), (0, "SEND_F0.0>1", 1.0, 1.25), (1, "RECV_F1.0<0", 0.0, 1.5),
            (1, "F1.0", 1.5, 2.0), (1, "B1.0", 2.0, 4.0), (1, "SEND_B1.0>0", 4.0, 4.5),
            (0, "RECV_B0.0<1", 1.25, 4.75), (0, "B0.0", 4.75, 6.0), (0, "SEND_F0.1>1", 2.0, 2.0)]
    timeline = Timeline(tuple(Event(r, Instr.parse(t), s, e) for r, t, s, e in rows), 2)
    # timeline.events are by rank, then start: rank 0's SENDs at 1.0 and 2.0, then rank 1's at 4.0; exact (binary
    # fractions); the zero-length SEND counts as 0.0
    assert send_seconds(timeline) == [0.25, 0.0, 0.5]


def test_no_send_events_give_an_empty_list_and_instant_sends_zeros():
    assert send_seconds(Timeline((Event(0, Instr.parse("F0.0"), 0.0, 1.0),), 1)) == []
    assert send_seconds(measured_like()) == [0.0, 0.0]  # its SEND_F and SEND_B take no time
    assert fit_cost(measured_like()).send_overhead == 0.0


def test_fit_cost_on_the_measured_run_is_unchanged():
    timeline = Timeline.load(MEASURED)
    sends = send_seconds(timeline)
    assert len(sends) == 16  # 1f1b, p=2, m=8: 8 SEND_F on rank 0, 8 SEND_B on rank 1
    assert statistics.median(sends) == pytest.approx(9.0966e-05, rel=1e-4)
    assert min(sends) == pytest.approx(6.9503e-05, rel=1e-4)
    fitted = fit_cost(timeline)  # the values fit_cost gave with its own copy of the helper
    assert fitted.send_overhead == 9.1e-05 and fitted.latency == 1.08e-05
    assert list(fitted.forward) == [0.000738, 0.00076] and list(fitted.backward) == [0.00158, 0.00146]
