"""The first two checks of :func:`pipesched.validate.validate`, each written twice (fast, exact): structure (every
instruction's stage, microbatch and peer fit the program, on the right rank) and completeness (every instruction at
most once, all the work there). :mod:`pipesched.validate` runs them; see its docstring for why twice.
"""
from __future__ import annotations

from collections import Counter

from . import engine
from .deps import message, route
from .errors import InvalidProgramError, failure_at
from .ir import COLLECTIVE_OPS, COMM_OPS, FORWARD_OPS, SEND_OPS, Instr, Op, Program


def has_structure_problem(plan: engine.Plan) -> bool:
    """Whether :func:`explain_structure` finds a problem, checked once per rule of each rank (and one
    comparison of all peers with the expected ones) instead of once per instruction."""
    program, rules = plan.program, plan.rules
    s2r, M, dp_size = program.stage_to_rank, program.num_microbatches, program.dp_size
    if max(plan.mb, default=0) >= M:
        return True
    expected = [_expected_peer(op, stage, s2r) for op, stage in zip(rules.op, rules.stage)]
    if list(map(expected.__getitem__, plan.rule)) != plan.peer:
        return True
    for rank in range(program.num_ranks):
        for t in set(plan.rule[plan.first[rank]:plan.first[rank + 1]]):
            op, stage = rules.op[t], rules.stage[t]
            probe = Instr(op, stage, None if op in COLLECTIVE_OPS else 0, expected[t])
            if _structure_problem(probe, rank, s2r, M, dp_size, program.forward_only):
                return True
    return False


def _expected_peer(op: Op, stage: int, s2r) -> int | None:
    """The peer a SEND/RECV of ``op`` at ``stage`` must name (0 when it has no neighbour stage), else None."""
    if op not in COMM_OPS:
        return None
    neighbour = _other_end(op, stage)
    return s2r[neighbour] if 0 <= neighbour < len(s2r) else 0


def _other_end(op: Op, stage: int) -> int:
    """The stage at the other end of a SEND/RECV of ``op`` at ``stage`` (may be out of range)."""
    path = route(message(Instr(op, stage, 0, 0)))
    return path.recv_stage if op in SEND_OPS else path.send_stage


def explain_structure(program: Program) -> None:
    """Raise the error :func:`~pipesched.validate.check_structure` reports for the first ill-formed instruction
    (if any)."""
    for rank, stream in enumerate(program.ranks):
        for pos, instr in enumerate(stream):
            reason = _structure_problem(instr, rank, program.stage_to_rank, program.num_microbatches,
                                        program.dp_size, program.forward_only)
            if reason:
                raise failure_at(InvalidProgramError, program, rank, pos, reason)


def _structure_problem(instr: Instr, rank: int, s2r, M: int, dp_size: int,
                       forward_only: bool = False) -> str | None:
    S = len(s2r)
    if instr.stage >= S:
        return f"stage {instr.stage} does not exist (stages 0..{S - 1})"
    if s2r[instr.stage] != rank:
        return f"stage {instr.stage} is placed on rank {s2r[instr.stage]}, not on rank {rank}"
    if instr.microbatch is not None and instr.microbatch >= M:
        return f"microbatch {instr.microbatch} does not exist (num_microbatches={M})"
    if forward_only and instr.op not in FORWARD_OPS:
        return f"{instr.op} in a forward-only program, which runs only F, SEND_F and RECV_F"
    if instr.op is Op.ALL_REDUCE and dp_size == 1:
        return "ALL_REDUCE in a program with dp_size=1 (nothing to reduce)"
    if instr.op in COMM_OPS:
        neighbour = _other_end(instr.op, instr.stage)
        if not 0 <= neighbour < S:
            return f"{instr.op} of stage {instr.stage} has no {'next' if neighbour > instr.stage else 'previous'} stage"
        if s2r[neighbour] == rank:
            return f"stage {neighbour} is on this same rank; no {instr.op} is needed"
        if instr.peer != s2r[neighbour]:
            return f"peer must be rank {s2r[neighbour]} (holds stage {neighbour}), got {instr.peer}"
    return None


def is_complete(plan: engine.Plan) -> bool:
    """Whether :func:`~pipesched.validate.check_complete` passes, from counts: with every stage and microbatch in
    range and nothing twice, S * M forwards are all of them."""
    program, rules = plan.program, plan.rules
    M, cells = program.num_microbatches, program.num_stages * program.num_microbatches
    # every instruction at most once, SEND/RECV and collectives included (a SEND's peer follows from its stage)
    work = [t * M + mb for t, mb in zip(plan.rule, plan.mb)]
    if len(set(work)) != len(work):
        return False  # some (op, stage, microbatch) appears twice
    count: Counter = Counter()
    for t, n in Counter(plan.rule).items():
        count[rules.op[t]] += n
    if program.forward_only:  # its structure check allowed F, SEND_F and RECV_F only
        return count[Op.F] == cells
    if count[Op.F] != cells or (program.dp_size > 1 and count[Op.ALL_REDUCE] != program.num_stages):
        return False
    if not (count[Op.I] or count[Op.W]):
        return count[Op.B] == cells
    full, inp, wgt = ({(i.stage, i.microbatch) for i in plan.instrs if i.op is op} for op in (Op.B, Op.I, Op.W))
    return not (full & inp) and not (full & wgt) and inp == wgt and len(full) + len(inp) == cells


def explain_incomplete(program: Program) -> None:
    """Raise the error :func:`~pipesched.validate.check_complete` reports (if any): the first duplicate (of any
    kind: a SEND/RECV pair given twice matches itself, so only this check finds it), else the first missing work."""
    counts: Counter = Counter()
    for rank, stream in enumerate(program.ranks):
        for pos, instr in enumerate(stream):
            key = instr.key
            counts[key] += 1
            if counts[key] > 1:
                raise failure_at(InvalidProgramError, program, rank, pos, f"{instr} appears twice (each instruction "
                            f"runs at most once)")
    for s in range(program.num_stages):
        for mb in range(program.num_microbatches):
            problem = _missing_work(counts, s, mb, program.forward_only)
            if problem:
                op, reason = problem
                raise InvalidProgramError(
                    f"stage {s}, microbatch {mb}: {reason}", program.stage_to_rank[s], Instr(op, s, mb)
                )
        if program.dp_size > 1 and not program.forward_only and counts[(Op.ALL_REDUCE, s, None)] == 0:
            raise InvalidProgramError(f"dp_size={program.dp_size} but stage {s} has no ALL_REDUCE")


def _missing_work(counts: Counter, s: int, mb: int, forward_only: bool = False) -> tuple[Op, str] | None:
    if not counts[(Op.F, s, mb)]:
        return Op.F, "its forward F is missing"
    if forward_only:
        return None
    full, inp, wgt = counts[(Op.B, s, mb)], counts[(Op.I, s, mb)], counts[(Op.W, s, mb)]
    if full and (inp or wgt):
        return Op.B, "has both a B and an I/W split; use one or the other"
    if not (full or inp or wgt):
        return Op.B, "its backward is missing (a B, or an I and a W)"
    if not full and not inp:
        return Op.I, "has a W but no I (the input-gradient half it follows)"
    if not full and not wgt:
        return Op.W, "has an I but no W (the weight-gradient half)"
    return None
