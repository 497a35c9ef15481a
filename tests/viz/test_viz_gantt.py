"""plot_timeline: headless, one row per rank, one box per compute instruction, the simulator's bubble."""
import io
import re

import pytest

from pipesched import SCHEDULES, CostModel, Timeline
from pipesched.ir import COMPUTE_OPS, Op
from pipesched.viz.gantt import plot_timeline

from viz_support import sim

CASES = [(name, 4, 8, None) for name in sorted(SCHEDULES)] + [("1f1b", 8, 32, None)]


def boxes(fig, prefix="compute:"):
    """(rank, instruction text, y centre, x, width, facecolor, hatch) of every compute box drawn."""
    found = []
    for ax in fig.axes:
        for patch in ax.patches:
            gid = patch.get_gid() or ""
            if gid.startswith(prefix):
                _, rank, text = gid.rsplit(":", 2)
                found.append((int(rank), text, patch.get_y() + patch.get_height() / 2, patch.get_x(),
                              patch.get_width(), patch.get_facecolor(), patch.get_hatch()))
    return found


def title_bubble(ax) -> float:
    return float(re.search(r"bubble (\d+\.\d+)%", ax.get_title(loc="left")).group(1))


def rank_texts(ax):
    rows = {}
    for text in ax.texts:
        if (text.get_gid() or "").startswith("bubble-rank-"):
            bubble, peak = text.get_text().split()
            rows[int(text.get_gid().rsplit("-", 1)[1])] = (float(bubble.rstrip("%")), int(peak))
    return [rows[r] for r in sorted(rows)]


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_every_schedule_renders_headless_with_one_box_per_compute_instruction(name, p, m, v):
    program, timeline = sim(name, p, m, v)
    fig = plot_timeline(timeline)
    assert type(fig.canvas).__name__ == "FigureCanvasAgg"
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    assert buffer.getvalue()[:8] == b"\x89PNG\r\n\x1a\n"
    ax = fig.axes[0]
    stages_per_rank = program.num_stages // p
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"rank {r}" for r in range(p)]
    drawn = boxes(fig)
    split = sum(i.op is Op.W for s in program.ranks for i in s)  # dualpipev: B for some, I and W for others
    assert len(drawn) == 2 * m * p * stages_per_rank + split  # per (stage, microbatch): F and B, or F, I and W
    for rank in range(p):
        expected = sorted(str(i) for i in program.ranks[rank] if i.op in COMPUTE_OPS)
        assert sorted(text for r, text, *_ in drawn if r == rank) == expected
        assert all(y == pytest.approx(rank) for r, _, y, *_ in drawn if r == rank)


def test_annotated_bubble_equals_the_simulators():
    _, timeline = sim("1f1b", 4, 8)  # (p-1)/(m+p-1) = 3/11
    ax = plot_timeline(timeline).axes[0]
    assert title_bubble(ax) == 27.27
    assert round(100 * timeline.bubble_fraction, 2) == 27.27
    assert rank_texts(ax) == [(27.3, 4), (27.3, 3), (27.3, 2), (27.3, 1)]


def test_title_names_schedule_sizes_and_costs():
    _, timeline = sim("interleaved-1f1b", 4, 8, 2, cost=CostModel(forward=1.5, backward=3, latency=0.25))
    title = plot_timeline(timeline).axes[0].get_title(loc="left")
    for piece in ("interleaved-1f1b", "p=4", "m=8", "v=2", "F=1.5", "B=3", "latency=0.25s", "simulated"):
        assert piece in title
    assert title_bubble(plot_timeline(timeline).axes[0]) == round(100 * timeline.bubble_fraction, 2)


def test_boxes_sit_at_their_times_and_kinds_and_chunks_look_different():
    _, timeline = sim("interleaved-1f1b", 4, 8, 2)
    drawn = {(r, text): rest for r, text, *rest in boxes(plot_timeline(timeline))}
    events = {(e.rank, str(e.instr)): e for e in timeline.events}
    for key, (_, x, width, _, _) in drawn.items():
        assert x == pytest.approx(events[key].start) and width == pytest.approx(events[key].duration)
    f0, f1 = drawn[(0, "F0.0")], drawn[(0, "F4.0")]  # rank 0 holds stages 0 and 4
    b0 = drawn[(0, "B0.0")]
    assert f0[3] != b0[3]  # forward and backward colours differ
    assert f0[3] != f1[3] and f0[4] == "" and f1[4] != ""  # later chunk: lighter and hatched


def test_microbatch_numbers_are_written_where_they_fit():
    _, timeline = sim("gpipe", 4, 8)
    ax = plot_timeline(timeline).axes[0]
    numbers = [t.get_text() for t in ax.texts if t.get_text().isdigit()]
    assert sorted(numbers) == sorted(str(mb) for mb in range(8) for _ in range(8))


def test_measured_trace_renders_in_milliseconds(measured):
    fig = plot_timeline(measured)
    ax = fig.axes[0]
    assert len(boxes(fig)) == 4
    assert "measured" in ax.get_title(loc="left")
    assert "(ms)" in ax.get_xlabel()
    assert title_bubble(ax) == 62.5
    # bubble per rank 4.9/8 and 5.1/8; peak in-flight counted from the event order: 1 each
    assert rank_texts(ax) == [(61.3, 1), (63.8, 1)]
    x = {text: (x, w) for _, text, _, x, w, *_ in boxes(fig)}
    assert x["B0.0"] == pytest.approx((4.9, 2.1))
    assert [p.get_gid() for p in ax.patches if (p.get_gid() or "").startswith("allreduce")] == [
        "allreduce:0:ALL_REDUCE0", "allreduce:1:ALL_REDUCE1"]
    waits = [p for p in ax.patches if (p.get_gid() or "").startswith("wait:")]
    spans = sorted((p.get_x(), p.get_width()) for p in waits)
    assert [v for span in spans for v in span] == pytest.approx([1.0, 0.4, 4.4, 0.4])


def test_draws_into_a_given_axes():
    from matplotlib.figure import Figure

    fig = Figure()
    ax = fig.add_subplot(2, 1, 2)
    _, timeline = sim("gpipe", 2, 2)
    assert plot_timeline(timeline, ax=ax, title="mine") is fig
    assert ax.get_title(loc="left").startswith("mine\n")
    assert len(boxes(fig)) == 8


def test_empty_timeline_raises():
    with pytest.raises(ValueError, match="0 events"):
        plot_timeline(Timeline((), 2))


def test_split_backward_and_recompute_kinds_get_their_own_colours_and_legend_entries():
    from pipesched import Event, Instr

    rows = [(0, "F0.0", 0, 1), (0, "R0.0", 3, 4), (0, "I0.0", 4, 5), (0, "W0.0", 5, 6),
            (1, "F1.0", 1, 2), (1, "I1.0", 2, 3), (1, "W1.0", 3, 4)]
    timeline = Timeline(tuple(Event(r, Instr.parse(t), s, e) for r, t, s, e in rows), 2, source="measured")
    fig = plot_timeline(timeline)
    colours = {text[0]: colour for _, text, _, _, _, colour, _ in boxes(fig)}
    assert len(boxes(fig)) == 7
    assert len({tuple(c) for c in colours.values()}) == 4  # F, R, I, W all different
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == ["forward F", "input grad I", "weight grad W", "recompute R", "idle (bubble)"]
    # no labels in meta: sizes are read off the events
    assert "custom  ·  p=2 ranks  ·  m=1 microbatches  ·  v=1  ·  measured" in fig.axes[0].get_title(loc="left")


def test_a_one_rank_timeline_draws_only_that_rank():
    _, timeline = sim("1f1b", 2, 4)
    one = Timeline(tuple(e for e in timeline.events if e.rank == 1), 2, "measured", dict(timeline.meta), ranks=(1,))
    fig = plot_timeline(one)
    gids = {p.get_gid() for ax in fig.axes for p in ax.patches}
    assert "idle:1" in gids and "idle:0" not in gids
    texts = {t.get_gid(): t.get_text() for ax in fig.axes for t in ax.texts if t.get_gid()}
    assert texts["bubble-rank-0"].split() == ["--", "--"]
