"""plot_comparison refuses a simulated and a measured timeline of different programs (it drew a prediction next to
a run it does not predict, and put their bubbles side by side); it keeps taking a measured timeline of the same
program: a prediction from it, one of some ranks, one whose backend added all-reduces."""
import dataclasses
from pathlib import Path

import pytest

import pipesched as ps
from pipesched import Timeline
from pipesched.viz.compare import plot_comparison, predict_for

MEASURED = Path(__file__).resolve().parents[2] / "viz" / "measured" / "cpu-1f1b-p2-m8.json"
COST = ps.CostModel(forward=1.0, backward=2.0, latency=0.5)


def _sim(name, p, m, v=None, **options):
    return ps.simulate(ps.compile_program(name, p, m, v, **options), COST)


def _measured(timeline):
    return dataclasses.replace(timeline, source="measured")


def test_other_microbatch_count_is_refused_naming_the_rank_and_instruction():
    with pytest.raises(ValueError) as info:
        plot_comparison(_sim("1f1b", 2, 4), _measured(_sim("1f1b", 2, 2)))
    assert str(info.value) == (
        "plot_comparison: simulated and measured must be timelines of the same program (the same compute "
        "instructions on each rank), but on rank 0 the simulated timeline runs B0.2 and the measured does not "
        "(8 compute instructions simulated, 4 measured, 4 in one only)")


def test_a_split_backward_prediction_of_an_unsplit_run_is_refused():
    with pytest.raises(ValueError) as info:
        plot_comparison(_sim("1f1b", 2, 2, split_backward=True), _measured(_sim("1f1b", 2, 2)))
    assert str(info.value) == (
        "plot_comparison: simulated and measured must be timelines of the same program (the same compute "
        "instructions on each rank), but on rank 1 the measured timeline runs B1.0 and the simulated does not "
        "(6 compute instructions simulated, 4 measured, 6 in one only)")  # stage 0 has no input gradient to split


def test_other_stage_placement_is_refused_on_the_first_rank_that_differs():
    # interleaved v=2 on 2 ranks vs zbv (V placement): rank 0 holds stages 0 and 2 vs 0 and 3
    with pytest.raises(ValueError) as info:
        plot_comparison(_sim("interleaved-1f1b", 2, 4, 2), _measured(_sim("zbv", 2, 4)))
    assert str(info.value).startswith(
        "plot_comparison: simulated and measured must be timelines of the same program (the same compute "
        "instructions on each rank), but on rank 0 the ")


def test_a_measured_one_rank_timeline_is_compared_on_its_rank_only():
    simulated = _sim("1f1b", 2, 2)
    one = dataclasses.replace(simulated, events=tuple(e for e in simulated.events if e.rank == 1), source="measured",
                              ranks=(1,))
    assert plot_comparison(simulated, one, mode="overlay") is not None
    other = _sim("1f1b", 2, 4)
    with pytest.raises(ValueError, match=r"but on rank 1 the simulated timeline runs B1\.2 and the measured does "
                                         r"not \(8 compute instructions simulated, 4 measured, 4 in one only\)"):
        plot_comparison(other, one)


def test_the_same_program_is_accepted_whatever_its_messages_and_all_reduces():
    measured = Timeline.load(MEASURED)  # a real CPU run, the one `pipesched render --compare` is shown with
    assert plot_comparison(predict_for(measured), measured) is not None
    with_dp = _measured(_sim("1f1b", 2, 4, dp_size=2))  # ALL_REDUCE: a backend pass, not another program
    assert plot_comparison(_sim("1f1b", 2, 4), with_dp) is not None


# ---- coinciding schedules stay visible in the bubble-vs-microbatches chart ------------------------------------

def test_schedules_with_equal_bubbles_are_drawn_side_by_side_at_the_exact_m():
    from pipesched.viz.charts import SCHEDULES, plot_bubble_vs_microbatches

    fig = plot_bubble_vs_microbatches(4, microbatches=[8])
    drawn = {line.get_gid()[4:]: line for line in fig.axes[0].get_lines() if (line.get_gid() or "").startswith("sim:")}
    zbv, dualpipev = drawn["zbv"], drawn["dualpipev"]
    assert zbv.get_data()[1][0] == dualpipev.get_data()[1][0]  # the same bubble at m=8
    assert list(zbv.get_data()[0]) == list(dualpipev.get_data()[0]) == [8]  # the data keeps the exact m
    x = {name: line.get_transform().transform((8, 0))[0] for name, line in drawn.items()}
    step = 2.5 / 72 * fig.dpi  # display pixels between neighbouring schedules
    order = list(SCHEDULES)
    assert x["dualpipev"] - x["zbv"] == pytest.approx((order.index("dualpipev") - order.index("zbv")) * step)
    centre = fig.axes[0].transData.transform((8, 0))[0]
    assert sum(x.values()) / len(x) == pytest.approx(centre)  # centred on m
