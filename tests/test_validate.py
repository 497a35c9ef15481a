"""The validator rejects hand-made bad programs, each with the expected error, rank and instruction; its fast
checks, its exact (explaining) checks and the engine agree on randomly edited programs."""
import importlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesched import (SCHEDULES, DeadlockError, DependencyError, InvalidProgramError, PairingError, ScheduleError,
                       build, compile_program, engine, loads, validate)
from pipesched.ir import COMM_OPS, Instr, Op, Program

checks = importlib.import_module("pipesched.validate")  # the module (``pipesched.validate`` is the function)

HEADER = "microbatches: {m}\nstage_to_rank: 0 1\n"
GOOD = HEADER.format(m=1) + """
rank 0: F0.0 SEND_F0.0>1 RECV_B0.0<1 B0.0
rank 1: RECV_F1.0<0 F1.0 B1.0 SEND_B1.0>0
"""


def _check(text, error, rank, instr, reason):
    with pytest.raises(error) as info:
        validate(loads(text))
    assert isinstance(info.value, ScheduleError)
    assert info.value.rank == rank
    assert str(info.value.instr) == instr
    assert reason in info.value.reason
    assert "<-- here" in str(info.value) or not info.value.grid
    return info.value


def test_good_program_passes():
    program = loads(GOOD)
    assert validate(program) is program


def test_missing_receive():
    text = HEADER.format(m=1) + """
rank 0: F0.0 SEND_F0.0>1 RECV_B0.0<1 B0.0
rank 1: F1.0 B1.0 SEND_B1.0>0
"""
    _check(text, DependencyError, 1, "F1.0", "no RECV_F receives it")


def test_send_without_receive():
    text = HEADER.format(m=1) + """
rank 0: F0.0 SEND_F0.0>1 SEND_F0.0>1 RECV_B0.0<1 B0.0
rank 1: RECV_F1.0<0 F1.0 B1.0 SEND_B1.0>0
"""
    # the extra send is a duplicate: every instruction runs at most once (a send needed by no one has no receive)
    _check(text, InvalidProgramError, 0, "SEND_F0.0>1", "appears twice")


def test_swapped_pair_deadlocks():
    error = _check(open_example("broken-deadlock.txt"), DeadlockError, 0, "SEND_F0.1>1", "deadlock")
    assert "rank 1 blocked at SEND_B1.0>0" in error.reason
    assert str(error).count("<-- here") == 2


def test_backward_before_forward():
    text = HEADER.format(m=1) + """
rank 0: B0.0 F0.0 SEND_F0.0>1 RECV_B0.0<1
rank 1: RECV_F1.0<0 F1.0 B1.0 SEND_B1.0>0
"""
    _check(text, DependencyError, 0, "B0.0", "the forward F0.0, which comes later in this stream")


def test_receives_out_of_send_order_between_a_pair():
    # per-kind matching would accept this; FIFO matching between a pair of ranks (NCCL's) does not
    text = HEADER.format(m=2) + """
rank 0: F0.0 SEND_F0.0>1 F0.1 SEND_F0.1>1 RECV_B0.0<1 B0.0 RECV_B0.1<1 B0.1
rank 1: RECV_F1.1<0 RECV_F1.0<0 F1.0 B1.0 SEND_B1.0>0 F1.1 B1.1 SEND_B1.1>0
"""
    _check(text, PairingError, 0, "SEND_F0.0>1", "out of the order of its sends")


# interleaved 1F1B, p=2, m=2, v=2 as compiled, but rank 0 posts RECV_B2.0 (the gradient rank 1 sends third) before
# RECV_F2.1 (the activation it sends second): per-kind channels would pair these, FIFO between the two ranks does not
ACROSS_KINDS = """microbatches: 2
stage_to_rank: 0 1 0 1
rank 0: F0.0 SEND_F0.0>1 F0.1 SEND_F0.1>1 RECV_F2.0<1 F2.0 SEND_F2.0>1 RECV_B2.0<1 RECV_F2.1<1 F2.1 SEND_F2.1>1
        B2.0 SEND_B2.0>1 RECV_B2.1<1 B2.1 SEND_B2.1>1 RECV_B0.0<1 B0.0 RECV_B0.1<1 B0.1
rank 1: RECV_F1.0<0 F1.0 RECV_F1.1<0 SEND_F1.0>0 F1.1 RECV_F3.0<0 SEND_F1.1>0 F3.0 RECV_F3.1<0 B3.0 SEND_B3.0>0
        F3.1 B3.1 RECV_B1.0<0 SEND_B3.1>0 B1.0 RECV_B1.1<0 SEND_B1.0>0 B1.1 SEND_B1.1>0
""".replace("\n        ", " ")


def test_receives_out_of_send_order_across_kinds():
    assert str(loads(ACROSS_KINDS)).count("RECV_") == str(compile_program("interleaved-1f1b", 2, 2, 2)).count("RECV_")
    error = _check(ACROSS_KINDS, PairingError, 1, "SEND_F1.1>0", "out of the order of its sends")
    assert "rank 0's matching receive is RECV_B2.0<1" in error.reason


def test_engine_refuses_a_send_matched_to_a_receive_posted_for_another_message():
    # the engine alone (static pairing skipped) pairs SEND_F1.1 with RECV_B2.0, first in first out
    program = loads(ACROSS_KINDS)
    with pytest.raises(PairingError) as info:
        engine.run(engine.Plan(program))
    assert (info.value.rank, str(info.value.instr)) == (1, "SEND_F1.1>0")
    assert ("matches RECV_B2.0<1 on rank 0, a receive posted for another message: it sends the output of stage 1 "
            "for microbatch 1, the receive is for the input gradient of stage 3 for microbatch 0") in info.value.reason
    assert str(info.value).count("<-- here") == 2


def test_engine_refuses_a_receive_left_without_its_send():
    program = loads(GOOD.replace("rank 1: RECV_F1.0<0", "rank 1: RECV_F1.0<0 RECV_F1.0<0"))
    with pytest.raises(PairingError) as info:
        engine.run(engine.Plan(program))
    assert (info.value.rank, str(info.value.instr)) == (1, "RECV_F1.0<0")
    assert "has no matching send on rank 0" in info.value.reason


ONE_RANK = "microbatches: {m}\nstage_to_rank: 0\nrank 0: {stream}\n"


@pytest.mark.parametrize("text, error, instr, reason", [
    (ONE_RANK.format(m=2, stream="F0.0 F0.1 B0.0"), InvalidProgramError, "B0.1", "its backward is missing"),
    (ONE_RANK.format(m=1, stream="F0.0 F0.0 B0.0"), InvalidProgramError, "F0.0", "appears twice"),
    (HEADER.format(m=1) + "rank 0: F0.0 F1.0 B1.0 B0.0\nrank 1:\n", InvalidProgramError, "F1.0",
     "stage 1 is placed on rank 1, not on rank 0"),
    (HEADER.format(m=1) + "rank 0: F0.0 SEND_F0.0>0 RECV_B0.0<1 B0.0\nrank 1: RECV_F1.0<0 F1.0 B1.0 SEND_B1.0>0\n",
     InvalidProgramError, "SEND_F0.0>0", "peer must be rank 1"),
    (ONE_RANK.format(m=1, stream="F0.0 I0.0"), InvalidProgramError, "W0.0", "has an I but no W"),
    (ONE_RANK.format(m=1, stream="F0.0 W0.0 I0.0"), DependencyError, "W0.0", "the input-gradient backward I0.0"),
], ids=["missing-backward", "duplicate-forward", "wrong-rank", "wrong-peer", "i-without-w", "w-before-i"])
def test_ill_formed_program_names_rank_0_the_instruction_and_the_reason(text, error, instr, reason):
    _check(text, error, 0, instr, reason)


def test_compute_only_program_that_deadlocks():
    # rank 0 waits for microbatch 0's gradient before the forward of microbatch 1, which rank 1 runs first
    text = HEADER.format(m=2) + "rank 0: F0.0 B0.0 F0.1 B0.1\nrank 1: F1.1 F1.0 B1.0 B1.1\n"
    error = _check(text, DeadlockError, 0, "B0.0", "deadlock")
    assert "rank 1 blocked at F1.1" in error.reason


def test_compute_only_program_passes_without_comm():
    validate(loads(HEADER.format(m=1) + "rank 0: F0.0 B0.0\nrank 1: F1.0 B1.0\n"))


def test_all_reduce_needs_dp():
    text = "microbatches: 1\nstage_to_rank: 0\nrank 0: F0.0 B0.0 ALL_REDUCE0\n"
    _check(text, InvalidProgramError, 0, "ALL_REDUCE0", "dp_size=1")


def open_example(name):
    from pathlib import Path

    return (Path(__file__).resolve().parents[1] / "schedules" / "examples" / name).read_text()


# ---- differential: fast check == exact check == engine, on valid programs edited at random ---------------------

def _exact(explain, program):
    """The exact check's verdict: the error it raises, or None."""
    try:
        explain(program)
    except ScheduleError as error:
        return error
    return None


def _agree(program) -> str:
    """Assert that, in validate's order up to the first check that fails, each fast check and its exact check
    agree, and validate raises the exact check's error; that the engine alone rejects what pairing rejects; and
    that, the static checks passed, the engine's verdict is validate's. Returns the check that failed ("valid")."""
    try:
        plan = engine.Plan(program)
    except engine.NoSuchStage:
        plan = None
    for check in checks.CHECKS:
        failed, error = not check.passes(program, plan), _exact(check.explain, program)
        assert failed == (error is not None), f"{check.name}: fast check failed={failed}, exact: {error!r}\n{program}"
        if failed:
            with pytest.raises(type(error)) as raised:
                validate(program)
            assert str(raised.value) == str(error)
            if check is checks.PAIRING:  # the engine checks pairing again as it matches
                with pytest.raises((PairingError, DeadlockError)):
                    engine.run(plan)
            return check.name
    done = engine.fire_all(plan)
    complete = done.heads == plan.first[1:]
    assert done.mismatch is None and not (complete and done.unmatched), f"the engine disagrees on pairing\n{program}"
    if complete:
        assert validate(program) is program
        return "valid"
    with pytest.raises(DeadlockError):
        validate(program)
    return "deadlock"


def _rekind(instr: Instr, op: Op, peer: int) -> Instr:
    if op in (Op.ALL_REDUCE, Op.TIE_REDUCE):
        return Instr(op, instr.stage)
    mb = instr.microbatch if instr.microbatch is not None else 0
    return Instr(op, instr.stage, mb, peer if op in COMM_OPS else None)


@st.composite
def edited_programs(draw):
    """A compiled program (small sizes, every option, forward-only or with receives posted early) with one to
    three random edits: swap two instructions (any two, or neighbours), move one a few places, drop one,
    duplicate one, give one another kind, or another stage or microbatch (up to one past the last). Half the
    time every edit moves a SEND or RECV a few places instead, which often keeps the order valid, so that some
    edited programs deadlock (receives are then where add_send_recv put them: posted early, few moves deadlock)."""
    name = draw(st.sampled_from(sorted(SCHEDULES)))
    only_moves = draw(st.booleans())  # deadlocks need an order-valid program: move messages only, half the time
    p, m = draw(st.integers(2 if only_moves else 1, 3)), draw(st.integers(1, 4))
    info = SCHEDULES[name]
    v = draw(st.integers(1, 2)) if info.default_virtual_stages > 1 and not info.fixed_virtual_stages else \
        info.default_virtual_stages
    owner = build(name, p, m, v).stage_to_rank  # a V puts the last stage on rank 0: tie stage 0 to another rank's
    last = max((s for s in range(p * v) if owner[s] != owner[0]), default=0)
    program = compile_program(name, p, m, v, dp_size=draw(st.integers(1, 2)), recompute=draw(st.booleans()),
                              split_backward=draw(st.booleans()), forward_only=draw(st.integers(0, 3)) == 0,
                              early_receives=0 if only_moves else draw(st.sampled_from([0, 2, 16])),
                              ties=[(0, last)] if p > 1 and draw(st.booleans()) else ())  # first, last off rank 0
    streams = [list(stream) for stream in program.ranks]
    for _ in range(draw(st.integers(1, 3))):
        rank = draw(st.integers(0, p - 1))
        stream = streams[rank]
        if not stream:
            continue
        at = draw(st.integers(0, len(stream) - 1))
        edit = "move" if only_moves else draw(st.sampled_from(["swap", "swap next", "move", "drop", "duplicate",
                                                               "rekind", "renumber"]))
        comm = [k for k, instr in enumerate(stream) if instr.op in COMM_OPS]
        if edit.startswith("swap"):
            other = min(at + 1, len(stream) - 1) if edit == "swap next" else draw(st.integers(0, len(stream) - 1))
            stream[at], stream[other] = stream[other], stream[at]
        elif edit == "move":
            at = draw(st.sampled_from(comm)) if comm and only_moves else at
            to = min(max(0, at + draw(st.integers(-4, 4))), len(stream) - 1)
            stream.insert(to, stream.pop(at))
        elif edit == "drop":
            del stream[at]
        elif edit == "duplicate":
            stream.insert(draw(st.integers(0, len(stream))), stream[at])
        elif edit == "rekind":
            op = draw(st.sampled_from([op for op in Op if op is not stream[at].op]))
            stream[at] = _rekind(stream[at], op, draw(st.integers(0, p - 1)))
        elif stream[at].microbatch is not None and draw(st.booleans()):
            stream[at] = stream[at]._replace(microbatch=draw(st.integers(0, m)))
        else:
            stream[at] = stream[at]._replace(stage=draw(st.integers(0, program.num_stages)))
    return program.replace(streams)


def test_fast_and_exact_checks_and_the_engine_agree():
    seen = set()

    @settings(max_examples=1000, deadline=None, derandomize=True)  # the coverage assert below must not be luck
    @given(edited_programs())
    def agree(program):
        seen.add(_agree(program))

    agree()
    # not vacuous: the edits reach every check's failure, deadlocks and valid programs
    assert seen == {"structure", "completeness", "ties", "order", "pairing", "overlap", "deadlock", "valid"}


@pytest.mark.parametrize("instr", ["F0.0", (Op.F, 0, 0)])
def test_an_instruction_that_is_not_an_instr_is_named_with_the_way_out(instr):
    # a string or a plain tuple failed deep inside the checks (TypeError: '>=' not supported between 'str' and
    # 'int'; AttributeError: 'tuple' object has no attribute 'op'), naming neither the rank nor the fix
    program = Program(((Instr(Op.F, 0, 1), instr),), (0,), 2)
    with pytest.raises(InvalidProgramError) as info:
        validate(program)
    assert str(info.value) == (f"rank 0, instruction 1: must be a pipesched.Instr, got {instr!r} "
                               f"({type(instr).__name__}); parse text with pipesched.Instr.parse('F0.0'), or a "
                               f"whole program with pipesched.loads(text)")


def test_a_send_deleted_mid_channel_is_named_as_missing_not_only_as_out_of_order():
    # the likeliest hand edit, a deleted line, read as "posted out of the order of its sends" alone (a fuzz)
    program = compile_program("1f1b", 2, 3)
    edited = program.replace([[i for i in program.ranks[0] if str(i) != "SEND_F0.1>1"], program.ranks[1]])
    with pytest.raises(PairingError) as info:
        validate(edited)
    assert str(info.value).splitlines()[0] == (
        "rank 0, SEND_F0.2>1: receives from rank 0 are posted out of the order of its sends: rank 0 sends "
        "SEND_F0.2>1 here, but rank 1's matching receive is RECV_F1.1<0 (messages between two ranks match first in, "
        "first out); rank 0 never sends what RECV_F1.1<0 receives: a send may be missing")
    swapped = list(program.ranks[0])
    a, b = (swapped.index(Instr.parse(t)) for t in ("SEND_F0.1>1", "SEND_F0.2>1"))
    swapped[a], swapped[b] = swapped[b], swapped[a]
    with pytest.raises(ScheduleError) as info:  # a true reordering keeps the plain wording
        validate(program.replace([swapped, program.ranks[1]]))
    assert "may be missing" not in str(info.value)
