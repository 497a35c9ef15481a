"""Regenerate the ``viz/`` gallery: every built-in schedule's timeline, the bubble chart, sim vs measured.

Usage: ``python -m pipesched.viz.gallery [--out viz/] [--measured RUN.json] [--no-cpu-run]``. It measures a
fresh run on local CPU ranks (torch, gloo) into ``<out>/measured/``, and draws simulated vs measured for
every ``<out>/measured/*.json`` (or the ``--measured`` files): timelines saved with ``Timeline.save``.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from ..api import compile_program
from ..cost import CostModel
from ..schedules import SCHEDULES
from ..sim import simulate
from ..timeline import Timeline
from .analysis import starts_after_receives

REFERENCE = (4, 8)  # p, m of the catalogue's reference timelines
LARGE = ("1f1b", 8, 32)
DPI = 110


def build_gallery(out="viz", measured=(), cpu_run: bool = False) -> list[Path]:
    """Render the gallery into ``out`` and return the files written.

    Files: ``timeline-<schedule>-p4-m8[-v<v>].png`` for every registered schedule (its default v),
    ``timeline-1f1b-p8-m32.png``, ``timeline-1f1b-p4-m8-dp2-recompute-latency.png`` (every box kind:
    recompute, communication wait, all-reduce), ``bubble-vs-microbatches-p4.png`` and ``-p8.png``,
    ``trace-1f1b-p4-m8.json`` (Chrome trace), one ``sim-vs-measured-<name>.png`` per measured timeline
    file in ``measured``, and ``README.md`` listing them. ``cpu_run``: first measure a real run
    (:func:`record_cpu_run`: 1f1b, m=8, an MLP on 4 local CPU ranks over gloo, 2 with fewer than 4 cores)
    into ``<out>/measured/``, which is then drawn like the other files.

    Raises:
        OSError: ``out`` cannot be written or a measured file cannot be read.
        ValueError: a measured file is not a saved Timeline of a registered schedule.
        ImportError: ``cpu_run`` without torch.
    """
    from . import charts, gantt, trace  # noqa: F401 - they need matplotlib: without it, fail before making out

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    entries: list[tuple[str, str]] = []

    def save(figure, name: str, caption: str) -> None:
        path = out / name
        figure.savefig(path, dpi=DPI)
        written.append(path)
        entries.append((name, caption))

    _save_timelines(out, save, written)
    for ranks in (4, 8):
        save(charts.plot_bubble_vs_microbatches(ranks), f"bubble-vs-microbatches-p{ranks}.png",
             f"bubble fraction vs microbatches at p={ranks}: simulated points, closed-form curves")
    _save_measured(out, measured, cpu_run, written, entries)
    written.append(_write_readme(out, entries))
    return written


def _save_timelines(out: Path, save, written: list[Path]) -> None:
    """:func:`build_gallery`'s simulated timelines (every schedule at :data:`REFERENCE`, :data:`LARGE`, every box
    kind) through ``save``, and the Chrome trace of 1f1b (into ``written``)."""
    from .gantt import plot_timeline
    from .trace import save_chrome_trace

    p, m = REFERENCE
    for name, info in SCHEDULES.items():
        v = info.default_virtual_stages
        stem = f"timeline-{name}-p{p}-m{m}" + (f"-v{v}" if v > 1 else "")
        timeline = simulate(compile_program(name, p, m, v))
        save(plot_timeline(timeline), stem + ".png", f"{name}, p={p}, m={m}, v={v}: {info.summary}")
        if name == "1f1b":
            save_chrome_trace(timeline, out / f"trace-{name}-p{p}-m{m}.json")
            written.append(out / f"trace-{name}-p{p}-m{m}.json")
    name, p8, m32 = LARGE
    save(plot_timeline(simulate(compile_program(name, p8, m32))), f"timeline-{name}-p{p8}-m{m32}.png",
         f"{name} at p={p8}, m={m32}: the size the pictures must read well at")
    busy = CostModel(latency=0.15, grad_bytes=4e6, bandwidth=2e6)
    save(plot_timeline(simulate(compile_program("1f1b", p, m, dp_size=2, recompute=True), busy)),
         f"timeline-1f1b-p{p}-m{m}-dp2-recompute-latency.png",
         "1f1b with recompute, dp=2 and 0.15 s message latency: recompute, communication wait, all-reduce")


def _save_measured(out: Path, measured, cpu_run: bool, written: list[Path], entries: list[tuple[str, str]]) -> None:
    """:func:`build_gallery`'s simulated-vs-measured figures, one per file of ``measured`` (and, with ``cpu_run``,
    of a run measured now), into ``written`` and ``entries``."""
    measured = list(measured)
    if cpu_run:
        measured_file = record_cpu_run(out / "measured")
        if measured_file not in measured:
            measured.append(measured_file)
    for path in measured:
        figure_path = render_measured_comparison(path, out)
        written.append(figure_path)
        host = Timeline.load(path).meta.get("host")
        entries.append((figure_path.name, f"simulated (fitted costs) vs measured: {Path(path).name}"
                        + (f" ({host})" if host else "")))


def record_cpu_run(folder) -> Path:
    """Measure a 1f1b run, m=8, on 4 CPU ranks (2 on a machine with fewer than 4 cores) and save it in
    ``folder`` as ``cpu-1f1b-p<ranks>-m8.json``; return the file.

    Raises:
        ImportError: torch or the runtime is missing. TimeoutError, RuntimeError: the run failed.
    """
    import os

    from .cpu_run import measure_cpu_run

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count() or 1
    ranks = REFERENCE[0] if cores >= REFERENCE[0] else 2  # more processes than cores measures the OS scheduler
    timeline = measure_cpu_run("1f1b", ranks, REFERENCE[1])
    timeline.meta["host"] = f"{cores} CPU cores, gloo, one process per rank"
    path = folder / f"cpu-1f1b-p{ranks}-m{REFERENCE[1]}.json"
    timeline.save(path)
    return path


def render_measured_comparison(measured_path, out="viz", mode: str = "side-by-side") -> Path:
    """Draw the prediction beside a measured run saved with ``Timeline.save``; return the PNG's path.

    The prediction simulates the same program with costs fitted from the run
    (:func:`pipesched.viz.compare.fit_cost`), so the gap between the two bubbles is what the cost model
    misses (communication, jitter), not a different compute speed. Compute events that were timestamped
    before their input arrived are first moved to start when it landed
    (:func:`~pipesched.viz.analysis.starts_after_receives`). Writes ``<out>/sim-vs-measured-<file stem>.png``.

    Raises:
        OSError: the file cannot be read or the PNG written.
        ValueError: the file is not a saved Timeline of a registered schedule.
    """
    from .compare import plot_comparison, predict_for

    measured = starts_after_receives(Timeline.load(measured_path))
    path = Path(out) / f"sim-vs-measured-{Path(measured_path).stem}.png"
    plot_comparison(predict_for(measured), measured, mode=mode).savefig(path, dpi=DPI)
    return path


def _check_measured(measured, flag: str = "--measured") -> str | None:
    """Why one of the ``measured`` files cannot be drawn (it cannot be read, is not a saved Timeline, holds only
    some ranks, or does not name a registered schedule and its sizes), as one line naming it (after ``flag``, the
    option that gave it, if any); None when all can."""
    from ..errors import ScheduleError
    from .cli import load_saved
    from .compare import predict_for

    for path in measured:
        try:
            timeline = load_saved(path, flag)
        except ValueError as exc:
            return str(exc)
        try:
            predict_for(starts_after_receives(timeline))
        except (ScheduleError, ValueError, KeyError, TypeError) as exc:
            return f"{f'{flag} ' if flag else ''}{path}: {exc}"
    return None


def _write_readme(out: Path, entries: list[tuple[str, str]]) -> Path:
    lines = ["# Gallery", "",
             "Regenerate with `python -m pipesched.viz.gallery --out viz` (about 10 s). It simulates every built-in",
             "schedule at default costs (F=1 s, B=2 s per stage and microbatch unless a caption says otherwise),",
             "measures a fresh 1f1b run on local CPU ranks (torch, gloo; `--no-cpu-run` skips it) into",
             "`viz/measured/`, and draws simulated-vs-measured for every timeline there (`Timeline.save`; or pass",
             "`--measured FILE`). `trace-1f1b-p4-m8.json` opens in https://ui.perfetto.dev.", "",
             "Reading a timeline: one row per rank; blue = forward, vermillion = backward (orange I, green W,",
             "purple recompute); later virtual stages are lighter and hatched; the number is the microbatch; light",
             "grey = idle; grey cross-hatch = waiting for a message in flight (a short wait is a thin grey mark);",
             "dark-grey half-height bar = the rank inside its own send call (measured; or a send overhead);",
             "black bar = all-reduce. The right margin gives each rank's bubble and peak in-flight microbatches; the",
             "title the overall bubble, the makespan and the costs, all in the time axis's unit (s, ms or µs).",
             "In the bubble-vs-microbatches charts, hollow markers are simulated and lines the closed forms; the",
             "interleaved form holds for m a multiple of p, so it is drawn as filled dots at those m only.",
             "Each schedule's markers sit a few points beside the last one's: equal bubbles both show.",
             "The breakdown bars split the bubble into warmup, steady, cooldown, sending, communication and",
             "imbalance (defined in `pipesched.viz.bubble_breakdown`). Render your own: `pipesched render",
             "SCHEDULE -p P -m M [costs] -o FILE.png|.svg|.json` or `pipesched render --trace RUN.json [--compare]",
             "-o FILE.png`.", ""]
    for name, caption in entries:
        lines += [f"## {caption}", "", f"![{caption}]({name})", ""]
    path = out / "README.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def main(argv=None) -> int:
    """``python -m pipesched.viz.gallery``: write the gallery (see :func:`build_gallery`) and print each file; 0.
    A measured file that cannot be drawn is reported on stderr before anything is written; 2."""
    parser = argparse.ArgumentParser(prog="python -m pipesched.viz.gallery", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="viz", help="folder to write (default: viz)")
    parser.add_argument("--measured", action="append", default=None, metavar="RUN.json",
                        help="a measured timeline (Timeline.save); repeatable; default <out>/measured/*.json")
    parser.add_argument("--no-cpu-run", dest="cpu_run", action="store_false",
                        help="do not measure a fresh CPU run (default: measure one when torch is installed)")
    args = parser.parse_args(argv)
    measured = args.measured if args.measured is not None else sorted(Path(args.out, "measured").glob("*.json"))
    if args.cpu_run and importlib.util.find_spec("torch") is None:
        print("note: torch is not installed: no fresh CPU run", file=sys.stderr)
        args.cpu_run = False
    problem = _check_measured(measured, "--measured" if args.measured is not None else "")
    if problem:  # before anything is written, as pipesched render reports a bad --trace
        print(f"error: gallery: {problem}", file=sys.stderr)
        return 2
    if not measured and not args.cpu_run:
        print("note: no measured timeline (no --measured, nothing in <out>/measured/): "
              "skipping the simulated-vs-measured chart", file=sys.stderr)
    for path in build_gallery(args.out, measured, cpu_run=args.cpu_run):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
