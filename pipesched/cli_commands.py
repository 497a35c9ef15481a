"""``pipesched list``, ``show`` and ``simulate``: the commands that print the schedules, a schedule's program (the
grid, the text or the JSON form, or a torch CSV file) and its simulation; their parsers (:func:`add_schedule_commands`,
which :func:`pipesched.cli.make_parser` calls) and what each runs. The schedule options they share and the program
those name are :mod:`pipesched.cli`'s (:func:`~pipesched.cli.schedule_parent`, :func:`~pipesched.cli.program_from_args`,
:func:`~pipesched.cli.simulate_from_args`). Torch-free.
"""
from __future__ import annotations

import json

from . import interop_cli, program_io, progress
from .api import build
from .cli import (add_schedule_module_arg, auto_args, note_one_rank_ties, program_from_args, schedule_parent,
                  simulate_from_args)
from .cli_costs import given_costs
from .errors import render_grid
from .lower import add_recompute, add_tie_reduce, forward_only, split_backward
from .registry import REGISTRY


def add_schedule_commands(sub) -> None:
    """The parsers of ``list``, ``show`` and ``simulate``, in that order, on ``sub`` (the subparsers of
    :func:`~pipesched.cli.make_parser`)."""
    p = sub.add_parser("list", help="the schedules: built-in, registered (--schedule-module) and of entry points")
    p.add_argument("--json", action="store_true")
    add_schedule_module_arg(p)
    p.set_defaults(func=_cmd_list)
    p = sub.add_parser("show", help="the per-rank instruction streams of a schedule", parents=[schedule_parent()])
    p.add_argument("--format", choices=("grid", "text"), default=None, help="grid (default) or the text form")
    p.add_argument("--compute-only", action="store_true", help="before lowering: no SEND/RECV")
    p.add_argument("--json", action="store_true", help="print the JSON form")
    interop_cli.add_show_args(p)
    p.set_defaults(func=_cmd_show)
    p = sub.add_parser("simulate", help="makespan, bubble fraction and peak in-flight activations",
                       parents=[schedule_parent()])
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_simulate)


def _cmd_list(args) -> int:
    schedules = REGISTRY.all()  # the built-ins, then those registered and those of entry points
    if args.json:
        print(json.dumps([{"name": i.name, "summary": i.summary, "paper": i.paper, "bubble": i.bubble,
                           "peak_inflight": i.inflight, "microbatches": i.microbatches}
                          for i in schedules.values()], indent=2))
        return 0
    width = max(len(name) for name in schedules)
    for info in schedules.values():
        print(f"{info.name.ljust(width)}  {info.summary}  [{info.paper}]")
    return 0


def _cmd_show(args) -> int:
    other = [flag for flag, on in (("--json", args.json), ("--torch-csv", args.torch_csv is not None)) if on]
    if args.format is not None and other:  # --format would be ignored (--json with --torch-csv: JSON on stdout)
        raise ValueError(f"show prints the program in one form; --format and {other[0]} were given: keep one")
    given = given_costs(args)
    if given and not getattr(REGISTRY.get(args.schedule), "takes_costs", False):
        raise ValueError(f"{given[0]} sets a cost that a schedule built from costs (zb-auto) is built for; "
                         f"{args.schedule} is built without costs, so show would ignore it: drop {given[0]} "
                         f"(pipesched simulate takes it)")
    if args.compute_only:
        if args.dp != 1:
            raise ValueError(f"--dp {args.dp} adds ALL_REDUCE when the program is lowered; "
                             "drop --compute-only to see it")
        program = build(args.schedule, args.ranks, args.microbatches, args.virtual_stages, **auto_args(args))
        if args.split_backward:
            program = split_backward(program)
        if args.recompute:
            program = add_recompute(program)
        if args.ties:
            program = add_tie_reduce(program, args.ties)
            note_one_rank_ties(args.ties, program)
        if args.forward_only:
            program = forward_only(program)
    else:
        program = program_from_args(args)
    if args.torch_csv:
        return interop_cli.write_show(args, program)
    if args.json:
        print(program_io.to_json(program, indent=None))
    elif args.format == "text":
        print(program_io.to_text(program), end="")
    else:
        print(f"# {program.schedule}: p={program.num_ranks} m={program.num_microbatches} "
              f"stages={program.num_stages} dp={program.dp_size} instructions={len(program)}")
        print(render_grid(program.ranks))
    return 0


def _cmd_simulate(args) -> int:
    program, timeline = simulate_from_args(args)
    progress.note("summarizing the timeline")
    summary = timeline.summary()
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"{program.schedule}: p={program.num_ranks} m={program.num_microbatches} "
          f"v={summary['meta']['virtual_stages']} dp={program.dp_size}  costs: {summary['meta']['cost']}")
    print(f"makespan         {timeline.makespan:.6g} s")
    print(f"bubble fraction  {timeline.bubble_fraction:.4f}")
    for rank, (bubble, peak) in enumerate(zip(timeline.bubble_per_rank(), timeline.peak_inflight)):
        extra = ""
        if timeline.peak_activation_bytes is not None:
            extra = f"  peak activations {timeline.peak_activation_bytes[rank]:.4g} B"
        print(f"  rank {rank}: bubble {bubble:.4f}  peak in-flight {peak}{extra}")
    return 0
