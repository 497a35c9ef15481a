"""The catalogue: compiled programs of each built-in schedule at reference sizes, as golden text files.

Regenerate with ``python -m pipesched.catalogue`` (writes ``schedules/*.txt`` at the repository root);
``tests/test_catalogue.py`` compares them byte for byte, so any change to a schedule shows in review.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .api import compile_program
from .program_io import to_text

#: file stem -> (schedule, p, m, v, dp, recompute)
REFERENCE_SIZES = {
    "gpipe-p4-m8": ("gpipe", 4, 8, 1, 1, False),
    "1f1b-p4-m8": ("1f1b", 4, 8, 1, 1, False),
    "1f1b-p4-m2": ("1f1b", 4, 2, 1, 1, False),
    "interleaved-1f1b-p4-m8-v2": ("interleaved-1f1b", 4, 8, 2, 1, False),
    "interleaved-1f1b-p4-m6-v2": ("interleaved-1f1b", 4, 6, 2, 1, False),
    "1f1b-p2-m4-dp2-recompute": ("1f1b", 2, 4, 1, 2, True),
    "zb-h1-p4-m8": ("zb-h1", 4, 8, 1, 1, False),
    "zb-h2-p4-m8": ("zb-h2", 4, 8, 1, 1, False),
    "zbv-p4-m8": ("zbv", 4, 8, 2, 1, False),
    "dualpipev-p4-m8": ("dualpipev", 4, 8, 2, 1, False),
}


def render(stem: str) -> str:
    """The golden text of one catalogue entry: a comment naming the command, then the program."""
    name, p, m, v, dp, recompute = REFERENCE_SIZES[stem]
    program = compile_program(name, p, m, v, dp_size=dp, recompute=recompute)
    flags = f"--ranks {p} --microbatches {m} --virtual-stages {v}" + (f" --dp {dp}" if dp > 1 else "")
    flags += " --recompute" if recompute else ""
    return f"# pipesched show {name} {flags} --format text\n" + to_text(program)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Regenerate the catalogue of compiled reference programs.")
    parser.add_argument("out", nargs="?", default="schedules", help="folder to write (default: schedules)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for stem in REFERENCE_SIZES:
        (out / f"{stem}.txt").write_text(render(stem), encoding="utf-8")
        print(f"wrote {out / (stem + '.txt')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
