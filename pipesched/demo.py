"""``pipesched demo``: train a small GPT across local pipeline ranks (runs ``examples/train_gpt.py``)."""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"


def add_demo_parser(subparsers) -> None:
    """Register ``demo``; every option after it goes to ``examples/train_gpt.py`` (see ``demo --help``)."""
    parser = subparsers.add_parser(
        "demo", help="train a small GPT across 4 local pipeline ranks (CPU, gloo), then draw its bubble",
        add_help=False, description="Runs examples/train_gpt.py with these options; --help lists them.")
    parser.set_defaults(func=run_demo, passes_options=True)


def run_demo(args: argparse.Namespace) -> int:
    """Import the example from the source checkout and run its ``main`` with the given options."""
    if not EXAMPLE.exists():
        print(f"error: pipesched demo runs {EXAMPLE}, which is not here; it ships with the source "
              f"checkout (git clone, then pip install -e .)", file=sys.stderr)
        return 2
    sys.path.insert(0, str(EXAMPLE.parent))  # spawned ranks inherit sys.path, so they can import it too
    module = importlib.import_module(EXAMPLE.stem)
    module.main(args.extra, prog="pipesched demo")
    return 0
