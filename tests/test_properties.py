"""Hypothesis properties over schedule, p in 1..16, m in 1..64, v in 1..4, dp in 1..4 and random costs."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipesched import CostModel, Op, compile_program, simulate
from pipesched.testing import check_program, cost_models, schedule_configs


@given(schedule_configs())
def test_every_built_in_program_validates_and_round_trips(config):
    program = config.compile()
    check_program(program)
    assert program.num_stages == config.num_ranks * config.virtual_stages
    assert sum(i.op is Op.ALL_REDUCE for s in program.ranks for i in s) == (
        program.num_stages if config.dp_size > 1 else 0)


@given(schedule_configs(max_ranks=8, max_microbatches=24), st.data())
def test_simulator_terminates_with_random_costs(config, data):
    program = config.compile()
    cost = data.draw(cost_models(program.num_stages))
    timeline = simulate(program, cost, check=False)
    assert len(timeline.events) == len(program)
    compute = sum(cost.per_stage("forward", program.num_stages)) * config.num_microbatches
    assert timeline.makespan >= compute / config.num_ranks - 1e-9  # no schedule beats perfect balance


@given(st.sampled_from(["gpipe", "1f1b"]), st.integers(1, 16), st.integers(1, 64), st.data())
def test_unit_cost_formulas_gpipe_1f1b(name, p, m, data):
    cost = data.draw(cost_models(p, uniform=True))
    timeline = simulate(compile_program(name, p, m), cost, check=False)
    assert timeline.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-9)
    expected = (m,) * p if name == "gpipe" else tuple(min(p - r, m) for r in range(p))
    assert timeline.peak_inflight == expected


@given(st.integers(1, 16), st.integers(1, 4), st.integers(1, 4), st.data())
def test_unit_cost_formula_interleaved(p, rounds, v, data):
    m = p * rounds
    cost = data.draw(cost_models(p * v, uniform=True))
    timeline = simulate(compile_program("interleaved-1f1b", p, m, v), cost, check=False)
    assert timeline.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-9)
    # the README's closed form: Megatron's warmup of (v-1)p + 2(p-1-r) forwards, plus the steady state's one
    assert timeline.peak_inflight == tuple(min((v - 1) * p + 2 * (p - 1 - r) + 1, v * m) for r in range(p))


@given(schedule_configs(max_ranks=8, max_microbatches=32, recompute=True))
def test_programs_with_recompute_validate(config):
    program = config.compile()
    check_program(program)
    recomputes = sum(i.op is Op.R for s in program.ranks for i in s)
    assert recomputes == program.num_stages * program.num_microbatches


@given(schedule_configs(max_ranks=8, max_microbatches=32))
def test_lowering_costs_no_time(config):
    """The lowered program simulates exactly like its compute-only source (free messages)."""
    from pipesched import build

    source = build(config.schedule, config.num_ranks, config.num_microbatches, config.virtual_stages)
    lowered = compile_program(config.schedule, config.num_ranks, config.num_microbatches, config.virtual_stages)
    cost = CostModel(forward=1.3, backward=1.9)
    assert simulate(lowered, cost).makespan == pytest.approx(simulate(source, cost).makespan)
