"""Prove a program runnable: well-formed, complete, correctly ordered, send/recv-paired, deadlock-free.

:func:`validate` runs five checks, cheapest first, each linear in the number of instructions:

1. structure — integer sizes and placement; every instruction's stage, microbatch and peer fit the program, on
   the right rank;
2. completeness — every instruction at most once (SEND/RECV, ALL_REDUCE and TIE_REDUCE included: a SEND/RECV pair
   given twice would match itself); each (stage, microbatch) has one F and one B (or one I and one W), at most one R;
   with ``dp_size > 1`` each stage has one ALL_REDUCE; a forward-only program
   (:attr:`~pipesched.ir.Program.forward_only`) has one F each and nothing but F, SEND_F and RECV_F;
   with ties, each rank holding one has one TIE_REDUCE after its tied stages' backwards (:mod:`pipesched.ties`);
3. order — on each rank, everything an instruction needs (:mod:`pipesched.deps`) comes before it; in a
   lowered program, data from another rank must arrive through an earlier RECV;
4. pairing and deadlock — between any two ranks the receives are posted in the order the sends are
   issued, and the rendezvous execution of :mod:`pipesched.engine` completes;
5. overlapped pairs — each pair of ``program.meta[OVERLAP_PAIRS]`` (if any) is what
   :data:`~pipesched.ir.OVERLAP_PAIRS` says: an F then the B or I of another microbatch, adjacent in one rank's
   compute order, no instruction in two pairs (checked before the deadlock check).

Each failure raises a :class:`~pipesched.errors.ScheduleError` subclass naming the rank, the instruction,
the reason, and showing the grid with the spot marked.

Speed: checks 1-3 and pairing first decide *whether* the program passes from the integer tables of
:class:`~pipesched.engine.Plan` (once per rule, counts, list comparisons: a few list operations per
instruction); only when one does not pass does its exact scan (``explain_*``) run to find and explain
the first failure, so the error is the one a plain scan reports. Each check is thus written twice, fast
and exact (:data:`CHECKS`; structure and completeness in :mod:`pipesched.validate_structure`, order and pairing in
:mod:`pipesched.validate_order`); ``tests/test_validate.py`` edits valid programs at random and asserts that the
two agree, and that the engine (which checks pairing again as it matches) agrees with both.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from . import engine
from .checks import as_int
from .errors import DependencyError, InvalidProgramError
from .gcpause import paused_gc
from .ir import Instr, Op, Program
from .checks import check_program
from .ties import check_ties
from .overlap_check import explain_overlap, overlap_passes
from .validate_order import explain_order, explain_pairing, in_order, paired
from .validate_structure import explain_incomplete, explain_structure, has_structure_problem, is_complete


@paused_gc()
def validate(program: Program) -> Program:
    """Check ``program``; return it unchanged if it is valid.

    The complete execution that proves it deadlock-free is remembered for the program
    (:func:`pipesched.engine.remember`), so validating or simulating it again does not repeat it; the overlapped
    pairs, in ``meta`` (which a caller may change), are checked again if they are not the tuple that passed.

    Raises:
        InvalidProgramError: bad sizes, stage, microbatch or peer, instruction on the wrong rank, missing or
            duplicated work (any instruction given twice), an overlapped pair that is not one.
        DependencyError: an instruction precedes what it needs on its rank.
        PairingError: a send without its receive (or the reverse), or receives out of the sends' order.
        DeadlockError: no rank can progress under rendezvous semantics.
        TypeError: ``program`` is not a :class:`~pipesched.ir.Program`.
    """
    check_program(program)
    if engine.proven_run(program) is None:
        engine.remember(program, engine.run(check_static(program)))
    else:
        _decide(OVERLAP, program, None)  # meta may have changed since the proof
    return program


def check_static(program: Program) -> engine.Plan:
    """Every check but the deadlock check (which needs an execution), cheapest first.

    Returns the program's :class:`~pipesched.engine.Plan`, ready for that execution.
    Raises as :func:`validate`.
    """
    plan = check_structure(program)
    check_complete(program, plan)
    _decide(TIES, program, plan)  # the ties' TIE_REDUCE: one per rank, after its tied stages' backwards
    check_order(program, plan)
    check_pairing(program, plan)
    _decide(OVERLAP, program, plan)  # the overlapped pairs of meta[OVERLAP_PAIRS], if any
    return plan


def check_structure(program: Program) -> engine.Plan:
    """Sizes, stage/microbatch ranges, placement and peers. Returns the program's plan."""
    p, S, M = program.num_ranks, program.num_stages, program.num_microbatches
    for name, value in (("num_microbatches", M), ("dp_size", program.dp_size),
                        *((f"stage_to_rank[{s}]", r) for s, r in enumerate(program.stage_to_rank))):
        if as_int(value) is None:  # a bool, a float (1.5, 0.0) or a string: never a count or a rank
            raise InvalidProgramError(f"{name} must be an integer, got {value!r}")
    if p < 1 or S < 1 or M < 1 or program.dp_size < 1:
        raise InvalidProgramError(
            f"a program needs >= 1 rank, stage, microbatch and dp_size; got ranks={p}, stages={S}, "
            f"num_microbatches={M}, dp_size={program.dp_size}"
        )
    bad = [r for r in program.stage_to_rank if not 0 <= r < p]
    if bad:
        raise InvalidProgramError(f"stage_to_rank names rank {bad[0]}, but the program has ranks 0..{p - 1}")
    _check_instructions(program)
    try:
        plan = engine.Plan(program)
    except engine.NoSuchStage:
        plan = None
    _decide(STRUCTURE, program, plan)
    return plan


def _check_instructions(program: Program) -> None:
    """Every instruction is an :class:`~pipesched.ir.Instr` (a string such as ``"F0.0"`` or a plain tuple would
    fail deep inside the checks with a TypeError or AttributeError that names neither the rank nor the way out)."""
    for rank, stream in enumerate(program.ranks):
        for index, instr in enumerate(stream):
            if type(instr) is not Instr:
                raise InvalidProgramError(
                    f"rank {rank}, instruction {index}: must be a pipesched.Instr, got {instr!r} "
                    f"({type(instr).__name__}); parse text with pipesched.Instr.parse('F0.0'), or a whole program "
                    f"with pipesched.loads(text)")


def check_complete(program: Program, plan: engine.Plan | None = None) -> None:
    """One F and one B (or one I and one W) per (stage, microbatch); at most one R; ALL_REDUCE per stage.
    ``plan``: the program's plan, if already made (it assumes :func:`check_structure` passed)."""
    _decide(COMPLETENESS, program, plan or check_structure(program))


def check_order(program: Program, plan: engine.Plan | None = None) -> None:
    """On each rank, what an instruction needs comes earlier in the stream (or, in a compute-only
    program, is made by another rank). ``plan``: the program's plan, if already made."""
    _decide(ORDER, program, plan or check_structure(program))


def check_pairing(program: Program, plan: engine.Plan | None = None) -> None:
    """Every send has its receive, and between two ranks receives are posted in the order of the sends.
    ``plan``: the program's plan, if already made."""
    _decide(PAIRING, program, plan or check_structure(program))


class Check(NamedTuple):
    """One check of :func:`validate`, written twice (see the module docstring).

    Attributes:
        name: what it checks.
        passes: ``(program, plan) -> bool``, the fast decision from the plan's integer tables (``plan`` is
            ``None`` when an instruction names a stage that does not exist).
        explain: ``(program) -> None``, the exact scan: raises the error for the first failure, returns if none.
    """

    name: str
    passes: Callable[[Program, "engine.Plan | None"], bool]
    explain: Callable[[Program], None]


STRUCTURE = Check("structure", lambda program, plan: plan is not None and not has_structure_problem(plan),
                  explain_structure)
COMPLETENESS = Check("completeness", lambda program, plan: is_complete(plan), explain_incomplete)
ORDER = Check("order", in_order, explain_order)
PAIRING = Check("pairing", paired, explain_pairing)
#: :func:`pipesched.ties.check_ties`; decided at once for a program without ties or TIE_REDUCE, else by its scan
TIES = Check("ties", lambda program, plan: _ties_pass(program, plan), check_ties)
#: the overlapped pairs (``meta[OVERLAP_PAIRS]``, :data:`pipesched.ir.OVERLAP_PAIRS`); decided at once for a program
#: without pairs (or with the pairs that passed last), else by one loop over the pairs
OVERLAP = Check("overlap", lambda program, plan: overlap_passes(program), explain_overlap)
#: the checks :func:`check_static` runs, in its order (each assumes the ones before it passed)
CHECKS = (STRUCTURE, COMPLETENESS, TIES, ORDER, PAIRING, OVERLAP)


def _ties_pass(program: Program, plan: engine.Plan) -> bool:
    if not program.ties and Op.TIE_REDUCE not in plan.ops:
        return True
    return _exact_passes(check_ties, program)


def _exact_passes(explain, program: Program) -> bool:
    try:
        explain(program)
    except (InvalidProgramError, DependencyError):
        return False
    return True


def _decide(check: Check, program: Program, plan) -> None:
    """Run ``check``: the fast decision, then, if it fails, the exact scan that raises the error."""
    if not check.passes(program, plan):
        check.explain(program)
        raise AssertionError(f"the fast {check.name} check found a problem that the exact one does not")  # a bug
