"""The norm parts of an anticipated clip_grad_norm_ in the wire protocol (pipesched.protocol, runtime/norm_parts.py):
the dry run (every rank's real handshake and executor in threads, first-in first-out matching per pair whatever the
tag) posts exactly step_posts(..., norm_parts=True), each rank's part is the last message each way on each pair,
both ranks of a pair post them in one order where receives are not posted early (NCCL), every rank ends the step
with every rank's part, and check_step refuses the orders that would swap or hang them."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from pipesched import PairingError, compile_program, protocol, step_programs
from pipesched.protocol import NORM, Post, check_step, norm_end_posts, norm_post_position, step_posts
from pipesched.runtime.wire import TAG_LOSS, tag_of
from pipesched.runtime.norm_parts import ROW, TAG_NORM

from dry_run import DryPipeline

SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 3}


def _row(post: Post, num_stages: int) -> tuple:
    """A post as the dry run logs it: (kind, peer, tag, tensors); the all-gather without tag and count."""
    kind, stage, mb = post.message
    if kind in ("opening", "replicas"):  # the replicas' agreement (dp > 1) as the dry run logs it
        return ("all_gather", None, None if kind == "opening" else "replicas")
    tag = {"loss": TAG_LOSS, "norm": TAG_NORM}.get(kind) or tag_of(kind, stage, mb, num_stages)
    return (post.kind, post.peer, tag, 1 if post.tensors is None else post.tensors)


def dry_run_with_parts(config: dict, backend: str, norm_type: float = 2.0) -> None:
    programs = step_programs(compile_program(**config), backend)
    pipe = DryPipeline(programs, norm_parts=(1.0, norm_type))
    for train, learning in ((True, True), (True, False), (False, True), (False, False)):
        logs = pipe.run(train)
        program = programs.pick(train, learning)
        early = programs.early_receives > 0 and not learning
        check_step(program, learning, early, not early, norm_parts=True)
        for rank, log in enumerate(logs):
            expect = [_row(p, program.num_stages) for p in step_posts(program, rank, learning, early, None, train)]
            assert log == expect, (rank, train, learning)
        if not early:  # one order per pair, both directions (what NCCL needs)
            flip = {"send": "recv", "recv": "send"}
            for a in range(pipe.p):
                for b in range(a + 1, pipe.p):
                    assert [(flip[r[0]], r[2:]) for r in logs[a] if r[1] == b] == \
                           [(r[0], r[2:]) for r in logs[b] if r[1] == a], (a, b)
        if train:  # every rank holds every rank's row: its own norm and the agreed arguments
            rows = [parts.rows for parts in pipe.parts]
            assert all(r == rows[0] for r in rows) and len(rows[0]) == pipe.p
            for rank, row in enumerate(rows[0]):
                grads = [q.grad for q in pipe.parts[rank].owned() if q.grad is not None]
                assert len(row) == ROW and row[-2:] == [1.0, norm_type]
                assert row[0] == float(torch.nn.utils.get_total_norm(grads, norm_type)), rank
        else:
            assert all(parts.rows is None for parts in pipe.parts)  # a forward sends none
        for layer in pipe.layers:
            layer.zero_grad()


@st.composite
def configs(draw):
    schedule = draw(st.sampled_from(sorted(SCHEDULES)))
    return dict(schedule=schedule, num_ranks=draw(st.integers(1, 4)), num_microbatches=draw(st.integers(1, 6)),
                virtual_stages=draw(st.integers(1, SCHEDULES[schedule])), dp_size=draw(st.integers(1, 2)),
                recompute=draw(st.booleans()), split_backward=draw(st.booleans()))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(), backend=st.sampled_from(["gloo", "nccl"]), inf=st.booleans())
def test_the_dry_run_posts_the_norm_parts_of_the_protocol(config, backend, inf):
    dry_run_with_parts(config, backend, math.inf if inf else 2.0)


def test_norm_parts_by_hand_on_three_ranks():
    program = step_programs(compile_program("1f1b", 3, 2)).train  # gloo: receives posted early
    stream = program.ranks[0]
    # rank 0 receives from rank 1 (gradients) and from rank 2 (the loss, at the start)
    last_from_1 = max(k for k, i in enumerate(stream) if i.peer == 1 and i.op.name.startswith("RECV"))
    assert norm_post_position(stream, 1, True) == last_from_1
    assert norm_post_position(stream, 2, True) == -1 and norm_post_position(stream, 2, False) is None
    assert norm_end_posts(0, 3, True) == [("send", 1), ("send", 2)]
    assert norm_end_posts(1, 3, False) == [("recv", 0), ("send", 0), ("send", 2), ("recv", 2)]
    posts = step_posts(program, 0, learning=False, early=True, norm_parts=True)
    with_2 = [(p.kind, p.message[0]) for p in posts if p.peer == 2]
    assert with_2 == [("recv", "loss"), ("recv", "norm"), ("send", "norm")]  # the target's verdict: in the gather
    assert [p for p in posts if p.message == NORM][-2:] == [Post("send", 1, NORM), Post("send", 2, NORM)]
    last = step_posts(program, 2, learning=False, early=True, norm_parts=True)
    assert [(p.kind, p.peer, p.message[0]) for p in last[-4:]] == [
        ("send", 0, "loss"), ("send", 1, "loss"), ("send", 0, "norm"), ("send", 1, "norm")]
    assert not any(p.message == NORM for p in step_posts(program, 1, False, True))  # not anticipating: none


def test_check_step_refuses_a_pair_that_would_post_its_parts_in_two_orders(monkeypatch):
    # both ranks of a pair receiving first: on NCCL, where a pair's messages run in issue order, both would wait
    program = compile_program("1f1b", 2, 2)
    check_step(program, learning=False, early=False, same_pair_order=True, norm_parts=True)

    def receive_first(rank, num_ranks, early):
        return [(kind, peer) for peer in range(num_ranks) if peer != rank for kind in ("recv", "send")]

    monkeypatch.setattr(protocol, "norm_end_posts", receive_first)
    with pytest.raises(PairingError, match=r"ranks 0 and 1 post their messages to each other in different orders: "
                                           r"here rank 0 posts the recv of the norm part, where rank 1 posts the "
                                           r"recv of the norm part"):
        check_step(program, learning=False, early=False, same_pair_order=True, norm_parts=True)
    check_step(program, learning=False, early=False, same_pair_order=True, norm_parts=False)  # no parts: fine


def test_check_step_wants_each_part_last_on_its_pair(monkeypatch):
    # the last stage's rank sending its part before its loss: first-in first-out matching would hand the loss's
    # receive the part
    program = compile_program("1f1b", 2, 2)
    real = protocol._numbered_posts

    def part_before_loss(*args):
        posts = real(*args)
        loss = [k for k, (_, p) in enumerate(posts) if p.message == protocol.LOSS and p.kind == "send"]
        part = [k for k, (_, p) in enumerate(posts) if p.message == NORM and p.kind == "send"]
        if loss and part:
            posts[loss[0]], posts[part[0]] = posts[part[0]], posts[loss[0]]
        return posts

    monkeypatch.setattr(protocol, "_numbered_posts", part_before_loss)
    with pytest.raises(PairingError, match=r"rank 1's norm part to rank 0 must be the last message it sends rank 0, "
                                           r"once; it is at positions \[\d+\]"):
        check_step(program, learning=False, early=False, norm_parts=True)


def test_every_built_in_program_is_proven_with_and_without_the_parts():
    # step_programs proves each training program both ways (check_step's default): what a Pipeline runs
    for name, v in SCHEDULES.items():
        for backend in ("gloo", "nccl"):
            programs = step_programs(compile_program(name, 4, 6, min(v, 2)), backend)
            for learning in (False, True):
                program = programs.pick(True, learning)
                early = programs.early_receives > 0 and not learning
                check_step(program, learning, early, backend == "nccl", norm_parts=True)
