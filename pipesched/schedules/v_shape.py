"""ZB-V: the zero-bubble schedule on a V placement (two stages per rank)."""
from __future__ import annotations

from .. import placement
from ..ir import Instr, Op
from ._common import check_fixed_sizes, program


def build_zbv(num_ranks: int, num_microbatches: int, virtual_stages: int = 2):
    """ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", arXiv:2401.10241, section 6).

    Placement V (:func:`pipesched.placement.vshape`): rank ``r`` holds stage ``r`` (its *down* stage) and
    stage ``2p - 1 - r`` (its *up* stage), so a microbatch goes down the ranks and back up, and rank 0 holds
    both the first and the last stage. Each backward is split into ``I`` (input gradient) and ``W`` (weight
    gradient). Rank ``r`` runs, with ``n = max(m, 2p - 1)``:

    - warmup: ``2(p - r) - 1`` forwards of its down stage; ``r`` times an up then a down forward; ``p - r``
      times an up forward then its ``I`` and ``W``;
    - steady: a down forward (while any are left), the down ``I`` and ``W`` of the oldest microbatch, an up
      forward, the up ``I`` and ``W``, until every forward has run;
    - cooldown: ``r`` times a down then an up ``I``; ``p - r`` times a down ``I`` then the oldest deferred down
      ``W``; then the deferred up ``W``\\ s, then the remaining down ``W``\\ s;

    and microbatches ``>= m`` are dropped (``m < 2p - 1``: the order of the rest is kept, still correct and
    deadlock-free, with a larger bubble). This is the order of PyTorch's ``ScheduleZBVZeroBubble``, which
    needs exactly two stages per rank like this one; PyTorch assumes F = I = W, this builder only fixes an
    order, proven deadlock-free for any costs by the validator.

    Guarantees, tested exactly in the simulator with F = I = W (each ``c`` seconds) and free messages: for
    ``m >= 2p - 1`` the makespan is ``(6m + p - 1) c`` (each rank works ``6m c``: two stages x (F + I + W)), so
    the bubble fraction is ``(p - 1) / (6m + p - 1)``; the same model on 1F1B over ``p`` ranks (stages twice as
    large: F = 2c, B = 4c) has ``(p - 1) / (m + p - 1)``. Peak in-flight activations (microbatch-stages whose F
    ran and whose W has not) on rank ``r``: ``min(2p, 2m, m + r + 1)`` for every ``m >= 1``, so ``2p`` for
    ``m >= 2p - 1``: stages of half a 1F1B stage's layers, so every rank holds what 1F1B's rank 0 holds. The
    in-flight count depends on the order only, so it holds for any costs (tested with random ones too).

    Args:
        num_ranks: pipeline ranks ``p >= 1``.
        num_microbatches: ``m >= 1``.
        virtual_stages: must be 2 (the V places exactly two stages per rank).
    Returns:
        The compute-only program (F, I, W; no messages yet: lower it with :func:`pipesched.compile_program`).
    Raises:
        ScheduleArgumentError: a size is not a positive integer, or ``virtual_stages != 2``.
    """
    p, m = check_fixed_sizes("zbv", num_ranks, num_microbatches, virtual_stages, 2)
    streams = [_rank_order(r, p, max(m, 2 * p - 1), m) for r in range(p)]
    return program("zbv", streams, placement.vshape(p), m, virtual_stages=2)


def _rank_order(r: int, p: int, n: int, m: int) -> list[Instr]:
    """Rank ``r``'s compute order for ``n >= 2p - 1`` microbatches (see :func:`build_zbv`), less those ``>= m``.

    The order for ``n`` is kept phase by phase, but a microbatch ``>= m`` is never made: once every instruction
    of a phase's repeated group is dropped, the rest of the phase only moves its counters, so a rank costs
    time in its ``O(m)`` instructions kept, not in the ``O(p)`` of the order for ``n`` (``m = 2``, ``p = 1000``).
    """
    down, up = r, 2 * p - 1 - r
    dF, dI, dW, uF, uI, uW = ((stage, op) for stage in (down, up) for op in (Op.F, Op.I, Op.W))
    nxt = dict.fromkeys((dF, dI, dW, uF, uI, uW), 0)  # (stage, op) -> its next microbatch
    out: list[Instr] = []

    def repeat(times: int, *group) -> None:  # the takes of ``group``, ``times`` times over
        for done in range(times):
            if all(nxt[key] >= m for key in group):  # all dropped from here on: move the counters only
                for key in group:
                    nxt[key] += times - done
                return
            for key in group:
                mb = nxt[key]
                nxt[key] = mb + 1
                if mb < m:
                    out.append(Instr.trusted(key[1], key[0], mb))

    repeat(2 * (p - r) - 1, dF)  # warmup
    repeat(r, uF, dF)
    repeat(p - r, uF, uI, uW)
    # steady, while an up forward trails the down ones or a down forward is left (up <= down <= n here): a down
    # forward in each of the first n - down rounds, n - up rounds in all
    with_forward = n - nxt[dF]
    repeat(with_forward, dF, dI, dW, uF, uI, uW)
    repeat(n - nxt[uF], dI, dW, uF, uI, uW)
    repeat(r, dI, uI)  # cooldown
    repeat(p - r, dI, dW)
    repeat(n - nxt[uW], uW)
    repeat(n - nxt[dW], dW)
    return out
