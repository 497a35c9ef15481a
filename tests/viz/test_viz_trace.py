"""Chrome-trace export: valid JSON, one event per instruction, ordered, on the right rank tracks."""
import json
from collections import Counter

import pytest

from pipesched import CostModel
from pipesched.viz.trace import save_chrome_trace, to_chrome_trace

from viz_support import sim


def instruction_events(trace):
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


@pytest.mark.parametrize("name,v", [("1f1b", None), ("gpipe", None), ("interleaved-1f1b", 2)])
def test_one_event_per_instruction_on_its_rank(name, v, tmp_path):
    program, timeline = sim(name, 4, 8, v, cost=CostModel(latency=0.1, grad_bytes=1, bandwidth=4),
                            dp_size=2, recompute=True)
    path = tmp_path / "trace.json"
    save_chrome_trace(timeline, path)
    trace = json.loads(path.read_text())
    events = instruction_events(trace)
    assert len(events) == len(program)
    for rank in range(4):
        names = Counter(e["name"] for e in events if e["pid"] == rank)
        assert names == Counter(str(i) for i in program.ranks[rank])
    processes = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert processes == {r: f"rank {r}" for r in range(4)}
    assert trace["otherData"]["bubble_fraction"] == pytest.approx(timeline.bubble_fraction)


def test_events_are_ordered_and_in_microseconds():
    _, timeline = sim("1f1b", 2, 2)
    events = instruction_events(to_chrome_trace(timeline))
    keys = [(e["pid"], e["ts"]) for e in events]
    assert keys == sorted(keys)
    assert [e["name"] for e in events] == [str(e.instr) for e in timeline.events]
    first = events[0]
    assert (first["name"], first["ts"], first["dur"], first["cat"], first["tid"]) == ("F0.0", 0.0, 1e6, "compute", 0)
    assert first["args"] == {"op": "F", "stage": 0, "microbatch": 0, "peer": None, "rank": 0}


def test_overlapping_spans_get_their_own_lanes(measured):
    events = instruction_events(to_chrome_trace(measured))
    by_name = {e["name"]: e for e in events}
    assert by_name["F0.0"]["tid"] == 0 and by_name["SEND_F0.0>1"]["tid"] == 0
    assert by_name["RECV_B0.0<1"]["tid"] == 1 and by_name["RECV_B0.0<1"]["cat"] == "recv"
    assert by_name["ALL_REDUCE0"]["tid"] == 2 and by_name["ALL_REDUCE0"]["cat"] == "all-reduce"
    assert by_name["RECV_B0.0<1"]["dur"] == pytest.approx(3800.0)  # 1.0 ms -> 4.8 ms
    lanes = {}
    for e in events:
        lanes.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in lanes.values():
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert start >= end - 1e-6  # nothing overlaps within a thread


def test_event_rank_outside_the_timeline_raises():
    from pipesched import Event, Instr, Timeline

    with pytest.raises(ValueError, match=r"^Timeline: events\[0\] \(F0\.0\): rank 3 is outside 0\.\.1 \(num_ranks=2\)$"):
        Timeline((Event(3, Instr.parse("F0.0"), 0.0, 1.0),), num_ranks=2)


def test_an_int_path_is_refused_not_taken_for_a_file_descriptor():
    _, timeline = sim("1f1b", 2, 2, None)
    with pytest.raises(TypeError) as caught:
        save_chrome_trace(timeline, 1)  # fd 1 would be this process's stdout, then closed
    assert str(caught.value) == "save_chrome_trace: path must be a str or os.PathLike, got int 1"
