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
instruction); only when one does not pass does its exact scan (``_explain_*``) run to find and explain
the first failure, so the error is the one a plain scan reports. Each check is thus written twice, fast
and exact (:data:`CHECKS`); ``tests/test_validate.py`` edits valid programs at random and asserts that the
two agree, and that the engine (which checks pairing again as it matches) agrees with both.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from typing import NamedTuple

from . import engine
from .checks import as_int
from .deps import REMOTE_KINDS, describe, message, needs, produces, route
from .errors import DependencyError, InvalidProgramError, PairingError, failure_at, render_grid
from .gcpause import paused_gc
from .ir import COLLECTIVE_OPS, COMM_OPS, FORWARD_OPS, RECV_OPS, SEND_OPS, Instr, Op, Program
from .checks import check_program
from .ties import check_ties
from .overlap_check import explain_overlap, overlap_passes


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
    try:
        plan = engine.Plan(program)
    except engine.NoSuchStage:
        plan = None
    _decide(STRUCTURE, program, plan)
    return plan


def _has_structure_problem(plan: engine.Plan) -> bool:
    """Whether :func:`_explain_structure` finds a problem, checked once per rule of each rank (and one
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


def _explain_structure(program: Program) -> None:
    """Raise the error :func:`check_structure` reports for the first ill-formed instruction (if any)."""
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


def check_complete(program: Program, plan: engine.Plan | None = None) -> None:
    """One F and one B (or one I and one W) per (stage, microbatch); at most one R; ALL_REDUCE per stage.
    ``plan``: the program's plan, if already made (it assumes :func:`check_structure` passed)."""
    _decide(COMPLETENESS, program, plan or check_structure(program))


def _is_complete(plan: engine.Plan) -> bool:
    """Whether :func:`check_complete` passes, from counts: with every stage and microbatch in range and
    nothing twice, S * M forwards are all of them."""
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


def _explain_incomplete(program: Program) -> None:
    """Raise the error :func:`check_complete` reports (if any): the first duplicate (of any kind: a SEND/RECV
    pair given twice matches itself, so only this check finds it), else the first missing work."""
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


def check_order(program: Program, plan: engine.Plan | None = None) -> None:
    """On each rank, what an instruction needs comes earlier in the stream (or, in a compute-only
    program, is made by another rank). ``plan``: the program's plan, if already made."""
    _decide(ORDER, program, plan or check_structure(program))


def _in_order(program: Program, plan: engine.Plan) -> bool:
    """Whether :func:`check_order` passes, from the plan's integer tables."""
    rules, s2r = plan.rules, program.stage_to_rank
    # per rule, the items that must be made earlier on the same rank: all it needs, but in a
    # compute-only program not what it gets from another rank
    local = [
        tuple(base for base in need if plan.lowered or not _made_elsewhere(rules.item(base), s2r[stage], s2r))
        for need, stage in zip(rules.need, rules.stage)
    ]
    made, rule, mb, first = rules.made, plan.rule, plan.mb, plan.first
    for rank in range(program.num_ranks):
        have = bytearray(rules.num_items)
        for t, m in zip(rule[first[rank]:first[rank + 1]], mb[first[rank]:first[rank + 1]]):
            for base in local[t]:
                if not have[base + m]:
                    return False
            for base in made[t]:
                have[base + m] = 1
    return True


def _made_elsewhere(item, rank: int, s2r) -> bool:
    """Whether ``rank`` gets ``item`` from another rank."""
    kind, stage, _ = item
    return kind in REMOTE_KINDS and s2r[stage] != rank


def _explain_order(program: Program) -> None:
    """Raise the error :func:`check_order` reports for the first instruction that comes too early (if any)."""
    lowered = engine.has_comm(program)
    S, M, s2r = program.num_stages, program.num_microbatches, program.stage_to_rank
    recomputed = program.recomputed()
    for rank, stream in enumerate(program.ranks):
        have: set = set()
        for pos, instr in enumerate(stream):
            for item in needs(instr, S, M, (instr.stage, instr.microbatch) in recomputed):
                remote = _made_elsewhere(item, rank, s2r)
                if item in have or (remote and not lowered):
                    continue
                raise failure_at(DependencyError, program, rank, pos, _order_reason(item, remote, stream, pos))
            have.update(produces(instr))


def _order_reason(item, remote: bool, stream, pos: int) -> str:
    what = describe(item)
    if remote:
        recv = route(item).recv
        return f"needs {what} from another rank, but no {recv} receives it before this point"
    later = any(item in produces(i) for i in stream[pos + 1:])
    return f"needs {what}, which comes {'later in this stream' if later else 'nowhere before it on this rank'}"


def check_pairing(program: Program, plan: engine.Plan | None = None) -> None:
    """Every send has its receive, and between two ranks receives are posted in the order of the sends.
    ``plan``: the program's plan, if already made."""
    _decide(PAIRING, program, plan or check_structure(program))


def _paired(program: Program, plan: engine.Plan) -> bool:
    """Whether :func:`check_pairing` passes, from the plan's integer tables."""
    if not plan.lowered:
        return True
    p, kind, message = program.num_ranks, plan.kind, plan.give  # per rule; a SEND's or RECV's message
    sends: dict = defaultdict(list)  # src * p + dst -> messages (ids) in the order of the sends
    recvs: dict = defaultdict(list)  # src * p + dst -> messages (ids) in the order the receives are posted
    rule, mb, peer, first = plan.rule, plan.mb, plan.peer, plan.first
    for rank in range(p):
        for g in range(first[rank], first[rank + 1]):
            if peer[g] is not None:
                t = rule[g]
                if kind[t] == engine.SEND:
                    sends[rank * p + peer[g]].append(message[t] + mb[g])
                else:
                    recvs[peer[g] * p + rank].append(message[t] + mb[g])
    return sends == recvs


def _explain_pairing(program: Program) -> None:
    """Raise the error :func:`check_pairing` reports (if any): the first channel whose sends and receives differ."""
    sends: dict = defaultdict(list)
    recvs: dict = defaultdict(list)
    for rank, stream in enumerate(program.ranks):
        for pos, instr in enumerate(stream):
            if instr.op in SEND_OPS:
                sends[(rank, instr.peer)].append((pos, message(instr)))
            elif instr.op in RECV_OPS:
                recvs[(instr.peer, rank)].append((pos, message(instr)))
    for channel in sorted(set(sends) | set(recvs)):
        src, dst = channel
        out, inn = sends.get(channel, []), recvs.get(channel, [])
        for (spos, smsg), (rpos, rmsg) in zip(out, inn):
            if smsg != rmsg:
                raise PairingError(
                    f"receives from rank {src} are posted out of the order of its sends: rank {src} sends "
                    f"{program.ranks[src][spos]} here, but rank {dst}'s matching receive is "
                    f"{program.ranks[dst][rpos]} (messages between two ranks match first in, first out)",
                    src, program.ranks[src][spos], render_grid(program.ranks, {src: spos, dst: rpos}),
                )
        if len(out) > len(inn):
            pos = out[len(inn)][0]
            raise failure_at(PairingError, program, src, pos, f"has no matching receive on rank {dst}")
        if len(inn) > len(out):
            pos = inn[len(out)][0]
            raise failure_at(PairingError, program, dst, pos, f"has no matching send on rank {src}")


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


STRUCTURE = Check("structure", lambda program, plan: plan is not None and not _has_structure_problem(plan),
                  _explain_structure)
COMPLETENESS = Check("completeness", lambda program, plan: _is_complete(plan), _explain_incomplete)
ORDER = Check("order", _in_order, _explain_order)
PAIRING = Check("pairing", _paired, _explain_pairing)
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
