"""The bubble breakdown in any time unit (new-user trial E, item 6): its tolerance for "the same instant" is relative
to the timeline's makespan (1e-12 x makespan), not an absolute 1e-12 s, so that with op times of 1e-12 s or less the
six parts still add up to the bubble (they added up to 0.000 of a 0.399 bubble at 1e-13 s, 0.357 at 1e-12 s), and a
timeline scaled by any factor breaks down into the same fractions, with every interval scaled by that factor.

pytest.approx is given ``abs=0`` throughout: its default absolute tolerance (1e-12) would pass any picosecond value.
"""
import math

import pytest

import pipesched as ps
from pipesched.viz import send_intervals
from pipesched.viz.analysis import CATEGORIES, bubble_breakdown, communication_waits, tolerance

SCALES = (1e-15, 1e-13, 1e-12, 1e-9, 1.0, 1e6, 1e12)


def exactly(value, rel=1e-9):
    return pytest.approx(value, rel=rel, abs=0)


def nothing(k: float):
    """0 seconds on a timeline in units of ``k`` (float rounding of sums of such times: within 1e-12 k)."""
    return pytest.approx(0, abs=1e-12 * k)


def two_ranks(k: float):
    """tests/viz/test_viz_sending.py's two_ranks() with every time multiplied by ``k``: 1f1b, p=2, m=1, F=k, B=2k,
    latency 0.5k, send overhead 0.25k. rank 0: F [0, k], SEND_F [k, 1.25k], B [5.5k, 7.5k]; rank 1: F [1.75k,
    2.75k], B [2.75k, 4.75k], SEND_B [4.75k, 5k]; makespan 7.5k, each rank idle 4.5k."""
    return ps.simulate(ps.compile_program("1f1b", 2, 1),
                       ps.CostModel(forward=k, backward=2 * k, latency=0.5 * k, send_overhead=0.25 * k))


@pytest.mark.parametrize("k", SCALES, ids=lambda k: f"{k:g}s")
def test_the_hand_checked_breakdown_scales_with_the_time_unit(k):
    timeline = two_ranks(k)
    assert timeline.makespan == exactly(7.5 * k)
    assert tolerance(timeline) == exactly(7.5e-12 * k)
    result = bubble_breakdown(timeline)
    assert result["per_rank"][0] == {
        "warmup": exactly(3.5 * k), "steady": nothing(k), "cooldown": nothing(k), "sending": exactly(0.25 * k),
        "communication": exactly(0.75 * k), "imbalance": nothing(k), "idle": exactly(4.5 * k)}
    assert result["per_rank"][1] == {
        "warmup": exactly(1.0 * k), "steady": nothing(k), "cooldown": exactly(2.5 * k), "sending": exactly(0.25 * k),
        "communication": exactly(0.75 * k), "imbalance": nothing(k), "idle": exactly(4.5 * k)}
    assert timeline.bubble_fraction == exactly(0.6)  # 9 idle rank-seconds of 2 x 7.5
    assert result["fraction"] == {"warmup": exactly(4.5 / 15), "steady": nothing(1), "cooldown": exactly(2.5 / 15),
                                  "sending": exactly(0.5 / 15), "communication": exactly(1.5 / 15),
                                  "imbalance": nothing(1), "total": exactly(0.6)}
    assert sum(result["fraction"][c] for c in CATEGORIES) == exactly(0.6)
    sends = send_intervals(timeline)
    assert [[tuple(x / k for x in span) for span in row] for row in sends] == [
        [(exactly(1.0), exactly(1.25))], [(exactly(4.75), exactly(5.0))]]
    waits = communication_waits(timeline)
    assert [[(a / k, b / k, kind) for a, b, kind in row] for row in waits] == [
        [(exactly(4.75), exactly(5.5), "p2p")], [(exactly(1.0), exactly(1.75), "p2p")]]


def _program(name: str, variant: str):
    """A p=4, m=6 program of ``name``: ``plain``, or ``dp-ties`` (dp=2 and stages 0 and the last tied, so that
    ALL_REDUCE and TIE_REDUCE waits join the p2p ones); zb-auto is built from its costs (at 1 s, scale-free)."""
    kwargs = {"virtual_stages": 2} if name == "interleaved-1f1b" else {}
    if variant == "dp-ties":
        stages = 8 if name in ("interleaved-1f1b", "zbv", "dualpipev") else 4
        kwargs.update(dp_size=2, ties=((0, stages - 1),))
    if name == "zb-auto":
        kwargs["costs"] = _costs(1.0, 4)
    return ps.compile_program(name, 4, 6, **kwargs)


def _costs(k: float, stages: int, comm: bool = False) -> ps.CostModel:
    """Uneven stages (imbalance), latency, a send overhead (the sending part), and with ``comm`` bytes that take
    time to reduce, all in units of ``k`` seconds."""
    return ps.CostModel(forward=[k * (1 + 0.3 * s) for s in range(stages)], backward=[k * 2] * stages,
                        latency=0.1 * k, send_overhead=0.05 * k, bandwidth=1e6 / k,
                        grad_bytes=1e6 if comm else 0, tie_bytes=1e6 if comm else 0)


SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "dualpipev", "zb-auto")


@pytest.mark.parametrize("variant", ("plain", "dp-ties"))
@pytest.mark.parametrize("name", SCHEDULES)
def test_the_parts_add_up_to_the_bubble_at_every_scale_and_do_not_depend_on_it(name, variant):
    program = _program(name, variant)
    stages = program.num_stages
    at_one = bubble_breakdown(ps.simulate(program, _costs(1.0, stages, variant == "dp-ties")))
    assert at_one["fraction"]["sending"] > 0  # the send overhead is there
    assert at_one["fraction"]["communication"] > 0
    assert at_one["fraction"]["total"] > 0
    for k in SCALES:
        timeline = ps.simulate(program, _costs(k, stages, variant == "dp-ties"))
        result = bubble_breakdown(timeline)
        where = f"{name} {variant} at {k:g} s"
        assert sum(result["fraction"][c] for c in CATEGORIES) == exactly(timeline.bubble_fraction), where
        assert result["fraction"]["total"] == exactly(timeline.bubble_fraction), where
        assert sum(result["seconds"][c] for c in CATEGORIES) == exactly(result["idle"]), where
        assert all(result["seconds"][c] >= 0 for c in CATEGORIES), where
        # the same fractions as at 1 s: the breakdown reads the shape of the timeline, not its unit
        assert {c: result["fraction"][c] for c in CATEGORIES} == {
            c: pytest.approx(at_one["fraction"][c], rel=1e-6, abs=1e-9) for c in CATEGORIES}, where
        for rank, row in enumerate(result["per_rank"]):  # per rank too, in units of k
            assert {c: row[c] / k for c in CATEGORIES} == {
                c: pytest.approx(at_one["per_rank"][rank][c], rel=1e-6, abs=1e-9) for c in CATEGORIES}, where
        # the intervals behind the pictures are the parts' seconds
        waits, sends = communication_waits(timeline), send_intervals(timeline)
        assert sum(b - a for row in waits for a, b, _ in row) == exactly(result["seconds"]["communication"]), where
        assert sum(b - a for row in sends for a, b in row) == exactly(result["seconds"]["sending"]), where


def test_a_timeline_in_picoseconds_keeps_its_gaps():
    # the trial's case: at 1e-13 s per op every gap is shorter than 1e-12 s; an absolute tolerance saw no idle at all
    program = ps.compile_program("1f1b", 4, 6)
    timeline = ps.simulate(program, _costs(1e-13, 4))
    result = bubble_breakdown(timeline)
    at_one = ps.simulate(program, _costs(1.0, 4))
    assert timeline.bubble_fraction == exactly(at_one.bubble_fraction)
    assert result["fraction"]["total"] == exactly(at_one.bubble_fraction)
    assert result["idle"] == exactly(4 * timeline.makespan * timeline.bubble_fraction)
    assert math.isclose(result["idle"] / 1e-13, 4 * at_one.makespan * at_one.bubble_fraction, rel_tol=1e-9)
    assert all(row for row in send_intervals(timeline))  # every rank sends: each has its send calls
