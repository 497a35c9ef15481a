"""``pipesched render``: draw a schedule's timeline or a measured run, or export it as a Chrome trace.

Importing this module does not import matplotlib (``pipesched --help`` stays fast); drawing does.
Standalone: ``python -m pipesched.viz.cli render 1f1b -p 8 -m 32 -o 1f1b.png``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .. import progress

IMAGE_SUFFIXES = (".png", ".svg", ".pdf")
#: the range of ``--dpi``: below 20 the smallest text cannot be drawn (FreeType); 600 is print quality (a
#: 22-inch-wide chart is then 13200 pixels wide)
DPI_RANGE = (20, 600)


def _dpi(text: str) -> int:
    """``--dpi``: an integer in :data:`DPI_RANGE` (argparse names the option in its error)."""
    low, high = DPI_RANGE
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer from {low} to {high}, got {text!r}") from None
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"dots per inch must be from {low} to {high} (print quality is 300 to "
                                         f"600), got {value}")
    return value


def add_render_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``render`` on an argparse subparsers object; the parsed args run with :func:`run_render`.

    Usage: ``render SCHEDULE --ranks P --microbatches M [--virtual-stages V] [--dp D] [--recompute]
    [cost options] -o FILE.png|.svg|.pdf|.json`` or ``render --trace MEASURED.json [--compare] -o FILE``.
    """
    from ..cli import schedule_parent

    parser = subparsers.add_parser(
        "render", help="draw a timeline (.png/.svg/.pdf) or export a Chrome trace (.json)",
        description="Simulate SCHEDULE with the cost options and draw its timeline, or draw a measured run "
                    "the runtime saved (--trace). The output's suffix picks the format: .png/.svg/.pdf is a "
                    "Gantt chart, .json a Chrome/Perfetto trace.",
        parents=[schedule_parent(optional_name=True)])
    parser.add_argument("--trace", metavar="MEASURED.json", help="a timeline saved with Timeline.save (measured run)")
    parser.add_argument("--compare", action="store_true",
                        help="with --trace: draw the prediction (costs fitted from the run) beside the measurement")
    parser.add_argument("--as-recorded", action="store_true",
                        help="with --trace: keep compute events that start before their input landed as they are "
                             "(default: start them when it landed, as the timeline contract says)")
    parser.add_argument("--mode", choices=("side-by-side", "overlay"), default="side-by-side",
                        help="layout of --compare (default side-by-side)")
    parser.add_argument("--output", "-o", required=True, metavar="FILE",
                        help="FILE.png|.svg|.pdf|.json (missing folders are created)")
    parser.add_argument("--title", default=None, help="replace the first title line")
    parser.add_argument("--dpi", type=_dpi, default=110,
                        help=f"dots per inch of a .png, {DPI_RANGE[0]} to {DPI_RANGE[1]} (default 110)")
    parser.set_defaults(func=run_render)
    return parser


def run_render(args: argparse.Namespace) -> int:
    """Run ``render`` with parsed ``args``; returns the exit status (0 done, 2 bad input).

    Writes the file named by ``args.output`` and prints one line naming it and its bubble fraction.
    Errors (unknown schedule, bad sizes, unreadable trace, unknown suffix) are printed to stderr.
    """
    from ..errors import ScheduleError

    try:
        return _render(args)
    except (ScheduleError, ValueError, KeyError, OSError) as exc:
        from ..cli import decided

        decided(args, 2)  # kept if stderr's reader goes away (BrokenPipeError)
        message = f"{exc.strerror}: {exc.filename}" if isinstance(exc, OSError) and exc.strerror else exc
        print(f"error: render: {message}", file=sys.stderr)
        return 2


def _render(args: argparse.Namespace) -> int:
    out = Path(args.output)
    suffix = out.suffix.lower()
    if suffix not in IMAGE_SUFFIXES + (".json",):
        raise ValueError(f"cannot tell the format of {out}: use .png, .svg, .pdf or .json")
    if (args.trace is None) == (args.schedule is None):
        raise ValueError("give a SCHEDULE to simulate or --trace MEASURED.json, exactly one of them")
    if args.compare and (args.trace is None or suffix == ".json"):
        raise ValueError("--compare needs --trace and an image output (.png/.svg/.pdf)")
    _refuse_ignored(args)
    if args.trace is not None and _same_file(out, Path(args.trace)):
        raise ValueError(f"-o/--output {out} is the --trace file {args.trace}: writing it would replace the measured "
                         f"run; choose another output file")
    timeline = _load(args.trace, args.as_recorded) if args.trace else _simulate(args)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"-o {out}: cannot create its folder {out.parent}: {exc.strerror or exc}") from None
    if suffix == ".json":
        from .trace import save_chrome_trace

        _write(out, lambda: save_chrome_trace(timeline, out))
        print(f"wrote {out}: Chrome trace, {len(timeline.events)} events on {timeline.num_ranks} ranks")
        return 0
    from ..ir import COMPUTE_OPS
    from .gantt import PATCH_LIMIT

    boxes = sum(e.instr.op in COMPUTE_OPS for e in timeline.events)
    if boxes >= PATCH_LIMIT:  # drawn as collections, not a patch per box: a few seconds for 10^5 boxes
        progress.clear()  # a progress line on a terminal (pipesched.progress), not to be run into
        print(f"rendering {boxes} boxes on {timeline.num_ranks} ranks...", file=sys.stderr, flush=True)
    progress.note(f"drawing {boxes} boxes")
    if args.compare:
        from .compare import plot_comparison, predict_for

        predicted = predict_for(timeline)
        figure = plot_comparison(predicted, timeline, mode=args.mode, title=args.title)
        what = (f"measured vs simulated timeline, bubble fraction {timeline.bubble_fraction:.4f} measured, "
                f"{predicted.bubble_fraction:.4f} simulated")
    else:
        from .gantt import plot_timeline

        figure = plot_timeline(timeline, title=args.title)
        what = f"{timeline.source} timeline, bubble fraction {timeline.bubble_fraction:.4f}"
    try:
        _write(out, lambda: figure.savefig(out, dpi=args.dpi))
    except MemoryError:  # a huge chart (thousands of ranks) at a high --dpi
        width, height = (round(x * args.dpi) for x in figure.get_size_inches())
        raise ValueError(f"--dpi {args.dpi}: the {width}x{height}-pixel picture does not fit in memory; lower --dpi, "
                         f"or write .svg or .pdf") from None
    print(f"wrote {out}: {what}")
    return 0


def _refuse_ignored(args: argparse.Namespace) -> None:
    """Refuse the options render would ignore (given, not at their defaults, as ``pipesched show`` refuses a cost
    option): the schedule and cost options with ``--trace`` (the program and, with ``--compare``, the costs come
    from the file), ``--mode`` without ``--compare``, ``--as-recorded`` without ``--trace``.

    Raises:
        ValueError: naming every ignored option.
    """
    if args.trace is not None:
        given = _given_schedule_options(args)
        if given:
            fitted = " (and, with --compare, the costs fitted from it)" if args.compare else ""
            raise ValueError(f"--trace {args.trace} draws the saved run: its program{fitted} comes from the file, "
                             f"so render would ignore {', '.join(given)}; drop {'it' if len(given) == 1 else 'them'} "
                             f"(schedule and cost options are for render SCHEDULE)")
    if args.mode != "side-by-side" and not args.compare:
        raise ValueError(f"--mode {args.mode} lays out --compare, and it was not given: add --compare (with --trace), "
                         f"or drop --mode")
    if args.as_recorded and args.trace is None:
        raise ValueError("--as-recorded keeps the compute events of a --trace file as they were recorded; a simulated "
                         "SCHEDULE has none: drop --as-recorded")


def _given_schedule_options(args: argparse.Namespace) -> list[str]:
    """The schedule and cost options ``args`` holds at other than their defaults, as typed (``--ranks 7``)."""
    from ..cli import add_schedule_args
    from ..cli_costs import given_costs, given_options

    return given_options(args, lambda parser: add_schedule_args(parser, optional_name=True),
                         skip=("schedule", "schedule_modules")) + given_costs(args)


def _same_file(out: Path, trace: Path) -> bool:
    """Whether ``out`` names the file ``trace`` names (the same file when both exist, else the same resolved path)."""
    try:
        if out.exists() and trace.exists():
            return os.path.samefile(out, trace)
        return out.resolve() == trace.resolve()
    except OSError:
        return False


def _write(out: Path, write) -> None:
    """Run ``write()``; an OSError becomes a ValueError naming ``-o``."""
    try:
        write()
    except OSError as exc:
        raise ValueError(f"-o {out}: cannot write it: {exc.strerror or exc}") from None


def _simulate(args: argparse.Namespace):
    from ..cli import simulate_from_args

    return simulate_from_args(args)[1]


def load_saved(path, flag: str = "--trace"):
    """``Timeline.load(path)``; the errors of a file that cannot be read or is not a saved Timeline become a
    ValueError of one line (an unreadable file is named after ``flag``, the option that gave it, if any)."""
    from ..strict_json import DuplicateKeyError
    from ..timeline import Timeline

    try:
        return Timeline.load(path)
    except OSError as exc:
        raise ValueError(f"{f'{flag} ' if flag else ''}{path}: cannot read it: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{exc.msg} (at line {exc.lineno})") from None  # names the file and its writer
    except DuplicateKeyError as exc:
        raise ValueError(f"{path}: {exc}") from None
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a saved Timeline (missing or bad field {exc})") from None


def _load(path: str, as_recorded: bool):
    from .analysis import starts_after_receives

    timeline = load_saved(path, "--trace")
    if as_recorded:
        return timeline
    aligned = starts_after_receives(timeline)
    before = {(e.rank, e.instr): e.start for e in timeline.events}
    moved = sum(before[(e.rank, e.instr)] != e.start for e in aligned.events)
    if moved:
        print(f"note: {moved} compute events of {path} start before their input landed; drawn from when it "
              f"landed (--as-recorded keeps them)", file=sys.stderr)
    return aligned


def main(argv=None) -> int:
    """``python -m pipesched.viz.cli render ...``: the subcommand without the rest of the CLI."""
    parser = argparse.ArgumentParser(prog="pipesched.viz")
    add_render_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
