"""The simulator: hand-computed timelines, closed forms, costs, memory and its errors."""
import json
import math
import re

import pytest

from pipesched import (CostModel, DeadlockError, Event, Instr, Op, Timeline, build, compile_program, loads,
                       simulate)


def test_hand_computed_timeline_with_message_delay():
    # F=1, B=2, each message 0.5 s latency + 100 B at 200 B/s
    cost = CostModel(forward=1, backward=2, latency=0.5, bandwidth=200, activation_bytes=100)
    timeline = simulate(compile_program("1f1b", 2, 1), cost)
    compute = {(e.rank, str(e.instr)): (e.start, e.end) for e in timeline.events if e.instr.op.value in "FB"}
    assert compute == {(0, "F0.0"): (0, 1), (1, "F1.0"): (2, 3), (1, "B1.0"): (3, 5), (0, "B0.0"): (6, 8)}
    assert timeline.makespan == 8
    assert timeline.bubble_per_rank() == (5 / 8, 5 / 8)
    assert timeline.bubble_fraction == 5 / 8


def test_hand_computed_timeline_with_per_stage_message_sizes():
    # p=3, m=1, F=1, B=2, 100 B/s, no latency. Stage 0's output is 100 B (1 s), stage 1's 300 B (3 s); the
    # gradient of a stage's input has the size of the previous stage's output: grad into stage 1 300 B, into stage 0 100 B
    cost = CostModel(forward=1, backward=2, bandwidth=100, activation_bytes=[100, 300, 0])
    timeline = simulate(compile_program("1f1b", 3, 1), cost)
    events = {(e.rank, str(e.instr)): (e.start, e.end) for e in timeline.events}
    assert events == {
        (0, "F0.0"): (0, 1), (0, "SEND_F0.0>1"): (1, 1), (0, "RECV_B0.0<1"): (1, 15), (0, "B0.0"): (15, 17),
        (1, "RECV_F1.0<0"): (0, 2), (1, "F1.0"): (2, 3), (1, "SEND_F1.0>2"): (3, 3), (1, "RECV_B1.0<2"): (3, 12),
        (1, "B1.0"): (12, 14), (1, "SEND_B1.0>0"): (14, 14),
        (2, "RECV_F2.0<1"): (0, 6), (2, "F2.0"): (6, 7), (2, "B2.0"): (7, 9), (2, "SEND_B2.0>1"): (9, 9),
    }
    assert timeline.makespan == 17
    # the compute-only program, whose messages are implicit, is timed the same
    implicit = simulate(build("1f1b", 3, 1), cost)
    assert {(e.rank, str(e.instr)): (e.start, e.end) for e in implicit.events} == {
        key: times for key, times in events.items() if "SEND" not in key[1] and "RECV" not in key[1]}


@pytest.mark.parametrize("f, b", [(1, 1), (1, 2), (2, 1), (0.3, 0.7)])
@pytest.mark.parametrize("p, m", [(1, 1), (2, 5), (4, 8), (4, 3), (8, 16)])
def test_gpipe_and_1f1b_closed_forms(f, b, p, m):
    for name in ("gpipe", "1f1b"):
        timeline = simulate(compile_program(name, p, m), CostModel(forward=f, backward=b))
        assert timeline.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
        assert timeline.makespan == pytest.approx((m + p - 1) * (f + b))
    assert simulate(compile_program("gpipe", p, m)).peak_inflight == (m,) * p
    assert simulate(compile_program("1f1b", p, m)).peak_inflight == tuple(min(p - r, m) for r in range(p))


@pytest.mark.parametrize("p, m, v", [(2, 4, 2), (4, 8, 2), (4, 12, 3), (3, 6, 4)])
def test_interleaved_closed_form(p, m, v):
    timeline = simulate(compile_program("interleaved-1f1b", p, m, v), CostModel(forward=1, backward=2))
    assert timeline.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)


def test_per_stage_costs_and_imbalance():
    timeline = simulate(compile_program("gpipe", 2, 1), CostModel(forward=[1, 3], backward=[2, 6]))
    assert timeline.makespan == 12  # 1 + 3 + 6 + 2
    assert timeline.busy_per_rank() == (3, 9)


def test_activation_memory_with_and_without_recompute():
    cost = CostModel(activation_bytes=10, stash_bytes=100)
    plain = simulate(compile_program("gpipe", 2, 4), cost)
    recomputed = simulate(compile_program("gpipe", 2, 4, recompute=True), cost)
    assert plain.peak_activation_bytes == (400, 400)
    # the inputs of the 3 other microbatches (10 B each) plus one recomputed microbatch: by default
    # max(stash, input) = 100 B (its input is among the saved tensors) ...
    assert recomputed.peak_activation_bytes == (130, 130)
    # ... or what the model really holds after R, e.g. an input the forward does not save: 10 + 100 B
    cost = CostModel(activation_bytes=10, stash_bytes=100, recompute_bytes=110)
    assert simulate(compile_program("gpipe", 2, 4, recompute=True), cost).peak_activation_bytes == (140, 140)


def test_all_reduce_is_asynchronous_and_counts_in_makespan():
    cost = CostModel(grad_bytes=1000, bandwidth=100)  # ring over 2 replicas moves 1000 B: 10 s
    timeline = simulate(compile_program("gpipe", 1, 1, dp_size=2), cost)
    assert timeline.makespan == 3 + 10
    assert timeline.busy_per_rank() == (3,)


def test_cost_list_of_wrong_length_is_refused():
    with pytest.raises(ValueError, match="cost forward has 3 values but the program has 2 stages"):
        simulate(compile_program("1f1b", 2, 2), CostModel(forward=[1, 1, 1]))


def test_deadlock_is_the_validators_error():
    program = loads("microbatches: 2\nstage_to_rank: 0 1\nrank 0: F0.0 B0.0 F0.1 B0.1\nrank 1: F1.1 F1.0 B1.0 B1.1\n")
    with pytest.raises(DeadlockError, match="deadlock"):
        simulate(program)


@pytest.mark.parametrize("kwargs, message", [
    ({"forward": float("inf")}, "cost forward must be a finite number >= 0 (seconds), got inf"),
    ({"forward": "1"}, "cost forward must be a number or a sequence of numbers (one per stage, in stage order: a list, "
                       "tuple or 1-d array), got '1'"),
    # a mapping's keys were taken as the costs (forward={0: 7.0, 1: 7.0} simulated F = 0 and 1 s), a set's order is
    # arbitrary: both refused (the docstring audit)
    ({"forward": {0: 7.0, 1: 7.0}}, "cost forward must be a number or a sequence of numbers (one per stage, in stage "
                                    "order: a list, tuple or 1-d array), got {0: 7.0, 1: 7.0}"),
    ({"backward": {2.0, 3.0}}, "cost backward must be a number or a sequence of numbers (one per stage, in stage "
                               "order: a list, tuple or 1-d array), got {2.0, 3.0}"),
    ({"backward": [1, -2]}, "cost backward must be a finite number >= 0 (seconds), got -2"),
    ({"latency": -1}, "cost latency must be a finite number >= 0 (seconds), got -1"),
    ({"bandwidth": 0}, "cost bandwidth must be a number of bytes/s > 0 (inf: free transfers), got 0"),
])
def test_bad_costs_are_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        CostModel(**kwargs)


def test_a_cost_list_changed_after_construction_does_not_change_the_checked_costs():
    forward = [1.0, 1.0]
    costs = CostModel(forward=forward)
    forward[0] = -50.0  # the list was held by reference: a bubble fraction of 1.79 followed
    assert costs.forward == (1.0, 1.0)
    assert hash(costs) == hash(CostModel(forward=(1.0, 1.0)))  # frozen and hashable, equal to the tuple form
    assert costs == CostModel(forward=(1.0, 1.0))


def test_per_stage_and_message_seconds_refuse_what_is_not_theirs():
    with pytest.raises(ValueError, match=r"per_stage: name 'nope' is not a per-stage cost; valid: forward, backward"):
        CostModel().per_stage("nope", 2)
    with pytest.raises(ValueError, match=r"message_seconds: nbytes must be a finite number of bytes >= 0, got -5"):
        CostModel(latency=0.5).message_seconds(-5)
    assert CostModel(latency=0.5, bandwidth=10.0).message_seconds(5) == 1.0


def test_a_timeline_of_one_rank_leaves_the_others_bubbles_unknown_not_idle():
    # rank 1 of 2: busy 3 of its 4 s; rank 0 is not in this timeline (as Pipeline.timeline() on rank 1)
    events = (Event(1, Instr(Op.F, 1, 0), 0.0, 1.0), Event(1, Instr(Op.B, 1, 0), 2.0, 4.0))
    one = Timeline(events, 2, "measured", ranks=(1,))
    bubbles = one.bubble_per_rank()
    assert math.isnan(bubbles[0]) and bubbles[1] == 0.25
    assert one.bubble_fraction == 0.25  # over the ranks held; counting rank 0 as idle would give 0.625
    assert Timeline(events, 2, "measured").bubble_fraction == 0.625
    one = Timeline(events, 2, "measured", ranks=(1,), peak_activation_bytes=(math.nan, 4096.0))
    text = json.dumps(one.to_json_dict(), allow_nan=False)  # strict JSON: no NaN literal for the rank not held
    back = Timeline.from_json_dict(json.loads(text))
    assert back.ranks == (1,) and back.bubble_fraction == 0.25
    assert math.isnan(back.peak_activation_bytes[0]) and back.peak_activation_bytes[1] == 4096.0


def test_recompute_with_default_sizes_never_peaks_higher_than_without():
    from hypothesis import given, strategies as st

    @given(st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b"]), st.integers(1, 4), st.integers(1, 9),
           st.integers(1, 3), st.booleans(), st.data())
    def check(name, p, m, v, split, data):
        v = v if name == "interleaved-1f1b" else 1
        sizes = st.lists(st.integers(0, 100), min_size=p * v, max_size=p * v)
        cost = CostModel(activation_bytes=data.draw(sizes), stash_bytes=data.draw(sizes))
        plain = simulate(compile_program(name, p, m, v, split_backward=split), cost).peak_activation_bytes
        redone = simulate(compile_program(name, p, m, v, recompute=True, split_backward=split),
                          cost).peak_activation_bytes
        assert plain is None or all(r <= q for r, q in zip(redone, plain))

    check()


def test_one_half_of_the_split_backward_given_makes_the_other_the_rest_of_b():
    # the split backward does B's work once: I + W = B whenever one half is left to its default
    assert CostModel(backward=4, weight_grad=3).per_stage("input_grad", 2) == (1.0, 1.0)
    assert CostModel(backward=[2, 4], input_grad=0.5).per_stage("weight_grad", 2) == (1.5, 3.5)
    assert CostModel(backward=4).per_stage("input_grad", 1) == CostModel(backward=4).per_stage("weight_grad", 1) \
        == (2.0,)
    assert CostModel(backward=4, input_grad=1, weight_grad=1).per_stage("weight_grad", 1) == (1.0,)  # both given
    with pytest.raises(ValueError, match=re.escape("cost input_grad defaults to backward - weight_grad, but "
                                                   "weight_grad (3.0 for stage 0) exceeds backward (2.0): give "
                                                   "input_grad too, or a backward >= weight_grad")) as info:
        CostModel(weight_grad=3).per_stage("input_grad", 1)
    assert info.value.field == "weight_grad"
    # one rounding step over B is B: 0.1 + 0.2 given for a B of 0.3 leaves a W of 0, not an error
    assert CostModel(backward=0.3, input_grad=0.1 + 0.2).per_stage("weight_grad", 1) == (0.0,)
    # what the simulator then charges: zb-h1 on one rank, one microbatch runs F, I, W back to back
    program = compile_program("zb-h1", 1, 1)
    assert simulate(program, CostModel(forward=1, backward=4, weight_grad=3)).makespan == 1 + 1 + 3
