"""DualPipe-V: DeepSeek-V3's bidirectional schedule folded onto a V placement (two stages per rank)."""
from __future__ import annotations

from collections import deque

from .. import placement
from ..ir import OVERLAP_PAIRS, Instr, Op
from ._common import check_fixed_sizes, program



def build_dualpipev(num_ranks: int, num_microbatches: int, virtual_stages: int = 2):
    """DualPipe-V (DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv:2412.19437; the V variant of DualPipe, as in
    deepseek-ai/DualPipe and PyTorch's ``ScheduleDualPipeV``).

    Placement V (:func:`pipesched.placement.vshape`): rank ``r`` holds its down stage ``r`` and its up stage
    ``2p - 1 - r``. Rank ``r`` runs, with ``n = max(m, 2p)`` microbatches (the later ones dropped at the end):
    ``2(p - r - 1)`` down forwards; ``r + 1`` times a down and an up forward; ``p - r - 1`` times an up ``I``, the
    oldest pending ``W`` and an up forward; then the main phase, ``n - 2p + r + 1`` times a down forward paired
    with an up backward ``B`` (not paired on the last rank's first round) and an up forward paired with a down
    backward; ``p - r - 1`` times an up ``B`` then an up forward paired with a down ``B``; ``r + 1`` times an up
    then a down backward (full ``B`` in the first half, ``I`` from the middle on, its ``W`` queued); ``p - r - 1``
    times a pending ``W`` then a down backward; then the remaining ``W``\\ s.

    **Overlapped pairs.** The paper overlaps the forward of one microbatch with the backward of another (the
    computation of one hides the other's communication). Each such pair is two adjacent instructions of the
    compute-only program, the ``F`` first, listed in ``program.meta["overlap_pairs"]`` as ``(F, B)`` instructions
    (the lowering passes keep them: messages, collectives and the backward's ``R`` may then sit between them,
    ``split_backward`` makes a split ``B`` its ``I``, ``forward_only`` drops them; :func:`pipesched.validate.validate`
    checks them). An executor may run a pair's two computations overlapped once both are ready; pipesched's runs
    them one after the other. The text and JSON forms carry them (``overlap_pairs``).

    Any ``m >= 1`` runs (PyTorch's needs ``m >= 2p``): for ``m < 2p`` the order of the microbatches that exist is
    kept (a pair that loses a member is no longer a pair), proven deadlock-free, with a larger bubble.

    Guarantees, tested exactly in the simulator with F = I = W = ``c`` (B = 2c) and free messages, the pairs run
    one after the other: for ``m >= 2p`` the makespan is ``(6m + p - 1) c``, bubble ``(p - 1) / (6m + p - 1)``, as
    ZB-V's (the overlap's gain is on hardware that overlaps a pair's computation and communication); peak
    in-flight activations (F run, B or W not yet) on rank ``r``: ``min(2p + 1, 2m, m + r + 1)`` microbatch-stages
    of half a 1F1B stage, for every ``m >= 1``: one more than ZB-V at large m.

    Args:
        num_ranks: pipeline ranks ``p >= 1``.
        num_microbatches: ``m >= 1``.
        virtual_stages: must be 2 (the V places exactly two stages per rank).
    Returns:
        The compute-only program (F, B, I, W), with ``meta["overlap_pairs"]``.
    Raises:
        ScheduleArgumentError: a size is not a positive integer, or ``virtual_stages != 2``.
    """
    p, m = check_fixed_sizes("dualpipev", num_ranks, num_microbatches, virtual_stages, 2)
    streams, pairs = [], []
    for r in range(p):
        order = _RankOrder(r, p, max(m, 2 * p), m)
        order.run()
        streams.append(order.out)
        pairs += order.pairs
    built = program("dualpipev", streams, placement.vshape(p), m, virtual_stages=2)
    built.meta[OVERLAP_PAIRS] = tuple(pairs)
    return built


class _RankOrder:
    """One rank's compute order, built phase by phase (see :func:`build_dualpipev`), less the microbatches ``>= m``.

    An instruction of a microbatch ``>= m`` is never made (nor a pair with one): once every take of a phase's
    round is dropped and no kept ``W`` is pending, the rest of the phase only moves the counters, so a rank costs
    time in its ``O(m)`` instructions kept, not in the ``O(p)`` of the order for ``n``.
    """

    def __init__(self, r: int, p: int, n: int, m: int) -> None:
        self.r, self.p, self.n, self.m = r, p, n, m
        self.down, self.up = r, 2 * p - 1 - r
        self.next = {}  # (stage, F | I) -> next microbatch (a B counts as an I)
        # each I whose W is not placed yet, oldest first: (stage, microbatch) if kept, else a count of dropped ones
        self.pending_w: deque = deque()
        self.pending_kept = 0  # the (stage, microbatch) entries in pending_w
        self.out: list[Instr] = []
        self.pairs: list[tuple[Instr, Instr]] = []

    def take(self, op: Op, stage: int) -> Instr | None:
        key = (stage, Op.F if op is Op.F else Op.I)
        mb = self.next.get(key, 0)
        self.next[key] = mb + 1
        if mb >= self.m:  # dropped
            if op is Op.I:
                self._pend_dropped(1)
            return None
        if op is Op.I:
            self.pending_w.append((stage, mb))
            self.pending_kept += 1
        instr = Instr.trusted(op, stage, mb)
        self.out.append(instr)
        return instr

    def _pend_dropped(self, count: int) -> None:
        if count:
            if self.pending_w and type(self.pending_w[-1]) is int:
                self.pending_w[-1] += count
            else:
                self.pending_w.append(count)

    def pair(self, forward_stage: int, backward_stage: int) -> None:
        f, b = self.take(Op.F, forward_stage), self.take(Op.B, backward_stage)
        if f is not None and b is not None:
            self.pairs.append((f, b))

    def weight(self) -> None:
        if self.pending_w:
            first = self.pending_w[0]
            if type(first) is int:  # a dropped one
                if first == 1:
                    self.pending_w.popleft()
                else:
                    self.pending_w[0] = first - 1
            else:
                self.pending_w.popleft()
                self.pending_kept -= 1
                self.out.append(Instr.trusted(Op.W, *first))

    def _dropped(self, *stages_ops, pending: bool = False) -> bool:
        """Whether every take of these ``(stage, F | I)`` from now on is dropped (and, with ``pending``, every
        pending W)."""
        m = self.m
        return all(self.next.get(key, 0) >= m for key in stages_ops) and not (pending and self.pending_kept)

    def _skip(self, times: int, *stages_ops) -> None:
        for key in stages_ops:
            self.next[key] = self.next.get(key, 0) + times

    def run(self) -> None:
        r, p, down, up = self.r, self.p, self.down, self.up
        dF, dI, uF, uI = (down, Op.F), (down, Op.I), (up, Op.F), (up, Op.I)
        rounds = 2 * (p - r - 1)
        for i in range(rounds):
            if self._dropped(dF):
                self._skip(rounds - i, dF)
                break
            self.take(Op.F, down)
        for i in range(r + 1):
            if self._dropped(dF, uF):
                self._skip(r + 1 - i, dF, uF)
                break
            self.take(Op.F, down), self.take(Op.F, up)
        rounds = p - r - 1
        for i in range(rounds):
            if self._dropped(uI, uF, pending=True):  # each round's I is pending until its own weight()
                self._skip(rounds - i, uI, uF)
                break
            self.take(Op.I, up), self.weight(), self.take(Op.F, up)
        rounds = self.n - 2 * p + r + 1
        for i in range(rounds):
            if self._dropped(dF, uI, uF, dI):
                self._skip(rounds - i, dF, uI, uF, dI)
                break
            if i == 0 and r == p - 1:  # not overlapped: it would lengthen the bubble on the last rank
                self.take(Op.F, down), self.take(Op.B, up)
            else:
                self.pair(down, up)
            self.pair(up, down)
        rounds = p - r - 1
        for i in range(rounds):
            if self._dropped(uI, uF, dI):
                self._skip(rounds - i, uI, uF, dI)
                break
            self.take(Op.B, up)
            self.pair(up, down)
        self._drain()

    def _drain(self) -> None:
        """The backward tail: full B in its first half, then I with the W deferred into the last bubbles."""
        r, p, down, up = self.r, self.p, self.down, self.up
        dI, uI = (down, Op.I), (up, Op.I)
        split, middle = False, (r + 1) // 2
        for i in range(r + 1):
            if self._dropped(uI, dI):  # the rest dropped: count the I's among them as pending
                left = r + 1 - i
                up_split = middle if r % 2 == 1 else middle + 1  # the first round whose up backward is an I
                self._pend_dropped(r + 1 - max(i, middle) + r + 1 - max(i, min(up_split, r + 1)))
                split = split or i <= middle
                self._skip(left, uI, dI)
                break
            split = split or (i == middle and r % 2 == 1)
            self.take(Op.I if split else Op.B, up)
            split = split or (i == middle and r % 2 == 0)
            self.take(Op.I if split else Op.B, down)
        rounds = p - r - 1
        for i in range(rounds):
            if self._dropped(dI, pending=True):  # only dropped ones pending: a count that the rounds move
                pending = sum(self.pending_w)
                self.pending_w.clear()
                self._pend_dropped(max(pending, 1) if split else max(pending - (rounds - i), 0))
                self._skip(rounds - i, dI)
                break
            self.weight()
            self.take(Op.I if split else Op.B, down)
        self.out += [Instr.trusted(Op.W, *entry) for entry in self.pending_w if type(entry) is not int]  # the rest
        self.pending_w.clear()
        self.pending_kept = 0
