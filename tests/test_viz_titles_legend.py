"""A forward pass says so in its Gantt and compare titles; the legend fits the figure (columns from the labels'
measured widths, moved in from the edges, the figure grown under it where its rows need the room) for narrow
programs whose legends ran off the figure with a fixed 1.45 in per column."""
import dataclasses

import pytest

import pipesched as ps

pytest.importorskip("matplotlib")

from pipesched.viz import plot_comparison, plot_timeline  # noqa: E402
from pipesched.viz.gantt import title_text  # noqa: E402

COST = ps.CostModel(forward=1e-3, backward=2e-3)
COMM = ps.CostModel(forward=1e-3, backward=2e-3, latency=1e-4, send_overhead=5e-5)


def _forward(source="simulated"):
    t = ps.simulate(ps.compile_program("1f1b", 2, 4, forward_only=True), COST)
    return t if source == "simulated" else dataclasses.replace(t, source=source, meta=dict(t.meta, cost=None))


def test_title_of_a_forward_pass_says_so():
    assert title_text(_forward()) == ("1f1b  ·  p=2 ranks  ·  m=4 microbatches  ·  v=1  ·  forward pass only  ·  "
                                      "simulated\nbubble 20.00%  ·  makespan 5 ms  ·  costs [ms per stage and "
                                      "microbatch]: F=1")  # no B: a forward pass has no backward box
    assert title_text(_forward("measured")).split("\n")[0] == (
        "1f1b  ·  p=2 ranks  ·  m=4 microbatches  ·  v=1  ·  forward pass only  ·  measured")
    train = ps.simulate(ps.compile_program("1f1b", 2, 4), COST)
    assert title_text(train).split("\n")[0] == "1f1b  ·  p=2 ranks  ·  m=4 microbatches  ·  v=1  ·  simulated"


def test_gantt_and_compare_titles_of_a_forward_pass():
    fig = plot_timeline(_forward())
    assert fig.axes[0].get_title(loc="left") == ("1f1b  ·  p=2 ranks  ·  m=4 microbatches  ·  v=1  ·  forward pass "
                                                 "only\nsimulated\nbubble 20.00%  ·  makespan 5 ms\ncosts [ms per "
                                                 "stage and microbatch]: F=1")
    fig = plot_comparison(_forward(), _forward("measured"))
    assert fig._suptitle.get_text() == ("1f1b  ·  p=2 ranks  ·  m=4 microbatches  ·  v=1  ·  forward pass only\n"
                                        "measured bubble 20.00%  vs  predicted 20.00%")
    train = ps.simulate(ps.compile_program("1f1b", 2, 4), COST)
    fig = plot_comparison(train, dataclasses.replace(train, source="measured"))
    assert fig._suptitle.get_text().split("\n")[0] == "1f1b  ·  p=2 ranks  ·  m=4 microbatches  ·  v=1"


NARROW = [("dualpipev", 2, 4, None, {}), ("zbv", 2, 4, None, {}), ("zb-h1", 2, 4, None, {}),
          ("interleaved-1f1b", 2, 4, 2, {"dp_size": 2, "recompute": True}),
          ("dualpipev", 2, 4, None, {"dp_size": 2, "recompute": True})]  # 14 entries: 5 rows, the figure grows
DUALPIPEV_LABELS = ["forward F, virtual stage 0", "forward F, virtual stage 1", "backward B, virtual stage 0",
                    "backward B, virtual stage 1", "input grad I, virtual stage 0", "input grad I, virtual stage 1",
                    "weight grad W, virtual stage 0", "weight grad W, virtual stage 1", "idle (bubble)",
                    "comm wait: message in flight (thin grey mark if short)", "in send call"]


def _legend_boxes(fig):
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    return renderer, [(ax, ax.get_legend().get_window_extent(renderer)) for ax in fig.axes
                      if ax.get_legend() is not None]


@pytest.mark.parametrize("case", NARROW, ids=lambda c: c[0] + ("-dp2-recompute" if c[4] else ""))
@pytest.mark.parametrize("picture", ["gantt", "compare", "overlay"])
def test_legend_lies_within_the_figure(case, picture):
    name, p, m, v, options = case
    t = ps.simulate(ps.compile_program(name, p, m, v, **options), COMM)
    fig = plot_timeline(t) if picture == "gantt" else plot_comparison(t, t, mode="side-by-side" if picture ==
                                                                      "compare" else "overlay")
    renderer, boxes = _legend_boxes(fig)
    legend_ax, box = boxes[0]  # the kinds' legend (compare: the bar chart's own legend second)
    assert len(boxes) == (1 if picture == "gantt" else 2)
    whole = fig.bbox
    assert whole.x0 <= box.x0 and box.x1 <= whole.x1, (box, whole)
    assert whole.y0 <= box.y0 and box.y1 <= whole.y1, (box, whole)
    assert box.y1 <= legend_ax.get_window_extent(renderer).y0  # under its Axes
    if picture != "gantt":  # above the breakdown bars and their title
        assert box.y0 >= fig.axes[-1].get_tightbbox(renderer).y1
    if name == "dualpipev" and not options:
        assert [t.get_text() for t in legend_ax.get_legend().get_texts()] == DUALPIPEV_LABELS


def test_the_legend_lists_only_the_kinds_drawn():
    # interleaved, split backward, m=1: virtual stage 0's first stage runs its whole backward as B, virtual
    # stage 1 has none; the legend listed "backward B, virtual stage 1" all the same (a new user's trial)
    t = ps.simulate(ps.compile_program("interleaved-1f1b", 2, 1, 2, split_backward=True), COST)
    drawn = {(e.instr.op.name, e.instr.stage >= 2) for e in t.events if e.instr.op.name in "FBIW"}
    assert ("B", True) not in drawn and ("B", False) in drawn
    labels = [x.get_text() for x in plot_timeline(t).axes[0].get_legend().get_texts()]
    assert labels == ["forward F, virtual stage 0", "forward F, virtual stage 1", "backward B, virtual stage 0",
                      "input grad I, virtual stage 0", "input grad I, virtual stage 1",
                      "weight grad W, virtual stage 0", "weight grad W, virtual stage 1", "idle (bubble)"]


def test_the_title_gives_the_costs_of_the_kinds_drawn_to_3_digits():
    cost = ps.CostModel(forward=[0.0437395, 0.0391869], backward=[0.154282, 0.180329],
                        input_grad=[0.012562, 0.134384], weight_grad=[0.14172, 0.0459449],
                        recompute=[0.0437395, 0.0391869], activation_bytes=[4096, 512], recompute_bytes=[8192, 8976])
    fused = ps.simulate(ps.compile_program("1f1b", 2, 2), cost)
    assert title_text(fused).split("\n")[1] == (
        "bubble 34.46%  ·  makespan 637.1 ms  ·  costs [ms per stage and microbatch]: F=[43.7,39.2] B=[154,180] "
        "act=[4096,512]B")  # no I, W, R or "held after R": 1f1b without a split or recompute draws none


def test_the_title_keeps_byte_counts_whole():
    # the 3-digit shortening is for seconds: a byte count of 1048576 printed as 1.05e+06 (a hunt of the change)
    cost = ps.CostModel(forward=1e-3, backward=2e-3, recompute=0.00123456, recompute_bytes=[1048576, 2097152])
    text = title_text(ps.simulate(ps.compile_program("1f1b", 2, 2, recompute=True), cost)).split("\n")[1]
    assert text.endswith("F=1 B=2 R=1.23 held after R=[1048576,2097152]B"), text
