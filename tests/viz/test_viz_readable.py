"""What a reader needs from a picture: short waits explained in the legend, one time unit throughout, the
breakdown panel as wide as the charts, the closed forms only where they hold, and which rank a one-rank
timeline is."""
import pytest
from matplotlib.colors import to_rgba

from pipesched import CostModel, Timeline
from pipesched.viz import style
from pipesched.viz.charts import plot_bubble_vs_microbatches
from pipesched.viz.compare import plot_comparison
from pipesched.viz.gantt import plot_timeline, title_text

from viz_support import sim

_MS_COSTS = CostModel(forward=1e-3, backward=2e-3, latency=1e-4)


def test_short_communication_waits_are_grey_marks_the_legend_explains():
    _, timeline = sim("1f1b", 4, 8, cost=_MS_COSTS)
    ax = plot_timeline(timeline).axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["forward F", "backward B", "idle (bubble)",
                      "comm wait: message in flight (thin grey mark if short)"]
    waits = [p for p in ax.patches if (p.get_gid() or "").startswith("wait:")]
    assert waits and all(p.get_facecolor() == to_rgba("#c8c8c8") for p in waits)  # filled: visible when thin
    assert max(p.get_width() for p in waits) == pytest.approx(0.1)  # 0.1 ms: the thin marks


def test_a_picture_in_milliseconds_gives_its_costs_in_milliseconds_too():
    _, timeline = sim("1f1b", 4, 8, cost=_MS_COSTS)
    ax = plot_timeline(timeline).axes[0]
    assert ax.get_xlabel() == "time from step start (ms)"
    assert ax.get_title(loc="left") == ("1f1b  ·  p=4 ranks  ·  m=8 microbatches  ·  v=1  ·  simulated\n"
                                        "bubble 30.64%  ·  makespan 34.6 ms\n"
                                        "costs [ms per stage and microbatch]: F=1 B=2 latency=0.1ms")
    fig = plot_comparison(timeline, timeline)
    assert [ax.get_title(loc="left") for ax in fig.axes[:2]] == [
        "predicted (simulated)  ·  bubble 30.64%  ·  makespan 34.6 ms\ncosts [ms]: F=1 B=2 latency=0.1ms",
        "measured (simulated)  ·  bubble 30.64%  ·  makespan 34.6 ms\ncosts [ms]: F=1 B=2 latency=0.1ms"]


def test_a_picture_in_seconds_keeps_its_costs_as_given():
    _, timeline = sim("1f1b", 2, 2, cost=CostModel(forward=1.5, latency=0.25))
    title = plot_timeline(timeline).axes[0].get_title(loc="left")
    assert title.endswith("costs [s per stage and microbatch]: F=1.5 B=2 latency=0.25s")


def test_cost_lines_convert_every_time_and_rate():
    assert style.cost_in_unit("F=[0.000738,0.00076] B=0.002 R=0.001 latency=0.0001s bw=2e+06B/s", "ms", 1e3) == \
        "F=[0.738,0.76] B=2 R=1 latency=0.1ms bw=2e+03B/ms"
    assert style.cost_in_unit("F=1 B=2 latency=0.5s", "s", 1.0) == "F=1 B=2 latency=0.5s"


def test_the_breakdown_panel_is_as_wide_as_the_charts_of_a_wide_figure():
    _, timeline = sim("1f1b", 8, 32)
    fig = plot_comparison(timeline, timeline)
    gantt, bars = fig.axes[0].get_position(), fig.axes[-1].get_position()
    assert fig.axes[-1].get_title(loc="left") == "bubble breakdown (see pipesched.viz.bubble_breakdown)"
    assert fig.get_figwidth() > 15  # wide: the panel used to stop at 7.5 inches
    assert (bars.x0, bars.width) == pytest.approx((gantt.x0, gantt.width))


def _lines(fig, prefix):
    return {line.get_gid().split(":", 1)[1]: line for line in fig.axes[0].lines
            if (line.get_gid() or "").startswith(prefix)}


def test_the_interleaved_closed_form_is_drawn_only_at_multiples_of_p():
    fig = plot_bubble_vs_microbatches(4)
    closed = _lines(fig, "closed:")
    xs, ys = closed["interleaved-1f1b"].get_data()
    assert list(xs) == [4, 8, 12, 16]
    assert list(ys) == pytest.approx([3 / 11, 3 / 19, 3 / 27, 3 / 35])  # (p-1)/(v*m+p-1), v=2
    assert closed["interleaved-1f1b"].get_linestyle() == "None"  # dots: no chord between them
    assert closed["interleaved-1f1b"].get_label() == ("interleaved-1f1b: closed form (p-1)/(v*m+p-1) for m % p == 0 "
                                                      "(drawn where it holds)")
    xs, _ = closed["1f1b"].get_data()  # no condition: a curve over every m
    assert (xs[0], xs[-1], len(xs)) == (1, 16, 200)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "interleaved-1f1b: closed form (p-1)/(v*m+p-1) for m % p == 0 (drawn where it holds)" in labels


def test_a_one_rank_timeline_says_which_rank_in_its_title():
    _, timeline = sim("1f1b", 2, 4)
    one = Timeline(tuple(e for e in timeline.events if e.rank == 1), 2, "measured", dict(timeline.meta), ranks=(1,))
    assert title_text(one).split("\n")[0] == ("1f1b  ·  p=2 ranks  ·  m=4 microbatches  ·  v=1  ·  measured  ·  "
                                              "rank 1 only")
    assert "rank 1 only" in plot_timeline(one).axes[0].get_title(loc="left")
    assert title_text(timeline).split("\n")[0] == "1f1b  ·  p=2 ranks  ·  m=4 microbatches  ·  v=1  ·  simulated"
