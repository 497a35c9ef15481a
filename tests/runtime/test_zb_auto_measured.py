"""zb-auto in Pipeline without ``costs=``: the first step runs a safe program and measures F, I, W (R) per stage and
the message latency; every rank agrees on one CostModel and runs zb-auto compiled from it from the second step on.
Gradients bitwise the unsplit model's (one microbatch at a time) on every step, on 2 ranks and DP x PP = 2 x 2;
plus the cost derivation from a synthetic step record (no processes)."""
import math

import pytest

import pipesched as ps
from pipesched.ir import Instr, Op
from pipesched.runtime import launch
from pipesched.runtime.measured_costs import (MeasurePlan, activation_bytes, combine, cost_model, cost_vector,
                                              replicas_max, safe_program, stage_seconds)

import rt_zb_auto_measured as rt


@pytest.fixture(scope="module")
def two():
    return launch(rt.suite_two, 2, timeout=300)


@pytest.fixture(scope="module")
def four():
    return launch(rt.suite_four, 4, timeout=300)


def _cases(two, four):
    return [(name, [res[name] for res in two]) for name in ("default", "tight")] + [("dp", [res["dp"] for res in four])]


def _check_case(name, per_rank, safe_schedule, ops):
    for case in per_rank:
        assert case["before"]["schedule"] == safe_schedule and case["before"]["costs"] is None, (name, case["before"])
        assert set(case["before"]["ops"]) >= ops and "B" not in case["before"]["ops"], case["before"]
        if "forward_equal" in case and case["pp_rank"] == 1:  # the last stage's rank gets the output
            assert case["forward_equal"] is True, name
        for k, step in enumerate(case["steps"]):
            assert step["loss_equal"] is True and step["bitwise"] is True and step["grads"] == 4, (name, k, step)
            assert step["schedule"] == "zb-auto", (name, k, step["schedule"])  # switched at the end of step 1
            assert set(step["ran"]) >= ops and "B" not in step["ran"], (name, k, step["ran"])
            assert step["ran_stream"] is True, (name, k)  # step 1: the safe program; then zb-auto's
        assert case["params_equal"] is True, name


def test_two_ranks_default_limit_bitwise(two):
    _check_case("default", [res["default"] for res in two], "zb-h1", {"F", "I", "W"})


def test_two_ranks_recompute_tight_limit_bitwise(two):
    # zb-h1 holds 2 in flight: over the limit of 1, so the safe program is zb-auto for the default costs
    _check_case("tight", [res["tight"] for res in two], "zb-auto", {"F", "R", "I", "W"})


def test_dp_2x2_bitwise(four):
    per_rank = [res["dp"] for res in four]
    assert sorted((c["dp_rank"], c["pp_rank"]) for c in per_rank) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    _check_case("dp", per_rank, "zb-h1", {"F", "I", "W"})


def test_costs_one_positive_entry_per_stage_identical_on_every_rank(two, four):
    for name, per_rank in _cases(two, four):
        costs = [step["costs"] for case in per_rank for step in case["steps"]]
        assert all(c == costs[0] for c in costs), name  # every rank, every step after the switch: the same floats
        c = costs[0]
        assert c["type"] == "CostModel" and c["bandwidth"] == math.inf, (name, c)
        for field in ("forward", "input_grad", "weight_grad"):
            assert len(c[field]) == 2 and all(t > 0 for t in c[field]), (name, field, c)
        assert c["backward"] == tuple(i + w for i, w in zip(c["input_grad"], c["weight_grad"])), (name, c)
        assert c["latency"] >= 0 and c["send_overhead"] > 0, (name, c)  # the safe program's SENDs took time
        assert c["recompute_given"] is (name == "tight"), (name, c)
        if name == "tight":
            assert all(t > 0 for t in c["recompute"]), c


def test_program_is_zb_auto_compiled_from_the_agreed_costs(two, four):
    for name, per_rank in _cases(two, four):
        prints = {case["steps"][-1]["fingerprint"] for case in per_rank}
        assert len(prints) == 1, (name, prints)  # every rank runs the same program
        for case in per_rank:
            assert case["program_equal"] is True and case["expected_fingerprint"] in prints, name
            assert {s["fingerprint"] for s in case["steps"]} == prints, name  # chosen once, after the first step


def test_tied_parameters_keep_their_tie_reduce_after_the_switch(two):
    for res in two:
        assert res["tied"] == [{"loss_equal": True, "close": True, "schedule": "zb-auto", "tie_reduce": True}] * 2


def test_costs_given_on_one_rank_only_are_refused_on_every_rank(two):
    for res in two:
        assert res["mismatch"] is not None and "built its Pipeline with costs=" in res["mismatch"], res["mismatch"]
        assert "None (measured in the first step)" in res["mismatch"] and "CostModel(" in res["mismatch"]


# ---- the cost derivation, no processes ---------------------------------------------------------------------------

def _record(spans):
    """(instr, start, end) events of a synthetic step: ``spans`` is ``[(text, seconds), ...]`` run back to back."""
    at, events = 0.0, []
    for text, seconds in spans:
        events.append((Instr.parse(text), at, at + seconds))
        at += seconds
    return events


def test_stage_seconds_are_per_stage_medians_of_f_i_w_r():
    events = _record([("F0.0", 0.9), ("F0.1", 0.1), ("F0.2", 0.2), ("SEND_F0.0>1", 5.0), ("RECV_B0.0<1", 7.0),
                         ("I0.0", 0.3), ("W0.0", 0.05), ("I0.1", 0.4), ("W0.1", 0.07), ("I0.2", 0.5),
                         ("W0.2", 0.0), ("F2.0", 3.0)])
    got = stage_seconds(events, (0,))
    assert got == {0: {Op.F: pytest.approx(0.2), Op.I: pytest.approx(0.4), Op.W: pytest.approx(0.05)}}
    assert stage_seconds(_record([("W1.0", 0.0)]), (1,)) == {1: {Op.W: 1e-9}}  # 0 s is one timer tick


def test_costs_combine_each_stage_from_its_owner_and_replicas_by_max():
    # pipeline rank 0 owns stage 0, rank 1 stage 1 (contiguous); each knows only its own
    rank0 = cost_vector({0: {Op.F: 1.0, Op.I: 2.0, Op.W: 3.0}}, 2, latency=0.25, send_overhead=0.0625)
    rank1 = cost_vector({1: {Op.F: 4.0, Op.I: 5.0, Op.W: 6.0}}, 2, latency=0.0, send_overhead=0.125)
    assert rank0 == [1.0, 0.0, 2.0, 0.0, 3.0, 0.0, 0.0, 0.0, 0.25, 0.0625]
    replica0 = combine([rank0, rank1], (0, 1))
    assert replica0 == [1.0, 4.0, 2.0, 5.0, 3.0, 6.0, 0.0, 0.0, 0.25, 0.125]  # the largest latency, overhead
    # a V-like placement: stage 0 and 3 on rank 0, so combine must follow stage_to_rank, not stage index
    rows = [cost_vector({0: {Op.F: 1.0}, 3: {Op.F: 4.0}}, 4, 9.0),
            cost_vector({1: {Op.F: 2.0}, 2: {Op.F: 3.0}}, 4, 8.0)]
    assert combine(rows, (0, 1, 1, 0))[:4] == [1.0, 2.0, 3.0, 4.0] and combine(rows, (0, 1, 1, 0))[-2:] == [9.0, 0.0]
    replica1 = [1.5, 3.0, 2.0, 5.5, 2.0, 6.0, 0.0, 0.0, 0.5, 0.0625]
    agreed = replicas_max([replica0, replica1])
    assert agreed == replicas_max([replica1, replica0]) == [1.5, 4.0, 2.0, 5.5, 3.0, 6.0, 0.0, 0.0, 0.5, 0.125]
    costs = cost_model(agreed, 2)
    assert costs == ps.CostModel(forward=(1.5, 4.0), backward=(5.0, 11.5), input_grad=(2.0, 5.5),
                                 weight_grad=(3.0, 6.0), recompute=None, latency=0.5, send_overhead=0.125)
    with_r = cost_model([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.5, 0.75, 0.0, 0.0], 2)
    assert with_r.recompute == (0.5, 0.75)
    with pytest.raises(ValueError, match=r"no measured I time for stages \[1\]"):
        cost_model([1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0], 2)


def test_activation_bytes_is_the_largest_send_f_to_the_peer():
    sent = {Instr.parse("SEND_F0.0>1"): 96, Instr.parse("SEND_F0.1>1"): 2144, Instr.parse("SEND_B1.0>0"): 5000}
    assert activation_bytes(sent, 1) == 2144
    assert activation_bytes(sent, 2) == 8  # nothing sent there: a minimal ping


def test_safe_program_keeps_the_memory_limit():
    plan = MeasurePlan(4, 8, 1, False, False, None, None)
    assert safe_program(plan).schedule == "zb-h1"
    tight = safe_program(plan._replace(memory_limit=2))
    assert tight.schedule == "zb-auto" and max(ps.simulate(tight, ps.CostModel()).peak_inflight) <= 2
    with pytest.raises(ps.ScheduleArgumentError, match="memory_limit"):
        safe_program(plan._replace(memory_limit=0))
    with pytest.raises(ps.ScheduleArgumentError, match="virtual_stages"):
        safe_program(plan, virtual_stages=2)


def test_a_memory_limit_given_on_one_rank_only_is_refused_at_construction_on_every_rank(two):
    for rank, res in enumerate(two):
        assert res["limit_mismatch"] == (
            f"world rank {1 - rank} built its Pipeline with memory_limit={[2, 2] if rank else [3, 3]} but world rank "
            f"{rank} with memory_limit={[3, 3] if rank else [2, 2]}; every rank must construct Pipeline with the same "
            f"arguments (and the same model)"), res["limit_mismatch"]
