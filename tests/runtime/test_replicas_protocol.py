"""The replicas' agreement in the wire protocol (pipesched.protocol, runtime/handshake.py): with dp_size > 1 every
rank's step posts, right after the opening all-gather on the pipeline group, exactly one all-gather on its
data-parallel group (Handshake._agree_replicas), before any message or ALL_REDUCE of its program; with one replica
none. step_posts lists it, check_step refuses a step that leaves it out, repeats it, misplaces it or posts it with one
replica, and the real handshake and executor (the dry run, with a fake data-parallel group of identical replicas)
post exactly that: also on a step that is refused, by this pipeline or by another replica."""
from __future__ import annotations

import pytest

from pipesched import PairingError, compile_program, protocol, step_programs
from pipesched.lower import forward_only
from pipesched.protocol import LOSS, OPENING, REPLICAS, Post, check_step, step_posts
from pipesched.runtime.handshake import REPLICA_MARK
from pipesched.runtime.refusals import encode_text

import dry_run
from dry_run import DryPipeline

GATHER, AGREE = ("all_gather", None, None), ("all_gather", None, "replicas")  # as the dry run logs them


def test_step_posts_by_hand_with_replicas():
    program = compile_program("1f1b", 2, 1, dp_size=2)
    act, grad = ("act", 0, 0), ("grad", 1, 0)
    opening, agree = Post("all_gather", None, OPENING), Post("all_gather", None, REPLICAS)
    assert step_posts(program, 0, learning=False, early=False) == [
        opening, agree, Post("send", 1, act), Post("recv", 1, grad, 1), Post("recv", 1, LOSS)]
    assert step_posts(program, 1, learning=False, early=False) == [
        opening, agree, Post("recv", 0, act), Post("send", 0, grad, 1), Post("send", 0, LOSS)]
    # a forward() agrees too (the handshake does whatever the call), and one replica never does
    assert step_posts(forward_only(program), 1, learning=False, early=False) == [opening, agree, Post("recv", 0, act)]
    one = compile_program("1f1b", 2, 1)
    assert step_posts(one, 1, learning=False, early=False) == [
        opening, Post("recv", 0, act), Post("send", 0, grad, 1), Post("send", 0, LOSS)]
    # every built-in program with replicas is proven with it (step_programs runs check_step)
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)):
        for backend in ("gloo", "nccl"):
            programs = step_programs(compile_program(schedule, 3, 4, v, dp_size=2), backend)
            for train in (True, False):
                for learning in (True, False):
                    program = programs.pick(train, learning)
                    early = programs.early_receives > 0 and not learning
                    check_step(program, learning, early, backend == "nccl")
                    for rank in range(3):
                        posts = step_posts(program, rank, learning, early, None, train)
                        assert [p.message for p in posts].count(REPLICAS) == 1 and posts[1] == agree


def _patched(monkeypatch, change):
    """Make :func:`protocol._numbered_posts` return ``change(posts, program)`` instead of ``posts``."""
    real = protocol._numbered_posts

    def numbered(program, *args):
        return change(real(program, *args), program)

    monkeypatch.setattr(protocol, "_numbered_posts", numbered)


def test_check_step_refuses_a_step_without_the_replicas_agreement(monkeypatch):
    program = compile_program("1f1b", 2, 2, dp_size=2)
    check_step(program, learning=False, early=False)
    _patched(monkeypatch, lambda posts, _: [p for p in posts if p[1].message != REPLICAS])
    with pytest.raises(PairingError, match=r"rank 0's replicas' agreement \(the all-gather on the data-parallel group, "
                                           r"dp_size 2\) must be posted once, right after the step's opening, before "
                                           r"any message or ALL_REDUCE of its program; it posts it at positions \[\]"):
        check_step(program, learning=False, early=False)


def test_check_step_refuses_the_replicas_agreement_after_a_program_message(monkeypatch):
    # rank 0 sends its first activation, then agrees: a message of its program before the agreement
    program = compile_program("1f1b", 2, 2, dp_size=2)
    _patched(monkeypatch, lambda posts, _: posts[:1] + posts[2:3] + posts[1:2] + posts[3:])
    with pytest.raises(PairingError, match=r"rank 0's replicas' agreement .* it posts it at positions \[2\]"):
        check_step(program, learning=False, early=False)


def test_check_step_refuses_the_replicas_agreement_before_the_opening(monkeypatch):
    program = compile_program("1f1b", 2, 2, dp_size=2)
    _patched(monkeypatch, lambda posts, _: posts[1:2] + posts[:1] + posts[2:])
    with pytest.raises(PairingError, match=r"rank 0's step must open with the all-gather on the pipeline group, once, "
                                           r"before any point-to-point message; it posts it at positions \[1\]"):
        check_step(program, learning=False, early=False)


def test_check_step_refuses_the_replicas_agreement_after_the_all_reduce(monkeypatch):
    # one pipeline rank: the step has no message at all, so only the instruction it is posted with tells an
    # agreement after the program's ALL_REDUCE (a second collective order on the data-parallel group)
    program = compile_program("1f1b", 1, 2, dp_size=2)
    stream = program.ranks[0]
    assert str(stream[-1]) == "ALL_REDUCE0"

    def at_the_end(posts, program):
        return [p for p in posts if p[1].message != REPLICAS] + [(len(program.ranks[0]) - 1, posts[1][1])]

    check_step(program, learning=False, early=False)
    _patched(monkeypatch, at_the_end)
    with pytest.raises(PairingError, match=rf"rank 0's replicas' agreement .* it posts it at positions \[1\] of its "
                                           rf"posts \(kind 'all_gather'\) with instruction {len(stream) - 1} of "
                                           rf"its stream, whose ALL_REDUCEs are at \[{len(stream) - 1}\]"):
        check_step(program, learning=False, early=False)


def test_check_step_refuses_two_agreements_and_one_with_a_single_replica(monkeypatch):
    agree = (0, Post("all_gather", None, REPLICAS))
    _patched(monkeypatch, lambda posts, _: posts[:1] + [agree] + posts[1:])  # one more, right after the opening
    with pytest.raises(PairingError, match=r"rank 0's replicas' agreement .* it posts it at positions \[1, 2\]"):
        check_step(compile_program("1f1b", 2, 2, dp_size=2), learning=False, early=False)
    with pytest.raises(PairingError, match=r"rank 0's replicas' agreement \(the all-gather on the data-parallel group, "
                                           r"dp_size 1\) must be absent \(one replica\); it posts it at "
                                           r"positions \[1\]"):
        check_step(compile_program("1f1b", 2, 2), learning=False, early=False)


def _step(pipe: DryPipeline, train: bool):
    """Run one step (or forward); returns (each rank's posts, where each rank's all-reduces came among them,
    the error)."""
    start = [len(log) for log in pipe.net.log]
    reduced = [len(r) for r in pipe.net.reduces]
    try:
        pipe.run(train)
        error = None
    except RuntimeError as exc:
        error = str(exc)
    logs = [log[n:] for log, n in zip(pipe.net.log, start)]
    reduces = [[at - n for at in r[k:]] for r, k, n in zip(pipe.net.reduces, reduced, start)]
    return logs, reduces, error


@pytest.mark.parametrize("schedule,p,v,backend", [("1f1b", 1, 1, "gloo"), ("1f1b", 2, 1, "nccl"),
                                                  ("gpipe", 3, 1, "gloo"), ("interleaved-1f1b", 2, 2, "gloo"),
                                                  ("interleaved-1f1b", 3, 2, "nccl")])
@pytest.mark.parametrize("dp", [1, 2])
def test_the_real_handshake_agrees_once_right_after_the_opening(schedule, p, v, backend, dp):
    programs = step_programs(compile_program(schedule, p, 3, v, dp_size=dp), backend)
    pipe = DryPipeline(programs)
    for train, learning in ((True, True), (True, False), (False, True), (False, False)):
        logs, reduces, error = _step(pipe, train)
        assert error is None
        program = programs.pick(train, learning)
        for rank, (log, at) in enumerate(zip(logs, reduces)):
            assert log[0] == GATHER
            if dp == 1:
                assert AGREE not in log and at == []
                continue
            assert log[1] == AGREE and log.count(AGREE) == 1, (rank, train, learning)
            # each ALL_REDUCE of the program (every stage has parameters) came after the agreement
            assert len(at) == sum(str(i).startswith("ALL_REDUCE") for i in program.ranks[rank])
            assert len(at) == (len(program.stages_of(rank)) if train else 0)
            assert all(k >= 2 for k in at), (rank, at)


@pytest.mark.parametrize("dp", [1, 2])
def test_a_refused_step_posts_the_opening_and_the_agreement_only(dp):
    programs = step_programs(compile_program("1f1b", 3, 3, dp_size=dp))
    pipe = DryPipeline(programs)
    pipe.x = None  # stage 0's rank gets no input: refused on every rank, after the replicas agreed
    logs, reduces, error = _step(pipe, True)
    assert "got no input x" in error
    assert logs == [[GATHER, AGREE] if dp > 1 else [GATHER]] * 3 and reduces == [[]] * 3


def test_a_step_another_replica_refuses_posts_the_opening_and_the_agreement_only(monkeypatch):
    real = dry_run._FakeDP.allgather

    def other_refuses(self, outputs, inputs):
        work = real(self, outputs, inputs)
        train = int(inputs[0][1])
        outputs[0][1].copy_(inputs[0].new_tensor(encode_text([REPLICA_MARK, train, 1], "out of data")))
        return work

    monkeypatch.setattr(dry_run._FakeDP, "allgather", other_refuses)
    pipe = DryPipeline(step_programs(compile_program("1f1b", 2, 2, dp_size=2)))
    logs, reduces, error = _step(pipe, True)
    assert error.endswith("Rejected: replica 1 refused its step: out of data")
    assert logs == [[GATHER, AGREE]] * 2 and reduces == [[]] * 2
