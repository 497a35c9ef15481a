"""zb-h1 and zb-h2 (arXiv:2401.10241, section 3): closed forms exact in the simulator, properties over random
sizes and costs, and the builder's own split standing whatever ``split_backward`` says."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesched import CostModel, Op, build, compile_program, simulate
from pipesched.errors import ScheduleArgumentError
from pipesched.testing import check_program, cost_models

UNIT = CostModel(forward=1.0, backward=2.0, input_grad=1.0, weight_grad=1.0)  # F = I = W = 1 s
NAMES = ("zb-h1", "zb-h2")


def expected_peak(name, p, m):
    """The docstrings' peak in-flight activations per rank (microbatch-stages whose W has not run)."""
    if name == "zb-h1":
        return tuple(min(p, m) for _ in range(p))
    return tuple(min(m, max(2 * (p - r) - 1, 2 * r)) for r in range(p))


def closed_form_holds(name, p, m):
    return m >= p if name == "zb-h1" else (m >= 2 * p - 2 or p == 1)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8])
def test_unit_cost_makespan_bubble_and_peak_exact(name, p):
    for m in range(1, 3 * p + 3):
        timeline = simulate(compile_program(name, p, m), UNIT)
        assert timeline.peak_inflight == expected_peak(name, p, m), (p, m)
        if closed_form_holds(name, p, m):
            assert timeline.makespan == 3 * m + p - 1, (p, m)
            assert timeline.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
        else:  # fewer microbatches than the closed form needs: valid, never faster than the bound
            assert timeline.makespan >= 3 * m + p - 1, (p, m)


def test_a_third_of_1f1b_bubble_and_1f1b_memory():
    """The paper's claim at p=4, m=8: 1F1B (fused B = I + W) idles 3(p-1) s per rank, ZB-H1 p-1 s, at 1F1B's
    peak (rank 0's p) on every rank; counted up to I (what only the input gradient needs) ZB-H1 holds 1F1B's
    min(p - r, m) on rank r."""
    one = simulate(compile_program("1f1b", 4, 8), UNIT)
    h1 = simulate(compile_program("zb-h1", 4, 8), UNIT)
    assert (one.makespan, h1.makespan) == (3 * 8 + 3 * 3, 3 * 8 + 3)
    assert max(h1.peak_inflight) == max(one.peak_inflight) == 4
    assert until_input_grad(compile_program("zb-h1", 4, 8)) == (4, 3, 2, 1)


def until_input_grad(program):
    peaks = []
    for stream in program.ranks:
        held = peak = 0
        for instr in stream:
            held += (instr.op is Op.F) - (instr.op is Op.I)
            peak = max(peak, held)
        peaks.append(peak)
    return tuple(peaks)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(NAMES), st.integers(1, 16), st.integers(1, 64), st.integers(1, 4), st.booleans(), st.data())
def test_validates_simulates_round_trips_and_keeps_its_memory(name, p, m, dp, recompute, data):
    program = compile_program(name, p, m, dp_size=dp, recompute=recompute)
    cost = data.draw(cost_models(p))
    check_program(program, cost)  # validates, simulates, round-trips text and JSON
    timeline = simulate(program, cost, check=False)
    assert timeline.peak_inflight == expected_peak(name, p, m)  # an order property: any costs
    ops = [i.op for s in program.ranks for i in s]
    assert ops.count(Op.I) == ops.count(Op.W) == p * m and Op.B not in ops
    assert ops.count(Op.R) == (p * m if recompute else 0)
    assert ops.count(Op.ALL_REDUCE) == (p if dp > 1 else 0)
    if recompute:  # each R directly before its I
        for stream in program.ranks:
            compute = [i for i in stream if i.op in (Op.F, Op.R, Op.I, Op.W)]
            for a, b in zip(compute, compute[1:]):
                if a.op is Op.R:
                    assert (b.op, b.stage, b.microbatch) == (Op.I, a.stage, a.microbatch)


@pytest.mark.parametrize("name", NAMES)
def test_split_backward_leaves_the_builders_split(name):
    """The builder emits I and W: split_backward (True, False or per stage) finds no B and changes nothing."""
    base = compile_program(name, 4, 8)
    assert compile_program(name, 4, 8, split_backward=True) == base
    assert compile_program(name, 4, 8, split_backward=[False, True, False, True]) == base
    with pytest.raises(ScheduleArgumentError, match="split_backward"):
        compile_program(name, 4, 8, split_backward=[True, True])


@pytest.mark.parametrize("name", NAMES)
def test_bad_sizes_are_refused_naming_the_argument(name):
    with pytest.raises(ScheduleArgumentError, match="virtual_stages=2"):
        build(name, 4, 8, 2)
    with pytest.raises(ScheduleArgumentError, match="num_microbatches"):
        build(name, 4, 0)
