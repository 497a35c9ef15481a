"""The whole wire protocol, dry-run: for every built-in schedule and option over a hypothesis grid, each rank's
real handshake and executor (threads of one process, an in-memory group matching messages first in, first out
whatever their tag) post exactly the messages of the validated program they run, plus the documented opening
all-gather, target verdict, shape headers and loss (:func:`pipesched.protocol.step_posts`), in that order."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from pipesched import compile_program, step_programs
from pipesched.engine import proven_run
from pipesched.protocol import step_posts
from pipesched.runtime.comm import TAG_LOSS, TAG_TARGET, tag_of

from dry_run import DryPipeline

SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 3}  # name -> the most virtual stages drawn


def _tag(message, num_stages: int) -> int:
    kind, stage, mb = message
    return {"loss": TAG_LOSS, "target": TAG_TARGET}.get(kind) or tag_of(kind, stage, mb, num_stages)


def _expected(program, rank: int, learning: bool, early: bool) -> list:
    return [(post.kind, post.peer, _tag(post.message, program.num_stages))
            for post in step_posts(program, rank, learning, early)]


def _same_pair_order(logs) -> None:
    """Between two ranks, the posts of both directions come in one order on both sides (what NCCL's per-pair
    stream needs when every message stays at its program position)."""
    flip = {"send": "recv", "recv": "send"}
    for a in range(len(logs)):
        for b in range(a + 1, len(logs)):
            mine = [(flip[kind], tag) for kind, peer, tag in logs[a] if peer == b]
            theirs = [(kind, tag) for kind, peer, tag in logs[b] if peer == a]
            assert mine == theirs, (a, b)


@st.composite
def configs(draw):
    schedule = draw(st.sampled_from(sorted(SCHEDULES)))
    p = draw(st.integers(1, 4))
    return dict(schedule=schedule, num_ranks=p, num_microbatches=draw(st.integers(1, 8)),
                virtual_stages=draw(st.integers(1, SCHEDULES[schedule])), dp_size=draw(st.integers(1, 2)),
                recompute=draw(st.booleans()), split_backward=draw(st.booleans()))


def dry_run_matches_programs(config: dict, backend: str, early_receives) -> None:
    """Run a learning step, a step, a learning forward and a forward; every rank's posts must be those of the
    program it ran, which must be the validated one ``step_programs`` made for it."""
    programs = step_programs(compile_program(**config), backend, early_receives)
    pipe = DryPipeline(programs)
    for train, learning in ((True, True), (True, False), (False, True), (False, False)):
        logs = pipe.run(train)
        program = programs.pick(train, learning)
        assert proven_run(program) is not None  # validated
        assert program.forward_only is not train
        assert all(ex.ran is program for ex in pipe.executors)  # the runtime takes its order from the program
        early = programs.early_receives > 0 and not learning
        for rank, log in enumerate(logs):
            assert log[0] == ("all_gather", None, None)  # the step opens with the collective, on every rank
            assert log[1:] == _expected(program, rank, learning, early), (rank, train, learning)
            logs[rank] = log[1:]
        if not early:
            _same_pair_order(logs)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(), backend=st.sampled_from(["gloo", "nccl"]), early_off=st.booleans())
def test_every_rank_posts_exactly_the_messages_of_the_proven_program(config, backend, early_off):
    dry_run_matches_programs(config, backend, False if early_off else None)


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)])
@pytest.mark.parametrize("early", [True, False], ids=["early-receives", "program-order"])
def test_dry_run_on_four_ranks_with_every_option(schedule, v, early):
    config = dict(schedule=schedule, num_ranks=4, num_microbatches=6, virtual_stages=v, dp_size=2, recompute=True,
                  split_backward=True)
    dry_run_matches_programs(config, "gloo", early)
