"""A Timeline refuses events and labels that would make its statistics wrong (an end before its start: a bubble over
100%; a rank outside 0..num_ranks-1: an IndexError or a silently dropped rank; an inf time), and
``Timeline.from_json_dict`` / ``Timeline.load`` read strictly (no ``2.7`` ranks read as 2, no ``"0"`` read as 0.0,
no unknown key dropped): each error names the field, its value and what is valid; ``load`` names the file."""
import json
import math
from pathlib import Path

import pytest

import pipesched as ps
from pipesched import Event, Instr, Timeline
from pipesched.timeline import InTimelineOrder

F = Instr.parse("F0.0")
MEASURED = Path(__file__).resolve().parents[1] / "viz" / "measured" / "cpu-1f1b-p2-m8.json"
KEYS = ("events, num_ranks, source, meta, peak_inflight, peak_activation_bytes, ranks, makespan, bubble_fraction, "
        "bubble_per_rank")


def measured_like() -> Timeline:
    """A 2-rank, 1-microbatch run as the runtime saves it: sends take no time (end == start)."""
    rows = [(0, "F0.0", 0.0, 1.0), (0, "SEND_F0.0>1", 1.0, 1.0), (0, "RECV_B0.0<1", 1.0, 4.5), (0, "B0.0", 4.5, 6.5),
            (1, "RECV_F1.0<0", 0.0, 1.5), (1, "F1.0", 1.5, 2.5), (1, "B1.0", 2.5, 4.5), (1, "SEND_B1.0>0", 4.5, 4.5)]
    return Timeline(tuple(Event(r, Instr.parse(t), s, e) for r, t, s, e in rows), 2, source="measured",
                    meta={"schedule": "1f1b"}, peak_inflight=(1, 1), peak_activation_bytes=(100.0, 50.0))


# ---- the constructor ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("events, num_ranks, kind, message", [
    ((Event(0, F, 2.0, 1.0),), 1, ValueError,
     "Timeline: events[0] (F0.0): end 1.0 is before start 2.0 (an event's end must be >= its start)"),
    ((Event(0, F, 0.0, math.inf),), 1, ValueError,
     "Timeline: events[0] (F0.0): end must be finite (seconds from the step's start), got inf"),
    ((Event(0, F, math.nan, 1.0),), 1, ValueError,
     "Timeline: events[0] (F0.0): start must be finite (seconds from the step's start), got nan"),
    ((Event(0, F, 0.0, 1.0), Event(2, F, 0.0, 1.0)), 2, ValueError,
     "Timeline: events[1] (F0.0): rank 2 is outside 0..1 (num_ranks=2)"),
    ((Event(-1, F, 0.0, 1.0),), 2, ValueError, "Timeline: events[0] (F0.0): rank -1 is outside 0..1 (num_ranks=2)"),
    ((Event(1.0, F, 0.0, 1.0),), 2, TypeError, "Timeline: events[0] (F0.0): rank must be an int, got float 1.0"),
    ((Event(0, F, "0", 1.0),), 2, TypeError,
     "Timeline: events[0] (F0.0): start must be a number (seconds), got str '0'"),
    ((Event(0, "F0.0", 0.0, 1.0),), 2, TypeError,
     "Timeline: events[0]: instr must be a pipesched.Instr, got str 'F0.0'"),
    (((0, F, 0.0, 1.0),), 2, TypeError, "Timeline: events[0] must be a pipesched.Event(rank, instr, start, end), got "
                                        "tuple (0, Instr(op=<Op.F: 'F'>, stage=0, microbatch=0, peer=None), 0.0, 1.0)"),
    (5, 2, TypeError, "Timeline: events must be a sequence of pipesched.Event, got int 5"),
    ((), 0, ValueError, "Timeline: num_ranks must be an int >= 1 (pipeline ranks), got 0"),
    ((), 2.7, TypeError, "Timeline: num_ranks must be an int >= 1 (pipeline ranks), got float 2.7"),
    ((), "2", TypeError, "Timeline: num_ranks must be an int >= 1 (pipeline ranks), got str '2'"),
    ((), True, TypeError, "Timeline: num_ranks must be an int >= 1 (pipeline ranks), got bool True"),
])
def test_bad_events_and_num_ranks_are_refused_naming_them(events, num_ranks, kind, message):
    with pytest.raises(kind) as info:
        Timeline(events, num_ranks)
    assert str(info.value) == message


def test_bad_events_are_named_by_their_index_as_given_not_as_sorted():
    events = (Event(1, F, 0.0, 1.0), Event(0, F, 0.0, 1.0), Event(0, F, 3.0, 2.0))
    with pytest.raises(ValueError) as info:
        Timeline(events, 2)
    assert str(info.value) == "Timeline: events[2] (F0.0): end 2.0 is before start 3.0 (an event's end must be >= " \
                              "its start)"


@pytest.mark.parametrize("labels, kind, message", [
    (dict(source="sim"), ValueError, "Timeline: source must be 'simulated' or 'measured', got str 'sim'"),
    (dict(meta=None), TypeError, "Timeline: meta must be a dict (free labels), got NoneType None"),
    (dict(peak_inflight=(1,)), ValueError,
     "Timeline: peak_inflight must be a list of 2 (one per rank) or an empty one (unknown), got 1: (1,)"),
    (dict(peak_inflight=(1, -1)), ValueError, "Timeline: peak_inflight[1] must be an int >= 0, got int -1"),
    (dict(peak_activation_bytes=(1.0, -1.0)), ValueError,
     "Timeline: peak_activation_bytes[1] must be a finite number >= 0 (bytes) or NaN (unknown), got float -1.0"),
    (dict(peak_activation_bytes=(1.0, "x")), TypeError,
     "Timeline: peak_activation_bytes[1] must be a finite number >= 0 (bytes) or NaN (unknown), got str 'x'"),
    (dict(peak_activation_bytes=(1.0,)), ValueError,
     "Timeline: peak_activation_bytes must be a list of 2 (one per rank), got 1: (1.0,)"),
    (dict(ranks=(1, 1)), ValueError,
     "Timeline: ranks[1] = 1 is given twice; ranks must be None (every rank) or a list of distinct ranks in 0..1"),
    (dict(ranks=(2,)), ValueError, "Timeline: ranks[0] = 2 is outside 0..1 (num_ranks=2); ranks must be None (every "
                                   "rank) or a list of distinct ranks in 0..1"),
    (dict(ranks=1), TypeError,
     "Timeline: ranks must be None (every rank) or a list of distinct ranks in 0..1, got int 1"),
])
def test_bad_labels_are_refused_naming_them(labels, kind, message):
    with pytest.raises(kind) as info:
        Timeline((), 2, **labels)
    assert str(info.value) == message


def test_an_event_of_a_rank_the_timeline_does_not_hold_is_refused():
    with pytest.raises(ValueError) as info:
        Timeline((Event(0, F, 0.0, 1.0),), 2, "measured", ranks=(1,))
    assert str(info.value) == ("Timeline: events[0] (F0.0): rank 0 is not one of the ranks the timeline holds "
                               "(ranks=(1,))")


def test_what_measured_runs_give_is_taken():
    timeline = measured_like()  # zero-length sends
    assert timeline.bubble_per_rank() == (3.5 / 6.5, 3.5 / 6.5)  # F 1 s + B 2 s of 6.5 s on each rank
    one = Timeline(tuple(e for e in timeline.events if e.rank == 1), 2, "measured", ranks=(1,),
                   peak_activation_bytes=(math.nan, 4096.0), peak_inflight=(0, 1))  # as Pipeline.timeline() on rank 1
    assert math.isnan(one.bubble_per_rank()[0]) and 0 <= one.bubble_per_rank()[1] <= 1
    assert Timeline((), 1).bubble_per_rank() == (0.0,)  # no events: nothing to refuse


def test_numpy_numbers_are_held_as_plain_ones():
    np = pytest.importorskip("numpy")
    timeline = Timeline((Event(np.int64(1), F, np.float32(0.5), np.float64(1.0)),), np.int64(2),
                        peak_inflight=(np.int64(0), 1), peak_activation_bytes=(np.float32(1.5), 0), ranks=[np.int64(1)])
    (event,) = timeline.events
    assert [type(v) for v in (event.rank, event.start, event.end)] == [int, float, float]
    assert (event.rank, event.start, event.end) == (1, 0.5, 1.0)
    assert type(timeline.num_ranks) is int and timeline.num_ranks == 2
    assert timeline.peak_inflight == (0, 1) and timeline.peak_activation_bytes == (1.5, 0) and timeline.ranks == (1,)
    assert [type(v) for v in timeline.peak_inflight + timeline.peak_activation_bytes + timeline.ranks] == \
        [int, int, float, int, int]
    json.dumps(timeline.to_json_dict())  # no numpy number left to trip json


def test_lists_and_iterators_are_taken_as_tuples():
    timeline = Timeline(iter([Event(0, F, 0.0, 1.0)]), 1, peak_inflight=[1], ranks=[0])
    assert timeline.events == (Event(0, F, 0.0, 1.0),) and timeline.peak_inflight == (1,) and timeline.ranks == (0,)


def test_simulator_events_in_timeline_order_are_trusted_but_their_rank_range_checked():
    simulated = ps.simulate(ps.compile_program("1f1b", 2, 2))
    assert Timeline(InTimelineOrder(simulated.events), 2) == Timeline(simulated.events, 2)
    with pytest.raises(ValueError) as info:  # rank 1 of a 1-rank timeline: the last event's rank
        Timeline(InTimelineOrder(simulated.events), 1)
    assert str(info.value).startswith("Timeline: events[") and str(info.value).endswith(
        ": rank 1 is outside 0..0 (num_ranks=1)")


def test_simulated_timelines_and_replace_still_build():
    from dataclasses import replace

    timeline = ps.simulate(ps.compile_program("zbv", 2, 4), ps.CostModel(activation_bytes=10))
    again = replace(timeline, events=tuple(reversed(timeline.events)))  # sorted again (ties: as given)
    assert sorted(again.events, key=str) == sorted(timeline.events, key=str)
    assert all(0 <= b <= 1 for b in timeline.bubble_per_rank())


# ---- from_json_dict ----------------------------------------------------------------------------------------------

GOOD = {"events": [[0, "F0.0", 0.0, 1.0]], "num_ranks": 2}


@pytest.mark.parametrize("data, message", [
    (dict(GOOD, num_ranks=2.7), "num_ranks must be an int >= 1 (pipeline ranks), got float 2.7"),
    (dict(GOOD, num_ranks=2.0), "num_ranks must be an int >= 1 (pipeline ranks), got float 2.0"),
    (dict(GOOD, num_ranks="2"), "num_ranks must be an int >= 1 (pipeline ranks), got str '2'"),
    (dict(GOOD, num_ranks=0), "num_ranks must be an int >= 1 (pipeline ranks), got 0"),
    (dict(GOOD, events=[[0, "F0.0", "0", 1.0]]), "events[0] (F0.0): start must be a number (seconds), got str '0'"),
    (dict(GOOD, events=[[0, "F0.0", True, 1.0]]), "events[0] (F0.0): start must be a number (seconds), got bool True"),
    (dict(GOOD, events=[["0", "F0.0", 0, 1]]), "events[0] (F0.0): rank must be an int, got str '0'"),
    (dict(GOOD, events=[[2, "F0.0", 0, 1]]), "events[0] (F0.0): rank 2 is outside 0..1 (num_ranks=2)"),
    (dict(GOOD, events=[[0, "F0.0", 1.0, 0.5]]),
     "events[0] (F0.0): end 0.5 is before start 1.0 (an event's end must be >= its start)"),
    (dict(GOOD, events=[[0, "F0.0", 0]]), "events[0] must be a [rank, instruction, start, end] row, got list "
                                          "[0, 'F0.0', 0]"),
    (dict(GOOD, events=[[0, 7, 0, 1]]), 'events[0]: the instruction must be its text (e.g. "F0.1"), got int 7'),
    (dict(GOOD, events=[[0, "F0.x", 0, 1]]), "events[0]: cannot parse instruction 'F0.x'; expected e.g. F0.3, B1.0, "
                                             "SEND_F0.3>1, RECV_B2.0<3, ALL_REDUCE1 (kinds: F, B, I, W, R, SEND_F, "
                                             "RECV_F, SEND_B, RECV_B, ALL_REDUCE, TIE_REDUCE)"),
    (dict(GOOD, events={}), "events must be a list of [rank, instruction, start, end] rows, got dict {}"),
    (dict(GOOD, num_rank=2),
     f"unknown key 'num_rank' (did you mean 'num_ranks'?); a saved Timeline's keys are {KEYS}"),
    (dict(GOOD, a=1, b=2), f"unknown keys 'a', 'b'; a saved Timeline's keys are {KEYS}"),
    ({"events": []}, "missing key 'num_ranks' (a saved Timeline needs events and num_ranks)"),
    ({}, "missing keys 'events', 'num_ranks' (a saved Timeline needs events and num_ranks)"),
    ([GOOD], "the top level must be a JSON object (as Timeline.save writes), got list [{'events': [[0, 'F0.0', 0.0, "
             "1.0]], 'num_ranks': 2}]"),
    (dict(GOOD, meta=[["a", 1]]), "meta must be a dict (free labels), got list [['a', 1]]"),
    (dict(GOOD, source="replayed"), "source must be 'simulated' or 'measured', got str 'replayed'"),
    (dict(GOOD, peak_inflight=[1, 1.5]), "peak_inflight[1] must be an int >= 0, got float 1.5"),
    (dict(GOOD, peak_activation_bytes=[1.0, "2"]),
     "peak_activation_bytes[1] must be a finite number >= 0 (bytes) or NaN (unknown), got str '2'"),
    (dict(GOOD, ranks=[1]), "events[0] (F0.0): rank 0 is not one of the ranks the timeline holds (ranks=(1,))"),
])
def test_from_json_dict_refuses_what_it_used_to_coerce_or_drop(data, message):
    with pytest.raises(ValueError) as info:
        Timeline.from_json_dict(data)
    assert type(info.value) is ValueError and str(info.value) == "Timeline JSON: " + message


def test_from_json_dict_reads_what_to_json_dict_writes():
    for timeline in (measured_like(), ps.simulate(ps.compile_program("1f1b", 2, 2), ps.CostModel(activation_bytes=8)),
                     Timeline((Event(1, F, 0.0, 1.0),), 2, "measured", ranks=(1,),
                              peak_activation_bytes=(math.nan, 3.0))):
        text = json.dumps(timeline.to_json_dict(), allow_nan=False)
        back = Timeline.from_json_dict(json.loads(text))
        assert back.events == timeline.events and back.summary().keys() == timeline.summary().keys()
        assert json.dumps(back.to_json_dict(), allow_nan=False) == text
    minimal = Timeline.from_json_dict(GOOD)  # the optional keys left out
    assert (minimal.source, minimal.meta, minimal.peak_inflight, minimal.peak_activation_bytes, minimal.ranks) == (
        "measured", {}, (), None, None)


def test_the_saved_measured_run_in_the_repository_still_loads():
    timeline = Timeline.load(MEASURED)  # written before "ranks" was saved: the key is left out
    assert timeline.num_ranks == 2 and len(timeline.events) == 64 and timeline.ranks is None
    saved = json.loads(MEASURED.read_text(encoding="utf-8"))
    assert timeline.bubble_fraction == pytest.approx(saved["bubble_fraction"])


# ---- load --------------------------------------------------------------------------------------------------------

def test_load_names_the_file(tmp_path):
    path = tmp_path / "run.json"
    data = measured_like().to_json_dict()
    data["num_ranks"] = 2.7
    path.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(ValueError) as info:
        Timeline.load(path)
    assert str(info.value) == f"{path} is not a saved Timeline: num_ranks must be an int >= 1 (pipeline ranks), got " \
                              f"float 2.7"
    path.write_text("[]", encoding="utf-8")
    with pytest.raises(ValueError) as info:
        Timeline.load(str(path))
    assert str(info.value) == (f"{path} is not a saved Timeline: the top level must be a JSON object (as "
                               f"Timeline.save writes), got list []")
    data = measured_like().to_json_dict()
    data["events"][2][2:] = [5.0, 4.0]
    path.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(ValueError) as info:
        Timeline.load(path)
    assert str(info.value) == f"{path} is not a saved Timeline: events[2] (RECV_B0.0<1): end 4.0 is before start " \
                              f"5.0 (an event's end must be >= its start)"


def test_render_trace_of_a_bad_file_exits_2_naming_the_file_and_field(tmp_path, capsys):
    from pipesched.viz.cli import main

    path = tmp_path / "run.json"
    data = measured_like().to_json_dict()
    data["split"] = True
    path.write_text(json.dumps(data), encoding="utf-8")
    assert main(["render", "--trace", str(path), "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert f"{path} is not a saved Timeline: unknown key 'split'" in err
    assert not (tmp_path / "x.png").exists()


# ---- session 19 (viz hunt) -----------------------------------------------------------------------------------

def test_an_instruction_run_twice_on_a_rank_is_refused():
    from pipesched import Event, Instr, Timeline

    events = (Event(0, Instr.parse("F0.0"), 0.0, 1.0), Event(0, Instr.parse("F0.0"), 1.0, 2.0),
              Event(0, Instr.parse("B0.0"), 2.0, 4.0))
    with pytest.raises(ValueError) as info:
        Timeline(events, num_ranks=1)
    assert str(info.value) == ("Timeline: events[1] (F0.0): rank 0 runs F0.0 twice (also events[0]); a timeline is "
                               "one step, each instruction once per rank")


def test_overlapping_computes_count_once_in_the_busy_time_and_the_bubble():
    from pipesched import Event, Instr, Timeline

    # F0.1 runs 1..3 while B0.0 runs 2..4 (an executor overlapping a pair): busy 0..4 = 4 s of a 6 s makespan
    events = (Event(0, Instr.parse("F0.0"), 0.0, 1.0), Event(0, Instr.parse("F0.1"), 1.0, 3.0),
              Event(0, Instr.parse("B0.0"), 2.0, 4.0), Event(0, Instr.parse("B0.1"), 5.0, 6.0))
    timeline = Timeline(events, num_ranks=1)
    assert timeline.busy_per_rank() == (5.0,)
    assert timeline.bubble_fraction == pytest.approx(1 / 6)


def test_a_time_too_large_for_a_float_is_named_not_an_overflow_error():
    from pipesched import Event, Instr, Timeline

    with pytest.raises(ValueError, match=r"^Timeline: events\[0\] \(F0\.0\): end must be finite \(seconds from the "
                                         r"step's start\), got 1000000"):
        Timeline((Event(0, Instr.parse("F0.0"), 0, 10 ** 400),), num_ranks=1)
