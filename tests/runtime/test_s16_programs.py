"""User programs the checker accepted but the runtime could not run (a fuzzing hunt's finds, session 16):

1. an ``R`` on some microbatches of a stage and not others (the checker's rule is per (stage, microbatch); the
   executor recomputed per stage and failed at the other microbatches' B with ``KeyError``): now run as written;
2. a ``RECV_B`` before its own ``F`` (the learning step sizes the gradient from that forward's output; failed with
   ``KeyError``): now refused by the step proof (``pipesched validate --backend gloo``, ``Pipeline``) naming both;
3. a learning step that blocks because a SEND_F comes late (program order, no early receives): the advice named
   only early receives; now it says which move fixes it, and that move is accepted;
4. backwards run out of microbatch order give gradients equal to the reference up to rounding only (the sum's
   order): documented as the condition of the bitwise guarantee, which every built-in schedule meets (checked)."""
import random

import pytest

import pipesched as ps
from pipesched.errors import DependencyError
from pipesched.grad_order import order_note, out_of_order, weight_gradient_order
from pipesched.ir import Instr, Op
from pipesched.runtime import launch

import rt_s16_programs as rt


def _recompute_some(program, pairs):
    """``program`` with an R right before the B of each (stage, microbatch) of ``pairs``."""
    ranks = []
    for stream in program.ranks:
        out = []
        for instr in stream:
            if instr.op is Op.B and (instr.stage, instr.microbatch) in pairs:
                out.append(Instr(Op.R, instr.stage, instr.microbatch))
            out.append(instr)
        ranks.append(out)
    return ps.validate(program.replace(ranks))


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule,p", [("1f1b", 2), ("interleaved-1f1b", 2)])
def test_a_program_recomputing_some_microbatches_of_a_stage_runs_bitwise(schedule, p):
    base = ps.compile_program(schedule, p, 3)
    program = _recompute_some(base, {(0, 1), (1, 0), (1, 2)})
    assert program.recomputed() == {(0, 1), (1, 0), (1, 2)}
    for report in launch(rt.run_program, p, ps.to_text(program), timeout=200):
        assert [(loss, ok, rel) for loss, _, ok, rel in report] == [(True, True, 0.0), (True, True, 0.0)]
        assert all(count > 0 for _, count, _, _ in report)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "dualpipev"])
def test_every_built_in_schedule_adds_weight_gradients_in_microbatch_order(schedule):
    """What the bitwise guarantee rests on (the README's 'bitwise gradients' condition for user programs)."""
    checked = 0
    for p in (1, 2, 3, 4):
        for m in (1, 2, 3, 5, 8):
            for options in ({}, {"split_backward": True}, {"recompute": True}):
                try:
                    program = ps.compile_program(schedule, p, m, **options)
                except (ValueError, ps.ScheduleError):
                    continue  # a size this schedule refuses (its error says why)
                assert weight_gradient_order(program) == {s: list(range(m)) for s in range(program.num_stages)}, \
                    (schedule, p, m, options)
                assert out_of_order(program) == {} and order_note(program) == ""
                checked += 1
    assert checked > 20


@pytest.mark.multiprocess
def test_backwards_in_another_microbatch_order_give_gradients_equal_up_to_rounding():
    base = ps.compile_program("gpipe", 2, 3)
    ranks = []
    for stream in base.ranks:  # each stage's backward block (RECV_B?, B, SEND_B?) in the order 2, 1, 0
        head = [i for i in stream if i.op in (Op.F, Op.SEND_F, Op.RECV_F)]
        tail = [i for i in stream if i not in head]
        blocks = {mb: [i for i in tail if i.microbatch == mb] for mb in range(3)}
        ranks.append(head + blocks[2] + blocks[1] + blocks[0])
    program = ps.validate(base.replace(ranks))
    assert out_of_order(program) == {0: [2, 1, 0], 1: [2, 1, 0]}
    assert order_note(program).startswith("Note: weight gradients are added out of microbatch order (stage 0: 2, 1, "
                                          "0; stage 1: 2, 1, 0), so they equal the unsplit model's up to float "
                                          "rounding (~1e-7 of a parameter's largest gradient), not bitwise")
    assert out_of_order(ps.lower.forward_only(program)) == {}
    for report in launch(rt.run_program, 2, ps.to_text(program), timeout=200):
        for loss, count, _, rel in report:
            assert loss and count > 0 and rel < 1e-6


def _move(program, rank, instr_text, before_text):
    stream = [i for i in program.ranks[rank] if str(i) != instr_text]
    at = [str(i) for i in stream].index(before_text)
    stream.insert(at, Instr.parse(instr_text))
    ranks = list(program.ranks)
    ranks[rank] = stream
    return ps.validate(program.replace(ranks))


def test_a_gradient_receive_before_its_forward_is_refused_naming_both():
    program = _move(ps.compile_program("1f1b", 2, 2), 0, "RECV_B0.0<1", "F0.0")  # valid as a program
    with pytest.raises(DependencyError) as info:
        ps.step_programs(program, "gloo")
    assert str(info.value).startswith(
        "rank 0, RECV_B0.0<1: comes before F0.0, whose output sizes the gradient it receives: a step that learns the "
        "message shapes (a Pipeline's first step, and the first after a change of input signature or settings) "
        "knows that size only once the forward ran; post it after F0.0 (a program compiled with compile_program(..., "
        "early_receives=N) does this: pass it in program order, without early_receives; the pipeline posts receives "
        "early itself once the shapes are known (gloo))\n")
    assert "RECV_B0.0<1 <-- here" in str(info.value)
    early = ps.compile_program("gpipe", 2, 1, early_receives=2)  # compile_program's own early receives, refused alike
    with pytest.raises(DependencyError, match=r"RECV_B0.0<1: comes before F0.0, .* without early_receives"):
        ps.step_programs(early, "gloo")


def test_a_late_send_that_blocks_the_learning_step_gets_advice_that_fixes_it():
    compiled = ps.compile_program("1f1b", 2, 2)
    late = _move(compiled, 0, "SEND_F0.1>1", "RECV_B0.1<1")  # after B0.0: program order, no early receives
    with pytest.raises(ps.ScheduleError) as info:
        ps.step_programs(late, "gloo")
    text = str(info.value)
    assert text.startswith("rank 0, B0.0: while learning the message shapes")
    assert ("Post each RECV_F right before the F that uses it, or issue each SEND_F before its rank's next receive "
            "(right after its F, as compile_program does)") in text
    fixed = _move(late, 1, "RECV_F1.1<0", "F1.1")  # the first remedy the advice names
    assert ps.step_programs(fixed, "gloo").learn_train.ranks[1] == fixed.ranks[1]  # proven, and run as written


def test_zb_auto_adds_weight_gradients_in_microbatch_order_under_uneven_costs():
    """zb-auto defers W into idle slots; it still runs each stage's in microbatch order (seeded random costs)."""
    rng = random.Random(0)
    for _ in range(60):
        p, m = rng.randint(1, 5), rng.randint(1, 10)
        spread = lambda lo, hi: tuple(rng.uniform(lo, hi) for _ in range(p))  # noqa: E731 - per stage
        costs = ps.CostModel(forward=spread(0.5, 2), backward=spread(1, 4), input_grad=spread(0.5, 2),
                             weight_grad=spread(0.1, 3), latency=rng.uniform(0, 1))
        program = ps.compile_program("zb-auto", p, m, costs=costs)
        assert out_of_order(program) == {}, (p, m, costs)


def test_pipesched_validate_notes_a_program_whose_gradients_cannot_be_bitwise(tmp_path, capsys):
    from pipesched.cli import main

    base = ps.compile_program("gpipe", 2, 2)
    swapped = _move(base, 1, "B1.1", "B1.0")  # stage 1 adds microbatch 1's weight gradients first
    path = tmp_path / "swapped.txt"
    path.write_text(ps.to_text(swapped))
    assert main(["validate", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"valid: {path}: 2 ranks") and lines[1].startswith(
        "Note: weight gradients are added out of microbatch order (stage 1: 1, 0), so they equal")
    assert main(["validate", str(path), "--json"]) == 0
    assert '"weight_gradients_out_of_order": {"1": [1, 0]}' in capsys.readouterr().out
    path.write_text(ps.to_text(base))
    assert main(["validate", str(path)]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1  # in order: no note
