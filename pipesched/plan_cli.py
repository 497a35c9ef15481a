"""``pipesched plan``: the planner on the command line (:func:`pipesched.planner.plan`).

``pipesched plan --profile FILE --world-size N --memory 16GiB --batch B [--top K] [--json] [--render FILE.png]
[--schedules NAME ...]`` prints the ranked candidates (or their JSON form), draws the winner's simulated timeline,
and exits 1 when no configuration fits the memory, naming the smallest memory that would (with ``--json`` also as
``{"error": ..., "smallest_memory": bytes, "plan": {...}}`` on stdout).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys

from . import progress

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: str) -> float:
    """``"16GiB"`` -> 17179869184, ``"512MiB"``, ``"1e9"`` (bytes), ``"2GB"`` (10^9); case-insensitive units B, KB,
    MB, GB, TB (powers of 10) and KiB, MiB, GiB, TiB (powers of 2).

    Raises:
        ValueError: not a size > 0 (names the text and the valid forms).
    """
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS or float(match.group(1)) * _UNITS[unit] <= 0:
        raise ValueError(f"--memory {text!r}: give bytes per rank > 0 as a number with an optional unit, e.g. 16GiB, "
                         f"512MiB, 2GB or 1e9")
    return float(match.group(1)) * _UNITS[unit]


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``plan`` on an argparse subparsers object (runs :func:`run_plan`)."""
    parser = subparsers.add_parser(
        "plan", help="pick schedule, pp x dp, microbatches, virtual stages, balance and recompute from a profile",
        description="Search pipeline configurations for a profiled model (pipesched.runtime.profile_layers, "
                    "LayerProfile.save) under a memory budget per rank; print them ranked by predicted step time.")
    parser.add_argument("--profile", required=True, metavar="FILE", help="a LayerProfile saved as JSON")
    parser.add_argument("--world-size", type=int, required=True, metavar="N", help="ranks in all (pp x dp)")
    parser.add_argument("--memory", required=True, metavar="SIZE",
                        help="bytes each rank may hold: 16GiB, 512MiB, 2GB, 1e9 (parameters, gradients, optimizer "
                             "state and activations)")
    parser.add_argument("--batch", type=int, required=True, metavar="B", help="global batch (samples per step)")
    parser.add_argument("--top", type=int, default=5, metavar="K", help="candidates to show (default 5)")
    parser.add_argument("--schedules", nargs="+", default=None, metavar="NAME",
                        help="schedules to search (default: the built-ins but zb-auto)")
    parser.add_argument("--optimizer-states", type=float, default=2.0, metavar="X",
                        help="optimizer state bytes per parameter byte (default 2: AdamW)")
    parser.add_argument("--max-microbatches", type=int, default=None, metavar="M",
                        help="largest m tried (default max(8, 4 x pp), at most 256)")
    parser.add_argument("--json", action="store_true",
                        help="print {\"candidates\": [...]} instead of the table (nothing fits: {\"error\", "
                             "\"smallest_memory\": bytes, \"plan\": the candidate that needs them}, exit 1)")
    parser.add_argument("--render", metavar="FILE.png", default=None, help="draw the winner's simulated timeline")
    parser.set_defaults(func=run_plan)
    return parser


def run_plan(args: argparse.Namespace) -> int:
    """Run ``plan``: 0 planned, 1 nothing fits the memory (the message names the smallest that does); a bad option
    raises ValueError (the command line prints it and exits 2)."""
    from .planner import PlanError, plan
    from .profile import LayerProfile

    memory = parse_bytes(args.memory)
    try:
        profile = LayerProfile.load(args.profile)
    except OSError as exc:
        raise ValueError(f"--profile {args.profile}: cannot read it ({exc.strerror or exc})") from None
    except ValueError as exc:  # not JSON or not text, or not a profile (the message names the file)
        raise ValueError(f"--profile: {exc}") from None
    try:
        result = plan(profile, args.world_size, memory, args.batch, schedules=args.schedules, top=args.top,
                      optimizer_states=args.optimizer_states, max_microbatches=args.max_microbatches)
    except PlanError as exc:
        progress.clear()  # the status line of the search (a terminal only), before the error
        from .cli import decided

        decided(args, 1)  # kept if the reader of the output goes away (BrokenPipeError)
        message = _as_option(str(exc))
        print(f"error: {message}", file=sys.stderr)
        if args.json:  # still one JSON object on stdout for a script: the error and what would fit
            print(json.dumps({"error": message, "smallest_memory": int(math.ceil(exc.smallest)),
                              "plan": exc.candidate.to_json()}))
        return 1
    except ValueError as exc:
        raise ValueError(_as_option(str(exc))) from None
    progress.clear()  # the status line of the search (a terminal only), before the report
    if args.render:
        _render(result.best, args.render)
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        print(format_table(result))
    return 0


def format_table(result) -> str:
    """The ranked candidates as a text table, then the winner's reason."""
    from .planner import format_bytes

    header = ("#", "schedule", "pp", "dp", "m", "v", "split", "recompute", "step (s)", "bubble", "peak memory",
              "balance")
    rows = [header]
    for i, c in enumerate(result, 1):
        balance = ",".join(map(str, c.balance))
        rows.append((str(i), c.schedule, str(c.pp), str(c.dp), str(c.num_microbatches), str(c.virtual_stages),
                     "yes" if c.split_backward else "no", f"{sum(c.recompute)}/{len(c.recompute)}",
                     f"{c.step_time:.4g}", f"{c.bubble_fraction:.1%}", format_bytes(max(c.peak_memory)),
                     balance if len(balance) <= 40 else balance[:37] + "..."))
    widths = [max(len(row[k]) for row in rows) for k in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines + [f"winner: {result.reason}"])


def _render(candidate, path: str) -> None:
    from pathlib import Path

    from .viz.gantt import plot_timeline

    out = Path(path)
    if out.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise ValueError(f"--render {path}: use a .png, .svg or .pdf file")
    figure = plot_timeline(candidate.timeline, title=f"plan winner: {candidate.describe()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(out, dpi=110, bbox_inches="tight")
    except OSError as exc:
        raise ValueError(f"--render {path}: cannot write it ({exc.strerror or exc})") from None
    print(f"wrote {out}: the winner's simulated timeline", file=sys.stderr)


def _as_option(message: str) -> str:
    """The planner's argument names as this command's options."""
    for name, option in (("world_size", "--world-size"), ("global_batch", "--batch"), ("memory_per_rank", "--memory"),
                         ("max_microbatches", "--max-microbatches"), ("optimizer_states", "--optimizer-states"),
                         ("schedules", "--schedules")):
        message = re.sub(rf"\b{name}\b", option, message)
    return re.sub(r"^top\b", "--top", message)  # only as the subject: "top" is also an English word
