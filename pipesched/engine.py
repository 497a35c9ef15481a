"""The execution model shared by the validator and the simulator.

Each rank runs its stream in order:

- a RECV *posts* a receive and moves on (it never blocks);
- a SEND blocks until the matching receive has been posted — the strictest semantics, so a program
  that completes here completes under any buffering an executor adds;
- a compute instruction waits until the data it needs from another rank has been sent to it (in a
  compute-only program: until the producing instruction has run);
- ALL_REDUCE starts an asynchronous collective and moves on.

Messages between two ranks match first in, first out, whatever their kind, as NCCL matches
point-to-point messages. This system is confluent — running one enabled instruction never disables
another — so one complete run proves every run completes. :func:`execute` finds that run or raises
:class:`~pipesched.errors.DeadlockError`.
"""
from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable

from .deps import needs, produces
from .errors import DeadlockError, render_grid
from .ir import COMM_OPS, RECV_OPS, SEND_OPS, Op, Program

# on_fire(rank, position, partner): partner is (rank, position) of the matched RECV for a SEND, else None
FireFn = Callable[[int, int, tuple[int, int] | None], None]


def has_comm(program: Program) -> bool:
    """Whether the program carries SEND/RECV (lowered) or leaves cross-rank edges implicit (compute-only)."""
    return any(instr.op in COMM_OPS for stream in program.ranks for instr in stream)


def remote_needs(program: Program) -> list[list[tuple]]:
    """Per rank and position, the items an instruction needs that another rank produces."""
    s2r, S, M = program.stage_to_rank, program.num_stages, program.num_microbatches
    recomputed = {(i.stage, i.microbatch) for st in program.ranks for i in st if i.op is Op.R}
    result = []
    for rank, stream in enumerate(program.ranks):
        per_pos = []
        for instr in stream:
            if instr.op in COMM_OPS or instr.op is Op.ALL_REDUCE:
                per_pos.append(())
                continue
            items = needs(instr, S, M, (instr.stage, instr.microbatch) in recomputed)
            per_pos.append(tuple(it for it in items if it[0] in ("act", "grad") and s2r[it[1]] != rank))
        result.append(per_pos)
    return result


def sent_item(instr) -> tuple:
    """The data item a SEND carries."""
    return ("act" if instr.op is Op.SEND_F else "grad", instr.stage, instr.microbatch)


def execute(program: Program, on_fire: FireFn | None = None) -> None:
    """Run the program in the model above, calling ``on_fire`` for each instruction in a valid order.

    Assumes the static checks of :mod:`pipesched.validate` passed (structure, local order, pairing).

    Raises:
        DeadlockError: no rank can move and work remains; names each rank's blocked instruction.
    """
    streams = program.ranks
    heads = [0] * len(streams)
    lowered = has_comm(program)
    remote = remote_needs(program)
    arrived: set = set()
    waiters: dict = defaultdict(list)
    posted: dict = defaultdict(deque)  # (src, dst) -> positions of posted, unmatched RECVs on dst
    blocked_send: dict = {}  # (src, dst) -> src, while src waits for dst to post
    ready = deque(range(len(streams)))
    fire = on_fire or (lambda rank, pos, partner: None)

    def deliver(item) -> None:
        arrived.add(item)
        ready.extend(waiters.pop(item, ()))

    while ready:
        rank = ready.popleft()
        stream, pos = streams[rank], heads[rank]
        while pos < len(stream):
            instr = stream[pos]
            op = instr.op
            if op in RECV_OPS:
                channel = (instr.peer, rank)
                posted[channel].append(pos)
                fire(rank, pos, None)
                if channel in blocked_send:
                    ready.append(blocked_send.pop(channel))
            elif op in SEND_OPS:
                channel = (rank, instr.peer)
                if not posted[channel]:
                    blocked_send[channel] = rank
                    break
                fire(rank, pos, (instr.peer, posted[channel].popleft()))
                deliver(sent_item(instr))
            else:
                missing = [it for it in remote[rank][pos] if it not in arrived]
                if missing:
                    waiters[missing[0]].append(rank)
                    break
                fire(rank, pos, None)
                if not lowered:
                    for item in produces(instr):
                        deliver(item)
            pos += 1
        heads[rank] = pos
    if any(heads[r] < len(s) for r, s in enumerate(streams)):
        raise _deadlock(program, heads)


def _deadlock(program: Program, heads: list[int]) -> DeadlockError:
    blocked = {r: h for r, h in enumerate(heads) if h < len(program.ranks[r])}
    lines = []
    for rank, pos in blocked.items():
        instr = program.ranks[rank][pos]
        if instr.op in SEND_OPS:
            peer_pos = heads[instr.peer]
            peer_at = program.ranks[instr.peer][peer_pos] if peer_pos < len(program.ranks[instr.peer]) else "its end"
            lines.append(f"  rank {rank} blocked at {instr} (step {pos}): rank {instr.peer} has not posted "
                         f"the receive; it is blocked at {peer_at}")
        else:
            lines.append(f"  rank {rank} blocked at {instr} (step {pos}): waiting for data from another rank")
    first = next(iter(blocked))
    reason = "deadlock: no rank can make progress and work remains\n" + "\n".join(lines)
    return DeadlockError(reason, first, program.ranks[first][blocked[first]], render_grid(program.ranks, blocked))
