"""The command line's torch CSV options: ``pipesched validate --torch-csv FILE``, ``show ... --torch-csv OUT``."""
from __future__ import annotations

import argparse
import re
import sys
import warnings

from . import program_io
from .errors import ProgramFormatError
from .interop import TorchCsvWarning, from_torch_csv, to_torch_csv


def add_validate_args(parser: argparse.ArgumentParser) -> None:
    """FILE (pipesched's text or JSON form) or ``--torch-csv FILE`` (a torch 2.13 schedule CSV)."""
    parser.add_argument("file", metavar="FILE", nargs="?", help="a program in pipesched's text or JSON form")
    parser.add_argument("--torch-csv", metavar="FILE", default=None,
                        help="a torch.distributed.pipelining schedule CSV (compute_only or compute_comms form, as "
                             "its _dump_csv writes); placement and microbatches are read from it")
    parser.add_argument("--dp", type=_at_least_one, default=None, metavar="N",
                        help="with --torch-csv: data-parallel replicas; N >= 2 reads each REDUCE_GRAD as its stage's "
                             "ALL_REDUCE (default 1: REDUCE_GRAD is dropped, with a note)")
    parser.add_argument("--stage-to-rank", type=_placement, default=None, metavar="R,R,...",
                        help="with --torch-csv: the rank of each stage, e.g. 0,1,1,0 for a V on 2 ranks (default: "
                             "where the file runs each stage, as torch infers it)")


def _at_least_one(text: str) -> int:
    """``--dp``: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 (data-parallel replicas), got {text!r}")
    return value


def _placement(text: str) -> tuple[int, ...]:
    """``--stage-to-rank``: ranks >= 0 joined by commas, one per stage."""
    try:
        ranks = tuple(int(r) for r in text.split(","))
    except ValueError:
        ranks = (-1,)
    if any(r < 0 for r in ranks):
        raise argparse.ArgumentTypeError(f"expected the rank (an integer >= 0) of each stage, joined by commas "
                                         f"(e.g. 0,1,1,0), got {text!r}")
    return ranks


def load_for_validate(args: argparse.Namespace):
    """The program ``validate`` checks: FILE, or the torch CSV read with ``--dp`` and ``--stage-to-rank`` (what
    was dropped, FSDP-only actions and REDUCE_GRAD at ``--dp 1``, noted on stderr, and ``args.file`` set to its
    path so messages name it).

    Raises:
        ValueError: both or neither of FILE and ``--torch-csv`` given; ``--dp``/``--stage-to-rank`` with FILE, or a
            ``--stage-to-rank`` the file contradicts (a stage's actions on another rank; a rank past the file's rows).
        ProgramFormatError: the file cannot be parsed (names the line).
        OSError: the file cannot be read.
    """
    if (args.file is None) == (args.torch_csv is None):
        raise ValueError("validate takes FILE (pipesched's text or JSON form) or --torch-csv FILE, exactly one; got "
                         + ("both" if args.file else "neither"))
    if args.file is not None:
        given = [flag for flag, value in (("--dp", args.dp), ("--stage-to-rank", args.stage_to_rank)) if value]
        if given:
            raise ValueError(f"{given[0]} applies to --torch-csv FILE; a program in pipesched's form ({args.file}) "
                             f"states its own dp_size and stage_to_rank: drop {given[0]}")
        return program_io.load(args.file)
    args.file = args.torch_csv
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TorchCsvWarning)
        try:
            program = from_torch_csv(args.torch_csv, stage_to_rank=args.stage_to_rank, dp_size=args.dp or 1)
        except (ProgramFormatError, ValueError) as exc:  # one that names stage_to_rank: the option's error
            if args.stage_to_rank is None or "stage_to_rank" not in str(exc):
                raise
            shown = ",".join(map(str, args.stage_to_rank))
            message = str(exc).replace("from_torch_csv: ", "").replace(  # the API's hint names no option of ours
                "; pass num_ranks for more", ": one row of actions per rank, so --stage-to-rank names ranks of "
                                             "those rows only")
            raise ValueError(f"--stage-to-rank {shown}: {message}") from None
    for warning in caught:  # the API's num_ranks has no option here: its hint goes (a stray line is deleted)
        print(f"note: {_NUM_RANKS_HINT.sub('', str(warning.message))}", file=sys.stderr)
    return program


#: from_torch_csv's hint for blank lines after the last rank, which names its num_ranks argument
_NUM_RANKS_HINT = re.compile(r", or pass num_ranks=[0-9]+ to ignore [a-z ]+$")


def add_show_args(parser: argparse.ArgumentParser) -> None:
    """``--torch-csv OUT``: write the program shown as a torch schedule CSV instead of printing it."""
    parser.add_argument("--torch-csv", metavar="OUT", default=None,
                        help="write the program as a torch.distributed.pipelining schedule CSV (compute_comms form; "
                             "compute_only with --compute-only) instead of printing it; with --json the JSON form "
                             "is printed as well (and the line saying what was written goes to stderr)")


def write_show(args: argparse.Namespace, program) -> int:
    """Write ``program`` to ``args.torch_csv``; one line says what was written: on stdout, or with ``--json`` on
    stderr, stdout then holding the program's JSON form (what ``show --json`` prints without ``--torch-csv``).
    Returns 0.

    Raises:
        ValueError: the program cannot be written in torch's form (TIE_REDUCE, see :func:`to_torch_csv`).
    """
    comms = not args.compute_only
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TorchCsvWarning)
        try:
            to_torch_csv(program, args.torch_csv, comms=comms)
        except OSError as exc:  # a missing folder, a folder given as the file: the option's error, not a traceback
            raise ValueError(f"--torch-csv {args.torch_csv}: cannot write it ({exc.strerror or exc})") from None
    for warning in caught:
        print(f"note: {warning.message}", file=sys.stderr)
    form = "compute_comms" if comms else "compute_only"
    if args.json:
        print(program_io.to_json(program, indent=None))
    print(f"wrote {args.torch_csv}: {program.schedule}, {program.num_ranks} ranks, {program.num_stages} stages, "
          f"{program.num_microbatches} microbatches, torch's {form} form (torch: schedule._load_csv(path, "
          f"format={form!r}))", file=sys.stderr if args.json else sys.stdout)
    return 0
