"""``pipesched validate FILE``: prove a program file (the text or JSON form, or a torch CSV file with ``--torch-csv``)
runnable and, with ``--backend``, what a Pipeline on that backend proves before running it. Prints ``valid: ...``
(exit 0) or ``invalid: FILE: ...`` with the error (exit 1), or with ``--json`` one JSON object either way; an
unreadable file exits 2. Its parser (:func:`add_validate_parser`, which :func:`pipesched.cli.make_parser` calls)
and what it runs. Torch-free.
"""
from __future__ import annotations

import json
import sys

from . import interop_cli
from .api import BACKENDS
from .cli import add_schedule_module_arg, decided
from .engine import has_comm
from .errors import DeadlockError, ProgramFormatError, ScheduleError
from .grad_order import order_note, out_of_order
from .sim import simulate


def add_validate_parser(sub) -> None:
    """The parser of ``validate``, on ``sub`` (the subparsers of :func:`~pipesched.cli.make_parser`)."""
    p = sub.add_parser("validate", help="prove a program file (text or JSON form) runnable")
    interop_cli.add_validate_args(p)
    p.add_argument("--backend", choices=tuple(BACKENDS), default=None,
                   help="also prove what a Pipeline on this torch.distributed backend proves before running it "
                        "(gloo: the step that learns the message shapes; nccl: also one message order per pair of "
                        "ranks), refusing with its error (exit 1)")
    p.add_argument("--json", action="store_true")
    add_schedule_module_arg(p)  # also after the command, as for the others (before FILE or after it)
    p.set_defaults(func=_cmd_validate)


def _cmd_validate(args) -> int:
    try:
        program = _load_and_validate(args)
    except DeadlockError as exc:
        return _report_invalid(args, exc, "deadlock")
    except ScheduleError as exc:
        return _report_invalid(args, exc, type(exc).__name__)
    except OSError as exc:
        decided(args, 2)
        print(f"error: cannot read {args.file}: {exc.strerror}", file=sys.stderr)
        if args.json:
            print(json.dumps({"error": f"cannot read {args.file}: {exc.strerror}", "exit_status": 2}))
        return 2
    if args.backend is not None:  # what Pipeline proves on that backend before any communication, by its functions
        refused = _refused_on_backend(args, program)
        if refused is not None:
            return refused
    return _report_valid(args, program)


def _load_and_validate(args):
    """The program of ``args.file``, validated. Raises what loading (``OSError``, ``ScheduleError``: a binary file
    too) and :func:`~pipesched.validate.validate` raise."""
    try:
        program = interop_cli.load_for_validate(args)
    except UnicodeDecodeError as exc:  # a binary file given as the text or JSON form
        from .strict_json import not_text

        raise ProgramFormatError(f"{args.file}: {not_text(exc)}; validate reads pipesched's text or JSON form "
                                 f"(or a torch CSV with --torch-csv)") from None
    from .validate import validate

    validate(program)
    return program


def _refused_on_backend(args, program) -> int | None:
    """Exit 1 (reported) if a Pipeline on ``args.backend`` refuses the valid ``program``, else ``None``."""
    from .user_programs import backend_programs

    try:
        backend_programs(program, args.backend)
    except (ScheduleError, ValueError) as exc:
        hung = isinstance(exc, DeadlockError) or isinstance(exc.__cause__, DeadlockError)
        return _report_invalid(args, exc, "deadlock" if hung else type(exc).__name__, args.backend)
    return None


def _report_valid(args, program) -> int:
    """Print the valid program's summary (text or ``--json``) and return 0."""
    timeline = simulate(program, check=False)
    if args.json:
        print(json.dumps({"valid": True, "compute_only": not has_comm(program),
                          "ranks": program.num_ranks, "stages": program.num_stages,
                          "num_microbatches": program.num_microbatches, "dp_size": program.dp_size,
                          "instructions": len(program),
                          "bubble_fraction": timeline.bubble_fraction,
                          "peak_inflight": list(timeline.peak_inflight),
                          "weight_gradients_out_of_order": {str(s): mbs for s, mbs in out_of_order(program).items()},
                          **({"backend": args.backend} if args.backend else {})}))
    else:
        kind = ("complete, ordered, send/recv-paired and deadlock-free"
                if has_comm(program) or len(set(program.stage_to_rank)) == 1 else
                "complete, ordered and deadlock-free as a compute-only program (no SEND/RECV: transfers between "
                "ranks are implicit; lower it with pipesched.add_send_recv before running it)")
        if args.backend:
            kind += f"; a Pipeline on {args.backend} runs it (its step protocol proven, the learning step included)"
        print(f"valid: {args.file}: {_count(program.num_ranks, 'rank')}, {_count(program.num_stages, 'stage')}, "
              f"{_count(program.num_microbatches, 'microbatch')}, "
              + (f"{program.dp_size} data-parallel replicas, " if program.dp_size > 1 else "")
              + f"{_count(len(program), 'instruction')}; {kind}. "
              f"Bubble fraction {timeline.bubble_fraction:.4f} at F=1 B=2, peak in-flight {list(timeline.peak_inflight)}")
        note = order_note(program)
        if note:
            print(note)
    return 0


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "es" if noun.endswith("h") else "s")


def _report_invalid(args, exc: ScheduleError | ValueError, cause: str, backend: str | None = None) -> int:
    """Exit 1 with the error; ``backend``: the program is valid, but a Pipeline on that backend refuses it (``exc``:
    its error, a ``ValueError`` when the program is not one a Pipeline runs)."""
    decided(args, 1)
    spot = exc.__cause__ if backend and getattr(exc, "rank", None) is None else exc  # a learning step's: its deadlock's
    rank, instr = getattr(spot, "rank", None), getattr(spot, "instr", None)
    if args.json:
        print(json.dumps({"valid": False, "cause": cause, "error": type(exc).__name__,
                          "rank": rank, "instruction": None if instr is None else str(instr),
                          "reason": getattr(exc, "reason", str(exc)), **({"backend": backend} if backend else {})}))
    else:
        on = f" on backend {backend}" if backend else ""
        print(f"invalid{on}: {args.file}: {type(exc).__name__}: {exc}", file=sys.stderr)
    return 1
