"""The Gantt pictures' legend: only the kinds a timeline has, fitted under its time axis within the figure."""
from __future__ import annotations

from ..ir import Op
from ..timeline import Timeline
from . import style
from .analysis import chunk_counts, stage_chunks, waits_and_sends


def add_legend(ax, timeline: Timeline, extra: tuple = ()) -> None:
    """A one- or two-row legend under the time axis with only the kinds the timeline has."""
    from matplotlib.patches import Patch

    chunks = stage_chunks(timeline)
    num_chunks = max(chunk_counts(chunks).values(), default=1)
    drawn = {(e.instr.op, chunks[(e.rank, e.instr.stage)]) for e in timeline.events}  # the kinds on the rows
    handles = []
    for op in style.BASE:
        for chunk in range(num_chunks):
            if (op, chunk) not in drawn:
                continue
            suffix = f", virtual stage {chunk}" if num_chunks > 1 else ""
            handles.append(Patch(facecolor=style.chunk_colour(op, chunk, num_chunks), edgecolor="white",
                                 hatch=style.chunk_hatch(chunk), label=style.KIND_NAME[op] + suffix))
    handles.append(Patch(facecolor=style.IDLE, label="idle (bubble)"))
    all_waits, all_sends = waits_and_sends(timeline)
    if any(all_waits):
        handles.append(Patch(facecolor=style.COMM_WAIT_FILL, edgecolor=style.COMM_WAIT, hatch="xxxx",
                             label=style.COMM_WAIT_LABEL))
    if any(all_sends):
        handles.append(Patch(facecolor=style.SENDING, label=style.SENDING_LABEL))
    if any(e.instr.op is Op.ALL_REDUCE for e in timeline.events):
        handles.append(Patch(facecolor=style.ALL_REDUCE, label="all-reduce"))
    if any(e.instr.op is Op.TIE_REDUCE for e in timeline.events):
        handles.append(Patch(facecolor=style.TIE_REDUCE, label="tied-gradient sum"))
    handles.extend(extra)
    place_legend(ax, handles)


LEGEND_PAD_PX = 4  # the legend's least distance from the figure's edges and from an Axes under it


def place_legend(ax, handles: list) -> None:
    """:func:`add_legend`'s legend under ``ax``'s time axis, fitted to the figure with the labels' own measured widths:
    the most columns (at most one row) whose width fits the figure, centred under ``ax`` and moved in to lie within
    the figure; where its rows reach below the figure's bottom (or into an Axes under ``ax``), the figure grows there
    by as much, ``ax`` and every Axes above it keeping their place from the top (inches)."""
    fig, pad = ax.figure, LEGEND_PAD_PX
    renderer = fig.canvas.get_renderer() if hasattr(fig.canvas, "get_renderer") else fig._get_renderer()
    y = -0.4 / _rows_in(ax)
    for ncol in range(len(handles), 0, -1):
        legend = ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, y), ncol=ncol, fontsize=7.5,
                           frameon=False, handlelength=1.6, columnspacing=1.2)
        box = legend.get_window_extent(renderer)
        if box.width <= fig.bbox.width - 2 * pad:
            break
    axes_box, fig_w = ax.get_window_extent(renderer), fig.bbox.width
    centre = min(max(axes_box.x0 + axes_box.width / 2, pad + box.width / 2), fig_w - pad - box.width / 2)
    if box.width > fig_w - 2 * pad:  # one column still too wide (a very narrow figure): centred on it
        centre = fig_w / 2
    legend.set_bbox_to_anchor(((centre - axes_box.x0) / axes_box.width, y), transform=ax.transAxes)
    here = ax.get_position()
    below = [other for other in fig.axes if other is not ax and other.get_position().y1 <= here.y0]
    floor = max([pad] + [other.get_tightbbox(renderer).y1 + pad for other in below])
    need = floor - legend.get_window_extent(renderer).y0
    if need <= 0:
        return
    old = fig.get_figheight()
    grow = need / fig.dpi
    boxes = [(other, other.get_position()) for other in fig.axes]
    fig.set_figheight(old + grow)
    for other, b in boxes:
        lift = grow if b.y0 >= here.y0 else 0.0
        other.set_position([b.x0, (b.y0 * old + lift) / (old + grow), b.width, b.height * old / (old + grow)])


def _rows_in(ax) -> float:
    return ax.get_position().height * ax.figure.get_figheight()
