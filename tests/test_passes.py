"""The passes the runtime's programs get, proven like every program: receives posted early, the forward-only
part, and which backend gets which (``passes_for``, ``step_programs``)."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, strategies as st

import pipesched as ps
from pipesched.cli import main
from pipesched.engine import proven_run
from pipesched.errors import DeadlockError, InvalidProgramError, ScheduleArgumentError
from pipesched.ir import FORWARD_OPS, RECV_OPS, SEND_OPS, Instr, Op, Program
from pipesched.lower import EARLY_RECEIVE_WINDOW, forward_only, post_receives_early
from pipesched import protocol
from pipesched.errors import PairingError
from pipesched.protocol import LOSS, OPENING, check_step, learning_view, step_posts
from pipesched.testing import schedule_configs


def _program(streams, m=2, forward=False) -> Program:
    return Program(tuple(tuple(Instr.parse(t) for t in s.split()) for s in streams), (0, 1), m, forward_only=forward)


def _config_program(config, split: bool) -> Program:
    return ps.compile_program(config.schedule, config.num_ranks, config.num_microbatches, config.virtual_stages,
                              config.dp_size, config.recompute, split)


def _old_hoist(stream, ahead):
    """The executor's reordering before it became a pass (``hoist_recvs`` in the former runtime/plan.py): today's behaviour."""
    keyed = [((pos - ahead if i.op in RECV_OPS else pos), 0 if i.op in RECV_OPS else 1, pos, i)
             for pos, i in enumerate(stream)]
    out, run = [], []
    for instr in [k[3] for k in sorted(keyed)] + [None]:
        if instr is not None and (instr.op in RECV_OPS or instr.op in SEND_OPS):
            run.append(instr)
            continue
        out += [i for i in run if i.op in SEND_OPS] + [i for i in run if i.op in RECV_OPS]
        run = []
        if instr is not None:
            out.append(instr)
    return tuple(out)


# ---- post_receives_early -----------------------------------------------------------------------------------

#: rank 0 receives B0.0's gradient before it sends F0.1's output; rank 1 sends that gradient before it posts
#: the receive of F0.1's output. Moving the send ahead of the receive (as the executor's old reordering did
#: within a run of messages) deadlocks when a send waits for its receive.
RECV_THEN_SEND = ("F0.0 F0.1 SEND_F0.0>1 RECV_B0.0<1 SEND_F0.1>1 B0.0 RECV_B0.1<1 B0.1",
                  "RECV_F1.0<0 F1.0 B1.0 SEND_B1.0>0 RECV_F1.1<0 F1.1 B1.1 SEND_B1.1>0")


def test_receives_move_up_but_never_behind_a_send_they_preceded():
    program = ps.validate(_program(RECV_THEN_SEND))
    early = post_receives_early(program, window=1)
    assert [" ".join(map(str, s)) for s in early.ranks] == [
        "F0.0 F0.1 SEND_F0.0>1 RECV_B0.0<1 SEND_F0.1>1 RECV_B0.1<1 B0.0 B0.1",
        "RECV_F1.0<0 F1.0 B1.0 SEND_B1.0>0 RECV_F1.1<0 F1.1 B1.1 SEND_B1.1>0"]
    assert ps.validate(early) is early
    # what a send-first reordering that passes an earlier receive would have made: the checker refuses it
    with pytest.raises(DeadlockError, match="rank 0 blocked at SEND_F0.1>1"):
        ps.validate(program.replace([_old_hoist(program.ranks[0], 1), program.ranks[1]]))


def test_a_receive_moves_window_places_up():
    program = ps.compile_program("1f1b", 2, 4)
    assert [str(i) for i in program.ranks[1][:4]] == ["RECV_F1.0<0", "F1.0", "RECV_F1.1<0", "B1.0"]
    assert " ".join(map(str, post_receives_early(program, 2).ranks[1])) == (
        "RECV_F1.0<0 RECV_F1.1<0 F1.0 B1.0 SEND_B1.0>0 RECV_F1.2<0 F1.1 B1.1 SEND_B1.1>0 RECV_F1.3<0 F1.2 B1.2 "
        "SEND_B1.2>0 F1.3 B1.3 SEND_B1.3>0")  # each RECV two places up, after the SEND it was placed after
    assert post_receives_early(program, 0) is program


@pytest.mark.parametrize("window", [-1, 1.5, True, "16"])
def test_a_bad_window_is_refused(window):
    with pytest.raises(ValueError, match="window must be an integer >= 0"):
        post_receives_early(ps.compile_program("1f1b", 2, 2), window)
    if not isinstance(window, bool):
        with pytest.raises(ScheduleArgumentError, match="early_receives must be an integer >= 0") as info:
            ps.compile_program("1f1b", 2, 2, early_receives=window)
        assert info.value.argument == "early_receives"


@given(schedule_configs(max_ranks=6, max_microbatches=12, max_virtual_stages=3, max_dp=2), st.booleans(),
       st.sampled_from([1, 3, EARLY_RECEIVE_WINDOW]))
def test_early_receives_only_move_receives_up_and_stay_proven(config, split, window):
    program = _config_program(config, split)
    early = ps.compile_program(config.schedule, config.num_ranks, config.num_microbatches, config.virtual_stages,
                               config.dp_size, config.recompute, split, early_receives=window)
    assert early == post_receives_early(program, window) and proven_run(early) is not None
    for old, new in zip(program.ranks, early.ranks):
        assert [i for i in new if i.op not in RECV_OPS] == [i for i in old if i.op not in RECV_OPS]
        assert [i for i in new if i.op in RECV_OPS] == [i for i in old if i.op in RECV_OPS]
        for instr in (i for i in old if i.op in RECV_OPS):  # up to `window` other instructions earlier, never later
            before_old = sum(1 for i in old[:old.index(instr)] if i.op not in RECV_OPS)
            before_new = sum(1 for i in new[:new.index(instr)] if i.op not in RECV_OPS)
            assert before_old - window <= before_new <= before_old
        if window == EARLY_RECEIVE_WINDOW:
            assert new == _old_hoist(old, window)  # the executor's order before the pass: behaviour kept


# ---- forward-only programs ---------------------------------------------------------------------------------

@given(schedule_configs(max_ranks=8, max_microbatches=16, max_virtual_stages=3, max_dp=2), st.booleans())
def test_forward_only_programs_are_compiled_and_proven(config, split):
    program = _config_program(config, split)
    fwd = ps.compile_program(config.schedule, config.num_ranks, config.num_microbatches, config.virtual_stages,
                             config.dp_size, config.recompute, split, forward_only=True)
    assert fwd.forward_only and proven_run(fwd) is not None and fwd == forward_only(program)
    assert [list(s) for s in fwd.ranks] == [[i for i in s if i.op in FORWARD_OPS] for s in program.ranks]
    timeline = ps.simulate(fwd)
    assert len(timeline.events) == len(fwd) and timeline.peak_inflight == (0,) * config.num_ranks


def test_the_checker_accepts_no_backward_only_when_told():
    streams = ("F0.0 SEND_F0.0>1 F0.1 SEND_F0.1>1", "RECV_F1.0<0 F1.0 RECV_F1.1<0 F1.1")
    assert ps.validate(_program(streams, forward=True)).forward_only
    with pytest.raises(InvalidProgramError, match=r"stage 0, microbatch 0: its backward is missing"):
        ps.validate(_program(streams))
    incomplete = ("F0.0 SEND_F0.0>1", "RECV_F1.0<0 F1.0")
    with pytest.raises(InvalidProgramError, match=r"stage 0, microbatch 1: its forward F is missing"):
        ps.validate(_program(incomplete, forward=True))
    with_backward = ("F0.0 SEND_F0.0>1 F0.1 SEND_F0.1>1", "RECV_F1.0<0 F1.0 RECV_F1.1<0 F1.1 B1.1")
    with pytest.raises(InvalidProgramError, match=r"B in a forward-only program, which runs only F, SEND_F and RECV_F"):
        ps.validate(_program(with_backward, forward=True))


def test_forward_only_forms_round_trip():
    fwd = ps.compile_program("interleaved-1f1b", 2, 4, forward_only=True)
    text = ps.to_text(fwd)
    assert "\nforward_only: true\n" in text and "forward_only" not in ps.to_text(ps.compile_program("1f1b", 2, 2))
    assert ps.loads(text) == fwd and ps.loads(ps.to_json(fwd)) == fwd
    assert json.loads(ps.to_json(fwd))["forward_only"] is True
    with pytest.raises(ps.ProgramFormatError, match="forward_only must be true or false"):
        ps.loads(text.replace("forward_only: true", "forward_only: yes"))


def test_a_forward_only_simulation_by_hand():
    timeline = ps.simulate(ps.compile_program("1f1b", 2, 2, forward_only=True),
                           ps.CostModel(forward=1.0, backward=2.0, latency=0.5, stash_bytes=100))
    assert [(str(e.instr), e.start, e.end) for e in timeline.events if e.instr.op is Op.F] == [
        ("F0.0", 0.0, 1.0), ("F0.1", 1.0, 2.0), ("F1.0", 1.5, 2.5), ("F1.1", 2.5, 3.5)]
    assert timeline.makespan == 3.5 and timeline.peak_inflight == (0, 0)
    assert timeline.peak_activation_bytes == (0.0, 0.0) and timeline.meta["step"] == "forward"


def test_cli_shows_and_simulates_forward_only(capsys):
    assert main(["show", "1f1b", "-p", "2", "-m", "2", "--forward-only", "--format", "text"]) == 0
    out = capsys.readouterr().out
    assert "forward_only: true" in out and "B" not in out.split("rank 0:")[1]
    assert main(["simulate", "1f1b", "-p", "2", "-m", "2", "--forward-only", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["makespan"] == 3.0 and data["peak_inflight"] == [0, 0]


# ---- which backend gets which passes -----------------------------------------------------------------------

def test_passes_per_backend():
    assert ps.passes_for("gloo") == {"early_receives": EARLY_RECEIVE_WINDOW}
    assert ps.passes_for("nccl") == {"early_receives": 0}
    assert ps.passes_for("gloo", learning=True) == {"early_receives": 0}
    with pytest.raises(ValueError, match="no passes are defined for backend 'mpi'; known: gloo, nccl"):
        ps.passes_for("mpi")


def _same_pair_order(program) -> bool:
    """Between two ranks, the messages of both directions come in one order on both sides."""
    for a in range(program.num_ranks):
        for b in range(a + 1, program.num_ranks):
            mine = [ps.deps.message(i) for i in program.ranks[a] if i.peer == b]
            theirs = [ps.deps.message(i) for i in program.ranks[b] if i.peer == a]
            if mine != theirs:
                return False
    return True


@given(schedule_configs(max_ranks=6, max_microbatches=12, max_virtual_stages=3, max_dp=2), st.booleans())
def test_step_programs_per_backend(config, split):
    program = _config_program(config, split)
    gloo, nccl = ps.step_programs(program, "gloo"), ps.step_programs(program, "nccl")
    args = (config.schedule, config.num_ranks, config.num_microbatches, config.virtual_stages, config.dp_size,
            config.recompute, split)
    assert gloo.train == ps.compile_program(*args, early_receives=EARLY_RECEIVE_WINDOW)
    assert gloo.forward == ps.compile_program(*args, forward_only=True, early_receives=EARLY_RECEIVE_WINDOW)
    for programs in (gloo, nccl):
        assert programs.learn_train == program
        assert programs.learn_forward == ps.compile_program(*args, forward_only=True)
        assert all(proven_run(p) is not None for p in programs[:4])
    assert nccl.train == program and nccl.forward == nccl.learn_forward and nccl.early_receives == 0
    # NCCL runs each pair's messages in issue order on one stream: program order keeps both sides' orders equal
    assert all(_same_pair_order(p) for p in nccl[:4])
    assert gloo.pick(True, False) is gloo.train and gloo.pick(False, True) is gloo.learn_forward


def test_step_programs_refuse_what_would_not_be_safe():
    program = ps.compile_program("1f1b", 2, 2)
    with pytest.raises(ValueError, match="early_receives=True: backend 'nccl' runs the messages between two ranks"):
        ps.step_programs(program, "nccl", early_receives=True)
    with pytest.raises(ValueError, match="early_receives must be None"):
        ps.step_programs(program, "gloo", early_receives=16)
    with pytest.raises(ValueError, match="takes a training program"):
        ps.step_programs(forward_only(program))
    assert ps.step_programs(program, "gloo", early_receives=False).train == program


# ---- the messages around the program: shape headers, the loss, one order per pair -------------------------

def test_step_posts_by_hand():
    program = ps.compile_program("1f1b", 2, 1)
    act, grad, opening = ("act", 0, 0), ("grad", 1, 0), ("all_gather", None, OPENING)
    # a gradient message carries the gradient plus its presence mask while learning (2 tensors), then 1
    assert [tuple(p) for p in step_posts(program, 0, learning=True, early=False)] == [
        opening + (None,), ("send", 1, ("act_header", 0, 0), None), ("send", 1, act, None),
        ("recv", 1, grad, 2), ("recv", 1, LOSS, None)]
    assert [tuple(p) for p in step_posts(program, 1, learning=False, early=False)] == [
        opening + (None,), ("recv", 0, act, None), ("send", 0, grad, 1),
        ("send", 0, LOSS, None)]
    assert [tuple(p) for p in step_posts(forward_only(program), 1, learning=False, early=False)] == [
        opening + (None,), ("recv", 0, act, None)]
    # masked: stage 1's input is two tensors that require grad, the second gets no gradient (3 tensors while
    # learning, then 1); none gets one: a message while learning (the mask says so), then none at all
    for mask, counts in (((True, False), (3, 1)), ((False,), (2, None)), ((), (None, None))):
        for learning, count in zip((True, False), counts):
            grads = [p.tensors for p in step_posts(program, 1, learning, False, {(1, 0): mask}) if p.message == grad]
            assert grads == ([] if count is None else [count]), (mask, learning)


def test_a_learning_step_blocks_at_each_activation_receive():
    program = ps.compile_program("1f1b", 2, 3)
    assert [str(i) for i in learning_view(program).ranks[1][:4]] == ["RECV_F1.0<0", "F1.0", "RECV_F1.1<0", "F1.1"]
    check_step(program, learning=True, early=False)
    # receives posted early would each wait for their header there: rank 1 waits for F0.1's output before it
    # sends the gradient rank 0 waits for first
    early = ps.validate(post_receives_early(program))
    check_step(early, learning=False, early=True)
    with pytest.raises(DeadlockError, match="while learning the message shapes"):
        check_step(early, learning=True, early=True)


def test_the_loss_must_be_the_last_receive_from_the_last_stage(monkeypatch):
    program = ps.compile_program("1f1b", 2, 2)
    check_step(program, learning=False, early=True)
    first_receive = lambda stream, last, early: 0  # noqa: E731 - the loss posted before rank 0's receives
    monkeypatch.setattr(protocol, "loss_post_position", first_receive)
    with pytest.raises(PairingError, match="the receive of the step's loss is posted before this receive"):
        check_step(program, learning=False, early=True)


def test_nccl_needs_one_message_order_per_pair():
    program = ps.compile_program("1f1b", 2, 4)
    check_step(program, learning=False, early=False, same_pair_order=True)
    with pytest.raises(PairingError, match="ranks 0 and 1 post their messages to each other in different orders"):
        check_step(ps.validate(post_receives_early(program)), learning=False, early=True, same_pair_order=True)


def test_a_program_with_early_receives_is_refused_with_what_to_pass_instead():
    # valid as compiled, but a learning step blocks where each activation receive is posted
    program = ps.compile_program("1f1b", 2, 4, early_receives=16)
    with pytest.raises(ps.ScheduleError, match=r"pass it in program order, without early_receives; the pipeline "
                                               r"posts receives early itself") as info:
        ps.step_programs(program, "gloo")
    assert isinstance(info.value.__cause__, ps.DeadlockError)
    assert ps.step_programs(ps.compile_program("1f1b", 2, 4), "gloo").early_receives > 0  # program order: accepted

