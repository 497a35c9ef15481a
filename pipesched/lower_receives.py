"""The lowering pass that posts each receive earlier (:func:`post_receives_early`), so a transfer overlaps the
compute before it; :mod:`pipesched.lower` re-exports it.
"""
from __future__ import annotations

from collections import deque

from .checks import as_int, check_program
from .ir import COMM_OPS, RECV_OPS, SEND_OPS, Program


#: how many instructions earlier :func:`post_receives_early` posts a receive by default
EARLY_RECEIVE_WINDOW = 16


def post_receives_early(program: Program, window: int = EARLY_RECEIVE_WINDOW) -> Program:
    """Post each receive up to ``window`` instructions earlier, so its transfer overlaps the compute before it.

    On each rank, a RECV at position ``i`` moves to just before the instruction at position ``i - window``
    (to the start of the stream when ``i < window``); the receives keep their order. Where that puts it inside
    a run of sends and receives, the run's sends that came before it in ``program`` stay ahead of it: a send
    is on a peer's critical path, a posted receive is not. Nothing but receives moves, and none moves later.

    Deadlock freedom (the checker's model, :mod:`pipesched.engine`): a RECV needs nothing and never blocks,
    so posting it earlier only lets the SEND that waits for it fire sooner. Take a complete execution of
    ``program``; fire each moved RECV as soon as it is at its rank's head and everything else when it fired
    there: each instruction still finds what it needed. The receives from each rank keep their order, so
    first-in first-out matching pairs the same messages. :func:`~pipesched.api.compile_program` validates
    the result all the same, like every program it returns.

    Not for a backend whose messages between two ranks run in issue order on one stream (NCCL): there a
    posted receive holds up every later message between the pair (:func:`pipesched.api.passes_for`).

    Args:
        program: a lowered program (one without receives comes back unchanged).
        window: how many instructions earlier; 0 returns ``program`` itself.
    Raises:
        ValueError: ``window`` is not an integer >= 0.
    """
    check_program(program)
    given, window = window, as_int(window)  # a numpy integer as a plain int; a bool refused
    if window is None or window < 0:
        raise ValueError(f"window must be an integer >= 0 (instructions a receive moves up), got {given!r}")
    if window == 0:
        return program
    return program.replace(_receives_early(stream, window) for stream in program.ranks)


def _receives_early(stream, window: int) -> tuple:
    """One rank's stream in :func:`post_receives_early`'s order."""
    def key(pos: int) -> tuple[int, int, int]:
        return (pos - window, 0, pos) if stream[pos].op in RECV_OPS else (pos, 1, pos)

    out, run = [], []  # run: positions of the current run of sends and receives
    for pos in sorted(range(len(stream)), key=key) + [None]:
        if pos is not None and stream[pos].op in COMM_OPS:
            run.append(pos)
            continue
        out.extend(stream[k] for k in _sends_first(run, stream))
        run = []
        if pos is not None:
            out.append(stream[pos])
    return tuple(out)


def _sends_first(run: list[int], stream) -> list[int]:
    """The positions of a run of sends and receives (each kind in stream order), each send as early as it can
    go without passing a receive that came before it in ``stream``."""
    recvs = deque(k for k in run if stream[k].op in RECV_OPS)
    out = []
    for k in (k for k in run if stream[k].op in SEND_OPS):
        while recvs and recvs[0] < k:
            out.append(recvs.popleft())
        out.append(k)
    return out + list(recvs)
