"""The overlapped pairs (``program.meta[OVERLAP_PAIRS]``, :data:`pipesched.ir.OVERLAP_PAIRS`) as the text and JSON
forms of :mod:`pipesched.program_io` carry them: which groups a program writes (:func:`overlap_groups`) and the
checked groups a program read from either form gets (:func:`with_groups`).
"""
from __future__ import annotations

from .errors import ProgramFormatError
from .ir import OVERLAP_PAIRS, Instr, Program


def overlap_groups(program: Program) -> tuple[tuple[Instr, ...], ...]:
    """The groups of ``program.meta[OVERLAP_PAIRS]`` the text and JSON forms carry: those whose instructions are all
    in one rank's stream (a pass that removes one, e.g. :func:`~pipesched.lower.forward_only` removing the
    backward of a pair, leaves a group the program no longer runs: it is left out)."""
    groups = program.meta.get(OVERLAP_PAIRS) or ()
    if not groups:
        return ()
    where = _rank_of(program)
    return tuple(tuple(g) for g in groups if len(g) >= 2 and all(i in where for i in g)
                 and len({where[i] for i in g}) == 1)


def _rank_of(program: Program) -> dict:
    return {instr: rank for rank, stream in enumerate(program.ranks) for instr in stream}


def with_groups(program: Program, groups) -> Program:
    """``program`` with ``meta[OVERLAP_PAIRS] = groups`` (none: unchanged).

    Raises:
        ProgramFormatError: a group of other than 2 instructions (a pair: :data:`~pipesched.ir.OVERLAP_PAIRS`), or
            one not all in one rank's stream.
    """
    if not groups:
        return program
    where = _rank_of(program)
    for group in groups:
        text = "+".join(map(str, group))
        missing = [i for i in group if i not in where]
        if len(group) != 2 or missing or len({where[i] for i in group}) > 1:
            why = (f"{missing[0]} is not an instruction of the program" if missing else
                   f"a pair joins exactly 2 instructions, this one {len(group)}" if len(group) != 2 else
                   "its instructions are on ranks " + " and ".join(str(where[i]) for i in group))
            raise ProgramFormatError(f"{OVERLAP_PAIRS}: {text}: {why}; each pair joins two instructions of one rank "
                                     f"with '+', e.g. F0.5+B3.1")
    program.meta[OVERLAP_PAIRS] = tuple(groups)
    return program
