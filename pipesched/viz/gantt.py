"""Gantt chart of one timeline: a row per rank, a box per compute instruction, idle time as visible gaps."""
from __future__ import annotations

from ..checks import check_timeline
from ..ir import Op
from ..timeline import Timeline, peak_inflight
from . import style
from .analysis import chunk_counts, compute_events, stage_chunks, waits_and_sends
from .legend import add_legend

ROW_IN = 0.42  # inches per rank row
LABEL_PT = 6.5  # microbatch number font size
MARGINS_IN = {"left": 0.75, "right": 1.45, "top": 0.75, "bottom": 0.95}
SEP = "  ·  "
PATCH_LIMIT = 2000  # fewer compute boxes: one Rectangle (with a gid) per box; this many or more: collections
SEND_HEIGHT = 0.5  # a send-call box's height, a share of the row's: a mark in the gap, not a compute box


def plot_timeline(timeline: Timeline, ax=None, title: str | None = None):
    """Draw ``timeline`` as a Gantt chart and return the matplotlib ``Figure``.

    One row per rank (rank 0 on top); one box per compute instruction (F, B, I, W, R) coloured by kind,
    later virtual stages lighter and hatched, with the microbatch number inside where it fits. Idle
    time shows as light-grey gaps; the part of a gap spent waiting for a message in flight
    ("communication wait", see :func:`~pipesched.viz.analysis.bubble_breakdown`) is hatched grey (a
    short one a thin grey mark, as the legend says), the part a rank spends inside its own send calls
    (``sending``; e.g. ``CostModel.send_overhead``, gloo's blocking sends) is a dark-grey half-height bar
    (legend "in send call", only when there is any), and
    all-reduces are thin black bars at the bottom of their row. The title names the schedule, p, m, v,
    the source (and, for a timeline of some ranks only, which: ``rank 1 only``) and the cost assumptions,
    and ends with the overall bubble fraction; the right margin gives each rank's bubble fraction and peak
    in-flight microbatches. Times are seconds, shown in s, ms or µs depending on the makespan: one unit
    for the axis, the makespan and the costs in the title.

    Args:
        timeline: a simulated or measured :class:`~pipesched.timeline.Timeline`.
        ax: an Axes to draw into (its figure is returned); ``None`` makes a new headless (Agg) figure
            sized so that boxes stay readable.
        title: replaces the first title line (schedule and sizes); the cost/bubble line stays.
    Returns:
        The ``matplotlib.figure.Figure`` (saving is the caller's: ``fig.savefig("x.png")``).
    Raises:
        TypeError: ``timeline`` is not a :class:`~pipesched.timeline.Timeline`.
        ValueError: the timeline has no events or no ranks.
    """
    check_timeline(timeline, where="plot_timeline: ")
    _check(timeline)
    own = ax is None
    if own:
        fig, ax = new_figure(timeline, timeline.num_ranks)
    else:
        fig = ax.figure
    draw_rows(ax, timeline)
    rank_axis(ax, timeline.num_ranks)
    annotate_ranks(ax, timeline)
    lines = set_title(ax, title_text(timeline, title))
    if own and lines > 2:
        grow_top(fig, (lines - 2) * 0.19)
    time_axis(ax, timeline)
    add_legend(ax, timeline)
    return fig


def new_figure(timeline: Timeline, rows: float, extra_rows_in: float = 0.0):
    """A headless Agg figure and its main Axes laid out in inches for ``rows`` rank rows."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    width = axes_width_in(timeline)
    height = max(1.3, rows * ROW_IN)
    m = MARGINS_IN
    fig_w = width + m["left"] + m["right"]
    fig_h = height + m["top"] + m["bottom"] + extra_rows_in
    fig = Figure(figsize=(fig_w, fig_h), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_axes([m["left"] / fig_w, (m["bottom"] + extra_rows_in) / fig_h, width / fig_w, height / fig_h])
    return fig, ax


def axes_width_in(timeline: Timeline) -> float:
    """Inches of time axis so that a typical compute box is about 11 points wide (6 to 20 inches)."""
    durations = sorted(e.duration for e in compute_events(timeline) if e.duration > 0)
    if not durations or timeline.makespan <= 0:
        return 8.0
    typical = durations[len(durations) // 4]
    return min(20.0, max(6.0, timeline.makespan / typical * 11 / 72))


def draw_rows(ax, timeline: Timeline, offset: float = 0.0, height: float = 0.8, labels: bool = True,
              tag: str = "", factor: float | None = None, per_box: bool | None = None) -> int:
    """Draw idle bands, communication waits, send calls, compute boxes and all-reduces; return the boxes
    drawn.

    Row ``r`` is centred at ``y = r + offset`` with boxes ``height`` tall (data units). With fewer than
    :data:`PATCH_LIMIT` compute boxes (or ``per_box=True``) every compute box is a ``Rectangle`` whose
    gid is ``"{tag}compute:{rank}:{instr}"`` (waits ``"{tag}wait:{rank}"``, send calls
    ``"{tag}send:{rank}"``, all-reduces ``"{tag}allreduce:{rank}:{instr}"``); with more (or
    ``per_box=False``) the same boxes, in the same places, colours and styles, are drawn as collections:
    gid ``"{tag}compute-boxes:{i}"`` (fill and edge, a path per box) and ``"{tag}compute-hatch:{i}.{j}"``
    (a hatch over the boxes that have it; ``wait-``, ``send-``, ``allreduce-`` alike; see
    :class:`_Shapes`). A patch costs about 1 ms to add and draw, a box in a collection microseconds.
    ``factor`` converts seconds to the x unit (default: the unit :func:`~pipesched.viz.style.time_unit`
    picks for the makespan).
    """
    events = compute_events(timeline)
    shapes = _Shapes(ax, len(events) < PATCH_LIMIT if per_box is None else per_box, tag)
    t0 = min(e.start for e in timeline.events)
    t1 = t0 + timeline.makespan
    if factor is None:
        factor = style.time_unit(timeline.makespan)[1]
    _draw_idle(ax, timeline, t0, t1, factor, offset, height, tag)
    _draw_waits_and_sends(shapes, timeline, t0, factor, offset, height)
    drawn = _draw_compute(ax, shapes, timeline, events, t0, factor, offset, height, labels)
    _draw_all_reduces(shapes, timeline, t0, factor, offset, height)
    shapes.flush()
    lo, hi = ax.get_xlim() if ax.get_autoscalex_on() is False else (0.0, 0.0)
    ax.set_xlim(min(lo, -0.01 * (t1 - t0) * factor), max(hi, (t1 - t0) * factor * 1.01))
    return drawn


def _draw_idle(ax, timeline: Timeline, t0: float, t1: float, factor: float, offset: float, height: float,
               tag: str) -> None:
    """:func:`draw_rows`'s idle band under each row the timeline holds (a rank it does not hold is left blank)."""
    from matplotlib.patches import Rectangle

    half = height / 2
    held = range(timeline.num_ranks) if timeline.ranks is None else timeline.ranks
    for rank in held:
        y = rank + offset
        ax.add_patch(Rectangle((0.0, y - half), (t1 - t0) * factor, height,
                               facecolor=style.IDLE, edgecolor="none", zorder=0, gid=f"{tag}idle:{rank}"))


def _draw_waits_and_sends(shapes: "_Shapes", timeline: Timeline, t0: float, factor: float, offset: float,
                          height: float) -> None:
    """:func:`draw_rows`'s communication waits (hatched) and send calls (half-height bars)."""
    half = height / 2
    all_waits, all_sends = waits_and_sends(timeline)
    for rank, waits in enumerate(all_waits):
        for start, end, kind in waits:
            if kind == "p2p":
                shapes.add("wait", (start - t0) * factor, rank + offset - half, (end - start) * factor,
                           height, facecolor=style.COMM_WAIT_FILL, edgecolor=style.COMM_WAIT,
                           hatch="xxxx", linewidth=0, zorder=1, gid=f"wait:{rank}")
    for rank, sends in enumerate(all_sends):
        for start, end in sends:
            shapes.add("send", (start - t0) * factor, rank + offset - SEND_HEIGHT * half,
                       (end - start) * factor, SEND_HEIGHT * height, facecolor=style.SENDING,
                       edgecolor="none", linewidth=0, zorder=1.5, gid=f"send:{rank}")


def _draw_compute(ax, shapes: "_Shapes", timeline: Timeline, events, t0: float, factor: float, offset: float,
                  height: float, labels: bool) -> int:
    """:func:`draw_rows`'s compute boxes, with the microbatch number inside where it fits; return how many."""
    half = height / 2
    chunks = stage_chunks(timeline)
    counts = chunk_counts(chunks)
    points_per_unit = _points_per_data_unit(ax, timeline.makespan * factor)
    drawn = 0
    for event in events:
        instr, rank = event.instr, event.rank
        chunk = chunks[(rank, instr.stage)]
        x, w = (event.start - t0) * factor, event.duration * factor
        shapes.add("compute", x, rank + offset - half, w, height,
                   facecolor=style.chunk_colour(instr.op, chunk, counts[rank]),
                   hatch=style.chunk_hatch(chunk), edgecolor="white", linewidth=0.4,
                   zorder=2, gid=f"compute:{rank}:{instr}")
        drawn += 1
        text = str(instr.microbatch)
        if labels and w * points_per_unit >= len(text) * 0.62 * LABEL_PT + 2.5:
            ax.text(x + w / 2, rank + offset, text, ha="center", va="center", fontsize=LABEL_PT,
                    color=style.text_colour(instr.op, chunk), zorder=3, clip_on=True)
    return drawn


def _draw_all_reduces(shapes: "_Shapes", timeline: Timeline, t0: float, factor: float, offset: float,
                      height: float) -> None:
    """:func:`draw_rows`'s all-reduces (and tie reduces): thin bars at the bottom of their row."""
    half = height / 2
    for event in timeline.events:
        if event.instr.op in (Op.ALL_REDUCE, Op.TIE_REDUCE):
            y = event.rank + offset + half
            shapes.add("allreduce", (event.start - t0) * factor, y - 0.14 * height,
                       max(event.duration, 0) * factor, 0.14 * height,
                       facecolor=getattr(style, event.instr.op.name),
                       edgecolor="none", zorder=4, gid=f"allreduce:{event.rank}:{event.instr}")


class _Shapes:
    """Rectangles for :func:`draw_rows`: each added as its own patch (``per_box``), or kept by kind and style
    and added by :meth:`flush` as collections that draw what the boxes' rectangles would:

    - one ``PolyCollection`` per kind and style but the face colour and hatch: fill and edge of every
      box, a face colour per box, in the order added (where boxes touch, the later one's fill covers the
      earlier's edge, as with patches), gid ``"{tag}{kind}-boxes:{i}"``;
    - for each hatch, a collection of one path holding all boxes with that hatch, drawn over them: the
      hatch only (no fill, an invisible edge of the boxes' width, so that it snaps to the pixels they
      do), gid ``"{tag}{kind}-hatch:{i}.{j}"``. Agg renders the hatch pattern once per path, about 0.5 ms:
      hatching each box of a collection on its own would cost what the patches did.
    """

    def __init__(self, ax, per_box: bool, tag: str):
        self.ax, self.per_box, self.tag = ax, per_box, tag
        self.groups: dict[tuple, tuple[list, list, list]] = {}  # style -> (boxes, face colours, hatches)

    def add(self, kind: str, x: float, y: float, w: float, h: float, gid: str, **style_kwargs) -> None:
        if self.per_box:
            from matplotlib.patches import Rectangle

            self.ax.add_patch(Rectangle((x, y), w, h, gid=self.tag + gid, **style_kwargs))
            return
        face, hatch = style_kwargs.pop("facecolor"), style_kwargs.pop("hatch", None) or ""
        key = (kind,) + tuple(sorted(style_kwargs.items()))
        boxes, faces, hatches = self.groups.setdefault(key, ([], [], []))
        boxes.append((x, y, x + w, y + h))
        faces.append(face)
        hatches.append(hatch)

    def flush(self) -> None:
        import numpy as np
        from matplotlib.collections import PathCollection, PolyCollection
        from matplotlib.patches import Rectangle
        from matplotlib.path import Path

        numbers: dict[str, int] = {}
        for (kind, *items), (boxes, faces, hatches) in self.groups.items():
            style_kwargs = dict(items)
            model = Rectangle((0, 0), 1, 1, **style_kwargs)
            c = np.asarray(boxes, dtype=float)  # x0, y0, x1, y1: the corners a Rectangle's path goes round
            verts = np.stack([c[:, [0, 1]], c[:, [2, 1]], c[:, [2, 3]], c[:, [0, 3]]], axis=1)
            number = numbers[kind] = numbers.get(kind, -1) + 1
            self.ax.add_collection(PolyCollection(
                verts, closed=True, facecolors=_face_colours(faces), edgecolors=[model.get_edgecolor()],
                linewidths=[model.get_linewidth()], antialiaseds=[model.get_antialiased()],
                zorder=model.get_zorder(), gid=f"{self.tag}{kind}-boxes:{number}"), autolim=False)
            # data limits as add_patch would set them (boxes of zero width or height left out); unlike
            # add_collection(autolim=True) on matplotlib >= 3.11, no autoscaling of the view
            solid = c[(c[:, 2] != c[:, 0]) & (c[:, 3] != c[:, 1])]
            if len(solid):
                self.ax.update_datalim(np.concatenate([solid[:, :2], solid[:, 2:]]))
            for j, hatch in enumerate(dict.fromkeys(h for h in hatches if h)):
                model = Rectangle((0, 0), 1, 1, hatch=hatch, **style_kwargs)
                overlay = PathCollection(
                    [Path.make_compound_path_from_polys(verts[np.array(hatches) == hatch])],
                    facecolors="none", edgecolors=[(*model.get_edgecolor()[:3], 0.0)],
                    linewidths=[model.get_linewidth()], antialiaseds=[model.get_antialiased()], hatch=hatch,
                    zorder=model.get_zorder(), gid=f"{self.tag}{kind}-hatch:{number}.{j}")
                overlay.set_snap(True)  # a path of over 1024 vertices is not snapped unless told to
                if hasattr(model, "get_hatchcolor"):  # matplotlib >= 3.10
                    overlay.set_hatchcolor(model.get_hatchcolor())
                else:  # older: a patch's hatch has its edge colour, a collection's rcParams["hatch.color"]
                    overlay._hatch_color = model._hatch_color
                self.ax.add_collection(overlay, autolim=False)
        self.groups.clear()


def _face_colours(faces: list) -> list:
    """RGBA of each face colour as a ``Rectangle(facecolor=...)`` has it (each distinct one converted once)."""
    from matplotlib.colors import to_rgba

    rgba = {face: to_rgba(face) for face in set(faces)}
    return [rgba[face] for face in faces]


def title_text(timeline: Timeline, title: str | None = None) -> str:
    """Two title lines: schedule and sizes (or ``title``), then the overall bubble fraction and the costs."""
    meta = dict(timeline.meta)
    microbatches = {e.instr.microbatch for e in timeline.events if e.instr.microbatch is not None}
    meta.setdefault("microbatches", len(microbatches) if microbatches else "?")
    meta.setdefault("virtual_stages", max(chunk_counts(stage_chunks(timeline)).values(), default=1))
    first = title or SEP.join(
        [f"{meta.get('schedule', 'custom')}", f"p={meta.get('ranks', timeline.num_ranks)} ranks",
         f"m={meta.get('microbatches', '?')} microbatches", f"v={meta.get('virtual_stages', '?')}"]
        + ([f"dp={meta['dp_size']}"] if meta.get("dp_size", 1) != 1 else [])
        + (["forward pass only"] if meta.get("step") == "forward" else []) + [timeline.source]
        + ([held_ranks(timeline)] if held_ranks(timeline) else []))
    unit, factor = style.time_unit(timeline.makespan)
    cost = meta.get("cost") or ("costs as measured" if timeline.source == "measured" else "default costs")
    drawn = {e.instr.op for e in timeline.events}
    cost_label = (f"costs [{unit} per stage and microbatch]: "
                  f"{style.cost_in_unit(style.costs_drawn(cost, drawn), unit, factor)}" if meta.get("cost") else cost)
    second = (f"bubble {100 * timeline.bubble_fraction:.2f}%{SEP}makespan {timeline.makespan * factor:.4g} "
              f"{unit}{SEP}{cost_label}")
    return first + "\n" + second


def held_ranks(timeline: Timeline) -> str:
    """``"rank 1 only"`` (``"ranks 0, 2 only"``) for a timeline of some ranks (``Pipeline.timeline()``), else ``""``."""
    held = timeline.ranks
    if held is None or len(held) >= timeline.num_ranks:
        return ""
    return ("rank " if len(held) == 1 else "ranks ") + ", ".join(str(r) for r in sorted(held)) + " only"


def set_title(ax, text: str, fontsize: float = 9.5) -> int:
    """Left-aligned title wrapped to the Axes width (long cost lists must not run off); returns its lines."""
    import textwrap

    width_pt = ax.get_position().width * ax.figure.get_figwidth() * 72
    chars = max(30, int(width_pt / (0.6 * fontsize)))
    lines = []
    for line in text.split("\n"):
        current = ""
        for part in line.split(SEP):
            joined = part if not current else current + SEP + part
            if current and len(joined) > chars:
                lines.append(current)
                current = part
            else:
                current = joined
        lines.extend(textwrap.wrap(current, chars) or [""])
    ax.set_title("\n".join(lines), fontsize=fontsize, loc="left", gid="title")
    return len(lines)


def grow_top(fig, inches: float) -> None:
    """Add ``inches`` at the top of ``fig`` keeping every Axes' size and place from the bottom (inches)."""
    old = fig.get_figheight()
    boxes = [(ax, ax.get_position()) for ax in fig.axes]
    fig.set_figheight(old + inches)
    for ax, box in boxes:
        ax.set_position([box.x0, box.y0 * old / (old + inches), box.width, box.height * old / (old + inches)])


def rank_peaks(timeline: Timeline) -> tuple[int, ...]:
    """Peak in-flight microbatches per rank: the timeline's own, else counted from its event order."""
    if len(timeline.peak_inflight) == timeline.num_ranks:
        return tuple(timeline.peak_inflight)
    streams = [[e.instr for e in timeline.events if e.rank == r] for r in range(timeline.num_ranks)]
    return peak_inflight(streams)


def annotate_ranks(ax, timeline: Timeline, offset: float = 0.0) -> None:
    """Right of each row: the rank's bubble fraction (%) and its peak in-flight microbatches."""
    peaks = rank_peaks(timeline)
    transform = ax.get_yaxis_transform()
    ax.text(1.01, -0.55 + offset, " " * 10 + "peak\nbubble  in-flight", transform=transform, fontsize=7.5,
            va="bottom", ha="left", family="monospace", color="#444444", clip_on=False)
    for rank, bubble in enumerate(timeline.bubble_per_rank()):
        # NaN: a rank the timeline does not hold
        shown = f"{'--':>6}  {'--':>9}" if bubble != bubble else f"{100 * bubble:5.1f}%  {peaks[rank]:>9d}"
        ax.text(1.01, rank + offset, shown, transform=transform,
                fontsize=7.5, va="center", ha="left", family="monospace", clip_on=False,
                gid=f"bubble-rank-{rank}")


def rank_axis(ax, num_ranks: int) -> None:
    """Label ``ax``'s y axis with one row per rank, rank 0 on top, and hide the frame but the bottom."""
    ax.set_ylim(num_ranks - 0.5, -0.5)
    ax.set_yticks(range(num_ranks))
    ax.set_yticklabels([f"rank {r}" for r in range(num_ranks)], fontsize=8)
    ax.tick_params(axis="y", length=0)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)


def time_axis(ax, timeline: Timeline, unit: str | None = None) -> None:
    """Label ``ax``'s x axis as time from step start in ``unit`` (default: the makespan's, see ``time_unit``)."""
    unit = unit or style.time_unit(timeline.makespan)[0]
    ax.set_xlabel(f"time from step start ({unit})", fontsize=8)
    ax.tick_params(axis="x", labelsize=7.5)
    ax.grid(axis="x", color="#dddddd", linewidth=0.5, zorder=-1)
    ax.set_axisbelow(True)


def _points_per_data_unit(ax, span: float) -> float:
    width_pt = ax.get_position().width * ax.figure.get_figwidth() * 72
    return width_pt / (span * 1.02) if span > 0 else 0.0


def _check(timeline: Timeline) -> None:
    if timeline.num_ranks < 1 or not timeline.events:
        raise ValueError(f"cannot draw a timeline with {timeline.num_ranks} ranks and "
                         f"{len(timeline.events)} events")
