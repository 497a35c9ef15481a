"""The demo's command line, checked before any rank starts: a bad option exits 2 naming it and what is valid,
and the model is sized so that every stage gets a layer. Loads no torch."""
from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from .. import ScheduleArgumentError, UnknownScheduleError, build, get_schedule
from ..plan_cli import parse_bytes
from .corpus import check_corpus

#: the longest ``--timeout``: ``pipesched.runtime.construction.MAX_TIMEOUT_S`` (not imported: this module loads no torch)
MAX_TIMEOUT_S = 1e9

DESCRIPTION = "Train a small GPT (byte level) across pipeline ranks with pipesched, then show where the bubble was."


def options(argv=None, prog: str | None = None) -> argparse.Namespace:
    """Parse and check the command line; a bad option exits 2 with a message naming it and what is valid."""
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    _add_schedule_options(parser)
    _add_model_options(parser)
    _add_run_options(parser)
    _add_plan_options(parser)
    args = parser.parse_args(argv)
    _check(parser, args)
    return args


def _add_schedule_options(parser: argparse.ArgumentParser) -> None:
    """:func:`options`'s options: the schedule and its sizes."""
    parser.add_argument("--schedule", default=None,
                        help="any schedule name (`pipesched list`: gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-h2, zbv, "
                             "dualpipev, zb-auto, registered ones; default 1f1b)")
    parser.add_argument("--ranks", type=int, default=4, help="pipeline ranks (pipesched demo only; torchrun: "
                        "world size / dp; default 4)")
    parser.add_argument("--microbatches", type=int, default=None, help="microbatches per step (default 4)")
    parser.add_argument("--virtual-stages", type=int, default=None,
                        help="stages per rank (default: the schedule's: 2 for interleaved-1f1b, zbv and dualpipev, "
                        "else 1)")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas (default 1)")
    parser.add_argument("--recompute", action="store_true", default=None, help="recompute activations in backward")
    parser.add_argument("--balance", default=None,
                        help="'params' (default: equal parameters per stage), 'layers', or layer counts like 2,2,2,1")


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    """:func:`options`'s options: the steps, the data and the model."""
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    parser.add_argument("--context", type=int, default=128, help="bytes per sequence (default 128)")
    parser.add_argument("--width", type=int, default=128, help="model width (default 128)")
    parser.add_argument("--depth", type=int, default=None,
                        help="transformer blocks (default: 4, or one per stage when ranks x virtual stages is more); "
                             "the model has depth + 3 layers (embedding, blocks, final norm, head), and every stage "
                             "needs at least one")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the initial weights, the batches drawn and the sample (default 0)")
    parser.add_argument("--data", default=None, help="text file or folder (default: the stdlib's source)")
    parser.add_argument("--corpus-bytes", type=byte_count, default=2_000_000,
                        help="bytes of text to use, e.g. 500000 or 5e5 (default 2e6)")


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    """:func:`options`'s options: the run: output, timeout, tying, clipping, autocast, checkpoints."""
    parser.add_argument("--out", default="out/demo",
                        help="folder for the timeline pictures and trace (default out/demo)")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds before a stuck rank gives up (default 120)")
    parser.add_argument("--untied", action="store_true", help="give the LM head its own weight (default: tied to "
                        "the token embedding, summed across the first and last rank)")
    parser.add_argument("--clip", type=float, default=1.0, help="clip gradients to this global norm over every "
                        "stage (default 1.0; 0: no clipping)")
    parser.add_argument("--autocast", choices=("auto", "bf16", "fp32"), default="auto",
                        help="bf16: forward under torch.autocast(bfloat16), activations cross ranks in bf16; "
                             "fp32: none; auto (default): bf16 where the CPU has native bf16 (avx512_bf16 or "
                             "amx_bf16), else fp32")
    parser.add_argument("--checkpoint-dir", default=None, help="save a checkpoint (model, AdamW, RNG, step) "
                        "under this folder every --checkpoint-every steps and at the end")
    parser.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints (default 50)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in "
                        "--checkpoint-dir, which must exist (start from scratch if it holds none)")


def _add_plan_options(parser: argparse.ArgumentParser) -> None:
    """:func:`options`'s options: --plan and its budget."""
    parser.add_argument("--plan", action="store_true", help="profile the model here, plan schedule, ranks x dp, "
                        "microbatches, virtual stages, balance and recompute for --ranks x --dp ranks and --memory "
                        "(pipesched.plan), print the table, train with the winner, and compare its prediction with "
                        "the run")
    parser.add_argument("--memory", default=None, help="with --plan: bytes per rank, e.g. 2GiB (default: the "
                        "memory available now / ranks)")
    parser.add_argument("--plan-top", type=int, default=5, help="with --plan: candidates to print (default 5)")


#: what ``--plan`` chooses: giving one of these with it is an error, not silently overridden
_PLANNED = ("schedule", "microbatches", "virtual_stages", "recompute", "balance")
#: the defaults of the options :data:`_PLANNED`: their parser default is ``None``, so that one given explicitly (even
#: at its default value, ``--plan --schedule 1f1b``) is told apart from one left out; ``virtual_stages`` stays ``None``
#: (the schedule's default, resolved in :func:`_fit_model_to_stages`)
_PLANNED_DEFAULTS = {"schedule": "1f1b", "microbatches": 4, "recompute": False, "balance": "params"}


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    given = [name for name in _PLANNED if getattr(args, name) is not None]  # on the command line, whatever the value
    for name, default in _PLANNED_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    for name in ("ranks", "microbatches", "virtual_stages", "dp", "steps", "batch", "context", "width", "depth",
                 "heads", "checkpoint_every", "plan_top"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.width % args.heads:
        parser.error(f"--width {args.width} must be a multiple of --heads {args.heads} (each head gets width/heads)")
    if args.batch < args.microbatches:
        parser.error(f"--batch {args.batch} must be >= --microbatches {args.microbatches} (every microbatch needs "
                     f"at least one sequence)")
    if args.data is not None and not Path(args.data).exists():
        parser.error(f"--data {args.data!r}: no such file or folder")
    if why := check_corpus(args.data, args.corpus_bytes):
        parser.error(why)
    if not 0 <= args.lr < math.inf:  # torch's AdamW would refuse it in every rank, after the ranks start
        parser.error(f"--lr must be a finite number >= 0, got {args.lr}")
    if not 0 < args.timeout <= MAX_TIMEOUT_S:  # Pipeline's check (runtime.construction), before any rank starts
        parser.error(f"--timeout must be a number of seconds > 0 and at most {MAX_TIMEOUT_S:g}, got {args.timeout}")
    if not args.clip >= 0:
        parser.error(f"--clip must be a global gradient norm >= 0 (0: no clipping), got {args.clip}")
    if args.resume and args.checkpoint_dir is None:
        parser.error("--resume needs --checkpoint-dir (the folder whose newest checkpoint to continue from)")
    if args.checkpoint_dir is not None and (why := checkpoint_dir_problem(args.checkpoint_dir, args.resume)):
        parser.error(why)
    if why := folder_problem("--out", args.out):
        parser.error(why)
    decided = [f"--{name.replace('_', '-')} {getattr(args, name)}" for name in given if args.plan]
    if decided:
        parser.error(f"{', '.join(decided)}: --plan decides the schedule, microbatches, virtual stages, balance and "
                     f"recompute; leave these out, or drop --plan")
    if args.memory is not None:
        if not args.plan:
            parser.error("--memory is the budget of --plan: add --plan")
        try:
            args.memory = parse_bytes(args.memory)
        except ValueError as exc:
            parser.error(str(exc))
    try:
        args.balance = _balance(args.balance)
    except ValueError:
        parser.error(f"--balance must be 'params', 'layers' or layer counts per stage like 2,2,2,1; got {args.balance!r}")
    _fit_model_to_stages(parser, args)


def byte_count(text: str) -> int:
    """``--corpus-bytes``: a whole number of bytes, in digits or as a float that is one (``2e6``, as the help shows).

    Raises:
        argparse.ArgumentTypeError: anything else (argparse names the option)."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        number = float(text)
    except ValueError:
        number = math.nan
    if not number.is_integer():  # nan, inf, 2.5
        raise argparse.ArgumentTypeError(f"a whole number of bytes is needed, e.g. 2000000 or 2e6, got {text!r}")
    return int(number)


def checkpoint_dir_problem(folder: str, resume: bool) -> str | None:
    """Why ``--checkpoint-dir folder`` cannot be used (``None``: it can), checked before any rank starts instead of
    at the first save: under ``--resume`` it does not exist (a typo would silently start from step 1); or
    :func:`folder_problem`."""
    if resume and not os.path.lexists(folder):
        return (f"--checkpoint-dir {folder!r} does not exist, so --resume has nothing to continue from (check the "
                f"name, or leave --resume out to start from step 1)")
    return folder_problem("--checkpoint-dir", folder)


def folder_problem(option: str, folder: str) -> str | None:
    """Why ``option folder``, a folder the demo writes into (made if missing), cannot be used (``None``: it can):
    it is a file, or the nearest existing path above it is a file or not writable (it cannot be made)."""
    path = Path(folder)
    if path.exists() and not path.is_dir():
        return f"{option} {folder!r} is a file, not a folder"
    existing = path.absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"{option} {folder!r} cannot be created: {str(existing)!r} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{option} {folder!r} cannot be written: {str(existing)!r} is not writable by this user"
    return None


def _balance(text: str):
    if text == "params":
        return "params"
    if text == "layers":
        return None
    return [int(x) for x in text.split(",")]


def _fit_model_to_stages(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Resolve ``--virtual-stages`` (None: the schedule's default, as ``Pipeline`` does) and ``--depth`` (None: 4
    blocks, or one per stage when there are more stages), and check the model has a layer for every stage.

    The pipeline ranks are ``--ranks``, or under torchrun ``WORLD_SIZE / --dp``.
    """
    try:
        info = get_schedule(args.schedule)
    except UnknownScheduleError as exc:
        parser.error(f"--schedule: {exc}")
    if args.virtual_stages is None:
        args.virtual_stages = info.default_virtual_stages
    ranks = args.ranks
    if "WORLD_SIZE" in os.environ:  # under torchrun: the pipeline has WORLD_SIZE / dp ranks
        ranks = max(1, int(os.environ["WORLD_SIZE"]) // args.dp)
    try:
        build(args.schedule, ranks, args.microbatches, args.virtual_stages)
    except ScheduleArgumentError as exc:
        parser.error(f"--schedule {args.schedule} with --virtual-stages {args.virtual_stages}: {exc}")
    stages = ranks * args.virtual_stages
    if args.depth is None:
        args.depth = max(4, stages)
    layers = args.depth + 3  # embedding, the blocks, final norm, head
    if layers < stages:
        blocks, rank_s = "block" if args.depth == 1 else "blocks", "rank" if ranks == 1 else "ranks"
        virtual = "virtual stage" if args.virtual_stages == 1 else "virtual stages"
        parser.error(f"--depth {args.depth} gives the model {layers} layers (embedding, {args.depth} {blocks}, final "
                     f"norm, head) but {ranks} {rank_s} x {args.virtual_stages} {virtual} = {stages} stages need "
                     f"at least {stages}: use --depth {stages - 3} or more (or leave --depth out), or fewer "
                     f"--ranks or --virtual-stages")
    if isinstance(args.balance, list) and min(args.balance) < 1:
        parser.error(f"--balance {','.join(map(str, args.balance))}: every stage needs at least one layer (counts >= 1), "
                     f"got {min(args.balance)} for stage {args.balance.index(min(args.balance))}")
    if isinstance(args.balance, list) and (len(args.balance) != stages or sum(args.balance) != layers):
        parser.error(f"--balance {','.join(map(str, args.balance))}: needs {stages} layer counts (one per stage) "
                     f"summing to the model's {layers} layers, got {len(args.balance)} summing to {sum(args.balance)}")
