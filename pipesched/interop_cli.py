"""The command line's torch CSV options: ``pipesched validate --torch-csv FILE``, ``show ... --torch-csv OUT``."""
from __future__ import annotations

import argparse
import sys
import warnings

from . import program_io
from .interop import TorchCsvWarning, from_torch_csv, to_torch_csv


def add_validate_args(parser: argparse.ArgumentParser) -> None:
    """FILE (pipesched's text or JSON form) or ``--torch-csv FILE`` (a torch 2.13 schedule CSV)."""
    parser.add_argument("file", metavar="FILE", nargs="?", help="a program in pipesched's text or JSON form")
    parser.add_argument("--torch-csv", metavar="FILE", default=None,
                        help="a torch.distributed.pipelining schedule CSV (compute_only or compute_comms form, as "
                             "its _dump_csv writes); placement and microbatches are read from it")


def load_for_validate(args: argparse.Namespace):
    """The program ``validate`` checks: FILE, or the torch CSV (its FSDP-only actions noted on stderr, and
    ``args.file`` set to its path so messages name it).

    Raises:
        ValueError: both or neither of FILE and ``--torch-csv`` given.
        ProgramFormatError: the file cannot be parsed (names the line).
        OSError: the file cannot be read.
    """
    if (args.file is None) == (args.torch_csv is None):
        raise ValueError("validate takes FILE (pipesched's text or JSON form) or --torch-csv FILE, exactly one; got "
                         + ("both" if args.file else "neither"))
    if args.file is not None:
        return program_io.load(args.file)
    args.file = args.torch_csv
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TorchCsvWarning)
        program = from_torch_csv(args.torch_csv)
    for warning in caught:
        print(f"note: {warning.message}", file=sys.stderr)
    return program


def add_show_args(parser: argparse.ArgumentParser) -> None:
    """``--torch-csv OUT``: write the program shown as a torch schedule CSV instead of printing it."""
    parser.add_argument("--torch-csv", metavar="OUT", default=None,
                        help="write the program as a torch.distributed.pipelining schedule CSV (compute_comms form; "
                             "compute_only with --compute-only) instead of printing it")


def write_show(args: argparse.Namespace, program) -> int:
    """Write ``program`` to ``args.torch_csv``; one line on stdout says what was written. Returns 0.

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
    print(f"wrote {args.torch_csv}: {program.schedule}, {program.num_ranks} ranks, {program.num_stages} stages, "
          f"{program.num_microbatches} microbatches, torch's {form} form (torch: schedule._load_csv(path, "
          f"format={form!r}))")
    return 0
