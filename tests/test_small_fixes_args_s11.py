"""compile_program's ``ties`` is never tested for truth (torch-free).

``compile_program(..., ties=np.array([[0, 3]]))`` raised numpy's "truth value of an array ... is ambiguous" from
``if ties:``; a 1 x 1 array ``[[0]]`` read as "no ties" (falsy) and compiled a program without its tie, silently; a
generator was truthy but read up by zb-auto's first candidate, so the program it returned had no ties, silently.
Now ``ties`` is read once as a tuple of tuples (:func:`pipesched.ties.tie_tuples`) and any sequence of sequences of
integers works as ``[(0, 3)]`` does; what is not one is refused naming ``ties``, its value and what is valid."""
from __future__ import annotations

import numpy as np
import pytest

import pipesched
from pipesched import ScheduleArgumentError, compile_program
from pipesched.ir import Op
from pipesched.ties import tie_tuples


def _tie_reduces(program):
    return [(rank, i.stage) for rank, stream in enumerate(program.ranks) for i in stream if i.op is Op.TIE_REDUCE]


@pytest.mark.parametrize("ties", [
    np.array([[0, 3]]),                      # numpy's 2-D array: "truth value ... ambiguous" before
    [np.array([0, 3])],                      # a list of arrays
    [(np.int64(0), np.int32(3))],            # numpy integers
    ((0, 3) for _ in range(1)),              # a generator, read once
    [[3, 0]],                                # any order within a tie
])
def test_ties_as_numpy_arrays_and_other_sequences_compile_as_a_list_of_tuples(ties):
    expected = compile_program("1f1b", 4, 8, ties=[(0, 3)])
    program = compile_program("1f1b", 4, 8, ties=ties)
    assert program.ties == ((0, 3),) and all(type(s) is int for s in program.ties[0])
    assert _tie_reduces(program) == _tie_reduces(expected) == [(0, 0), (3, 3)]
    assert pipesched.to_json(program) == pipesched.to_json(expected)


def test_zb_auto_keeps_the_ties_of_a_generator():
    """zb-auto runs the passes once per candidate: a generator was read up by the first, and the program returned
    had no ties (before: ``program.ties == ()``, no TIE_REDUCE)."""
    program = compile_program("zb-auto", 2, 4, ties=((0, 1) for _ in range(1)))
    assert program.ties == ((0, 1),)
    assert sorted(_tie_reduces(program)) == [(0, 0), (1, 1)]


@pytest.mark.parametrize("ties", [None, (), [], np.zeros((0, 2), dtype=np.int64)])
def test_no_ties(ties):
    program = compile_program("1f1b", 2, 4, ties=ties)  # an empty array: "ambiguous" before
    assert program.ties == () and _tie_reduces(program) == []


@pytest.mark.parametrize("ties, message", [
    # a 1 x 1 array was falsy: no ties and no error before
    (np.array([[0]]), "ties: (np.int64(0),) must name 2 or more distinct stages"),
    (np.array([[0.0, 1.0]]), "ties: (np.float64(0.0), np.float64(1.0)) names a stage that is not an integer in 0..1"),
    (np.array([0, 1]), "ties: each tie must be a sequence of stages, e.g. (0, 3), got np.int64(0)"),
    (5, "ties must be a sequence of stage groups, e.g. [(0, 3)], got 5"),
    ("01", "ties must be a sequence of stage groups, e.g. [(0, 3)], got '01'"),
    ([5], "ties: each tie must be a sequence of stages, e.g. (0, 3), got 5"),
    (np.array([[0, 2]]), "ties: (np.int64(0), np.int64(2)) names a stage that is not an integer in 0..1"),
])
def test_ill_formed_ties_are_refused_naming_ties_and_the_value(ties, message):
    with pytest.raises(ScheduleArgumentError) as info:
        compile_program("1f1b", 2, 4, ties=ties)
    assert str(info.value) == message
    assert info.value.argument == "ties"


def test_tie_tuples_reads_any_sequence_of_sequences_once():
    assert tie_tuples(np.array([[0, 3], [1, 2]])) == ((0, 3), (1, 2))
    assert tie_tuples(iter([range(2), [4, 5]])) == ((0, 1), (4, 5))
    assert tie_tuples([]) == ()
    with pytest.raises(ValueError, match=r"^ties must be a sequence of stage groups, e.g. \[\(0, 3\)\], got None$"):
        tie_tuples(None)


def test_add_tie_reduce_takes_a_numpy_array_too():
    program = compile_program("1f1b", 2, 4)
    assert pipesched.add_tie_reduce(program, np.array([[0, 1]])).ties == ((0, 1),)
