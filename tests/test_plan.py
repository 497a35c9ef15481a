"""The planner (pipesched.planner, plan_search, plan_bounds): every returned candidate fits the budget in the
simulator, the bounds it prunes with hold, plans are deterministic and ranked, the winner is never predicted slower
than the default configuration, and bad input names the argument."""
import json
import math

import pytest
from hypothesis import given, settings, strategies as st

import pipesched as ps
from pipesched.memory import peak_activation_bytes
from pipesched.plan_bounds import activation_peak, compute_order, stage_costs, static_bytes, step_time_bound
from pipesched.planner import Candidate, Plan, PlanError, pipeline_kwargs, plan, predict
from pipesched.profile import LayerProfile

MiB = 2**20


def gpt_profile(layers=8, forward=1e-3, param=4 * MiB, stash=8 * MiB, out=1 * MiB) -> LayerProfile:
    return LayerProfile(forward=[forward] * layers, input_grad=[forward] * layers, weight_grad=[forward] * layers,
                        activation_bytes=[stash] * layers, output_bytes=[out] * layers, param_bytes=[param] * layers,
                        microbatch_size=1, input_bytes=out, latency=1e-5, bandwidth=1e9,
                        layer_names=["Block"] * layers)


@st.composite
def profiles(draw, max_layers=6):
    n = draw(st.integers(2, max_layers))
    seconds = st.lists(st.floats(1e-4, 1e-2), min_size=n, max_size=n)
    sizes = st.lists(st.integers(0, 64 * MiB), min_size=n, max_size=n)
    return LayerProfile(forward=draw(seconds), input_grad=draw(seconds),
                        weight_grad=draw(st.lists(st.floats(0, 1e-2), min_size=n, max_size=n)),
                        activation_bytes=draw(sizes), output_bytes=draw(sizes), param_bytes=draw(sizes),
                        microbatch_size=draw(st.integers(1, 4)), input_bytes=draw(st.integers(0, 8 * MiB)),
                        latency=draw(st.sampled_from([0.0, 1e-4])), bandwidth=draw(st.sampled_from([math.inf, 1e8])))


def simulated(profile, cand: Candidate):
    """The candidate's program compiled and simulated from scratch: (makespan, peak bytes per rank)."""
    program = ps.compile_program(cand.schedule, cand.pp, cand.num_microbatches, cand.virtual_stages,
                                 dp_size=cand.dp, recompute=list(cand.recompute) if any(cand.recompute) else False,
                                 split_backward=cand.split_backward)
    cost = profile.scaled(cand.microbatch_size).costs(cand.balance)
    timeline = ps.simulate(program, cost)
    acts = timeline.peak_activation_bytes or (0.0,) * cand.pp
    params = [0.0] * cand.pp
    for s, r in enumerate(program.stage_to_rank):
        params[r] += cost.per_stage("grad_bytes", program.num_stages)[s] * 4  # + grads + AdamW's 2 states
    return timeline.makespan, tuple(p + a for p, a in zip(params, acts))


def ranked(result) -> bool:
    """Step times in order, to 9 significant digits (ties go to the simpler configuration: equal times summed in
    another order differ in their last bits)."""
    times = [c.step_time for c in result]
    return all(a <= b * (1 + 1e-9) for a, b in zip(times, times[1:]))


@settings(max_examples=40)
@given(profiles(), st.integers(1, 4), st.floats(0.05, 1.0), st.sampled_from([4, 8, 12]))
def test_every_candidate_fits_the_budget_in_the_simulator(profile, world, fraction, batch):
    # the budget: a fraction of what the whole model needs in one process, so some plans recompute, some fail
    whole = 4 * sum(profile.param_bytes) + batch / profile.microbatch_size * sum(profile.activation_bytes)
    budget = max(1.0, fraction * whole)
    try:
        result = plan(profile, world, budget, batch, top=3, max_microbatches=4)
    except PlanError as exc:
        assert exc.smallest > budget
        assert exc.argument == "memory_per_rank"
        again = plan(profile, world, exc.smallest, batch, top=1, max_microbatches=4)  # that much does fit
        assert max(again.best.peak_memory) <= exc.smallest
        return
    except ValueError as exc:  # no dp divides the batch: only when world has no divisor dp with batch % dp == 0
        assert "global_batch" in str(exc)
        return
    assert 1 <= len(result) <= 3
    for cand in result:
        time, peaks = simulated(profile, cand)
        assert time == pytest.approx(cand.step_time, rel=1e-12)
        assert peaks == pytest.approx(cand.peak_memory, rel=1e-12)
        assert max(peaks) <= budget
        assert cand.pp * cand.dp == world and batch % (cand.dp * cand.num_microbatches) == 0
    assert ranked(result)


CONFIGS = st.sampled_from([("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-h2", 1),
                           ("zbv", 2), ("dualpipev", 2)])


@settings(max_examples=60)
@given(profiles(max_layers=8), CONFIGS, st.integers(1, 3), st.integers(1, 6), st.integers(1, 3), st.data())
def test_bounds_hold_and_memory_walk_is_the_simulators(profile, config, p, m, dp, data):
    name, v = config
    S = p * v
    if S > profile.num_layers:
        return
    L = profile.num_layers
    cuts = sorted(data.draw(st.lists(st.integers(1, L - 1), unique=True, min_size=S - 1, max_size=S - 1)))
    balance = tuple(b - a for a, b in zip([0] + cuts, cuts + [L]))
    recompute = data.draw(st.lists(st.booleans(), min_size=S, max_size=S))
    split = data.draw(st.booleans()) and name in ("gpipe", "1f1b", "interleaved-1f1b", "dualpipev")
    cost = profile.costs(balance)
    program = ps.compile_program(name, p, m, v, dp_size=dp, recompute=recompute, split_backward=split)
    timeline = ps.simulate(program, cost)
    c = stage_costs(cost, program.stage_to_rank, dp)
    has_iw = split or name in ("zb-h1", "zb-h2", "zbv", "dualpipev")
    assert step_time_bound(c, program.stage_to_rank, m, has_iw) <= timeline.makespan * (1 + 1e-12)
    bare = ps.compile_program(name, p, m, v, split_backward=split)  # no recompute, no dp: the same compute order
    walked = tuple(activation_peak(order, c, recompute) for order in compute_order(bare))
    assert walked == pytest.approx(peak_activation_bytes(program, cost) or (0.0,) * p, rel=1e-12, abs=1e-6)
    static = static_bytes(c, program.stage_to_rank, p, 2.0)
    assert sum(static) == pytest.approx(4 * sum(profile.param_bytes))


def test_deterministic_and_ranked():
    profile = gpt_profile(12)
    first = plan(profile, 8, 2**40, 64, top=6)
    second = plan(profile, 8, 2**40, 64, top=6)
    assert first == second and first.reason == second.reason
    assert ranked(first)
    assert len(first) == 6 and first.best is first[0]
    assert first.simulated <= first.considered


def test_winner_is_never_slower_than_the_default():
    # skewed layers: time balance and schedule choice matter; the default (1f1b, m=8, even cut) is in the space
    widths = [1, 8, 1, 1, 8, 1, 1, 1]
    profile = LayerProfile(forward=[w * 1e-3 for w in widths], input_grad=[w * 1e-3 for w in widths],
                           weight_grad=[w * 1e-3 for w in widths], activation_bytes=[w * MiB for w in widths],
                           output_bytes=[MiB] * 8, param_bytes=[w * MiB for w in widths], microbatch_size=1)
    for world in (2, 4):
        default = predict(profile, 32, "1f1b", pp=world, num_microbatches=8)
        assert default.balance == (8 // world,) * world
        best = plan(profile, world, 2**40, 32).best
        assert best.step_time <= default.step_time
    assert best.step_time < 0.8 * default.step_time  # on 4 ranks the skew costs the default a lot


def test_memory_pressure_makes_it_recompute_then_fail():
    profile = gpt_profile(8)
    roomy = plan(profile, 4, 2**40, 32, schedules=["1f1b"]).best
    assert not any(roomy.recompute)
    need = max(roomy.peak_memory)
    tight = plan(profile, 4, need * 0.7, 32, schedules=["1f1b"])
    assert all(max(c.peak_memory) <= need * 0.7 for c in tight)
    with pytest.raises(PlanError) as info:
        plan(profile, 4, 10 * MiB, 32, schedules=["1f1b"])
    exc = info.value
    assert exc.smallest > 10 * MiB and all(exc.candidate.recompute)
    assert f"{int(math.ceil(exc.smallest))} bytes" in str(exc) and "1f1b pp=" in str(exc)
    assert "memory_per_rank=10 MiB" in str(exc)
    assert plan(profile, 4, exc.smallest, 32, schedules=["1f1b"], top=1).best.peak_memory  # exactly enough fits
    with pytest.raises(PlanError):
        plan(profile, 4, exc.smallest * 0.999, 32, schedules=["1f1b"], top=1)


@pytest.mark.parametrize("kwargs, words", [
    (dict(world_size=0), ["world_size", "0", ">= 1"]),
    (dict(global_batch=0), ["global_batch", ">= 1"]),
    (dict(world_size=16, global_batch=3), ["global_batch=3", "divisible by 2"]),
    (dict(memory_per_rank=-1), ["memory_per_rank", "-1"]),
    (dict(schedules=["nope"]), ["schedules", "nope", "1f1b"]),
    (dict(num_layers=5), ["5", "8 layers", "another model"]),
    # a count that is no count: "profile has 8 layers but the model has 8: the profile is of another model" before
    (dict(num_layers="8"), ["num_layers must be an integer >= 1, got '8'"]),
    (dict(num_layers=-1), ["num_layers must be an integer >= 1, got -1"]),
    (dict(optimizer_states=-1), ["optimizer_states", "-1"]),
])
def test_bad_input_names_the_argument(kwargs, words):
    args = dict(profile=gpt_profile(8), world_size=4, memory_per_rank=2**40, global_batch=32)
    args.update(kwargs)
    with pytest.raises(ValueError) as info:
        plan(**args)
    for word in words:
        assert word in str(info.value)


def test_pipeline_kwargs_checks_the_model_and_the_job():
    result = plan(gpt_profile(8), 4, 2**40, 32, top=1)
    best = result.best
    kwargs = pipeline_kwargs(result, 8, 4, ["Block"] * 8)
    assert kwargs["schedule"] == best.schedule and kwargs["dp_size"] == best.dp
    assert kwargs["balance"] == list(best.balance) and kwargs["num_microbatches"] == best.num_microbatches
    with pytest.raises(ValueError, match="8 layers but this model has 7"):
        pipeline_kwargs(result, 7, 4)
    with pytest.raises(ValueError, match="world size pp x dp .* but the job has 2 ranks"):
        pipeline_kwargs(best, 8, 2)
    with pytest.raises(ValueError, match="layer 0 is a Block but the model's is a Linear"):
        pipeline_kwargs(result, 8, 4, ["Linear"] * 8)
    with pytest.raises(TypeError):
        pipeline_kwargs({"schedule": "1f1b"}, 8, 4)


def test_json_form():
    result = plan(gpt_profile(8), 4, 2**40, 32, top=2)
    data = result.to_json()
    assert list(data) == ["candidates"] and len(data["candidates"]) == 2
    assert set(data["candidates"][0]) == {"schedule", "pp", "dp", "num_microbatches", "virtual_stages", "balance",
                                          "recompute", "split_backward", "microbatch_size", "step_time",
                                          "bubble_fraction", "peak_memory", "layer_names",  # the profile's
                                          "costs"}  # what the plan simulated it with
    first = data["candidates"][0]
    assert first["step_time"] == result.best.step_time and len(first["peak_memory"]) == result.best.pp
    assert all(isinstance(b, int) for b in first["peak_memory"])
    assert isinstance(result, Plan)
    # a CLI plan read back in a training script builds what the planner chose (peak memory rounded up to bytes)
    back = Candidate.from_json(json.loads(json.dumps(first)))
    best = result.best
    assert (back.schedule, back.pp, back.dp, back.num_microbatches, back.virtual_stages, back.balance,
            back.recompute, back.split_backward, back.microbatch_size) == (
        best.schedule, best.pp, best.dp, best.num_microbatches, best.virtual_stages, best.balance, best.recompute,
        best.split_backward, best.microbatch_size)
    with pytest.raises(ValueError, match=r"missing \['balance'\]"):
        Candidate.from_json({k: v for k, v in first.items() if k != "balance"})


def test_one_pipeline_rank_searches_no_virtual_stages():
    profile = gpt_profile(8)
    result = plan(profile, 2, 2**40, 16, top=50)
    assert not [c.describe() for c in result if c.pp == 1 and (c.virtual_stages > 1 or c.split_backward)]
    assert any(c.pp == 1 for c in result) and any(c.virtual_stages > 1 for c in result if c.pp == 2)
    alone = plan(profile, 1, 2**40, 16, schedules=["interleaved-1f1b"])  # nothing else runs pp=1: kept
    assert {c.virtual_stages for c in alone} <= {2, 4} and len(alone) >= 1


def fixed_profile(fixed):
    """2 layers profiled on microbatches of 4; ``fixed`` of each time does not shrink with the microbatch."""
    return LayerProfile(forward=[4e-3, 4e-3], input_grad=[4e-3, 4e-3], weight_grad=[4e-3, 4e-3],
                        activation_bytes=[MiB] * 2, output_bytes=[MiB] * 2, param_bytes=[MiB] * 2,
                        microbatch_size=4, forward_fixed=[fixed] * 2, input_grad_fixed=[fixed] * 2,
                        weight_grad_fixed=[fixed] * 2)


def test_the_prediction_scales_the_profile_affinely():
    # one rank, 16 samples in m microbatches of 16/m: m x 2 layers x (F + I + W) of fixed + (4 ms - fixed) x 4/m
    for fixed in (0.0, 1e-3):
        for m in (1, 4, 16):
            got = predict(fixed_profile(fixed), 16, "1f1b", pp=1, num_microbatches=m).step_time
            assert got == pytest.approx(m * 2 * 3 * (fixed + (4e-3 - fixed) * 16 / m / 4), rel=1e-9), (fixed, m)
    # with fixed parts fewer, larger microbatches win on one rank; without, every m ties (memory decides)
    assert plan(fixed_profile(1e-3), 1, 2**40, 16).best.num_microbatches == 1
    flat = plan(fixed_profile(0.0), 1, 2**40, 16, top=3)
    assert flat[0].step_time == pytest.approx(flat[2].step_time, rel=1e-9)
    assert flat.best.num_microbatches == 8  # the tie goes to less memory: the largest m tried (max(8, 4 x pp))
