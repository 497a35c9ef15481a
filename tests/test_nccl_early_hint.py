"""step_programs on nccl, given a program compiled with early receives: the PairingError says what to pass instead
(program order, no early_receives), as the gloo path's error does. Torch-free."""
import pytest

import pipesched as ps
from pipesched.errors import PairingError

HINT = "pass it in program order, without early_receives"


@pytest.mark.parametrize("schedule, p, v, early", [
    ("1f1b", 2, None, 16),
    ("1f1b", 4, None, 4),
    ("interleaved-1f1b", 2, 2, 2),
    ("zb-h1", 3, None, 4),
])
def test_nccl_names_program_order_as_the_fix(schedule, p, v, early):
    program = ps.compile_program(schedule, p, 2 * p, v, early_receives=early)
    with pytest.raises(PairingError) as info:
        ps.step_programs(program, "nccl")
    err, cause = info.value, info.value.__cause__
    assert isinstance(cause, PairingError)  # the proof's own error, kept as the cause
    assert HINT in str(err) and "compile_program(..., early_receives=N)" in str(err)
    assert "On backend 'nccl' both ranks of a pair post their messages to each other in one order" in str(err)
    assert err.reason.startswith(cause.reason + ". ")  # the proof's finding first, then the hint
    assert (err.rank, err.instr, err.grid) == (cause.rank, cause.instr, cause.grid) and err.grid
    # in program order it is accepted, as on gloo
    plain = ps.compile_program(schedule, p, 2 * p, v)
    assert ps.step_programs(plain, "nccl").train == plain


def test_gloo_keeps_its_hint():
    program = ps.compile_program("1f1b", 2, 4, early_receives=16)
    with pytest.raises(ps.ScheduleError, match=HINT):
        ps.step_programs(program, "gloo")
