"""Measured collectives span until their result was awaited (the all-reduce's tail is in the makespan and the
bubble, as the simulator has it), and a failed Pipeline's timeline() / gather_timeline() raise its PipelineError
instead of passing off the last good step's timeline (2 gloo ranks, one launch)."""
import pytest

import pipesched as ps
from pipesched.ir import BACKWARD_OPS, Op
from pipesched.runtime import launch
from pipesched.timeline import Timeline

import rt_measured_tail


@pytest.fixture(scope="module")
def runs():
    return launch(rt_measured_tail.suite, 2, timeout=240)


def _one(timeline, text):
    found = [e for e in timeline.events if str(e.instr) == text]
    assert len(found) == 1, (text, found)
    return found[0]


def test_the_dp_all_reduce_event_ends_when_its_sum_was_awaited(runs):
    by_replica = {}
    for rank in range(2):
        dp = runs[rank]["dp"]
        t = Timeline.from_json_dict(dp["local"])
        program = ps.loads(dp["program"])
        assert (program.num_ranks, program.dp_size) == (1, 2)
        assert [str(i) for i in program.ranks[0] if i.op is Op.ALL_REDUCE] == ["ALL_REDUCE0"]
        reduce = _one(t, "ALL_REDUCE0")
        last_backward = max(e.end for e in t.events if e.instr.op in BACKWARD_OPS)
        assert reduce.end >= last_backward
        assert reduce.end == max(e.end for e in t.events)  # the step's last event to end
        assert t.makespan == reduce.end - min(e.start for e in t.events)  # the makespan covers it
        assert dp["wall"] >= t.makespan
        by_replica[dp["dp_rank"]] = (reduce.start + dp["wall0"], reduce.end + dp["wall0"])
    assert sorted(by_replica) == [0, 1]
    # a sum is not in before every replica started it (one host: one wall clock); replica 1 was slow (it slept
    # 4 x 50 ms), so replica 0's event spans its wait for replica 1
    assert by_replica[0][1] >= by_replica[1][0]
    assert by_replica[1][1] >= by_replica[0][0]
    assert by_replica[0][0] < by_replica[1][0]


def test_the_tie_reduce_event_ends_when_its_sum_was_awaited(runs):
    t = Timeline.from_json_dict(runs[0]["ties"]["gathered"])
    assert t.events == Timeline.from_json_dict(runs[1]["ties"]["gathered"]).events
    program = ps.loads(runs[0]["ties"]["program"])
    reduces = {}
    for rank in range(2):
        found = [e for e in t.events if e.rank == rank and e.instr.op is Op.TIE_REDUCE]
        assert len(found) == 1 == sum(i.op is Op.TIE_REDUCE for i in program.ranks[rank])
        reduces[rank] = found[0]
        assert found[0].end == max(e.end for e in t.events if e.rank == rank)
    # pipeline rank 0's backwards sleep: it starts the tie's sum last, and rank 1's event spans the wait for it
    assert reduces[1].start < reduces[0].start <= reduces[1].end
    assert t.makespan == max(r.end for r in reduces.values()) - min(e.start for e in t.events)
    # each rank's own span lies within its step() call (the ranks start at different times)
    for rank in range(2):
        mine = [e for e in t.events if e.rank == rank]
        assert runs[rank]["ties"]["wall"] >= max(e.end for e in mine) - min(e.start for e in mine)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_failed_pipeline_has_no_timeline_to_give(runs, rank):
    failed = runs[rank]["failed"]
    assert failed["before"] == {"step": 16, "forward": 8}  # 1f1b p=2 m=4 per rank: 4 F, 4 B, 4 sends, 4 receives
    assert "failed at instruction F1.2 (kind F, stage 1, microbatch 2): ValueError: boom" in failed["step"]
    for name in ("timeline", "gather_timeline"):
        for kind in ("step", "forward"):
            kind_name, instr, cause, text = failed[(name, kind)]
            assert (kind_name, instr, cause) == ("PipelineError", "F1.2", "ValueError: boom")
            assert text.startswith("pipeline rank failure: world rank 1 (pipeline rank 1) failed at instruction F1.2")
            if rank == 0:  # the note says which call raised it
                assert text.endswith(f"[reported to world rank 0: {name}(kind={kind!r}): this Pipeline failed in "
                                     "an earlier step]" if name == "timeline" else
                                     "[reported to world rank 0: this Pipeline failed in an earlier step]")
