"""Small fixes of session 10 (helper-103): tie indices accept the integer kinds sizes accept (numpy integers,
any numbers.Integral but bool), recorded as plain ints; bools and floats are still refused with the same message."""
import dataclasses
import json
from fractions import Fraction

import numpy as np
import pytest

import pipesched as ps
from pipesched.errors import InvalidProgramError, ScheduleArgumentError
from pipesched.program_io import fingerprint
from pipesched.validate import validate


@pytest.mark.parametrize("ties", [
    [(np.int64(0), np.int64(3))], [(np.int32(3), 0)], [np.array([0, 3])], [(np.uint8(0), np.int16(3))]])
def test_numpy_tie_indices_compile_as_plain_ints(ties):
    program = ps.compile_program("1f1b", 4, 4, ties=ties)
    assert program == ps.compile_program("1f1b", 4, 4, ties=[(0, 3)])
    assert program.ties == ((0, 3),) and all(type(s) is int for s in program.ties[0])
    json.dumps(program.ties)  # no numpy integer left for JSON
    assert fingerprint(program) == fingerprint(ps.compile_program("1f1b", 4, 4, ties=[(0, 3)]))


@pytest.mark.parametrize("tie", [(True, 3), (0, 3.0), (np.float64(0), 3), (np.bool_(False), 3), (0, Fraction(3)),
                                 (0, "3"), (np.int64(0), np.int64(4))])
def test_bools_floats_and_out_of_range_stages_are_still_refused(tie):
    with pytest.raises(ScheduleArgumentError) as raised:
        ps.compile_program("1f1b", 4, 4, ties=[tie])
    assert str(raised.value) == f"ties: {tie!r} names a stage that is not an integer in 0..3"
    assert raised.value.argument == "ties"


def test_a_program_holding_numpy_ties_is_still_refused_by_the_validator():
    program = ps.compile_program("1f1b", 4, 4, ties=[(0, 3)])
    numpy_ties = dataclasses.replace(program, ties=((np.int64(0), np.int64(3)),))
    with pytest.raises(InvalidProgramError) as raised:
        validate(numpy_ties)
    assert str(raised.value) == "the program's ties ((np.int64(0), np.int64(3)),) hold np.int64(0), not a plain int"
