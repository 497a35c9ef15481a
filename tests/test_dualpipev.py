"""DualPipe-V (pipesched/schedules/dualpipe_v.py): order and overlapped pairs as PyTorch's, any m, closed forms."""
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesched import CostModel, Op, ScheduleArgumentError, build, compile_program, simulate, step_programs
from pipesched.ir import OVERLAP_PAIRS
from pipesched.testing import check_program, cost_models


def _torch_order(p, m, r):
    """PyTorch's ScheduleDualPipeV order of rank r as (op, stage, mb) keys, and its OVERLAP_F_B pairs."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    kinds = schedules._ComputationType
    names = {kinds.FORWARD: Op.F, kinds.BACKWARD_INPUT: Op.I, kinds.BACKWARD_WEIGHT: Op.W,
             kinds.FULL_BACKWARD: Op.B}
    fake = SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p)
    order, pairs = [], []
    for action in schedules.ScheduleDualPipeV._calculate_single_rank_operations(fake, r):
        subs = action.sub_actions if action.computation_type == kinds.OVERLAP_F_B else (action,)
        keys = [(names[a.computation_type], a.stage_index, a.microbatch_index) for a in subs]
        order += keys
        if len(keys) == 2:
            pairs.append(tuple(keys))
    return order, pairs


def test_same_order_and_pairs_as_torch_for_m_at_least_2p():
    for p in range(1, 6):
        for m in range(2 * p, 2 * p + 6):
            ours = build("dualpipev", p, m)
            pairs = {(f.key, b.key) for f, b in ours.meta[OVERLAP_PAIRS]}
            theirs_pairs = set()
            for r in range(p):
                order, torch_pairs = _torch_order(p, m, r)
                assert [i.key for i in ours.ranks[r]] == order, (p, m, r)
                theirs_pairs |= set(torch_pairs)
            assert pairs == theirs_pairs, (p, m)


def test_pairs_are_adjacent_f_then_b_on_one_rank():
    program = build("dualpipev", 3, 9)
    # rank r: 2 pairs in each of its m - 2p + r + 1 main rounds (the last rank's first round has 1), p - r - 1 after
    assert len(program.meta[OVERLAP_PAIRS]) == sum(2 * (9 - 6 + r + 1) + (3 - r - 1) for r in range(3)) - 1 == 32
    for f, b in program.meta[OVERLAP_PAIRS]:
        (rank,) = {program.stage_to_rank[f.stage], program.stage_to_rank[b.stage]}
        stream = program.ranks[rank]
        assert (f.op, b.op) == (Op.F, Op.B) and stream.index(b) == stream.index(f) + 1
    lowered = compile_program("dualpipev", 3, 9, dp_size=2, recompute=True)  # the pairs survive lowering
    assert lowered.meta[OVERLAP_PAIRS] == program.meta[OVERLAP_PAIRS]


def test_small_m_keeps_only_whole_pairs():
    program = build("dualpipev", 4, 3)  # PyTorch refuses m < 2p
    kept = {i for s in program.ranks for i in s}
    assert all(f in kept and b in kept and f.microbatch < 3 and b.microbatch < 3
               for f, b in program.meta[OVERLAP_PAIRS])


def test_virtual_stages_other_than_2_is_refused():
    with pytest.raises(ScheduleArgumentError, match="virtual_stages=3: dualpipev .* must be 2") as info:
        compile_program("dualpipev", 2, 4, 3)
    assert info.value.argument == "virtual_stages"


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 16), st.integers(1, 64), st.floats(0.1, 10))
def test_unit_cost_closed_forms(p, m, c):
    """F = I = W = c (B = 2c), free messages: makespan (6m + p - 1) c for m >= 2p; peak min(2p+1, 2m, m+r+1)."""
    timeline = simulate(compile_program("dualpipev", p, m), CostModel(forward=c, backward=2 * c), check=False)
    assert timeline.peak_inflight == tuple(min(2 * p + 1, 2 * m, m + r + 1) for r in range(p))
    if m >= 2 * p:
        assert timeline.makespan == pytest.approx((6 * m + p - 1) * c, rel=1e-12)
        assert timeline.bubble_fraction == pytest.approx((p - 1) / (6 * m + p - 1), abs=1e-9)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 16), st.integers(1, 64), st.integers(1, 4), st.booleans(), st.data())
def test_random_costs_dp_recompute(p, m, dp, recompute, data):
    program = compile_program("dualpipev", p, m, dp_size=dp, recompute=recompute)
    cost = data.draw(cost_models(program.num_stages))
    check_program(program, cost)
    backwards = sum(i.op in (Op.B, Op.I) for s in program.ranks for i in s)
    assert backwards == 2 * p * m  # one B or I per (stage, microbatch), and a W for each I
    assert sum(i.op is Op.W for s in program.ranks for i in s) == sum(i.op is Op.I for s in program.ranks for i in s)
    if not recompute:
        timeline = simulate(program, cost, check=False)
        assert timeline.peak_inflight == tuple(min(2 * p + 1, 2 * m, m + r + 1) for r in range(p))


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_step_protocol_proven(backend):
    for p in (2, 3, 4):
        for m in (1, 3, 2 * p, 2 * p + 3):
            for recompute in (False, True):
                step_programs(compile_program("dualpipev", p, m, recompute=recompute), backend)


def test_a_measured_run_is_predicted_with_its_own_program():
    """pipesched.viz.compare recompiles a measured run's program: dualpipev's own I/W (mixed with B on a stage) must
    not be taken for split_backward, which would split its B too."""
    from pipesched.timeline import Timeline
    from pipesched.viz.compare import predict_for

    for split in (False, True):
        program = compile_program("dualpipev", 2, 5, split_backward=split)
        run = simulate(program)
        meta = {"schedule": "dualpipev", "ranks": 2, "microbatches": 5, "virtual_stages": 2, "step": "train"}
        predicted = predict_for(Timeline(run.events, 2, "measured", meta, run.peak_inflight))
        for r in range(2):
            assert [e.instr for e in predicted.events if e.rank == r] == [e.instr for e in run.events if e.rank == r]
