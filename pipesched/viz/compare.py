"""Simulated vs measured: predict a measured run, draw both, and put the two bubbles side by side."""
from __future__ import annotations

import statistics

from ..api import compile_program
from ..checks import check_timeline
from ..cost import CostModel
from ..ir import COMPUTE_OPS, Op, Program
from ..placement import looped
from ..sim import simulate
from ..timing import COST_FIELD
from ..timeline import Timeline
from . import style
from .analysis import CATEGORIES, MessageFlights, bubble_breakdown, send_seconds
from .gantt import (ROW_IN, add_legend, annotate_ranks, axes_width_in, draw_rows, rank_axis, set_title,
                    time_axis, title_text)

__all__ = ["bubble_breakdown", "fit_cost", "plot_comparison", "predict_for", "simulate_like"]

BREAKDOWN_IN = 1.9  # inches of the breakdown bar panel


def fit_cost(measured: Timeline) -> CostModel:
    """A cost model read off a timeline: per stage, the mean seconds of each compute kind it ran.

    Values are rounded to 3 significant digits (measurements are not more precise than that, and the
    cost line in titles stays readable). ``send_overhead`` is the median duration of the SEND events (the sending
    rank's time inside its send calls; 0 without SEND events), and ``latency`` the shortest time any message took
    from its SEND's start to its RECV's end (the best case of a transfer) less that overhead, at least 0 (0 with no
    matched messages). All-reduce times are not fitted.

    Raises:
        ValueError: the timeline has no forward (``F``) events, or holds only some ranks (``Pipeline.timeline()``:
            the other ranks' stages would be fitted as free, 0 s).
        TypeError: ``measured`` is not a :class:`~pipesched.timeline.Timeline`.
    """
    check_timeline(measured, "measured", where="fit_cost: ")
    if measured.ranks is not None and len(measured.ranks) < measured.num_ranks:
        raise ValueError(f"cannot fit costs: the measured timeline holds ranks {list(measured.ranks)} of "
                         f"{measured.num_ranks}, so the other ranks' stages have no times: save "
                         f"Pipeline.gather_timeline(), not .timeline()")
    stages = 1 + max((e.instr.stage for e in measured.events), default=-1)
    samples: dict = {}
    for event in measured.events:
        if event.instr.op in COST_FIELD:
            samples.setdefault((event.instr.op, event.instr.stage), []).append(event.duration)
    if not any(op is Op.F for op, _ in samples):
        raise ValueError("cannot fit costs: the timeline has no forward (F) events")
    fields = {}
    for op, name in COST_FIELD.items():
        if any(o is op for o, _ in samples):
            fields[name] = [_sig3(statistics.fmean(samples.get((op, s), [0.0]))) for s in range(stages)]
    if "backward" not in fields:
        i, w = fields.get("input_grad", [0.0] * stages), fields.get("weight_grad", [0.0] * stages)
        fields["backward"] = [a + b for a, b in zip(i, w)]
    overhead = _sig3(statistics.median(sends)) if (sends := send_seconds(measured)) else 0.0
    latency = _sig3(max(0.0, _fitted_latency(measured) - overhead))
    return CostModel(latency=latency, send_overhead=overhead, **fields)


def _sig3(x: float) -> float:
    return float(f"{x:.3g}")


def predict_for(measured: Timeline, cost: CostModel | None = None) -> Timeline:
    """Simulate the program a measured run executed, with ``cost`` (default: :func:`fit_cost`).

    The program is compiled from the measured timeline's ``meta`` (``schedule``, ``ranks``,
    ``microbatches``, ``virtual_stages``, ``dp_size``, ``ties`` if any), recomputing and splitting the backward
    of the stages the executed program does (its :func:`executed_program`, asked ``stages_with(Op.R)`` and ``(Op.I)``); a
    timeline of a ``forward()`` (``meta["step"]``) gets the forward-only program
    (:func:`pipesched.lower.forward_only`).

    Raises:
        ValueError: ``meta`` does not name a registered schedule and its sizes; the timeline holds only some
            ranks (``Pipeline.timeline()``).
        UnknownScheduleError, ScheduleArgumentError: as :func:`pipesched.compile_program`.
        TypeError: ``measured`` is not a :class:`~pipesched.timeline.Timeline`.
    """
    meta = check_timeline(measured, "measured", where="predict_for: ").meta
    if measured.ranks is not None and len(measured.ranks) < measured.num_ranks:
        raise ValueError(f"the measured timeline holds ranks {list(measured.ranks)} of {measured.num_ranks}; a "
                         f"prediction needs every rank's costs: save Pipeline.gather_timeline(), not .timeline()")
    missing = [k for k in ("schedule", "microbatches") if k not in meta]
    if missing:
        raise ValueError(f"the measured timeline's meta lacks {missing}; it has {sorted(meta)} — cannot "
                         f"recompile its program to predict it")
    ranks = int(meta.get("ranks", measured.num_ranks))
    v = meta.get("virtual_stages")
    stages = ranks * (int(v) if v else 1)
    executed = executed_program(measured, looped(ranks, stages // ranks))
    recompute = executed.stages_with(Op.R)
    split = executed.stages_with(Op.I) - executed.stages_with(Op.B)  # split by the pass; dualpipev mixes its own
    program = compile_program(meta["schedule"], ranks, int(meta["microbatches"]), None if v is None else int(v),
                              dp_size=int(meta.get("dp_size", 1)), recompute=_flags(recompute, stages),
                              split_backward=_flags(split, stages), forward_only=meta.get("step") == "forward",
                              ties=[tuple(tie) for tie in meta.get("ties", ())])
    return simulate(program, cost or fit_cost(measured), check=False)


def executed_program(measured: Timeline, stage_to_rank) -> Program:
    """The program a timeline ran: each rank's instructions in the order of their start (its events are
    ordered by rank, then start), with ``stage_to_rank``; ask it what the run did (``stages_with``,
    ``recomputed``). Not validated: a timeline of one rank has empty streams for the others."""
    streams = [[] for _ in range(measured.num_ranks)]
    for event in measured.events:
        streams[event.rank].append(event.instr)
    return Program(tuple(map(tuple, streams)), tuple(stage_to_rank), int(measured.meta.get("microbatches", 1)))


def _flags(stages: set, num_stages: int):
    """``False`` for no stage, else one bool per stage."""
    return bool(stages) and [s in stages for s in range(num_stages)]


def simulate_like(program, measured: Timeline, cost: CostModel | None = None) -> Timeline:
    """Simulate ``program`` (the one the measured run executed) with ``cost`` (default: fitted from ``measured``).

    Use this when the program is at hand (e.g. ``Pipeline.program``); :func:`predict_for` recompiles it
    from the measured timeline's labels instead.

    Raises:
        ValueError: the measured timeline has no forwards (cannot fit), or a cost does not fit the program.
        ScheduleError: the program is invalid.
        TypeError: ``measured`` is not a :class:`~pipesched.timeline.Timeline`.
    """
    check_timeline(measured, "measured", where="simulate_like: ")
    return simulate(program, cost or fit_cost(measured))


def plot_comparison(simulated: Timeline, measured: Timeline, mode: str = "side-by-side", title: str | None = None):
    """Draw a simulated and a measured timeline of the same program, with both bubbles and breakdowns.

    ``"side-by-side"``: the predicted Gantt chart above the measured one on one time scale, each titled
    with its bubble fraction. ``"overlay"``: one chart, each rank row split in two — predicted on top,
    measured below. Both modes end with a bar chart of :func:`bubble_breakdown` (percent of
    ranks x makespan) for predicted and measured, with the measured bubble next to the predicted one.

    Args:
        simulated: the prediction (e.g. :func:`predict_for` of ``measured``).
        measured: the measured timeline (``Timeline.load`` of the runtime's file).
        mode: ``"side-by-side"`` or ``"overlay"``.
        title: the figure's first title line (default: schedule and sizes of ``measured``).
    Returns:
        The headless (Agg) ``matplotlib.figure.Figure``.
    Raises:
        TypeError: ``simulated`` or ``measured`` is not a :class:`~pipesched.timeline.Timeline`.
        ValueError: unknown ``mode``, an empty timeline, different rank counts, or timelines of different programs:
            on a rank both hold, not the same compute instructions (``F``, ``B``, ``I``, ``W``, ``R`` of each stage
            and microbatch); the message names the first such rank and an instruction only one of them runs.
            Messages and collectives are not compared (they follow the backend's passes: ``dp_size``'s
            ``ALL_REDUCE``, receives posted early).
    """
    check_timeline(simulated, "simulated", where="plot_comparison: ")
    check_timeline(measured, "measured", where="plot_comparison: ")
    if mode not in ("side-by-side", "overlay"):
        raise ValueError(f"mode must be 'side-by-side' or 'overlay', got {mode!r}")
    if simulated.num_ranks != measured.num_ranks or not simulated.events or not measured.events:
        raise ValueError(f"need two non-empty timelines with the same ranks, got {simulated.num_ranks} "
                         f"and {measured.num_ranks} ranks")
    _refuse_other_program(simulated, measured)
    unit, factor = style.time_unit(max(simulated.makespan, measured.makespan))
    p = measured.num_ranks
    panels = [p, p] if mode == "side-by-side" else [2 * p * 0.8]
    fig, gantt_axes, bar_ax = _layout(max(simulated, measured, key=axes_width_in), panels)
    _breakdown_bars(bar_ax, simulated, measured)  # first: the legend keeps clear of the bars' title (add_legend)
    head = title or title_text(measured).split("\n")[0].replace(f"  ·  {measured.source}", "")
    versus = (f"measured bubble {100 * measured.bubble_fraction:.2f}%  vs  predicted "
              f"{100 * simulated.bubble_fraction:.2f}%")
    fig.suptitle(f"{head}\n{versus}", x=0.01, ha="left", fontsize=11, y=0.995, va="top")
    if mode == "side-by-side":
        for ax, timeline, name in zip(gantt_axes, (simulated, measured), ("predicted", "measured")):
            draw_rows(ax, timeline, factor=factor, tag=f"{name}:")
            rank_axis(ax, p)
            annotate_ranks(ax, timeline)
            time_axis(ax, timeline, unit)
            source = "" if timeline.source == name else f" ({timeline.source})"
            set_title(ax, f"{name}{source}  ·  bubble {100 * timeline.bubble_fraction:.2f}%  ·  "
                          f"makespan {timeline.makespan * factor:.4g} {unit}\n"
                          f"{_cost_label(timeline, unit, factor)}")
        gantt_axes[0].set_xlabel("")
        _share_xlim(gantt_axes)
        add_legend(gantt_axes[1], measured)
    else:
        _overlay(gantt_axes[0], simulated, measured, factor, unit)
    return fig


def _refuse_other_program(simulated: Timeline, measured: Timeline) -> None:
    """Raise ValueError naming the first rank both timelines hold whose compute instructions differ (a prediction
    drawn next to a run of another schedule, size or placement: its bubble compared to one it does not predict)."""
    held = [r for r in range(measured.num_ranks) if (simulated.ranks is None or r in simulated.ranks)
            and (measured.ranks is None or r in measured.ranks)]
    computes = [_computes(timeline, measured.num_ranks) for timeline in (simulated, measured)]
    for rank in held:
        mine, theirs = computes[0][rank], computes[1][rank]
        if mine != theirs:
            first = min(mine ^ theirs)
            only, other = ("simulated", "measured") if first in mine else ("measured", "simulated")
            raise ValueError(f"plot_comparison: simulated and measured must be timelines of the same program (the same "
                             f"compute instructions on each rank), but on rank {rank} the {only} timeline runs "
                             f"{first} and the {other} does not ({len(mine)} compute instructions simulated, "
                             f"{len(theirs)} measured, {len(mine ^ theirs)} in one only)")


def _computes(timeline: Timeline, num_ranks: int) -> list[set]:
    """Per rank, the set of compute instructions (F, B, I, W, R) of ``timeline``."""
    per_rank = [set() for _ in range(num_ranks)]
    for event in timeline.events:
        if event.instr.op in COMPUTE_OPS:
            per_rank[event.rank].add(event.instr)
    return per_rank


def _overlay(ax, simulated: Timeline, measured: Timeline, factor: float, unit: str) -> None:
    draw_rows(ax, simulated, offset=-0.21, height=0.4, tag="predicted:", factor=factor)
    draw_rows(ax, measured, offset=0.21, height=0.4, tag="measured:", factor=factor)
    rank_axis(ax, measured.num_ranks)
    ax.set_yticklabels([f"rank {r}\npred / meas" for r in range(measured.num_ranks)], fontsize=7.5)
    transform = ax.get_yaxis_transform()
    for rank, (a, b) in enumerate(zip(simulated.bubble_per_rank(), measured.bubble_per_rank())):
        shown = "\n".join(f"{'--':>6}" if x != x else f"{100 * x:5.1f}%" for x in (a, b))  # NaN: a rank not held
        ax.text(1.01, rank, shown, transform=transform, fontsize=7.5,
                va="center", ha="left", family="monospace", clip_on=False, gid=f"bubble-rank-{rank}")
    ax.text(1.01, -0.62, "bubble\npred/meas", transform=transform, fontsize=7, va="bottom", color="#444444")
    time_axis(ax, measured, unit)
    set_title(ax, f"each row: predicted (top) and measured (bottom)\npredicted with "
                  f"{_cost_label(simulated, unit, factor)}")
    add_legend(ax, measured)


def _breakdown_bars(ax, simulated: Timeline, measured: Timeline) -> None:
    import numpy as np

    names = ("total",) + CATEGORIES
    x = np.arange(len(names))
    for shift, timeline, colour, label in ((-0.2, simulated, "#999999", "predicted"),
                                           (0.2, measured, "#0072B2", "measured")):
        fractions = bubble_breakdown(timeline)["fraction"]
        values = [100 * fractions[n] for n in names]
        bars = ax.bar(x + shift, values, width=0.38, color=colour, label=label, gid=f"breakdown:{label}")
        ax.bar_label(bars, fmt="%.1f", fontsize=7, padding=1)
    ax.set_xticks(x, ["bubble (total)"] + [n for n in CATEGORIES], fontsize=8)
    ax.set_ylabel("% of ranks × makespan", fontsize=8)
    ax.tick_params(axis="y", labelsize=7.5)
    ax.set_ylim(0, max(5.0, ax.get_ylim()[1] * 1.15))
    ax.legend(fontsize=8, frameon=False, loc="upper right")
    ax.set_title("bubble breakdown (see pipesched.viz.bubble_breakdown)", fontsize=9, loc="left")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _layout(timeline: Timeline, panels: list[float]):
    """Figure in inches, top to bottom: suptitle, per panel (3-line title, rows, time axis), legend, bars."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    width = axes_width_in(timeline)
    left, right, suptitle, panel_title, axis, legend, bar_title, bottom = 0.85, 1.45, 0.5, 0.6, 0.45, 0.6, 0.35, 0.45
    heights = [max(1.2, rows * ROW_IN) for rows in panels]
    fig_w = width + left + right
    fig_h = suptitle + sum(panel_title + h + axis for h in heights) + legend + bar_title + BREAKDOWN_IN + bottom
    fig = Figure(figsize=(fig_w, fig_h), dpi=110)
    FigureCanvasAgg(fig)
    axes, cursor = [], fig_h - suptitle
    for height in heights:
        cursor -= panel_title + height
        axes.append(fig.add_axes([left / fig_w, cursor / fig_h, width / fig_w, height / fig_h]))
        cursor -= axis
    bar = fig.add_axes([left / fig_w, bottom / fig_h, width / fig_w, BREAKDOWN_IN / fig_h])  # as wide as the charts
    return fig, axes, bar


def _cost_label(timeline: Timeline, unit: str, factor: float) -> str:
    """The costs in the picture's time unit (``unit``, ``seconds * factor``), or where they were measured."""
    cost, host = timeline.meta.get("cost"), timeline.meta.get("host")
    if cost:
        drawn = {e.instr.op for e in timeline.events}
        return f"costs [{unit}]: {style.cost_in_unit(style.costs_drawn(cost, drawn), unit, factor)}"
    return f"costs as measured on {host}" if host else "costs as measured"


def _share_xlim(axes) -> None:
    lo = min(ax.get_xlim()[0] for ax in axes)
    hi = max(ax.get_xlim()[1] for ax in axes)
    for ax in axes:
        ax.set_xlim(lo, hi)


def _fitted_latency(timeline: Timeline) -> float:
    return min(MessageFlights(timeline).durations(), default=0.0)

