"""``pipesched demo``: train a small byte-level GPT across local pipeline ranks, then draw its bubble.

The demo is part of the package, so it runs from any install (``pip install .`` as well as a clone):
``model.py`` (the GPT as one ``nn.Sequential``), ``data.py`` (the Python standard library's own source as
text, no download), ``options.py`` (the command line, checked before any rank starts), ``train.py`` (each
rank's loop, and ``main``). ``examples/train_gpt.py`` is the same program as a script (for ``torchrun``).
Importing this module loads neither torch nor matplotlib (``pipesched --help`` stays fast).
"""
from __future__ import annotations

import argparse


def add_demo_parser(subparsers) -> None:
    """Register ``demo``; every option after it goes to :func:`pipesched.demo.train.main` (see ``demo --help``)."""
    parser = subparsers.add_parser(
        "demo", help="train a small GPT across 4 local pipeline ranks (CPU, gloo), then draw its bubble",
        add_help=False, description="Trains a small GPT across local pipeline ranks; --help lists the options.")
    parser.set_defaults(func=run_demo, passes_options=True)


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo with the options after ``demo`` (``args.extra``); returns the exit status."""
    from .train import main

    main(args.extra, prog="pipesched demo")
    return 0
