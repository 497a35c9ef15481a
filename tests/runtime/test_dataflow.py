"""Shapes learned per input signature: changing sequence lengths, forward-only calls between steps."""
import math

import torch

import pytest

from pipesched import compile_program, step_programs
from pipesched.protocol import step_posts
from pipesched.runtime.wire import TAG_LOSS, tag_of
from rt_cases import SCHEDULES

pytestmark = pytest.mark.multiprocess


def test_sequence_length_changes_and_forward_only_calls(two_ranks):
    expected_order = [("forward", 5), ("step", 5), ("forward", 6), ("step", 7), ("step", 5), ("forward", 7)]
    for rank, results in enumerate(two_ranks):
        seq = results["seq"]
        assert [(k, t) for k, t, _ in seq["results"]] == expected_order
        # rank 0 gets None from forward(); rank 1 (last stage) the reference output, bitwise; steps bitwise
        assert [ok for _, _, ok in seq["results"]] == [True] * 6, (rank, seq)
        # forward T=5, step T=5, forward T=6, step T=7, forward T=7: five signatures (step T=5 is reused)
        assert seq["signatures"] == 5


def test_gathered_timeline_has_every_instruction_of_both_ranks(two_ranks):
    tl = two_ranks[0]["gathered"]
    assert tl.source == "measured" and tl.num_ranks == 2
    assert [sum(e.rank == r for e in tl.events) for r in (0, 1)] == [16, 16]  # 1f1b, p=2, m=4
    assert all(e.end >= e.start >= 0 for e in tl.events)
    assert 0.0 <= tl.bubble_fraction < 1.0
    assert tl.peak_inflight == (2, 1)
    assert all(b > 0 and not math.isnan(b) for b in tl.peak_activation_bytes)
    # the same timeline on both ranks
    assert two_ranks[1]["gathered"].events == tl.events


def test_a_closed_pipeline_refuses_steps(two_ranks):
    assert [r["closed"] for r in two_ranks] == ["this Pipeline was closed; create a new one"] * 2


def test_rejected_inputs_are_plain_value_errors_with_the_checking_ranks_message_on_every_rank(two_ranks):
    small = "batch size 3 is smaller than num_microbatches=4; every microbatch needs at least one sample " \
            "(use a batch of >= 4)"
    no_x = "the rank of stage 0 (pipeline rank 0) got no input x; pass the batch as x there"
    no_target = "step() needs target on the rank of the last stage (pipeline rank 1): loss_fn takes (output, target)"
    bad_target = "target has batch size 5 but x has 8"
    from_first = "the rank of stage 0 (pipeline rank 0) rejected the step input: "
    from_last = "the rank of the last stage (pipeline rank 1) rejected the step's target: "
    assert two_ranks[0]["small"]["errors"] == [
        ("ValueError", small), ("ValueError", small), ("ValueError", no_x),
        ("ValueError", from_last + no_target), ("ValueError", from_last + bad_target)]
    assert two_ranks[1]["small"]["errors"] == [  # rank 1 ignores its x: rank 0 tells it
        ("ValueError", from_first + small), ("ValueError", from_first + small), ("ValueError", from_first + no_x),
        ("ValueError", no_target), ("ValueError", bad_target)]
    assert [r["small"]["then_ok"] for r in two_ranks] == [True, True]


def test_timeline_and_peak_describe_the_last_step_not_a_later_forward(two_ranks):
    for rank, results in enumerate(two_ranks):
        rec = results["records"]
        assert rec["before"] == (None, None)
        assert rec["step_peak"] > 0 and rec["peak_after_forward"] == rec["step_peak"], (rank, rec)
        assert rec["step_ops"] == (["B", "F", "RECV_B", "SEND_F"] if rank == 0 else ["B", "F", "RECV_F", "SEND_B"])
        assert rec["step_events"] == 16  # 1f1b, p=2, m=4: 4 instructions per microbatch on each rank
        assert rec["forward_ops"] == (["F", "SEND_F"] if rank == 0 else ["F", "RECV_F"])
        assert rec["kinds"] == ("train", "forward", "train", "forward")
        assert rec["gathered_events"] == (32, 16)
        local, fraction, gathered = rec["bubbles"]
        assert math.isnan(local[1 - rank]) and 0 <= local[rank] < 1 and fraction == local[rank]
        assert not any(math.isnan(b) for b in gathered)


def _single(rank):
    import torch.nn.functional as F

    from rt_cases import pair, reference_step, grad_report
    from pipesched.runtime import Pipeline
    model, ref = pair(num_layers=3)
    pipe = Pipeline(model, schedule="gpipe", num_microbatches=3, loss_fn=F.mse_loss)
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    loss = pipe.step(x, target=y)
    return bool(torch.equal(loss, reference_step(ref, x, y, 3))), grad_report(pipe, model, ref)


def test_one_process_pipeline_equals_the_model():
    from pipesched.runtime import launch
    (loss_equal, (count, bitwise, _)), = launch(_single, 1)
    assert (loss_equal, count, bitwise) == (True, 6, True)


def _check_message_order(logs, hoist):
    """What rank a sends to rank b is what b posts from a, in the same order. Without early receives (the
    NCCL discipline) also: the ops between a and b, both directions together, come in the same order on both
    sides — NCCL runs them on one stream per pair, and a receive there holds up every later op."""
    flip = {"send": "recv", "recv": "send"}
    for a in range(len(logs)):
        for b in range(len(logs)):
            if a == b:
                continue
            sent = [tag for kind, peer, tag in logs[a] if kind == "send" and peer == b]
            posted = [tag for kind, peer, tag in logs[b] if kind == "recv" and peer == a]
            assert sent == posted, (a, b)
            if not hoist:
                mine = [(flip[kind], tag) for kind, peer, tag in logs[a] if peer == b]
                theirs = [(kind, tag) for kind, peer, tag in logs[b] if peer == a]
                assert mine == theirs, (a, b)


@pytest.mark.parametrize("hoist", [True, False], ids=["gloo-early-receives", "program-order"])
@pytest.mark.parametrize("schedule", [s for s, _ in SCHEDULES])
def test_between_two_ranks_receives_are_posted_in_the_order_the_messages_are_sent(two_ranks, schedule, hoist):
    # NCCL matches point-to-point messages by order, not tag: on the step that learns shapes (headers),
    # the next one and a forward
    logs = [results[("order", schedule, hoist)] for results in two_ranks]
    assert all(len(log) > 16 for log in logs)
    _check_message_order(logs, hoist)


@pytest.mark.parametrize("hoist", [True, False], ids=["gloo-early-receives", "program-order"])
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b"])
def test_message_order_on_four_ranks(four_ranks, schedule, hoist):
    # with p >= 3, interleaved sends gradients to a rank after its last receive from it: the loss receive
    # must not be posted before them on a per-pair stream
    logs = [results[("order", schedule, hoist)] for results in four_ranks]
    assert all(len(log) > 16 for log in logs)
    _check_message_order(logs, hoist)


def _step_posts(schedule, v, p, early) -> list:
    """Per rank, the posts ``message_order`` makes by :func:`pipesched.protocol.step_posts` (a learning step, a
    step, a learning forward), as ``(kind, peer, tag)``."""
    programs = step_programs(compile_program(schedule, p, 4, v), "gloo", early)
    tags = {"loss": TAG_LOSS}
    runs = ((programs.learn_train, True, False), (programs.train, False, early), (programs.learn_forward, True, False))
    return [[(post.kind, post.peer, tags.get(post.message[0]) or tag_of(*post.message, programs.train.num_stages))
             for program, learning, early_run in runs for post in step_posts(program, rank, learning, early_run)
             if post.kind != "all_gather"]  # the log holds point-to-point posts
            for rank in range(p)]


@pytest.mark.parametrize("hoist", [True, False], ids=["gloo-early-receives", "program-order"])
@pytest.mark.parametrize("schedule", [s for s, _ in SCHEDULES])
def test_real_gloo_posts_are_the_protocols(two_ranks, four_ranks, schedule, hoist):
    v = dict(SCHEDULES)[schedule]
    for ranks in (two_ranks, four_ranks):
        if ("order", schedule, hoist) in ranks[0]:
            logs = [results[("order", schedule, hoist)] for results in ranks]
            assert logs == _step_posts(schedule, v, len(ranks), hoist)


def test_program_order_messaging_is_bitwise_too(two_ranks):
    for rank, results in enumerate(two_ranks):
        case = results["program_order"]
        assert [s["bitwise"] and s["loss_equal"] for s in case["steps"]] == [True, True], (rank, case)
