"""benchmarks/bench_opening.py's table (the step's lead vs no lead vs torch): the step time is the max over the two
ranks, the ratios are per round, printed as median [q1-q3], and the opening marks are medians. No timing."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCHMARKS))  # it imports bench_zero_bubble's sides
    try:
        spec = importlib.util.spec_from_file_location("bench_opening_under_test", BENCHMARKS / "bench_opening.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


def _steps(seconds):
    return [(s, 0, 0.0) for s in seconds]  # (seconds, faults, CPU seconds) as timed() gives them


def test_the_table_takes_the_slower_rank_and_ratios_per_round(bench):
    rank0 = {4: {"steps": {"lead": _steps([0.010, 0.020, 0.030, 0.040]), "plain": _steps([0.020] * 4),
                           "torch": _steps([0.010] * 4)},
                 "opening": [{"posted": 0.3, "rows in": 1.0}, {"posted": 0.5, "rows in": 2.0}]}}
    rank1 = {4: {"steps": {"lead": _steps([0.012, 0.010, 0.010, 0.010]), "plain": _steps([0.010] * 4),
                           "torch": _steps([0.020] * 4)},
                 "opening": [{"posted": 0.1, "rows in": 1.1}, {"posted": 0.3, "rows in": 1.3}]}}
    lines = bench.report([rank0, rank1], [4])
    # per round, max over ranks: lead 12, 20, 30, 40 ms; plain 20 ms; torch 20 ms
    assert lines[2] == "| 4 | 25.00 | 20.00 | 20.00 | 1.250 [1.00-1.50] | 1.250 [1.00-1.50] | 1.000 [1.00-1.00] |"
    assert lines[3] == "m=4 rank 0: opening posted at 0.40 ms, rows in at 1.50 ms (lead side, medians)"
    assert lines[4] == "m=4 rank 1: opening posted at 0.20 ms, rows in at 1.20 ms (lead side, medians)"
