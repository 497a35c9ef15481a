"""The "sending" part of the bubble: idle instants a rank spends inside its own SEND calls (CostModel.send_overhead,
gloo's blocking sends): counted before communication wait and the positional parts, and drawn in the Gantt as
dark-grey half-height boxes ("send:{rank}") with an "in send call" legend entry when there are any."""
import numpy as np
import pytest
from matplotlib.colors import to_rgba

import pipesched as ps
from pipesched import SCHEDULES, CostModel, Event, Instr, Timeline
from pipesched.ir import COMPUTE_OPS, SEND_OPS
from pipesched.viz import gantt, style
from pipesched.viz import send_intervals  # exported next to communication_waits
from pipesched.viz.analysis import CATEGORIES, bubble_breakdown, communication_waits
from pipesched.viz.compare import plot_comparison
from pipesched.viz.gantt import draw_rows, new_figure, plot_timeline


def two_ranks():
    """1f1b, p=2, m=1, F=1, B=2, latency 0.5, send overhead 0.25 s:
    rank 0: F [0, 1], SEND_F [1, 1.25], B [5.5, 7.5]  (gradient sent at 4.75, lands 5.5)
    rank 1: F [1.75, 2.75] (activation sent at 1.0, lands 1.75), B [2.75, 4.75], SEND_B [4.75, 5.0]
    makespan 7.5; each rank computes 3 s, idles 4.5 s, of which 0.25 s inside its one send call."""
    return ps.simulate(ps.compile_program("1f1b", 2, 1), ps.CostModel(latency=0.5, send_overhead=0.25))


def hand_built(rows, ranks=2):
    return Timeline(tuple(Event(r, Instr.parse(t), s, e) for r, t, s, e in rows), ranks, source="measured",
                    meta={"schedule": "1f1b", "ranks": ranks, "microbatches": 1, "virtual_stages": 1})


def test_the_send_overhead_is_the_sending_part_of_the_bubble():
    timeline = two_ranks()
    result = bubble_breakdown(timeline)
    assert CATEGORIES == ("warmup", "steady", "cooldown", "sending", "communication", "imbalance")
    # rank 0: gap [1, 5.5]: send [1, 1.25], gradient in flight [4.75, 5.5], the rest (3.5) fills the pipe.
    assert result["per_rank"][0] == pytest.approx(
        {"warmup": 3.5, "steady": 0, "cooldown": 0, "sending": 0.25, "communication": 0.75, "imbalance": 0,
         "idle": 4.5})
    # rank 1: gap [0, 1.75]: activation in flight [1.0, 1.75]; trailing [4.75, 7.5]: send [4.75, 5], drain 2.5.
    assert result["per_rank"][1] == pytest.approx(
        {"warmup": 1.0, "steady": 0, "cooldown": 2.5, "sending": 0.25, "communication": 0.75, "imbalance": 0,
         "idle": 4.5})
    assert result["seconds"]["sending"] == pytest.approx(0.5)
    assert result["fraction"]["sending"] == pytest.approx(0.5 / 15)
    assert sum(result["fraction"][c] for c in CATEGORIES) == pytest.approx(timeline.bubble_fraction)
    assert send_intervals(timeline) == [[(1.0, 1.25)], [(4.75, 5.0)]]
    assert communication_waits(timeline) == [[(4.75, 5.5, "p2p")], [(1.0, 1.75, "p2p")]]


def test_without_send_time_there_is_no_sending():
    timeline = ps.simulate(ps.compile_program("1f1b", 2, 1), ps.CostModel(latency=0.5))  # SENDs take 0 s
    assert [row["sending"] for row in bubble_breakdown(timeline)["per_rank"]] == [0, 0]
    assert send_intervals(timeline) == [[], []]


def test_an_own_send_call_comes_before_a_communication_wait_and_is_not_imbalance():
    # rank 0: F [0, 1], a slow send call [1, 3], gradient sent at 2.2 lands 4, B [4, 6].
    # rank 1: activation lands 1.2, F [1.2, 1.7], B [1.7, 2.2], SEND_B [2.2, 2.5]; makespan 6.
    timeline = hand_built([
        (0, "F0.0", 0, 1), (0, "SEND_F0.0>1", 1, 3), (0, "RECV_B0.0<1", 3, 4), (0, "B0.0", 4, 6),
        (1, "RECV_F1.0<0", 0, 1.2), (1, "F1.0", 1.2, 1.7), (1, "B1.0", 1.7, 2.2), (1, "SEND_B1.0>0", 2.2, 2.5)])
    rows = bubble_breakdown(timeline)["per_rank"]
    # rank 0's gap [1, 4]: in its send call [1, 3] (though the gradient is in flight from 2.2), waiting [3, 4]
    assert rows[0] == pytest.approx({"warmup": 0, "steady": 0, "cooldown": 0, "sending": 2.0,
                                     "communication": 1.0, "imbalance": 0, "idle": 3.0})
    # rank 1: idle 5 = 0.2 wait + 1.0 warmup + 0.3 sending + 3.5 after its backward; it computes 2 s less than
    # rank 0: 2 of the 3.5 are imbalance (the send call is not), 1.5 cooldown
    assert rows[1] == pytest.approx({"warmup": 1.0, "steady": 0, "cooldown": 1.5, "sending": 0.3,
                                     "communication": 0.2, "imbalance": 2.0, "idle": 5.0})
    assert communication_waits(timeline)[0] == [(3, 4, "p2p")]
    assert send_intervals(timeline) == [[(1, 3)], [(2.2, 2.5)]]


ROWS = [  # 1f1b, p=2, m=2, by hand; rank 0 runs F0.1 [2, 3] after F0.0 [0, 1]
    (0, "F0.0", 0, 1), (0, "SEND_F0.0>1", 1, 1), (0, "F0.1", 2, 3), (0, "SEND_F0.1>1", 3, 3),
    (0, "RECV_B0.0<1", 3, 4), (0, "B0.0", 4, 5), (0, "RECV_B0.1<1", 5, 7), (0, "B0.1", 7, 8),
    (1, "RECV_F1.0<0", 0, 2), (1, "F1.0", 2, 2.5), (1, "B1.0", 2.5, 3), (1, "SEND_B1.0>0", 3, 3),
    (1, "RECV_F1.1<0", 3.5, 5), (1, "F1.1", 5, 5.5), (1, "B1.1", 5.5, 6), (1, "SEND_B1.1>0", 6, 6)]


def with_sends(**spans):
    return hand_built([(r, t, *spans[t]) if t in spans else (r, t, s, e) for r, t, s, e in ROWS])


def test_only_the_idle_part_of_a_send_call_is_sending():
    # rank 0's send call [1, 2.5] runs on into its own F0.1 [2, 3]: [1, 2] is sending, the rest is compute
    timeline = with_sends(**{"SEND_F0.0>1": (1, 2.5)})
    assert send_intervals(timeline) == [[(1, 2)], []]
    rows = bubble_breakdown(timeline)["per_rank"]
    assert rows[0]["sending"] == pytest.approx(1.0)
    assert rows[0]["idle"] == pytest.approx(8 - 4)  # the bubble is still compute's complement
    assert sum(rows[0][c] for c in CATEGORIES) == pytest.approx(rows[0]["idle"])


def test_a_send_call_inside_a_wait_is_cut_out_of_it():
    # rank 1 waits [3, 5] for F1.1's activation (in flight from SEND_F0.1's start 3 to 5)
    assert communication_waits(with_sends())[1] == [(1, 2, "p2p"), (3, 5, "p2p")]
    # its own send call [3, 3.5] starts that wait: the wait is what is left
    timeline = with_sends(**{"SEND_B1.0>0": (3, 3.5)})
    assert communication_waits(timeline)[1] == [(1, 2, "p2p"), (3.5, 5, "p2p")]
    assert send_intervals(timeline) == [[], [(3, 3.5)]]
    # a send call [3.2, 3.4] in the middle splits the wait in two
    timeline = with_sends(**{"SEND_B1.0>0": (3.2, 3.4)})
    assert communication_waits(timeline)[1] == [(1, 2, "p2p"), (3, 3.2, "p2p"), (3.4, 5, "p2p")]
    row = bubble_breakdown(timeline)["per_rank"][1]
    assert row["sending"] == pytest.approx(0.2) and row["communication"] == pytest.approx(1 + 0.2 + 1.6)
    assert sum(row[c] for c in CATEGORIES) == pytest.approx(row["idle"]) and row["idle"] == pytest.approx(6)
    ax = plot_timeline(timeline).axes[0]
    assert flat(extents(p) for p in send_patches(ax)) == pytest.approx([3.2, 0.8, 0.2, 0.4])
    waits = flat(extents(p) for p in ax.patches if p.get_gid() == "wait:1")
    assert waits == pytest.approx([1, 0.6, 1, 0.8, 3, 0.6, 0.2, 0.8, 3.4, 0.6, 1.6, 0.8])


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_with_send_overhead_the_categories_still_partition_the_bubble(name):
    v = SCHEDULES[name].default_virtual_stages
    cost = CostModel(forward=[1, 1.5, 1, 0.7] * v, backward=2.5, latency=0.05, send_overhead=0.2, grad_bytes=1,
                     bandwidth=2)
    timeline = ps.simulate(ps.compile_program(name, 4, 8, v if v > 1 else None, dp_size=2), cost)
    result = bubble_breakdown(timeline)
    assert all(value >= -1e-9 for value in result["seconds"].values())
    assert sum(result["fraction"][c] for c in CATEGORIES) == pytest.approx(timeline.bubble_fraction)
    for rank, (row, bubble) in enumerate(zip(result["per_rank"], timeline.bubble_per_rank())):
        assert sum(row[c] for c in CATEGORIES) == pytest.approx(row["idle"])
        assert row["idle"] == pytest.approx(bubble * timeline.makespan)
        # the simulator never overlaps a send call with compute: all of it is idle, 0.2 s per SEND
        sends = sum(e.instr.op in SEND_OPS for e in timeline.events if e.rank == rank)
        assert row["sending"] == pytest.approx(0.2 * sends)
    if v == 1:  # 1 chunk: rank 0 sends m activations, the last rank m gradients, the middle ones both
        assert [row["sending"] for row in result["per_rank"]] == pytest.approx([1.6, 3.2, 3.2, 1.6])


def send_patches(ax, tag=""):
    return [p for p in ax.patches if (p.get_gid() or "").startswith(tag + "send:")]


def extents(patch):
    return (patch.get_x(), patch.get_y(), patch.get_width(), patch.get_height())


def flat(boxes):
    return [value for box in boxes for value in box]


def test_the_gantt_draws_each_send_call_as_a_dark_half_height_box():
    ax = plot_timeline(two_ranks()).axes[0]  # makespan 7.5 s: the axis is in seconds
    boxes = send_patches(ax)
    assert [p.get_gid() for p in boxes] == ["send:0", "send:1"]
    # x from the step start, row r centred at y = r with boxes 0.8 tall: a send box 0.4 tall, centred
    assert extents(boxes[0]) == pytest.approx((1.0, -0.2, 0.25, 0.4))
    assert extents(boxes[1]) == pytest.approx((4.75, 0.8, 0.25, 0.4))
    assert all(p.get_facecolor() == to_rgba(style.SENDING) for p in boxes)
    assert style.SENDING not in (style.COMM_WAIT, style.COMM_WAIT_FILL, style.IDLE, style.ALL_REDUCE)
    waits = [p for p in ax.patches if (p.get_gid() or "").startswith("wait:")]
    computes = [p for p in ax.patches if (p.get_gid() or "").startswith("compute:")]
    assert max(p.get_zorder() for p in waits) < boxes[0].get_zorder() < min(p.get_zorder() for p in computes)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[-1] == "in send call" and labels.count("in send call") == 1


def test_no_send_boxes_or_legend_entry_without_send_time(measured):
    for timeline in (ps.simulate(ps.compile_program("1f1b", 2, 1), ps.CostModel(latency=0.5)), measured):
        ax = plot_timeline(timeline).axes[0]
        assert send_patches(ax) == []
        assert "in send call" not in [t.get_text() for t in ax.get_legend().get_texts()]


def test_large_timelines_draw_the_send_boxes_as_a_collection_in_the_same_places():
    timeline = two_ranks()
    fig, ax = new_figure(timeline, 2)
    draw_rows(ax, timeline, per_box=False)
    assert send_patches(ax) == []
    found = [c for c in ax.collections if c.get_gid() == "send-boxes:0"]
    assert len(found) == 1
    boxes = sorted((float(v[:, 0].min()), float(v[:, 1].min()), float(v[:, 0].max()), float(v[:, 1].max()))
                   for v in (np.asarray(path.vertices) for path in found[0].get_paths()))
    assert flat(boxes) == pytest.approx([1.0, -0.2, 1.25, 0.2, 4.75, 0.8, 5.0, 1.2])
    assert tuple(found[0].get_facecolor()[0]) == to_rgba(style.SENDING)


def test_above_the_patch_limit_every_send_call_is_in_the_collection():
    timeline = ps.simulate(ps.compile_program("1f1b", 8, 128), ps.CostModel(send_overhead=0.1))
    assert sum(e.instr.op in COMPUTE_OPS for e in timeline.events) >= gantt.PATCH_LIMIT
    ax = plot_timeline(timeline).axes[0]
    assert send_patches(ax) == []
    paths = sum(len(c.get_paths()) for c in ax.collections if (c.get_gid() or "").startswith("send-boxes:"))
    assert paths == sum(e.instr.op in SEND_OPS for e in timeline.events) == 2 * 128 * 7
    assert "in send call" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_the_comparison_has_sending_bars_and_send_boxes_in_both_panels():
    predicted = two_ranks()
    measured = Timeline(predicted.events, 2, source="measured", meta=dict(predicted.meta))
    fig = plot_comparison(predicted, measured)
    bar_ax = fig.axes[-1]
    ticks = [t.get_text() for t in bar_ax.get_xticklabels()]
    assert ticks == ["bubble (total)", "warmup", "steady", "cooldown", "sending", "communication", "imbalance"]
    heights = [p.get_height() for p in bar_ax.patches if p.get_gid() == "breakdown:measured"]
    assert heights[ticks.index("sending")] == pytest.approx(100 * 0.5 / 15)
    for ax, tag in zip(fig.axes[:2], ("predicted:", "measured:")):
        assert [p.get_gid() for p in send_patches(ax, tag)] == [tag + "send:0", tag + "send:1"]
    assert "in send call" in [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
