"""The ``pipesched`` command line: list, show, simulate, validate, plan, render, demo.

This module holds the parser (:func:`make_parser`), :func:`main` (exit statuses, ``--json`` errors, a closed pipe,
progress on a terminal, ``--schedule-module``) and the schedule options that show, simulate and render share
(:func:`schedule_parent`: parsed to a program by :func:`program_from_args`, simulated by :func:`simulate_from_args`).
The commands are in :mod:`pipesched.cli_commands` (list, show, simulate), :mod:`pipesched.cli_validate`,
:mod:`pipesched.plan_cli`, :mod:`pipesched.viz.cli` (render) and :mod:`pipesched.demo`.
"""
from __future__ import annotations

import argparse
import json
import sys

from . import plan_cli, progress
from .api import compile_program
from .cli_costs import add_cost_args, cost_from_args, named_cost_error, show_value
from .cost import CostError
from .errors import ScheduleArgumentError, ScheduleError
from .ir import Op
from .registry import REGISTRY
from .schedules import SCHEDULES
from .sim import simulate
from .ties import one_rank_ties


def schedule_parent(optional_name: bool = False) -> argparse.ArgumentParser:
    """The argparse parent of every command that compiles a schedule by name (show, simulate, render: pass it as
    ``parents=[schedule_parent()]``): SCHEDULE, the sizes and passes (:func:`add_schedule_args`), ``--memory-limit``
    and the cost options (:func:`~pipesched.cli_costs.add_cost_args`), which ``zb-auto`` is built for in every one of them (and which
    simulate and render also simulate with). ``optional_name``: SCHEDULE may be left out (render --trace)."""
    parent = argparse.ArgumentParser(add_help=False)
    add_schedule_args(parent, optional_name)
    add_cost_args(parent)
    return parent


def add_schedule_args(parser: argparse.ArgumentParser, optional_name: bool = False) -> None:
    """SCHEDULE and the size options of :func:`schedule_parent` (without the cost options)."""
    parser.add_argument("schedule", nargs="?" if optional_name else None, metavar="SCHEDULE",
                        help=f"schedule name: {', '.join(SCHEDULES)}")
    parser.add_argument("--ranks", "-p", type=int, default=4, help="pipeline ranks p (default 4)")
    parser.add_argument("--microbatches", "-m", type=int, default=8, help="microbatches per step m (default 8)")
    parser.add_argument("--virtual-stages", "-v", type=int, default=None,
                        help="stages per rank v (default: the schedule's: 2 for interleaved-1f1b, zbv and dualpipev, "
                             "else 1)")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas (adds ALL_REDUCE; default 1)")
    parser.add_argument("--recompute", action="store_true", help="recompute every stage's forward before its backward")
    parser.add_argument("--split-backward", action="store_true",
                        help="run the backward of each stage that sends a gradient as I, SEND_B, W "
                             "(the input gradient leaves before the weight gradient is computed)")
    parser.add_argument("--forward-only", action="store_true",
                        help="the forward-only program (what Pipeline.forward() runs): F, SEND_F, RECV_F only")
    parser.add_argument("--ties", nargs="+", action="extend", type=_tie_group, default=[], metavar="S,S",
                        help="groups of stages that share a parameter, e.g. --ties 0,7 (an embedding tied to the "
                             "head): adds a TIE_REDUCE per rank holding one; repeat it or list several")
    parser.add_argument("--memory-limit", type=_limit, default=None, metavar="N[,N...]",
                        help="zb-auto only: peak in-flight microbatches per rank, one number or one per rank "
                             "(default min(p, m), zb-h1's); zb-auto is built for it and the cost options")
    add_schedule_module_arg(parser)


def add_schedule_module_arg(parser: argparse.ArgumentParser, dest: str = "schedule_modules") -> None:
    """``--schedule-module MODULE`` (repeatable): import a module that registers schedules before the command."""
    parser.add_argument("--schedule-module", action="append", default=[], dest=dest, metavar="MODULE",
                        help="import MODULE (a dotted name, or a .py file) that registers schedules with "
                             "pipesched.register_schedule, before the command runs (repeatable)")


def _tie_group(text: str) -> tuple[int, ...]:
    """A tie: stages joined by commas (``0,7``)."""
    try:
        return tuple(int(s) for s in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected stages joined by commas (e.g. 0,7), got {text!r}") from None


def _limit(text: str):
    """``--memory-limit``: an integer, or a comma list of integers (one per rank)."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 or a comma list of them, one per rank (e.g. 4 "
                                         f"or 4,3,2,1), got {text!r}") from None
    return values[0] if len(values) == 1 else values


_SIZE_FLAGS = {"num_ranks": ("--ranks", "ranks"), "num_microbatches": ("--microbatches", "microbatches"),
               "virtual_stages": ("--virtual-stages", "virtual_stages"), "dp_size": ("--dp", "dp"),
               "ties": ("--ties", "ties"), "memory_limit": ("--memory-limit", "memory_limit")}


def program_from_args(args: argparse.Namespace):
    """Compile the program the schedule options name.

    Raises:
        ScheduleArgumentError: a size the schedule cannot run, prefixed with the option that set it.
    """
    try:
        program = compile_program(args.schedule, args.ranks, args.microbatches, args.virtual_stages,
                                  dp_size=args.dp, recompute=bool(args.recompute),
                                  split_backward=bool(args.split_backward), forward_only=bool(args.forward_only),
                                  ties=tuple(args.ties), **auto_args(args))
        note_one_rank_ties(args.ties, program)
        return program
    except ScheduleArgumentError as exc:
        if exc.argument not in _SIZE_FLAGS:
            raise
        flag, attr = _SIZE_FLAGS[exc.argument]
        value = getattr(args, attr)
        shown = ",".join(map(str, value)) if isinstance(value, list) and attr == "memory_limit" else value
        shown = " ".join(",".join(map(str, t)) for t in value) if attr == "ties" else shown
        raise ScheduleArgumentError(f"{flag} {shown}: {exc}", argument=exc.argument) from None
    except CostError as exc:  # zb-auto is built from the costs: a per-stage cost of the wrong length
        raise named_cost_error(exc) from None


def note_one_rank_ties(ties, program) -> None:
    """Say on stderr which ``--ties`` were left out because their stages are all on one rank (no TIE_REDUCE)."""
    for tie in one_rank_ties(ties, program.stage_to_rank):
        print(f"note: --ties {','.join(map(str, tie))}: stages {' and '.join(map(str, tie))} are all on rank "
              f"{program.stage_to_rank[tie[0]]}, where autograd sums the uses of the shared parameter: no TIE_REDUCE "
              f"needed", file=sys.stderr)


def auto_args(args: argparse.Namespace) -> dict:
    """``costs`` (the cost options, where the command has them) and ``memory_limit`` for a schedule built from costs
    (``zb-auto``); only ``memory_limit`` otherwise (refused by :func:`compile_program` when given)."""
    limit = {"memory_limit": args.memory_limit} if getattr(args, "memory_limit", None) is not None else {}
    if hasattr(args, "forward") and getattr(REGISTRY.get(args.schedule), "takes_costs", False):
        return {"costs": cost_from_args(args), **limit}
    return limit


def simulate_from_args(args: argparse.Namespace):
    """``(program, timeline)``: the program the schedule options name, simulated with the cost options.

    Raises:
        ValueError: a bad option; or ``--input-grad``/``--weight-grad`` for a program without I and W, or
            ``--recompute-cost``, ``--input-bytes`` or ``--recompute-bytes`` without ``--recompute``, or
            ``--tie-bytes`` without ``--ties``, or ``--recompute``/``--grad-bytes`` with ``--forward-only`` (they
            would be ignored).
    """
    program = program_from_args(args)
    for flag, value, what in (("--recompute-cost", args.recompute_cost, "the cost of R"),
                              ("--input-bytes", args.input_bytes, "what a recomputing stage keeps per microbatch"),
                              ("--recompute-bytes", args.recompute_bytes, "what a stage holds after its R")):
        if value is not None and not args.recompute:
            raise ValueError(f"{flag} {show_value(value)} sets {what}, but this program recomputes nothing; add "
                             f"--recompute, or drop {flag}")
    split = any(i.op in (Op.I, Op.W) for stream in program.ranks for i in stream)
    for flag, value in (("--input-grad", args.input_grad), ("--weight-grad", args.weight_grad)):
        if value is not None and not split:
            hint = ("with --split-backward only stages whose input gradient goes to another rank are split, and "
                    "this program has none" if args.split_backward else "add --split-backward, or drop " + flag)
            raise ValueError(f"{flag} {value} sets the cost of I/W, but this program runs fused B backwards "
                             f"(no I or W); {hint}")
    if args.forward_only:  # no backward, so no recompute and no gradients to reduce: those options would be ignored
        given = [flag for flag, value in (("--recompute", args.recompute), ("--grad-bytes", args.grad_bytes))
                 if value]
        if given:
            raise ValueError(f"{' and '.join(given)} with --forward-only: a forward-only program has no backward, "
                             f"so no recompute and no gradient all-reduce; drop {' and '.join(given)}")
    if args.tie_bytes and not program.ties:
        hint = ("its --ties are each on one rank (no TIE_REDUCE):" if args.ties else
                f"add --ties (e.g. --ties 0,{program.num_stages - 1}), or")
        raise ValueError(f"--tie-bytes {show_value(args.tie_bytes)} sets the size of the tied gradients, but this program "
                         f"has no ties to reduce; {hint} drop --tie-bytes")
    cost = cost_from_args(args)
    try:
        return program, simulate(program, cost, check=False)
    except CostError as exc:  # a per-stage cost of the wrong length, found against the program
        raise named_cost_error(exc) from None


def _version() -> str:
    """The installed distribution's version (``importlib.metadata``), else the source tree's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pipesched")
    except PackageNotFoundError:
        from . import __version__

        return f"{__version__} (not installed)"


class JsonErrorParser(argparse.ArgumentParser):
    """The parser of a command line holding ``--json``: a usage error (an unknown option, a bad int, a missing
    argument; exit 2) is printed as argparse prints it, on stderr, and also on stdout as ``{"error": MESSAGE,
    "exit_status": 2}``, as the commands' other errors are. Its subcommands' parsers are of this class too."""

    def error(self, message):
        self.print_usage(sys.stderr)
        print(json.dumps({"error": message, "exit_status": 2}))
        self.exit(2, f"{self.prog}: error: {message}\n")


def asks_json(argv) -> bool:
    """Whether the command line ``argv`` (without the program) holds ``--json`` (or an abbreviation argparse takes
    for it, ``--js``), before any ``--``."""
    for word in argv:
        if word == "--":
            return False
        name = word.split("=", 1)[0] if isinstance(word, str) else ""
        if len(name) >= 3 and "--json".startswith(name):
            return True
    return False


def make_parser(json_errors: bool = False) -> argparse.ArgumentParser:
    """The ``pipesched`` parser; ``json_errors``: a :class:`JsonErrorParser` (``main`` asks for one when ``--json`` is
    on the command line)."""
    parser = (JsonErrorParser if json_errors else argparse.ArgumentParser)(
        prog="pipesched", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"pipesched {_version()}")
    add_schedule_module_arg(parser, dest="global_schedule_modules")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from .cli_commands import add_schedule_commands  # here: those modules import this one's options
    from .cli_validate import add_validate_parser

    add_schedule_commands(sub)  # list, show, simulate
    add_validate_parser(sub)
    add_schedule_module_arg(plan_cli.add_plan_parser(sub))  # pipesched plan: pipesched/plan_cli.py (--schedules NAME)
    _add_optional_commands(sub)
    return parser


def command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The subparser of ``command`` (``pipesched show``'s for ``show``), else ``parser`` itself."""
    for action in parser._actions:  # argparse keeps its subparsers here (no public accessor)
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(command, parser)
    return parser


def _add_optional_commands(sub) -> None:
    """Subcommands whose modules import matplotlib or torch, which load only when those commands run."""
    try:
        from .viz.cli import add_render_parser
    except ImportError:
        add_render_parser = None
    if add_render_parser is not None:
        add_render_parser(sub)
    try:
        from .demo import add_demo_parser
    except ImportError:
        add_demo_parser = None
    if add_demo_parser is not None:
        add_demo_parser(sub)


#: the commands that show progress on a terminal (:mod:`pipesched.progress`) while they build, simulate, draw
_PROGRESS_COMMANDS = ("show", "simulate", "render", "plan")
#: instructions (p * m * v; zb-auto: 20 times that, for its candidates) from which work is known to take seconds
LONG_WORK = 500_000


def long_work(args) -> bool:
    """Whether the program the options name is big enough to take seconds: progress is then shown from the start
    (else after :data:`pipesched.progress.AFTER_SECONDS`)."""
    size = (getattr(args, "ranks", 0) or 0) * (getattr(args, "microbatches", 0) or 0) * (
        getattr(args, "virtual_stages", None) or 1)
    return size * (20 if getattr(args, "schedule", None) == "zb-auto" else 1) >= LONG_WORK


def decided(args, status: int) -> int:
    """Record ``status`` on ``args`` as the exit status of the running command before it prints its report, and
    return it: if the reader of the output goes away meanwhile (``pipesched validate BAD | head -1``:
    ``BrokenPipeError``), :func:`main` still exits with it, not 0."""
    args.decided_status = status
    return status


def main(argv=None) -> int:
    parser = make_parser(json_errors=asks_json(sys.argv[1:] if argv is None else argv))
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "passes_options", False):  # the command's own usage, not the top level's
        command_parser(parser, args.command).error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    args.decided_status = 0
    try:
        try:
            _import_schedule_modules(getattr(args, "global_schedule_modules", []) +
                                     getattr(args, "schedule_modules", []))
            if args.command not in _PROGRESS_COMMANDS:
                return args.func(args)
            with progress.on_terminal(show_now=long_work(args)):  # stderr only, and only if it is a TTY
                return args.func(args)
        except (ScheduleError, ValueError) as exc:
            decided(args, 2)
            print(f"error: {exc}", file=sys.stderr)
            if getattr(args, "json", False):  # --json: a script reading stdout gets one JSON object either way
                print(json.dumps({"error": str(exc), "exit_status": 2}))
            return 2
    except BrokenPipeError:  # e.g. `pipesched show ... | head`: the verdict already decided, else 0
        _quiet_broken_pipe()
        return args.decided_status
    except KeyboardInterrupt:  # Ctrl-C: launch already said "interrupted: stopping N ranks" and stopped them
        return 130


def _quiet_broken_pipe() -> None:
    """Point stdout and stderr at /dev/null, so that flushing them at exit raises no second BrokenPipeError."""
    import os

    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
        except (OSError, ValueError, AttributeError):  # not a real file (captured by a test, closed)
            pass


def _import_schedule_modules(modules) -> None:
    """Import each ``--schedule-module``.

    Raises:
        ValueError: one cannot be imported or fails while importing (names it and quotes the error).
    """
    for module in modules:
        try:
            REGISTRY.import_module(module)
        except Exception as exc:  # noqa: BLE001 - any error of the user's module, reported as a bad option
            cause = exc.__cause__ if isinstance(exc, ImportError) and exc.__cause__ else exc
            raise ValueError(f"--schedule-module {module}: cannot import it: {type(cause).__name__}: {cause}") from None


if __name__ == "__main__":
    sys.exit(main())
