"""Lowering passes that add the asynchronous collectives a training step starts besides its pipeline messages:
the data-parallel ``ALL_REDUCE`` (:func:`add_all_reduce`) and the tied-gradient ``TIE_REDUCE``
(:func:`add_tie_reduce`). Neither blocks a rank's stream; :mod:`pipesched.lower` re-exports both.
"""
from __future__ import annotations

from .checks import as_int, check_program
from .deps import ENDS_BACKWARD
from .ir import Instr, Op, Program
from . import ties as _ties


def add_all_reduce(program: Program, dp_size: int) -> Program:
    """Add ``ALL_REDUCE(s)`` after the last backward (B or W) of each stage, and after the sends that
    directly follow it, so the reduction overlaps the rank's remaining work without delaying a send.

    Deadlock freedom: ALL_REDUCE only starts an asynchronous collective over the data-parallel group;
    it never blocks the pipeline stream. The replicas of a pipeline rank run the same program, so they
    start their collectives in the same order, and every rank waits for them only after its stream ends.

    Raises:
        ValueError: ``dp_size`` is not an integer >= 1, or the program already has ALL_REDUCE.
    """
    check_program(program)
    given, dp_size = dp_size, as_int(dp_size)  # a numpy integer as a plain int; a bool refused
    if dp_size is None or dp_size < 1:
        raise ValueError(f"dp_size must be an integer >= 1, got {given!r}")
    if any(i.op is Op.ALL_REDUCE for st in program.ranks for i in st):
        raise ValueError("the program already has ALL_REDUCE instructions")
    if dp_size == 1:
        return _with_dp(program, program.ranks, 1)
    streams = []
    for stream in program.ranks:
        last = {i.stage: pos for pos, i in enumerate(stream) if i.op in ENDS_BACKWARD}
        after: dict[int, list[int]] = {}
        for stage, pos in last.items():
            while pos + 1 < len(stream) and stream[pos + 1].op in (Op.SEND_B, Op.SEND_F):
                pos += 1
            after.setdefault(pos, []).append(stage)
        out = []
        for pos, instr in enumerate(stream):
            out.append(instr)
            out.extend(Instr(Op.ALL_REDUCE, s) for s in sorted(after.get(pos, ())))
        streams.append(tuple(out))
    return _with_dp(program, streams, dp_size)


def _with_dp(program: Program, streams, dp_size: int) -> Program:
    return Program(tuple(streams), program.stage_to_rank, program.num_microbatches, dp_size,
                   program.schedule, dict(program.meta), program.forward_only, program.ties)


def add_tie_reduce(program: Program, ties) -> Program:
    """Record ``ties`` (groups of stages sharing a parameter) in the program and add one ``TIE_REDUCE`` per rank
    holding a tied stage; a tie whose stages are all on one rank needs no collective and is left out (not
    recorded, no ``TIE_REDUCE``: :func:`pipesched.ties.cross_rank_ties`). The ``TIE_REDUCE`` goes after the last
    backward (B or W) of its tied stages, and after the sends and ALL_REDUCEs that directly follow it, naming the
    tied stage whose backward ends last (:mod:`pipesched.ties`).

    Deadlock freedom: TIE_REDUCE only starts asynchronous collectives (one per tie, over the tie's ranks, in tie
    order on every rank, so ranks sharing two ties start them in one order); it never blocks the stream, and
    every rank waits for them only after its stream ends.

    Args:
        program: a training program (compute-only or lowered), with or without ALL_REDUCE.
        ties: sequence of groups of >= 2 stages, e.g. ``[(0, 3)]``; empty, or all on one rank each: ``program``
            unchanged.
    Raises:
        ValueError: ill-formed ``ties`` (see :func:`pipesched.ties.check_tie_groups`), a forward-only program,
            a program that already has TIE_REDUCE, or tied stages without a backward.
    """
    check_program(program)
    groups = _ties.cross_rank_ties(ties, program.stage_to_rank)
    if program.forward_only:
        raise ValueError("add_tie_reduce takes a training program; this one is forward-only (no gradients)")
    if program.ties or program.stages_with(Op.TIE_REDUCE):
        raise ValueError("the program already has ties or TIE_REDUCE instructions (apply add_tie_reduce once)")
    tied = Program(program.ranks, program.stage_to_rank, program.num_microbatches, program.dp_size,
                   program.schedule, dict(program.meta), program.forward_only, groups)
    streams = []
    for rank, stream in enumerate(program.ranks):
        stages = _ties.tied_stages(tied, rank)
        if stages:
            anchor, pos = _ties.insert_position(stream, stages)
            stream = stream[:pos] + (Instr(Op.TIE_REDUCE, anchor),) + stream[pos:]
        streams.append(stream)
    return tied.replace(streams)
