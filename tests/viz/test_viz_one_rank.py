"""A timeline of one rank (what ``Pipeline.timeline()`` returns) knows how many stages its program has: a rank
without the last stage took the highest stage it saw for the last, so its backward needed no gradient message and
its waits for one were drawn and broken down as warmup or cooldown (communication 0)."""
import pytest

import pipesched as ps
from pipesched import Timeline
from pipesched.viz import bubble_breakdown
from pipesched.viz.analysis import communication_waits, stage_count


def _alone(full, rank):
    return Timeline(tuple(e for e in full.events if e.rank == rank), full.num_ranks, "measured", dict(full.meta),
                    full.peak_inflight, ranks=(rank,))


@pytest.mark.parametrize("schedule, rank, waits", [("1f1b", 0, 3), ("1f1b", 1, 2), ("zbv", 1, 2)])
def test_a_one_rank_timeline_waits_for_the_same_messages(schedule, rank, waits):
    full = ps.simulate(ps.compile_program(schedule, 2, 4), ps.CostModel(forward=1.0, backward=2.0, latency=0.5))
    alone = _alone(full, rank)
    assert len(communication_waits(full)[rank]) == len(communication_waits(alone)[rank]) == waits
    assert bubble_breakdown(alone)["per_rank"][rank]["communication"] > 0.0


def test_the_stage_count_comes_from_the_messages_and_meta():
    full = ps.simulate(ps.compile_program("zbv", 2, 4))
    assert stage_count(full) == 4
    no_meta = Timeline(tuple(e for e in full.events if e.rank == 1), 2, "measured", {}, full.peak_inflight,
                       ranks=(1,))
    assert stage_count(no_meta) == 4  # rank 1 holds stages 1 and 2; its SEND_F2 says stage 3 exists
