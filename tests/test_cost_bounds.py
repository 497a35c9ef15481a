"""Costs at the edges of float: numpy's real numbers accepted as plain ones, and huge finite costs whose sum
overflows refused by simulate with a CostError naming the fields (never an inf makespan with bubble 0)."""
import math
from fractions import Fraction

import numpy as np
import pytest

import pipesched as ps
from pipesched.cli import main


@pytest.mark.parametrize("value", [np.float32(1.5), np.float64(1.5), np.float16(1.5), Fraction(3, 2), np.int64(2)])
def test_any_real_number_is_a_cost_held_plain(value):
    cost = ps.CostModel(forward=value, latency=value, activation_bytes=np.array([value, value]))
    assert type(cost.forward) in (int, float) and cost.forward == float(value)
    assert type(cost.latency) in (int, float)
    assert cost.activation_bytes == (float(value),) * 2 and all(type(v) in (int, float) for v in cost.activation_bytes)


@pytest.mark.parametrize("value", [True, np.bool_(True), "1", 1j, np.float32("nan"), np.float32("inf"),
                                   np.float32(-1)])
def test_non_numbers_and_non_finite_numpy_costs_are_refused(value):
    with pytest.raises(ps.CostError):
        ps.CostModel(forward=value)


def test_float32_costs_simulate_like_floats():
    program = ps.compile_program("1f1b", 4, 8)
    assert ps.simulate(program, ps.CostModel(forward=np.float32(1), backward=np.float32(2))).bubble_fraction == \
        pytest.approx(3 / 11)


def test_huge_compute_costs_are_refused_naming_them():
    program = ps.compile_program("1f1b", 4, 8)
    with pytest.raises(ps.CostError) as caught:
        ps.simulate(program, ps.CostModel(forward=1e308, backward=1e308))
    assert caught.value.field in ("forward", "backward")
    assert str(caught.value).startswith("cost forward, backward too large: the step's seconds add up past the largest")


def test_huge_but_summable_costs_still_simulate():
    timeline = ps.simulate(ps.compile_program("1f1b", 4, 8), ps.CostModel(forward=1e306, backward=2e306))
    assert math.isfinite(timeline.makespan) and timeline.bubble_fraction == pytest.approx(3 / 11)


def test_message_seconds_overflow_is_refused_naming_bytes_and_bandwidth():
    program = ps.compile_program("1f1b", 2, 4)
    with pytest.raises(ps.CostError) as caught:
        ps.simulate(program, ps.CostModel(bandwidth=1e-300, activation_bytes=1e10))
    assert caught.value.field == "activation_bytes"
    assert "activation_bytes = 1e+10 B at bandwidth = 1e-300 B/s" in str(caught.value)


def test_held_bytes_overflow_is_refused():
    with pytest.raises(ps.CostError) as caught:
        ps.simulate(ps.compile_program("1f1b", 4, 8), ps.CostModel(stash_bytes=1e308))
    assert caught.value.field == "stash_bytes" and "the activation bytes a rank holds" in str(caught.value)


def test_cli_overflow_exits_2_naming_the_option(capsys):
    code = main(["simulate", "1f1b", "-p", "4", "-m", "8", "--forward", "1e308", "--backward", "1e308"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.startswith("error: --forward: cost forward, backward too large")
