"""Tied parameters across ranks in the IR: the tie groups of a program, where ``TIE_REDUCE`` goes, and its proof.

A *tie* is a group of stages that use one parameter (a GPT's token embedding on stage 0 and its LM head on the
last stage). The caller knows the model, so the caller gives the ties (:attr:`pipesched.ir.Program.ties`: sorted
tuples of stages); a tie whose stages are all on one rank needs nothing (autograd sums both uses into the one
``.grad``; ZB-V's and DualPipe-V's V puts stage 0 and the last stage on rank 0, so an embedding tied to the head
is such a tie): :func:`pipesched.lower.add_tie_reduce` accepts it and leaves it out, and a program's ties are
the ones that span two ranks or more (:func:`cross_rank_ties`).

After the last backward of its tied stages, each rank holding a tie issues ONE ``TIE_REDUCE`` whose ``stage``
is the *anchor*: the rank's tied stage whose backward ends last (B, or W of a split). It starts one asynchronous
sum per tie the rank holds, in the order of :attr:`~pipesched.ir.Program.ties`, each over that tie's ranks; the
executor waits for them at the end of the step. Why one instruction per rank rather than one per tie: two ranks
sharing two ties then start their two collectives in one order (tie order) on every rank by construction, whatever
the schedule, so no order across ranks has to be proven (or can be wrong); the cost is that a rank holding two
ties on different stages starts both after the later one's backward (a rare layout).

:func:`check_ties` proves, for every program (:func:`pipesched.validate.validate` calls it): the ties are well
formed; each rank holding a tie has exactly one ``TIE_REDUCE``, at its anchor stage, after the last backward of
every tied stage it holds; no other rank has one; a forward-only program has none.
"""
from __future__ import annotations

from .checks import as_int
from .deps import ENDS_BACKWARD
from .errors import DependencyError, InvalidProgramError, failure_at
from .ir import Instr, Op, Program

#: the instructions :func:`insert_position` steps over after the anchor's last backward (they do not wait on it)
_PASSED = frozenset({Op.SEND_B, Op.SEND_F, Op.ALL_REDUCE})


def cross_rank_ties(ties, stage_to_rank) -> tuple[tuple[int, ...], ...]:
    """The ties of ``ties`` that need a ``TIE_REDUCE``: as :func:`check_tie_groups`, but a tie whose stages are all
    on one rank is accepted and left out (autograd sums its uses on that rank; no collective).

    Raises:
        ValueError: as :func:`check_tie_groups`, except for a tie on one rank.
    """
    return check_tie_groups(ties, stage_to_rank, one_rank="drop")


def one_rank_ties(ties, stage_to_rank) -> tuple[tuple[int, ...], ...]:
    """The ties of well-formed ``ties`` whose stages are all on one rank (those :func:`cross_rank_ties` leaves
    out), as sorted tuples."""
    return tuple(tuple(sorted(t)) for t in ties if len({stage_to_rank[s] for s in t}) == 1)


def tie_tuples(ties) -> tuple[tuple, ...]:
    """``ties`` as a tuple of tuples of its items, not yet checked as stages: any sequence of sequences (lists,
    tuples, a 2-D numpy array, a generator, read once). ``ties`` is never tested for truth: a numpy array has none
    (``if ties:`` raises numpy's "ambiguous" error, and a 1 x 1 array ``[[0]]`` would read as "no ties").

    Raises:
        ValueError: ``ties`` or one of its ties is not a sequence (a string, a number); the message names ``ties``,
            the value and what is valid.
    """
    if isinstance(ties, (str, bytes)) or not hasattr(ties, "__iter__"):
        raise ValueError(f"ties must be a sequence of stage groups, e.g. [(0, 3)], got {ties!r}")
    groups = []
    for tie in ties:
        if isinstance(tie, (str, bytes)) or not hasattr(tie, "__iter__"):
            raise ValueError(f"ties: each tie must be a sequence of stages, e.g. (0, 3), got {tie!r}")
        groups.append(tuple(tie))
    return tuple(groups)


def check_tie_groups(ties, stage_to_rank, one_rank: str = "refuse") -> tuple[tuple[int, ...], ...]:
    """``ties`` as sorted tuples of stages, checked against the placement ``stage_to_rank``.

    A stage is any integer that is not a bool (an ``int``, a numpy integer: :func:`pipesched.checks.as_int`, as
    sizes are), returned as a plain ``int``.

    ``one_rank``: what to do with a tie whose stages are all on one rank: ``"refuse"`` (a program's ties,
    :attr:`pipesched.ir.Program.ties`, are the ones that need a collective) or ``"drop"`` (leave it out:
    :func:`cross_rank_ties`).

    Raises:
        ValueError: ``ties`` is not a sequence of sequences of stage indices; a tie with fewer than 2 stages,
            a repeated or out-of-range stage, all its stages on one rank (``one_rank="refuse"``), or given twice
            (the message names ``ties``, the value and what is valid).
    """
    groups = []
    num_stages = len(stage_to_rank)
    for tie in tie_tuples(ties):
        stages = tuple(as_int(s) for s in tie)
        if any(s is None or not 0 <= s < num_stages for s in stages):
            raise ValueError(f"ties: {tie!r} names a stage that is not an integer in 0..{num_stages - 1}")
        if len(set(stages)) != len(stages) or len(stages) < 2:
            raise ValueError(f"ties: {tie!r} must name 2 or more distinct stages")
        if len({stage_to_rank[s] for s in stages}) < 2 and one_rank != "drop":
            raise ValueError(f"ties: the stages {tie!r} are all on rank {stage_to_rank[stages[0]]}; a tie within one "
                             f"rank needs no collective (autograd sums its uses): leave it out")
        groups.append(tuple(sorted(stages)))
    if len(set(groups)) != len(groups):
        raise ValueError(f"ties: a tie is given twice in {list(groups)}; give each group of stages once")
    return tuple(g for g in groups if len({stage_to_rank[s] for s in g}) > 1)


def tie_ranks(program: Program, tie: int) -> tuple[int, ...]:
    """The pipeline ranks holding a stage of tie number ``tie``, sorted."""
    return tuple(sorted({program.stage_to_rank[s] for s in program.ties[tie]}))


def ties_of(program: Program, rank: int) -> tuple[int, ...]:
    """The numbers of the ties ``rank`` holds a stage of, in tie order (the order its collectives start)."""
    return tuple(k for k, tie in enumerate(program.ties) if any(program.stage_to_rank[s] == rank for s in tie))


def tied_stages(program: Program, rank: int) -> frozenset[int]:
    """The stages of ``rank`` that belong to some tie."""
    return frozenset(s for tie in program.ties for s in tie if program.stage_to_rank[s] == rank)


def last_backwards(stream, stages) -> dict[int, int]:
    """{stage: position of its last B or W in ``stream``} for the ``stages`` that have one."""
    return {i.stage: pos for pos, i in enumerate(stream) if i.op in ENDS_BACKWARD and i.stage in stages}


def insert_position(stream, stages) -> tuple[int, int]:
    """``(anchor stage, position)``: where :func:`pipesched.lower.add_tie_reduce` puts the ``TIE_REDUCE`` of a
    rank whose tied stages are ``stages``: after the last backward of the anchor (the stage whose backward ends
    last) and after the sends and ALL_REDUCEs that directly follow it, so no send waits for it.

    Raises:
        ValueError: none of ``stages`` has a backward in ``stream``.
    """
    last = last_backwards(stream, stages)
    if not last:
        raise ValueError(f"add_tie_reduce: tied stages {sorted(stages)} have no backward (B or W) on their rank; "
                         f"tie a training program")
    anchor = max(last, key=last.get)
    pos = last[anchor] + 1
    while pos < len(stream) and stream[pos].op in _PASSED:
        pos += 1
    return anchor, pos


def check_ties(program: Program, has_tie_reduce: bool = True) -> None:
    """Prove the ties of ``program`` and the placement of its ``TIE_REDUCE`` instructions (module docstring).

    ``has_tie_reduce``: whether some instruction is a ``TIE_REDUCE`` (``False`` skips the scan when the
    program has no ties either).
    Raises:
        InvalidProgramError: ill-formed ties; a rank holding a tie without its ``TIE_REDUCE`` or with two; a
            ``TIE_REDUCE`` on a rank that holds no tie or at a stage other than the anchor.
        DependencyError: a ``TIE_REDUCE`` before the last backward of a tied stage of its rank.
    """
    if not program.ties and not has_tie_reduce:
        return
    try:
        check_tie_groups(program.ties, program.stage_to_rank)
    except ValueError as exc:
        raise InvalidProgramError(f"the program's {exc}") from None
    plain = [s for tie in program.ties for s in tie if type(s) is not int]  # noqa: E721 - a program holds ints
    if plain:  # add_tie_reduce records plain ints; a numpy integer would not reach JSON or the fingerprint
        raise InvalidProgramError(f"the program's ties {program.ties!r} hold {plain[0]!r}, not a plain int")
    for rank, stream in enumerate(program.ranks):
        _check_rank(program, rank, stream)


def _check_rank(program: Program, rank: int, stream) -> None:
    stages = tied_stages(program, rank)
    found = [pos for pos, i in enumerate(stream) if i.op is Op.TIE_REDUCE]
    if program.forward_only or not stages:
        if found:
            why = "a forward-only program" if program.forward_only else f"rank {rank}, which holds no tied stage"
            raise failure_at(InvalidProgramError, program, rank, found[0], f"TIE_REDUCE in {why}")
        return
    ties = [program.ties[k] for k in ties_of(program, rank)]
    if not found:
        raise InvalidProgramError(f"rank {rank} holds tied stages {sorted(stages)} (ties {ties}) but has no TIE_REDUCE "
                                  f"to sum their gradients", rank, Instr(Op.TIE_REDUCE, min(stages)))
    if len(found) > 1:
        raise failure_at(InvalidProgramError, program, rank, found[1], f"a second TIE_REDUCE on rank {rank}; one per rank "
                                                                   f"reduces all its ties, in tie order")
    pos, last = found[0], last_backwards(stream, stages)
    late = [s for s, at in sorted(last.items()) if at > pos]
    if late:
        raise failure_at(DependencyError, program, rank, pos, f"comes before the last backward of tied stage {late[0]} "
                                                          f"({stream[last[late[0]]]}); it must follow every "
                                                          f"backward of the rank's tied stages {sorted(stages)}")
    anchor = max(last, key=last.get)
    if stream[pos].stage != anchor:
        raise failure_at(InvalidProgramError, program, rank, pos, f"must name stage {anchor}, the tied stage of rank "
                                                              f"{rank} whose backward ends last")

