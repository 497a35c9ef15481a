"""Receives where torch can run them: torch's schedule runtime (and its dry run ``_simulate_comms_compute``) blocks
on a receive where it is posted, pipesched's never does, so a program whose receives are posted early
(``compile_program(..., early_receives=N)``) can stall torch. :func:`torch_runnable` finds out with a torch-free
copy of the dry run's readiness rules and, where it would stall, puts the receives where torch can run them
(for :func:`pipesched.interop.to_torch_csv`)."""
from __future__ import annotations

import dataclasses

from .ir import COMM_OPS, Instr, Op, Program
from .lower import add_all_reduce


def torch_runnable(program: Program) -> tuple[Program, str | None]:
    """``(program as torch can run it, what was changed or None)``: torch's receive blocks where it is posted (its
    dry run ``_simulate_comms_compute`` runs a RECV once the matching SEND ran), pipesched's never blocks. A program
    whose receives are posted early (``compile_program(..., early_receives=N)``,
    :func:`~pipesched.lower.post_receives_early`) can stall torch there: its receives are then put back where
    :func:`~pipesched.lower.add_send_recv` posts them (program order: nothing but receives differs), else, for a
    program lowered otherwise, just before the compute that uses them, in the same order, if that is still valid.

    Raises:
        ValueError: neither runs in torch's dry run (names where it stalls).
    """
    stuck = _torch_stall(program.ranks, program.stage_to_rank, program.num_stages)
    if stuck is None:
        return program, None
    for candidate, where in ((_program_order(program), "where add_send_recv posts them (program order)"),
                             (_at_use(program), "just before the compute that uses them, in the same order")):
        if candidate is not None and _torch_stall(candidate.ranks, program.stage_to_rank, program.num_stages) is None:
            return candidate, (f"to_torch_csv: torch's receives block where they are posted, and this program posts "
                               f"some early (compile_program(..., early_receives=N)), where torch's dry run stalls "
                               f"(rank {stuck[0]} at {stuck[1]}): the receives are written {where}")
    raise ValueError(f"to_torch_csv: torch's dry run (_simulate_comms_compute: a receive blocks where it is posted) "
                     f"stalls on this program at rank {stuck[0]}, {stuck[1]}; a program compiled without "
                     f"early_receives (compile_program(..., early_receives=0)) posts its receives where torch can run "
                     f"them")


def _program_order(program: Program) -> Program | None:
    """``program`` lowered again from its compute (:func:`~pipesched.lower.add_send_recv`), if that differs from it in
    where the receives are only; else ``None``."""
    from .errors import ScheduleError
    from .lower import add_send_recv

    drop = COMM_OPS | {Op.ALL_REDUCE}
    try:
        compute = program.replace(tuple(i for i in st if i.op not in drop) for st in program.ranks)
        lowered = add_send_recv(dataclasses.replace(compute, dp_size=1), check=False)
        if program.dp_size > 1:
            lowered = add_all_reduce(lowered, program.dp_size)
    except (ScheduleError, ValueError):
        return None
    lowered = dataclasses.replace(lowered, meta=program.meta, schedule=program.schedule)

    def kept(stream):
        return [i for i in stream if i.op not in (Op.RECV_F, Op.RECV_B)]

    same = all(kept(a) == kept(b) and sorted(map(str, a)) == sorted(map(str, b))
               for a, b in zip(lowered.ranks, program.ranks))
    return lowered if same else None


def _at_use(program: Program) -> Program | None:
    """``program`` with each receive just before its use (:func:`_receives_at_use`) if that is valid, else ``None``."""
    from .errors import ScheduleError
    from .validate import validate

    try:
        return validate(program.replace(_receives_at_use(stream) for stream in program.ranks))
    except ScheduleError:
        return None


def _torch_stall(streams, s2r, num_stages: int):
    """``None`` if torch's dry run of ``streams`` finishes, else ``(rank, instruction)`` of the first rank stuck:
    torch's readiness rules (``_simulate_comms_compute``): F needs stage 0, its RECV_F or the previous stage's F on
    its rank; B/I the last stage, its RECV_B or the next stage's B/I on its rank; a SEND its compute; a RECV its
    SEND on the peer; anything else is ready. Readiness only grows, so any fair order reaches torch's verdict."""
    done = [set() for _ in streams]
    heads = [0] * len(streams)

    def ready(rank: int, i: Instr) -> bool:
        mine, s, mb = done[rank], i.stage, i.microbatch
        if i.op is Op.F:
            return s == 0 or ("RECV_F", s, mb) in mine or ("F", s - 1, mb) in mine
        if i.op in (Op.B, Op.I):
            return (s == num_stages - 1 or ("RECV_B", s, mb) in mine or ("B", s + 1, mb) in mine
                    or ("I", s + 1, mb) in mine)
        if i.op is Op.SEND_F:
            return ("F", s, mb) in mine
        if i.op is Op.SEND_B:
            return ("B", s, mb) in mine or ("I", s, mb) in mine
        if i.op is Op.RECV_F:
            return ("SEND_F", s - 1, mb) in done[s2r[s - 1]]
        if i.op is Op.RECV_B:
            return ("SEND_B", s + 1, mb) in done[s2r[s + 1]]
        return True

    progress = True
    while progress:
        progress = False
        for rank, stream in enumerate(streams):
            while heads[rank] < len(stream) and ready(rank, stream[heads[rank]]):
                i = stream[heads[rank]]
                done[rank].add((i.op.value, i.stage, i.microbatch))
                heads[rank] += 1
                progress = True
    return next(((r, st[heads[r]]) for r, st in enumerate(streams) if heads[r] < len(st)), None)


def _receives_at_use(stream) -> tuple:
    """One rank's stream with each receive moved later, to just before the compute that uses it (RECV_F: the F of its
    stage and microbatch; RECV_B: the B or I), the receives kept in their order (so the messages between two ranks
    still pair first in, first out); nothing else moves."""
    others = [i for i in stream if i.op not in (Op.RECV_F, Op.RECV_B)]
    first_use = {}
    for pos, i in enumerate(others):
        if i.op in (Op.F, Op.B, Op.I):
            first_use.setdefault((Op.RECV_F if i.op is Op.F else Op.RECV_B, i.stage, i.microbatch), pos)
    receives = [i for i in stream if i.op in (Op.RECV_F, Op.RECV_B)]
    at, bound = [], len(others)
    for i in reversed(receives):  # the latest spot before its use and before the next receive's
        bound = min(bound, first_use.get((i.op, i.stage, i.microbatch), len(others)))
        at.append(bound)
    at.reverse()
    out, k = [], 0
    for pos, i in enumerate(others + [None]):
        while k < len(receives) and at[k] == pos:
            out.append(receives[k])
            k += 1
        if i is not None:
            out.append(i)
    return tuple(out)
