"""The overlapped pairs of a program (``program.meta[OVERLAP_PAIRS]``, :data:`pipesched.ir.OVERLAP_PAIRS`): the
fifth check of :func:`pipesched.validate.validate`, written twice like the others: :func:`overlap_passes`, one
loop over the pairs (remembered for the program while its pairs are the same tuple), and :func:`explain_overlap`,
the scan that raises the error naming the first pair that is not one."""
from __future__ import annotations

from .errors import InvalidProgramError, failure_at
from .ir import BACKWARD_OPS, COMPUTE_OPS, OVERLAP_PAIRS, Instr, Op, Program


def explain_overlap(program: Program) -> None:
    """Raise the error for the first overlapped pair (``program.meta[OVERLAP_PAIRS]``) that is not what
    :data:`~pipesched.ir.OVERLAP_PAIRS` says a pair is (if any): two instructions, an ``F`` then a ``B`` or ``I``
    of another microbatch (a backward needs its own microbatch's forward: the two could not overlap), both in
    one rank's stream, the backward directly after the ``F`` in that rank's compute order (only messages,
    collectives and the backward's own ``R`` between them), and no instruction in two pairs."""
    groups = program.meta.get(OVERLAP_PAIRS) or ()
    if not groups:
        return
    index = [dict(zip(stream, range(len(stream)))) for stream in program.ranks]  # per rank: instruction -> position
    s2r = program.stage_to_rank

    def where(instr) -> tuple[int, int] | None:
        """The rank and position of ``instr`` (on its stage's rank, the structure check passed), or None."""
        if not isinstance(instr, Instr) or instr.stage >= len(s2r) or not 0 <= s2r[instr.stage] < len(index):
            return None
        pos = index[s2r[instr.stage]].get(instr)
        return None if pos is None else (s2r[instr.stage], pos)

    paired: dict = {}  # instruction -> the first pair it is in
    for group in groups:
        problem = _pair_problem(program, group, where, paired)
        if problem is not None:
            reason, rank, pos = problem
            head = (f"overlap pair {_group_text(group)} ({OVERLAP_PAIRS}: an F and the B or I of another microbatch it "
                    f"overlaps, adjacent on one rank): {reason}; to run them apart, drop the pair from the program's "
                    f"{OVERLAP_PAIRS}: line (program.meta[{OVERLAP_PAIRS!r}])")
            raise InvalidProgramError(head) if rank is None else failure_at(InvalidProgramError, program, rank, pos, head)
        paired[group[0]] = paired[group[1]] = group


def _group_text(group) -> str:
    return "+".join(map(str, group))


def _pair_problem(program: Program, group, where, paired: dict) -> tuple[str, int | None, int] | None:
    """What is wrong with one group of :func:`explain_overlap` (the reason, and the rank and position to mark,
    or rank None), or None. ``where(instr)``: its (rank, position) or None; ``paired``: the pairs so far."""
    if len(group) != 2 or not all(isinstance(i, Instr) for i in group):
        return f"a pair joins exactly two instructions, this group has {len(group)}", None, 0
    first, second = group
    if first.op is not Op.F or second.op not in BACKWARD_OPS:
        return f"a pair is an F followed by a B or I, got {first.op} then {second.op}", None, 0
    spots = where(first), where(second)
    for instr, spot in zip(group, spots):
        if spot is None:
            return f"{instr} is not an instruction of the program", None, 0
        if instr in paired:
            return (f"{instr} is also in the pair {_group_text(paired[instr])}; an instruction is in at most one pair",
                    *spot)
    (rank, fpos), (brank, bpos) = spots
    if brank != rank:
        return f"its instructions are on ranks {rank} and {brank}; a pair is on one rank", None, 0
    if first.microbatch == second.microbatch:
        return (f"both are of microbatch {first.microbatch}; a backward needs its own microbatch's forward, so the "
                f"two cannot overlap", rank, bpos)
    if bpos < fpos:
        return f"{second} comes before {first} on rank {rank}; the F comes first", rank, bpos
    stream = program.ranks[rank]
    for k in range(fpos + 1, bpos):
        instr = stream[k]
        if instr.op in COMPUTE_OPS and not (instr.op is Op.R and instr[1:3] == second[1:3]):
            return (f"{instr} runs between them on rank {rank}; the backward directly follows the F in the rank's "
                    f"compute order (messages, collectives and its own R may come between)", rank, k)
    return None


#: private attribute of a program: the ``meta[OVERLAP_PAIRS]`` tuple :func:`overlap_passes` last passed
_PAIRS_PASSED = "_pairs_passed"


def overlap_passes(program: Program) -> bool:
    """Whether :func:`explain_overlap` passes; remembered for the program while ``meta[OVERLAP_PAIRS]`` is the
    same tuple of tuples (immutable), so validating a proven program again does not scan it again."""
    groups = program.meta.get(OVERLAP_PAIRS)
    if not groups or program.__dict__.get(_PAIRS_PASSED) is groups:
        return True
    if not _pairs_are_pairs(program, groups):
        return False
    if type(groups) is tuple and all(type(g) is tuple for g in groups):
        object.__setattr__(program, _PAIRS_PASSED, groups)
    return True


def _pairs_are_pairs(program: Program, groups) -> bool:
    """Whether :func:`explain_overlap` passes, in one loop over the pairs (its rules, in another order)."""
    s2r, ranks = program.stage_to_rank, program.ranks
    index = [dict(zip(stream, range(len(stream)))) for stream in ranks]  # per rank: instruction -> position
    num_stages, num_ranks, seen = len(s2r), len(ranks), set()
    for group in groups:
        if len(group) != 2:
            return False
        f, b = group
        if not (isinstance(f, Instr) and isinstance(b, Instr)) or f[0] is not Op.F or b[0] not in BACKWARD_OPS \
                or f[2] == b[2] or f[1] >= num_stages or b[1] >= num_stages or f in seen or b in seen:
            return False
        rank = s2r[f[1]]
        if s2r[b[1]] != rank or not 0 <= rank < num_ranks:
            return False
        fpos, bpos = index[rank].get(f), index[rank].get(b)
        if fpos is None or bpos is None or bpos < fpos:
            return False
        if bpos > fpos + 1:  # messages, collectives and the backward's own R may sit between
            for i in ranks[rank][fpos + 1:bpos]:
                if i[0] in COMPUTE_OPS and not (i[0] is Op.R and i[1] == b[1] and i[2] == b[2]):
                    return False
        seen.add(f)
        seen.add(b)
    return True
