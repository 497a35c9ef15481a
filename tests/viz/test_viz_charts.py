"""Bubble-vs-microbatches chart: simulated points per schedule and the closed forms beside them."""
import pytest

from pipesched import SCHEDULES, CostModel
from pipesched.viz.charts import closed_form_bubble, plot_bubble_vs_microbatches


def lines(fig, prefix):
    return {line.get_gid().split(":", 1)[1]: line for line in fig.axes[0].lines
            if (line.get_gid() or "").startswith(prefix)}


def test_closed_form_values():
    assert closed_form_bubble("(p-1)/(m+p-1)", 4, 8) == pytest.approx(3 / 11)
    assert closed_form_bubble("(p-1)/(v*m+p-1) for m % p == 0", 4, 8, 2) == pytest.approx(3 / 19)
    assert closed_form_bubble("(p-1)/(v*m+p-1) for m % p == 0", 4, 7, 2) is None  # condition fails
    assert closed_form_bubble("(p-1)/(v*m+p-1) for m % p == 0", 4, 7.5, 2) == pytest.approx(3 / 18)  # curve


@pytest.mark.parametrize("text", ["__import__('os').getcwd()", "zero bubble with W filling", "p.real", ""])
def test_closed_form_rejects_anything_but_arithmetic(text):
    assert closed_form_bubble(text, 4, 8) is None


def test_chart_has_simulated_points_and_closed_form_for_every_schedule():
    fig = plot_bubble_vs_microbatches(4, microbatches=range(1, 13))
    simulated, closed = lines(fig, "sim:"), lines(fig, "closed:")
    assert set(simulated) == set(SCHEDULES)
    # a closed form wherever the schedule states one (zb-auto's is a bound: "<= zb-h1's under the given costs")
    assert set(closed) == set(SCHEDULES) - {"zb-auto"}
    xs, ys = simulated["1f1b"].get_data()
    assert list(xs) == list(range(1, 13))
    assert ys[7] == pytest.approx(3 / 11)  # m = 8
    assert simulated["interleaved-1f1b"].get_data()[1][7] == pytest.approx(3 / 19)
    assert simulated["gpipe"].get_data()[1][0] == pytest.approx(3 / 4)  # m = 1: (p-1)/p


def test_chart_respects_costs_in_points_and_title():
    cost = CostModel(latency=0.5)
    fig = plot_bubble_vs_microbatches(2, microbatches=[1, 2], schedules=["1f1b"], cost=cost)
    # p=2, m=1, latency 0.5: makespan 7, busy 3 per rank -> 4/7
    assert lines(fig, "sim:")["1f1b"].get_data()[1][0] == pytest.approx(4 / 7)
    assert "latency=0.5s" in fig.axes[0].get_title(loc="left")


def test_chart_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_ranks"):
        plot_bubble_vs_microbatches(0)
    with pytest.raises(ValueError, match="empty"):
        plot_bubble_vs_microbatches(4, microbatches=[])


def test_a_closed_form_that_is_no_real_number_is_none_at_once():
    # p**p**p was evaluated in integers: it never returned (an audit); a negative base's root is complex
    assert closed_form_bubble("p**p**p", 9, 1) is None
    assert closed_form_bubble("(-1)**0.5", 4, 8) is None
    assert closed_form_bubble("(p-1)**2/(m*p)", 4, 8) == 9 / 32
