"""Lowering passes, Program -> Program: split backward, recompute, sends and receives, data-parallel all-reduce,
tied-gradient sums, the forward-only part, receives posted early.

Each pass takes a program and returns a new one; none decides *what* runs, only where the extra
instructions go (or, for :func:`forward_only`, which part runs). :func:`compile_program` in
:mod:`pipesched.api` chains them and validates the result, whichever passes ran. The collectives' passes
(:func:`add_all_reduce`, :func:`add_tie_reduce`) live in :mod:`pipesched.lower_collectives`, receives posted early
(:func:`post_receives_early`) in :mod:`pipesched.lower_receives`; both are re-exported here.
"""
from __future__ import annotations

from operator import itemgetter
from typing import NamedTuple

from .checks import check_cost, check_program
from .cost import CostModel
from .deps import route
from .engine import has_comm
from .gcpause import paused_gc
from .ir import BACKWARD_OPS, FORWARD_OPS, OVERLAP_PAIRS, Instr, Op, Program
from .lower_collectives import add_all_reduce, add_tie_reduce
from .lower_receives import EARLY_RECEIVE_WINDOW, post_receives_early
from .timeline import timeline_order
from .timing import COST_FIELD, time_instructions

__all__ = ["REFERENCE_COST", "EARLY_RECEIVE_WINDOW", "split_backward", "add_recompute", "stage_flags",
           "add_send_recv", "add_all_reduce", "add_tie_reduce", "forward_only", "post_receives_early"]

#: The cost model that orders communication: the usual backward = 2 x forward, free messages.
REFERENCE_COST = CostModel(forward=1.0, backward=2.0)


def split_backward(program: Program, stages=True) -> Program:
    """Replace each ``B(s, mb)`` of the chosen stages by ``I(s, mb)`` then ``W(s, mb)``: the backward split
    of zero-bubble pipelining (Qi et al., arXiv:2401.10241), with ``W`` left in ``B``'s place. The order
    of work per rank is unchanged; what changes is that the input gradient exists before the weight
    gradient is computed, so :func:`add_send_recv` puts its ``SEND_B`` between ``I`` and ``W`` and the
    previous stage's rank, which waits for it, gets it one ``W`` earlier.

    Overlapped pairs (``meta[OVERLAP_PAIRS]``, DualPipe-V's ``(F, B)``): a pair whose ``B`` is split becomes
    ``(F, I)``: the ``I`` takes the ``B``'s place right after the ``F``, and it is the half on the critical path
    (the input gradient the previous stage waits for) that the overlap hides; the ``W`` runs after the pair, as
    the IR allows (:data:`~pipesched.ir.OVERLAP_PAIRS`). No pair names a ``B`` the result no longer has.

    Args:
        program: a compute-only program (no SEND/RECV yet).
        stages: ``True``: every stage whose input gradient another rank waits for (``s > 0`` with stage
            ``s - 1`` on another rank; splitting the others gains nothing); ``False``: none; or one bool
            per stage.
    Raises:
        ValueError: ``stages`` has the wrong length, or the program already has SEND/RECV.
    """
    check_program(program)
    if has_comm(program):
        raise ValueError("split_backward takes a compute-only program; this one already has SEND/RECV "
                         "(apply split_backward before add_send_recv)")
    owner = program.stage_to_rank
    if stages is True:
        flags = [s > 0 and owner[s - 1] != owner[s] for s in range(program.num_stages)]
    else:
        flags = stage_flags(stages, program.num_stages)
    streams = []
    for stream in program.ranks:
        out = []
        for instr in stream:
            if instr.op is Op.B and flags[instr.stage]:
                out.append(Instr.trusted(Op.I, instr.stage, instr.microbatch))
                out.append(Instr.trusted(Op.W, instr.stage, instr.microbatch))
            else:
                out.append(instr)
        streams.append(tuple(out))
    def renamed(instr: Instr) -> Instr:  # a pair's B that was split: its I
        return Instr.trusted(Op.I, instr.stage, instr.microbatch) if instr.op is Op.B and flags[instr.stage] else instr

    return _pairs_mapped(program.replace(streams), renamed)


def _pairs_mapped(program: Program, rename=None, keep=None) -> Program:
    """``program`` (made by a pass, with its own copy of ``meta``) with its overlapped pairs
    (``meta[OVERLAP_PAIRS]``) carried through the pass: each instruction renamed by ``rename``, a group dropped
    unless ``keep`` holds for all its instructions; the key removed when no group is left (as in a program
    loaded from a file without pairs). Without pairs: ``program`` unchanged."""
    groups = program.meta.get(OVERLAP_PAIRS)
    if not groups:
        return program
    groups = tuple(tuple(map(rename, g)) if rename else tuple(g) for g in groups
                   if keep is None or all(map(keep, g)))
    if groups:
        program.meta[OVERLAP_PAIRS] = groups
    else:
        del program.meta[OVERLAP_PAIRS]
    return program


def add_recompute(program: Program, stages=True) -> Program:
    """Insert ``R(s, mb)`` right before each backward (``B`` or ``I``) of a recomputed stage.

    Args:
        program: a compute-only program (no SEND/RECV yet) without R.
        stages: ``True`` (every stage), ``False`` (none), or one bool per stage.
    Overlapped pairs (``meta[OVERLAP_PAIRS]``) are kept: the ``R`` before a pair's backward is part of it
    (:data:`~pipesched.ir.OVERLAP_PAIRS`).
    Memory guarantee: an R sits directly before the backward it serves in its rank's compute order, so
    a rank holds the full activations of at most one recomputed microbatch-stage at a time; the others
    keep only their stage input. When :func:`add_send_recv` then places the gradient's RECV_B, it lands
    after the R whenever the R can run before the gradient arrives, so the recompute overlaps that wait.
    Raises:
        ValueError: ``stages`` has the wrong length, or the program already has SEND/RECV or R.
    """
    check_program(program)
    flags = stage_flags(stages, program.num_stages)
    if has_comm(program):
        raise ValueError("add_recompute takes a compute-only program; this one already has SEND/RECV "
                         "(apply add_recompute before add_send_recv)")
    if program.recomputed():
        raise ValueError("add_recompute: the program already has R instructions (apply it once)")
    streams = []
    for stream in program.ranks:
        out = []
        for instr in stream:
            if instr.op in BACKWARD_OPS and flags[instr.stage]:
                out.append(Instr.trusted(Op.R, instr.stage, instr.microbatch))
            out.append(instr)
        streams.append(tuple(out))
    return program.replace(streams)


def stage_flags(value, num_stages: int, name: str = "stages") -> list[bool]:
    """One bool per stage from ``True``, ``False`` or a sequence of ``num_stages`` bools.

    Raises:
        ValueError: anything else (a string, a number, a non-bool item, the wrong length); the message names
            ``name``, the value and what is valid.
    """
    if isinstance(value, bool):
        return [value] * num_stages
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise ValueError(f"{name} must be True, False or a list of one bool per stage, got {value!r}")
    flags = list(value)
    wrong = [x for x in flags if not isinstance(x, bool)]
    if wrong:
        raise ValueError(f"{name} must hold only True or False (one per stage), got {wrong[0]!r} in {flags!r}")
    if len(flags) != num_stages:
        raise ValueError(f"{name} has {len(flags)} flag{'s' if len(flags) != 1 else ''} but the program has "
                         f"{num_stages} stages (pipeline ranks x virtual stages): give one bool per stage")
    return flags


@paused_gc()
def add_send_recv(program: Program, cost: CostModel = REFERENCE_COST, check: bool = True) -> Program:
    """Add a SEND on the producer's rank and a RECV on the consumer's rank for every cross-rank edge.

    Placement: time the compute-only program under ``cost`` (:func:`pipesched.timing.time_instructions`, the
    simulator's timing); every compute instruction gets the key
    (start, 1, rank) and every message the key (time its producer ends, 0, producer rank). The SEND goes
    right after its producer; the RECV is posted before the first compute of the consumer's rank that
    starts at or after that time. Posting never blocks (the consumer waits for the data, not the RECV),
    so an early post costs no time under any costs: simulated timelines of the lowered program equal
    those of the compute-only one plus message delays.

    Every compute takes time (> 0 seconds), so the keys of one rank's list are distinct: its computes
    start at distinct times, and each of its compute ends at a distinct time and sends at most one message.
    (With a zero-length producer, its message key (end, 0, ...) would sort before its own (start, 1, ...).)

    Deadlock freedom: sort all compute instructions and messages of all ranks by key into one global
    sequence in which each SEND and its RECV form a single step. Each rank's new stream is that sequence
    restricted to the rank, so the sequence itself is a complete execution even when every send blocks
    until its receive is posted: every step is either a compute whose inputs were sent earlier
    (producers end before consumers start) or a pair whose RECV and SEND are both at their ranks' heads.
    Messages between two ranks appear in the same order on both, so FIFO matching pairs them correctly.
    The execution model is confluent (:mod:`pipesched.engine`), so one complete execution means every
    execution completes, whatever the timing.

    Args:
        check: validate ``program`` first. ``False`` skips the static checks (for a program from a
            builder, whose lowered result is validated anyway); a deadlock still raises.
    Raises:
        ValueError: the program already has SEND/RECV, or a compute it runs costs 0 seconds.
        ScheduleError: ``check`` and the program is invalid (see :func:`pipesched.validate.validate`).
        DeadlockError: the program cannot complete.
    """
    check_program(program)
    check_cost(cost)
    if has_comm(program):
        raise ValueError("add_send_recv takes a compute-only program; this one already has SEND/RECV")
    plan, starts, ends = time_instructions(program, cost, check)
    _check_durations(plan, cost)
    routes = [_route_to(plan, give) for give in plan.give]  # per rule
    instrs, rule, mb = plan.instrs, plan.rule, plan.mb
    keyed: list[list] = [[] for _ in program.ranks]  # per rank: (key, instruction)
    for rank, mine in enumerate(keyed):
        lo, hi = plan.first[rank], plan.first[rank + 1]
        mine += [((starts[g], 1, rank), instrs[g]) for g in timeline_order(starts, ends, lo, hi)]
        sent = [(g, path) for g in range(lo, hi) if (path := routes[rule[g]]) is not None]  # computes that send
        keys = [(ends[g], 0, rank) for g, _ in sent]  # a message goes when its producer ends
        # the SENDs, then the RECVs, each made in one run: a program whose instructions lie together in memory
        # is walked faster by the passes after this one (validate and simulate took ~15% longer otherwise)
        sends = Instr.trusted_all([(path.send, path.send_stage, mb[g], path.dest) for g, path in sent])
        recvs = Instr.trusted_all([(path.recv, path.recv_stage, mb[g], rank) for g, path in sent])
        mine += zip(keys, sends)
        for key, recv, (_, path) in zip(keys, recvs, sent):
            keyed[path.dest].append((key, recv))
    streams = [tuple(map(itemgetter(1), sorted(items, key=itemgetter(0)))) for items in keyed]
    return program.replace(streams)


class _RouteTo(NamedTuple):
    """How an item travels (:class:`~pipesched.deps.Route`) and the rank that receives it."""

    send: Op
    send_stage: int
    recv: Op
    recv_stage: int
    dest: int


def _route_to(plan, give: int) -> _RouteTo | None:
    """How the item a compute rule of ``plan`` hands to another rank (its ``give``) travels; None if none."""
    if give < 0:
        return None
    path = route(plan.rules.item(give))
    return _RouteTo(*path, plan.program.stage_to_rank[path.recv_stage])


def _check_durations(plan, cost: CostModel) -> None:
    """Raise ``ValueError`` if a compute kind the plan runs costs 0 seconds at some stage (see
    :func:`add_send_recv` for why placement needs every compute to take time)."""
    num_stages = plan.program.num_stages
    for op in dict.fromkeys(plan.rules.op):
        name = COST_FIELD.get(op)
        if name is None:
            continue
        for stage, seconds in enumerate(cost.per_stage(name, num_stages)):
            if seconds <= 0:
                raise ValueError(
                    f"add_send_recv places each message after the end of the compute that makes it, so every "
                    f"compute must take time; cost {name} is {seconds:g} seconds at stage {stage} (give it > 0)"
                )


def forward_only(program: Program) -> Program:
    """The forward part of ``program``: its F, SEND_F and RECV_F in the same order on each rank, marked
    :attr:`~pipesched.ir.Program.forward_only` (what ``Pipeline.forward()`` runs; :func:`pipesched.validate.validate`
    then asks for one F per (stage, microbatch) and no backward). Placement, sizes and ``dp_size`` are kept.

    Deadlock freedom: a forward instruction needs only forward instructions (an F its stage input, from an F
    or a RECV_F; a SEND_F its F and the posted RECV_F), and the sends and receives left between two ranks
    keep their order on both sides. So the forward instructions of a complete execution of ``program``, in
    the order they fired there, are a complete execution of the result.

    Overlapped pairs (``meta[OVERLAP_PAIRS]``) are dropped with their backward: the result has none (no
    ``overlap_pairs`` key), as a forward-only program loaded from its text or JSON form.

    Args:
        program: a compute-only or lowered training program; a forward-only one is returned as it is.
    """
    check_program(program)
    if program.forward_only:
        return program
    streams = tuple(tuple(i for i in stream if i.op in FORWARD_OPS) for stream in program.ranks)
    result = Program(streams, program.stage_to_rank, program.num_microbatches, program.dp_size, program.schedule,
                     dict(program.meta), forward_only=True, ties=program.ties)
    return _pairs_mapped(result, keep=lambda i: i.op in FORWARD_OPS)
