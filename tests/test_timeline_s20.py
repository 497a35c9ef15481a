"""The timeline's strict checks live in pipesched.timeline_checks (imported by pipesched.timeline, never the
reverse; the moved names still import from pipesched.timeline), and two more refusals: a SEND/RECV whose peer rank
is outside 0..num_ranks-1, and a span (an event's, or the timeline's) that overflows a float, which made the
makespan inf and every bubble NaN."""
import ast
import math
from pathlib import Path

import numpy as np
import pytest

import pipesched as ps
import pipesched.timeline as timeline_module
import pipesched.timeline_checks as checks_module
from pipesched import Event, Instr, Timeline

ROOT = Path(__file__).resolve().parents[1]
F0, F1 = Instr.parse("F0.0"), Instr.parse("F1.0")


# ---- the move -------------------------------------------------------------------------------------------------

def test_the_moved_names_are_the_same_objects_from_either_module():
    for name in ("Event", "SOURCES", "InTimelineOrder"):
        assert getattr(timeline_module, name) is getattr(checks_module, name), name
    assert ps.Event is checks_module.Event and timeline_module.SOURCES == ("simulated", "measured")
    assert set(timeline_module.__all__) >= {"Event", "InTimelineOrder", "SOURCES", "Timeline", "peak_inflight",
                                            "timeline_order"}


def test_the_checks_module_does_not_import_the_timeline_module():
    tree = ast.parse((ROOT / "pipesched" / "timeline_checks.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported == {"__future__", "operator", "typing", "checks", "ir"}
    assert "timeline" not in {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                              for alias in node.names}


def test_timeline_py_is_a_small_file_again():
    assert len((ROOT / "pipesched" / "timeline.py").read_text().splitlines()) < 300


# ---- a peer rank outside the ranks --------------------------------------------------------------------------------

PEER_5 = ("Timeline: events[0] (SEND_F0.0>5): peer rank 5 is outside 0..1 (num_ranks=2); a SEND/RECV's peer must "
          "be a rank of the timeline")


@pytest.mark.parametrize("start", [0.0, np.float64(0.0)], ids=["quick-check", "one-by-one"])
def test_a_send_to_a_rank_outside_the_timeline_is_refused(start):
    with pytest.raises(ValueError) as info:
        Timeline([Event(0, Instr.parse("SEND_F0.0>5"), start, 1.0)], 2)
    assert str(info.value) == PEER_5


def test_a_receive_from_a_negative_peer_is_refused_naming_the_event_by_its_index():
    events = [Event(0, F0, 0.0, 1.0), Event(0, Instr("RECV_B", 0, 0, -1), 1.0, 2.0)]
    with pytest.raises(ValueError) as info:
        Timeline(events, 2)
    assert str(info.value) == ("Timeline: events[1] (RECV_B0.0<-1): peer rank -1 is outside 0..1 (num_ranks=2); a "
                               "SEND/RECV's peer must be a rank of the timeline")


def test_an_own_rank_outside_the_ranks_is_named_before_a_peer():
    events = [Event(0, Instr.parse("SEND_F0.0>7"), 0.0, 1.0), Event(3, F1, 0.0, 1.0)]
    with pytest.raises(ValueError) as info:
        Timeline(events, 2)
    assert str(info.value) == "Timeline: events[1] (F1.0): rank 3 is outside 0..1 (num_ranks=2)"


def test_a_saved_timeline_with_a_peer_outside_the_ranks_is_refused():
    data = Timeline([Event(0, Instr.parse("SEND_F0.0>1"), 0.0, 1.0)], 2).to_json_dict()
    data["events"][0][1] = "SEND_F0.0>2"
    with pytest.raises(ValueError) as info:
        Timeline.from_json_dict(data)
    assert str(info.value) == ("Timeline JSON: events[0] (SEND_F0.0>2): peer rank 2 is outside 0..1 (num_ranks=2); "
                               "a SEND/RECV's peer must be a rank of the timeline")


def test_a_one_rank_timeline_may_name_a_peer_it_does_not_hold():
    # pipe.timeline(): rank 1's events only; its receives name rank 0, a rank of the pipeline
    one = Timeline([Event(1, Instr.parse("RECV_F1.0<0"), 0.0, 1.0), Event(1, F1, 1.0, 2.0)], 2, ranks=[1])
    assert one.events[0].instr.peer == 0 and one.makespan == 2.0


def test_simulated_and_measured_timelines_still_build():
    simulated = ps.simulate(ps.compile_program("interleaved-1f1b", 4, 8, 2, dp_size=2))
    again = Timeline(list(simulated.events), 4, meta=simulated.meta)  # checked event by event this time
    assert again.makespan == simulated.makespan and again.bubble_fraction == simulated.bubble_fraction
    measured = Timeline.load(ROOT / "viz" / "measured" / "cpu-1f1b-p2-m8.json")
    assert measured.num_ranks == 2 and {e.instr.peer for e in measured.events} == {None, 0, 1}


# ---- a span that overflows ----------------------------------------------------------------------------------------

def test_an_event_whose_span_overflows_is_refused():
    with pytest.raises(ValueError) as info:
        Timeline([Event(0, F0, -1e308, 1e308)], 1)
    assert str(info.value) == ("Timeline: events[0] (F0.0): its span end - start = 1e+308 - -1e+308 overflows (not a "
                               "finite float); an event's span must be finite (seconds)")


def test_a_timeline_whose_span_overflows_is_refused_naming_both_ends():
    events = [Event(0, F0, -1e308, -1e308), Event(1, F1, 1e308, 1e308)]  # each event 0 s; first start to last end: inf
    with pytest.raises(ValueError) as info:
        Timeline(events, 2)
    assert str(info.value) == ("Timeline: the timeline's span from the first start -1e+308 (events[0]) to the last "
                               "end 1e+308 (events[1]) overflows (not a finite float); the makespan must be finite "
                               "(seconds)")


def test_a_saved_timeline_whose_span_overflows_is_refused():
    data = Timeline([Event(0, F0, 0.0, 1.0)], 1).to_json_dict()
    data["events"][0][2:] = [-1e308, 1e308]
    with pytest.raises(ValueError) as info:
        Timeline.from_json_dict(data)
    assert str(info.value) == ("Timeline JSON: events[0] (F0.0): its span end - start = 1e+308 - -1e+308 overflows "
                               "(not a finite float); an event's span must be finite (seconds)")


def test_a_large_finite_span_is_kept():
    timeline = Timeline([Event(0, F0, -1e307, 1e307)], 1)
    assert timeline.makespan == 2e307 and math.isfinite(timeline.makespan)
    assert timeline.bubble_per_rank() == (0.0,)
