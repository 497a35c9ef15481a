"""ZB-V and the V placement (pipesched/schedules/v_shape.py): order, sizes refused, closed forms, properties."""
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesched import CostModel, Op, ScheduleArgumentError, build, compile_program, placement, simulate, step_programs
from pipesched.testing import check_program, cost_models


def test_vshape_placement():
    assert placement.vshape(1) == (0, 0)
    assert placement.vshape(2) == (0, 1, 1, 0)
    assert placement.vshape(4) == (0, 1, 2, 3, 3, 2, 1, 0)
    program = build("zbv", 3, 5)
    assert program.stage_to_rank == (0, 1, 2, 2, 1, 0)
    assert [program.stages_of(r) for r in range(3)] == [(0, 5), (1, 4), (2, 3)]


def test_zbv_order_p2_m4():
    program = build("zbv", 2, 4)
    assert " ".join(map(str, program.ranks[1])) == (
        "F1.0 F2.0 F1.1 F2.1 I2.0 W2.0 F1.2 I1.0 W1.0 F2.2 I2.1 W2.1 F1.3 I1.1 W1.1 F2.3 I2.2 W2.2 "
        "I1.2 I2.3 I1.3 W1.2 W2.3 W1.3")
    assert " ".join(map(str, program.ranks[0][:9])) == "F0.0 F0.1 F0.2 F3.0 I3.0 W3.0 F3.1 I3.1 W3.1"


def test_default_virtual_stages_is_two_and_others_are_refused():
    assert compile_program("zbv", 2, 3).num_stages == 4
    for v in (1, 3):
        with pytest.raises(ScheduleArgumentError, match=f"virtual_stages={v}: zbv .* must be 2") as info:
            compile_program("zbv", 2, 3, v)
        assert info.value.argument == "virtual_stages"


@pytest.mark.parametrize("argument, args", [("num_ranks", (0, 4)), ("num_microbatches", (2, 0))])
def test_bad_sizes_name_the_argument(argument, args):
    with pytest.raises(ScheduleArgumentError, match=argument) as info:
        build("zbv", *args)
    assert info.value.argument == argument


def test_same_order_as_torch_for_every_m():
    """PyTorch's ScheduleZBVZeroBubble fixes the order of the paper's figure; ours is that order, any m >= 1."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    rank_ops = schedules.ScheduleZBVZeroBubble._calculate_single_rank_operations
    kinds = schedules._ComputationType
    names = {kinds.FORWARD: Op.F, kinds.BACKWARD_INPUT: Op.I, kinds.BACKWARD_WEIGHT: Op.W}
    for p in range(1, 6):
        for m in range(1, 4 * p + 2):
            fake = SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p)
            ours = build("zbv", p, m)
            for r in range(p):
                theirs = [(names[a.computation_type], a.stage_index, a.microbatch_index)
                          for a in rank_ops(fake, r) if a is not None]
                assert [i.key for i in ours.ranks[r]] == theirs, (p, m, r)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 16), st.integers(1, 64), st.floats(0.1, 10))
def test_unit_cost_closed_forms(p, m, c):
    """F = I = W = c, free messages: makespan (6m + p - 1) c for m >= 2p - 1; peak min(2p, 2m, m + r + 1)."""
    timeline = simulate(compile_program("zbv", p, m), CostModel(forward=c, backward=2 * c), check=False)
    assert timeline.peak_inflight == tuple(min(2 * p, 2 * m, m + r + 1) for r in range(p))
    if m >= 2 * p - 1:
        assert timeline.makespan == pytest.approx((6 * m + p - 1) * c, rel=1e-12)
        assert timeline.bubble_fraction == pytest.approx((p - 1) / (6 * m + p - 1), abs=1e-9)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 16), st.integers(1, 64), st.integers(1, 4), st.booleans(), st.data())
def test_random_costs_dp_recompute(p, m, dp, recompute, data):
    program = compile_program("zbv", p, m, dp_size=dp, recompute=recompute)
    cost = data.draw(cost_models(program.num_stages))
    check_program(program, cost)
    count = {op: sum(i.op is op for s in program.ranks for i in s) for op in (Op.F, Op.I, Op.W, Op.R, Op.B)}
    assert count == {Op.F: 2 * p * m, Op.I: 2 * p * m, Op.W: 2 * p * m, Op.R: 2 * p * m if recompute else 0,
                     Op.B: 0}
    assert sum(i.op is Op.ALL_REDUCE for s in program.ranks for i in s) == (2 * p if dp > 1 else 0)
    if not recompute:  # the memory guarantee holds for any costs: in-flight counts depend on the order only
        timeline = simulate(program, cost, check=False)
        assert timeline.peak_inflight == tuple(min(2 * p, 2 * m, m + r + 1) for r in range(p))


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_step_protocol_proven_with_sends_both_ways(backend):
    """V placement: ranks r and r + 1 send each other activations and gradients both ways; every step program
    keeps each pair's messages FIFO-matched (NCCL: one order on both sides)."""
    for p in (2, 3, 4):
        for m in (1, 2, 3, 5, 8):
            for recompute in (False, True):
                step_programs(compile_program("zbv", p, m, recompute=recompute), backend)
