"""The whole wire protocol, dry-run: for every built-in schedule and option over a hypothesis grid, each rank's
real handshake and executor (threads of one process, an in-memory group matching messages first in, first out
whatever their tag) post exactly the messages of the validated program they run, plus the documented opening
all-gather (which carries the verdict on the target: no message of its own), with replicas the replicas'
agreement all-gather over the data-parallel group right after it, shape headers and loss
(:func:`pipesched.protocol.step_posts`), in that order, with each gradient message carrying the tensors
:func:`pipesched.protocol.gradient_tensors` says — also where some stage inputs get no gradient (masked
messages) — and no rank enters a step's all-gather with a message of the previous step not yet waited for."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from pipesched import compile_program, step_programs
from pipesched.engine import proven_run
from pipesched.protocol import check_step, step_posts
from pipesched.runtime.wire import TAG_LOSS, tag_of

from dry_run import Boundary, DryPipeline

SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 3}  # name -> the most virtual stages drawn


def _tag(message, num_stages: int) -> int | None:
    kind, stage, mb = message
    if kind in ("opening", "replicas"):
        return None if kind == "opening" else "replicas"  # as the dry run logs the replicas' agreement
    return TAG_LOSS if kind == "loss" else tag_of(kind, stage, mb, num_stages)


def _expected(program, rank: int, learning: bool, early: bool, gradients=None, boundaries=None) -> list:
    """``step_posts`` as the dry run logs posts: ``(kind, peer, tag, tensors)`` (the all-gather without a
    count): a gradient's tensor count from the protocol, one tensor for a header and the loss,
    and an activation the stage's output tensors (one, or two where a :class:`Boundary` gives a pair)."""
    out = []
    for post in step_posts(program, rank, learning, early, gradients):
        kind, stage, _ = post.message
        row = (post.kind, post.peer, _tag(post.message, program.num_stages))
        if kind == "act":
            row += (2 if boundaries and boundaries[stage][2] else 1,)
        elif kind not in ("opening", "replicas"):
            row += (1 if post.tensors is None else post.tensors,)
        out.append(row)
    return out


def _same_pair_order(logs) -> None:
    """Between two ranks, the posts of both directions come in one order on both sides (what NCCL's per-pair
    stream needs when every message stays at its program position)."""
    flip = {"send": "recv", "recv": "send"}
    for a in range(len(logs)):
        for b in range(a + 1, len(logs)):
            mine = [(flip[row[0]], row[2:]) for row in logs[a] if row[1] == b]
            theirs = [(row[0], row[2:]) for row in logs[b] if row[1] == a]
            assert mine == theirs, (a, b)


@st.composite
def configs(draw):
    schedule = draw(st.sampled_from(sorted(SCHEDULES)))
    p = draw(st.integers(1, 4))
    return dict(schedule=schedule, num_ranks=p, num_microbatches=draw(st.integers(1, 8)),
                virtual_stages=draw(st.integers(1, SCHEDULES[schedule])), dp_size=draw(st.integers(1, 2)),
                recompute=draw(st.booleans()), split_backward=draw(st.booleans()))


def dry_run_matches_programs(config: dict, backend: str, early_receives, boundaries=None) -> None:
    """Run a learning step, a step, a learning forward and a forward; every rank's posts must be those of the
    program it ran, which must be the validated one ``step_programs`` made for it. ``boundaries``: per stage,
    :class:`Boundary`'s ``(detach, use_aux, pair_out)``; the gradients that come back are then
    :func:`expected_masks`' (otherwise every stage input is one tensor that gets its gradient)."""
    programs = step_programs(compile_program(**config), backend, early_receives)
    num_stages = programs.train.num_stages
    layers = [Boundary(4, *flags) for flags in boundaries] if boundaries else None
    masks = expected_masks(boundaries, programs.train.num_microbatches) if boundaries else None
    pipe = DryPipeline(programs, layers=layers)
    for train, learning in ((True, True), (True, False), (False, True), (False, False)):
        logs = pipe.run(train)
        program = programs.pick(train, learning)
        assert proven_run(program) is not None  # validated
        assert program.forward_only is not train
        assert all(ex.ran is program for ex in pipe.executors)  # the runtime takes its order from the program
        early = programs.early_receives > 0 and not learning
        check_step(program, learning, early, not early, masks)  # the proof holds with these masks too
        for rank, log in enumerate(logs):
            assert log[0] == ("all_gather", None, None)  # the step opens with the collective, on every rank
            assert log == _expected(program, rank, learning, early, masks, boundaries), (rank, train, learning)
            logs[rank] = log[1:]
        if not early:
            _same_pair_order(logs)
        assert num_stages == program.num_stages


def expected_masks(boundaries, num_microbatches: int) -> dict:
    """Which gradients of each stage input come back with :class:`Boundary` stages, by hand: every output
    requires grad (each stage has a Linear); stage s runs its backward from what reached its outputs (the last
    stage from its loss), and then its input's first tensor gets a gradient unless s detaches it, its second
    (if stage s-1 gives a pair) if s uses it. A stage whose outputs get none gives its inputs none."""
    gets = [False] * len(boundaries)
    masks = {}
    for s in reversed(range(len(boundaries))):
        gets[s] = s == len(boundaries) - 1 or any(masks[(s + 1, 0)])
        if s == 0:
            break
        detach, use_aux, _ = boundaries[s]
        pair = boundaries[s - 1][2]
        mask = (gets[s] and not detach,) + ((gets[s] and use_aux,) if pair else ())
        masks.update({(s, mb): mask for mb in range(num_microbatches)})
    return masks


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(), backend=st.sampled_from(["gloo", "nccl"]), early_off=st.booleans())
def test_every_rank_posts_exactly_the_messages_of_the_proven_program(config, backend, early_off):
    dry_run_matches_programs(config, backend, False if early_off else None)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(), backend=st.sampled_from(["gloo", "nccl"]), data=st.data())
def test_masked_gradient_messages_are_the_protocols(config, backend, data):
    """Stage inputs that are pairs, detached or partly unused: which gradient messages are posted and how many
    tensors each carries, learning (every gradient plus the mask) and after (the present ones, or none)."""
    stages = config["num_ranks"] * config["virtual_stages"]
    flags = st.tuples(st.booleans(), st.booleans(), st.booleans())
    boundaries = [list(data.draw(flags)) for _ in range(stages)]
    boundaries[-1][2] = False  # the last stage gives mse_loss one tensor
    dry_run_matches_programs(config, backend, None, [tuple(b) for b in boundaries])


def test_masks_by_hand():
    # stage 2 detaches its input and ignores the aux of stage 1's pair: stage 1 gets nothing back, skips its
    # backward, and gives stage 0 nothing back either; stage 3 uses both tensors of stage 2's pair
    boundaries = [(False, False, False), (False, False, True), (True, False, True), (False, True, False)]
    masks = expected_masks(boundaries, 1)
    assert masks == {(3, 0): (True, True), (2, 0): (False, False), (1, 0): (False,)}
    config = dict(schedule="1f1b", num_ranks=4, num_microbatches=1, virtual_stages=1, dp_size=1, recompute=False,
                  split_backward=False)
    program = step_programs(compile_program(**config)).train
    grads = [(p.kind, p.message, p.tensors) for r in range(4) for p in step_posts(program, r, False, False, masks)
             if p.message[0] == "grad"]
    assert grads == [("recv", ("grad", 3, 0), 2), ("send", ("grad", 3, 0), 2)]  # only 3 -> 2, once learned
    learned = [p.tensors for r in range(4) for p in step_posts(program, r, True, False, masks)
               if p.message[0] == "grad"]
    assert learned == [2, 3, 2, 3, 3, 3]  # every message while learning: each gradient (zeros if none) + mask
    dry_run_matches_programs(config, "gloo", None, boundaries)


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)])
@pytest.mark.parametrize("early", [True, False], ids=["early-receives", "program-order"])
def test_dry_run_on_four_ranks_with_every_option(schedule, v, early):
    config = dict(schedule=schedule, num_ranks=4, num_microbatches=6, virtual_stages=v, dp_size=2, recompute=True,
                  split_backward=True)
    dry_run_matches_programs(config, "gloo", early)


def test_check_step_rejects_a_message_one_side_does_not_post(monkeypatch):
    """A shape header only the receiver expects would make first-in first-out matching give the header's
    receive the activation (and leave a message over at the next step's all-gather): check_step says which."""
    from pipesched import PairingError, protocol

    program = compile_program("1f1b", 2, 2)
    real = protocol.instruction_posts

    def header_on_receive_side_only(instr, learning, gradients=None):
        posts = real(instr, learning, gradients)
        return [p for p in posts if not (p.kind == "send" and p.message[0] == "act_header")]

    monkeypatch.setattr(protocol, "instruction_posts", header_on_receive_side_only)
    with pytest.raises(PairingError) as err:
        check_step(program, learning=True, early=False)
    assert err.value.reason.startswith(
        "message 1 from rank 0 to rank 1 in a step: rank 0 sends stage 0's output, microbatch 0, rank 1 posts the "
        "receive of the shape header of stage 0's output, microbatch 0; first-in first-out matching")
    check_step(program, learning=False, early=False)  # no headers once the shapes are known


def test_check_step_wants_the_all_gather_first(monkeypatch):
    from pipesched import PairingError, protocol

    program = compile_program("1f1b", 2, 2)
    real = protocol._numbered_posts

    def gather_after_the_first_message(*args):
        posts = real(*args)
        return posts[1:2] + posts[:1] + posts[2:]

    monkeypatch.setattr(protocol, "_numbered_posts", gather_after_the_first_message)
    with pytest.raises(PairingError, match=r"rank 0's step must open with the all-gather on the pipeline group, "
                                           r"once, before any point-to-point message; it posts it at positions \[1\]"):
        check_step(program, learning=False, early=False)
