"""bubble_breakdown: the categories add up to the bubble and take the values worked out by hand."""
import pytest

from pipesched import SCHEDULES, CostModel
from pipesched.viz.analysis import CATEGORIES, bubble_breakdown, communication_waits
from pipesched.viz.compare import bubble_breakdown as from_compare

from viz_support import sim


def test_compare_exports_the_same_function():
    assert from_compare is bubble_breakdown


def test_uniform_1f1b_is_all_warmup_and_cooldown():
    # p=4, m=8, F=1, B=2: makespan 33, every rank idles 9 s; rank r fills for 6-r s and drains 3+r s.
    _, timeline = sim("1f1b", 4, 8)
    result = bubble_breakdown(timeline)
    assert result["makespan"] == pytest.approx(33.0)
    assert [row["warmup"] for row in result["per_rank"]] == pytest.approx([6, 5, 4, 3])
    assert [row["cooldown"] for row in result["per_rank"]] == pytest.approx([3, 4, 5, 6])
    assert result["seconds"]["communication"] == 0 and result["seconds"]["imbalance"] == 0
    assert result["seconds"]["steady"] == 0
    assert result["fraction"]["total"] == pytest.approx(3 / 11)
    assert result["fraction"]["warmup"] == pytest.approx(3 / 22)


def test_gpipe_fill_is_twice_its_drain():
    _, timeline = sim("gpipe", 4, 8)
    fraction = bubble_breakdown(timeline)["fraction"]
    assert fraction["warmup"] == pytest.approx(24 / 132)
    assert fraction["cooldown"] == pytest.approx(12 / 132)


def test_message_latency_is_communication_wait():
    # p=2, m=1, latency 0.5: rank 0 F[0,1] B[5,7]; rank 1 F[1.5,2.5] B[2.5,4.5]; makespan 7.
    _, timeline = sim("1f1b", 2, 1, cost=CostModel(latency=0.5))
    result = bubble_breakdown(timeline)
    assert result["per_rank"][0] == pytest.approx(
        {"warmup": 3.5, "steady": 0, "cooldown": 0, "sending": 0, "communication": 0.5, "imbalance": 0, "idle": 4})
    assert result["per_rank"][1] == pytest.approx(
        {"warmup": 1.0, "steady": 0, "cooldown": 2.5, "sending": 0, "communication": 0.5, "imbalance": 0, "idle": 4})
    assert communication_waits(timeline) == [[(4.5, 5.0, "p2p")], [(1.0, 1.5, "p2p")]]


def test_trailing_all_reduce_is_communication_wait():
    # dp=2, grad 3 bytes at 1 B/s: all-reduce takes 3 s; rank 1 waits [4,7] for it, then drains [7,9].
    _, timeline = sim("1f1b", 2, 1, cost=CostModel(grad_bytes=3, bandwidth=1), dp_size=2)
    rows = bubble_breakdown(timeline)["per_rank"]
    assert rows[1]["communication"] == pytest.approx(3.0)
    assert rows[1]["cooldown"] == pytest.approx(2.0)
    assert communication_waits(timeline)[1] == [(4.0, 7.0, "all-reduce")]


def test_slow_stage_shows_as_imbalance():
    # stage 2 costs twice the others: ranks 0, 1, 3 compute 24 s less than rank 2; makespan 55.
    cost = CostModel(forward=[1, 1, 2, 1], backward=[2, 2, 4, 2])
    _, timeline = sim("1f1b", 4, 8, cost=cost)
    result = bubble_breakdown(timeline)
    assert result["makespan"] == pytest.approx(55.0)
    assert [row["imbalance"] for row in result["per_rank"]] == pytest.approx([24, 24, 0, 24])
    assert result["fraction"]["imbalance"] == pytest.approx(72 / 220)


def test_measured_like_timeline(measured):
    # rank 0: gap [1, 4.9] ms, gradient in flight [4.4, 4.8] -> 0.4 ms comm, 3.5 ms warmup;
    #         trailing [7, 8]: its all-reduce [7, 8] -> 1.0 comm.
    # rank 1: gap [0, 1.5], activation in flight [1.0, 1.4] -> 0.4 comm, 1.1 warmup;
    #         trailing [4.4, 8]: all-reduce [4.4, 6.0] -> 1.6 comm, 2.0 left after its last forward, of
    #         which 0.2 is imbalance (it computes 2.9 ms, rank 0 3.1 ms) and 1.8 cooldown.
    rows = bubble_breakdown(measured)["per_rank"]
    ms = 1e-3
    assert rows[0]["communication"] == pytest.approx(1.4 * ms)
    assert rows[0]["warmup"] == pytest.approx(3.5 * ms)
    assert rows[1]["communication"] == pytest.approx(2.0 * ms)
    assert rows[1]["warmup"] == pytest.approx(1.1 * ms)
    assert rows[1]["imbalance"] == pytest.approx(0.2 * ms)
    assert rows[1]["cooldown"] == pytest.approx(1.8 * ms)
    assert rows[0]["imbalance"] == 0
    assert bubble_breakdown(measured)["fraction"]["total"] == pytest.approx(0.625)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("m", [1, 3, 8])
def test_categories_partition_the_bubble(name, m):
    cost = CostModel(forward=[1, 1.5, 1, 0.7], backward=2.5, latency=0.05, grad_bytes=1, bandwidth=2)
    v = SCHEDULES[name].default_virtual_stages
    if v > 1:
        cost = CostModel(forward=[1, 1.5, 1, 0.7] * v, backward=2.5, latency=0.05, grad_bytes=1, bandwidth=2)
    _, timeline = sim(name, 4, m, cost=cost, dp_size=2)
    result = bubble_breakdown(timeline)
    assert all(value >= -1e-9 for value in result["seconds"].values())
    assert sum(result["fraction"][c] for c in CATEGORIES) == pytest.approx(timeline.bubble_fraction)
    assert result["fraction"]["total"] == pytest.approx(timeline.bubble_fraction)
    for row, bubble in zip(result["per_rank"], timeline.bubble_per_rank()):
        assert sum(row[c] for c in CATEGORIES) == pytest.approx(row["idle"])
        assert row["idle"] == pytest.approx(bubble * timeline.makespan)


def test_starts_after_receives_moves_compute_that_was_stamped_before_its_input_landed():
    from pipesched import Event, Instr, Timeline
    from pipesched.viz.analysis import starts_after_receives

    rows = [(0, "F0.0", 0, 1), (0, "SEND_F0.0>1", 1, 1), (1, "RECV_F1.0<0", 0, 3), (1, "F1.0", 0.5, 4),
            (1, "B1.0", 4, 6), (1, "SEND_B1.0>0", 6, 6), (0, "RECV_B0.0<1", 1, 6.5), (0, "B0.0", 1, 8)]
    raw = Timeline(tuple(Event(r, Instr.parse(t), s, e) for r, t, s, e in rows), 2, source="measured")
    fixed = {(e.rank, str(e.instr)): (e.start, e.end) for e in starts_after_receives(raw).events}
    assert fixed[(1, "F1.0")] == (3, 4)  # waited 0.5 -> 3 for its input
    assert fixed[(0, "B0.0")] == (6.5, 8)
    assert fixed[(1, "B1.0")] == (4, 6) and fixed[(0, "F0.0")] == (0, 1)  # no receive: unchanged
    # busy 1 + 1.5 (rank 0), 1 + 2 (rank 1) over makespan 8 -> bubble (5.5 + 5) / 16
    assert starts_after_receives(raw).bubble_fraction == pytest.approx(10.5 / 16)


def test_breakdown_of_a_one_rank_timeline_covers_that_rank_only():
    from pipesched import Timeline

    _, timeline = sim("1f1b", 2, 4)
    one = Timeline(tuple(e for e in timeline.events if e.rank == 0), 2, "measured", ranks=(0,))
    result = bubble_breakdown(one)
    assert result["per_rank"][1] is None
    assert result["fraction"]["total"] == pytest.approx(one.bubble_fraction)
    assert sum(v for k, v in result["fraction"].items() if k != "total") == pytest.approx(one.bubble_fraction)
