"""The golden files in schedules/ equal what the compiler produces today, byte for byte."""
from pathlib import Path

import pytest

from pipesched import load, validate
from pipesched.catalogue import REFERENCE_SIZES, render

ROOT = Path(__file__).resolve().parents[1] / "schedules"


@pytest.mark.parametrize("stem", sorted(REFERENCE_SIZES))
def test_golden_file_matches(stem):
    golden = (ROOT / f"{stem}.txt").read_text(encoding="utf-8")
    assert render(stem) == golden, f"schedules/{stem}.txt is stale: run `python -m pipesched.catalogue`"


def test_every_golden_file_is_listed():
    assert sorted(p.stem for p in ROOT.glob("*.txt")) == sorted(REFERENCE_SIZES)


def test_handwritten_example_validates():
    program = load(ROOT / "examples" / "handwritten-1f1b-p2-m3.txt")
    assert validate(program).num_microbatches == 3
