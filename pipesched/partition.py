"""Cut a sequence of layers into contiguous stages that minimise the slowest rank: the exact partitioner behind
``Pipeline(balance="time")`` and ``balance="params"`` and the planner. Torch-free.

Objective, in order: (1) the largest per-rank load (a rank's load is the sum of its stages' costs, each stage's
cost the sum of its layers'); (2) the largest per-rank memory (same sums over ``memory``); (3) the slowest stage;
(4) ties go to the lexicographically smallest balance (earlier cuts, so smaller early stages: a faster fill, less
held in flight there) or, ``ties="even"`` with several stages per rank, to the first cut found nearest each rank's
even share of time (a search order: evener stages, not a guarantee of the most even). Neither wins always: for 96 layers on 8 x 4 looped stages the first tie puts
1-layer stages in the first round and 4-layer ones after, 429 simulated units against 387 for even stages; for a
6-layer model on 2 x 2 it is 163 against 171 the other way (F = cost, B = 2F, m = 8). The planner simulates both. ``memory_limit`` is a hard
per-rank bound on (2). All sums and comparisons are exact: the numbers are converted to integers over a common
power-of-two denominator (every float is a binary fraction), so there is no rounding anywhere.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

from .checks import as_int, is_real, plain_number
from .partition_search import evaluate, least_max
from .partition_v import least_v_load
from .placement import vshape


def balance_by_time(layer_costs: Sequence[float], num_stages: int, stage_to_rank: Sequence[int] | None = None,
                    memory: Sequence[float] | None = None, memory_limit: float | None = None,
                    max_nodes: int | None = 2_000, ties: str = "first") -> tuple[int, ...]:
    """Layers per stage: the contiguous cut of ``layer_costs`` into ``num_stages`` non-empty stages that minimises
    the slowest rank; then, among those, the largest per-rank ``memory``; then the slowest stage; then the
    lexicographically smallest balance (``ties="first"``) or the first found nearest even shares (``"even"``).

    Args:
        layer_costs: per layer, a cost >= 0 (seconds of forward + backward of one microbatch; any unit).
        num_stages: stages to cut into (ranks x virtual stages), 1 <= num_stages <= len(layer_costs).
        stage_to_rank: ``stage_to_rank[s]`` is the rank holding stage ``s`` (:mod:`pipesched.placement`:
            ``looped`` for interleaved, ``vshape`` for V schedules; any map works); ``None``: stage ``s`` on rank
            ``s`` (one stage per rank: minimise the slowest stage). A rank's load is the sum of its stages'.
        memory: per layer, bytes >= 0 (e.g. activations saved for backward); among the cuts of least time, the one
            with the smallest largest per-rank memory. ``None``: no memory criterion.
        memory_limit: bytes; cuts where a rank's memory exceeds it are not considered (needs ``memory``).
        max_nodes: for several stages per rank only: the most nodes of each of its (up to four) searches
            (``None``: no limit, always exact; a V placement without ``memory_limit`` needs none for time). When one is spent, it keeps the best cut it found (never worse than
            the one-stage-per-rank and the even cut for time; deterministic, as the count is); the default keeps a
            call under about a second for 96 layers, and is never reached at the tests' brute-force sizes.
        ties: ``"first"`` (the lexicographically smallest balance among the best) or ``"even"`` (several stages
            per rank: the first found in the order nearest each rank's even share of time -- usually evener
            stages, not the most even; one stage per rank:
            as ``"first"``). See the module docstring for when each wins.

    Returns:
        ``balance``: ``num_stages`` ints >= 1 summing to ``len(layer_costs)``; deterministic.

    Raises:
        ValueError: fewer layers than stages; a cost or memory that is negative, NaN, infinite or not a number;
            ``memory`` of another length; ``stage_to_rank`` of a length other than ``num_stages`` or with a
            negative rank; ``memory_limit`` without ``memory`` or < 0; no cut keeps every rank within
            ``memory_limit`` (names the smallest limit a cut meets); ``max_nodes`` < 1; ``ties`` not ``"first"`` or
            ``"even"``. TypeError: ``num_stages``
            not an int.

    Complexity (n layers, S stages): each rank holding one stage (``stage_to_rank`` None or one-to-one):
    O(n^2 log n) — binary search of the O(n^2) stage sums with an O(n) greedy feasibility test, then an O(n^2)
    lexicographic reconstruction. A V placement (``vshape``: zbv, dualpipev) without ``memory_limit``: the least
    slowest rank is exact in O(p n^2 log(total)) (:mod:`pipesched.partition_v`: the ranks nest, so their loads are
    the steps of one increasing sequence; ~0.1-1 s at 96 layers), then the later criteria as below. Other
    placements with several stages per rank (looped): the problem contains multiprocessor
    scheduling (NP-hard), so it is an exact depth-first branch and bound over the cut positions, trying first the
    stage end that leaves every rank still to receive stages an equal share of the cost left (not of the layers
    left: the cost), seeded with the best of the one-stage-per-rank cut and the even cut, pruned by each rank's
    load, by "the ranks still to receive stages hold the rest" (by sum and by layer count) and by a memo of failed
    states; one search per criterion (rank time -- when it spends ``max_nodes``, a second from its best cut
    trying the even share of layers first --, rank memory, stage time, then the first cut within those in the
    order ``ties`` asks).
    Exponential in the worst case, hence ``max_nodes``. Measured on this machine (``python
    benchmarks/bench_partition.py``: 96 layers, 94 blocks of cost 1 with 0 / 10 / 30% noise between a first of 3
    and a last of 4, activation bytes as memory; looped p x v = 4x2, 8x2, 8x4, 16x3, V p = 4, 8, 16; 3 seeds): the
    slowest rank 4.0% over the lower bound max(total / p, largest layer) on average, 11.8% at most (the bound is
    not always reachable: a rank's six layers on 16 ranks hold the 3-unit first layer whole; the V rows are the
    exact optimum), against 5.6% and 25% for the previous version (even shares of layers first, one search, V
    included); 0.46 s per call on average, 1.3 s at most (load average 1.6);
    the searches end at ``max_nodes`` in most noisy cases (best found, not proven optimal). With noise the least
    slowest rank can come with uneven stages on one rank (up to 1 : 22 layers at 4 x 2): the planner simulates the
    cut of least slowest stage next to it.
    """
    n, costs, mem, limit, s2r = _checked(layer_costs, num_stages, stage_to_rank, memory, memory_limit)
    memory_limit = limit  # a plain number (a numpy one given), as the costs and memory
    num_stages = as_int(num_stages)  # _checked refused anything else; numpy integers become plain ints
    if max_nodes is not None:
        nodes = as_int(max_nodes)
        if nodes is None or nodes < 1:
            raise ValueError(f"max_nodes must be None or an int >= 1, got {max_nodes!r}")
        max_nodes = nodes
    if ties not in ("first", "even"):
        raise ValueError(f"ties must be 'first' or 'even', got {ties!r}")
    C, M, limit = _exact_prefixes(costs, mem, limit)
    if len(set(s2r)) == num_stages:
        cut = _one_stage_per_rank(C, M, num_stages, limit)
    else:
        cut = _branch_and_bound(C, M, s2r, limit, max_nodes, ties)
    if cut is None:
        need = max(rank_loads(mem, balance_by_time(mem, num_stages, s2r, max_nodes=max_nodes), s2r))
        if need <= memory_limit:
            raise ValueError(f"memory_limit={memory_limit!r}: the search spent max_nodes={max_nodes} before finding a "
                             f"cut within it (one exists: the least per-rank memory is {need}); raise max_nodes")
        raise ValueError(f"memory_limit={memory_limit!r}: no cut of the {n} layers into {num_stages} stages keeps "
                         f"every rank within it; the smallest largest per-rank memory of any cut is {need}")
    return tuple(b - a for a, b in zip(cut, cut[1:]))


def rank_loads(values: Sequence[float], balance: Sequence[int], stage_to_rank: Sequence[int] | None = None) -> tuple:
    """Per rank (0 .. max rank), the sum of ``values`` over the layers of its stages; ``stage_to_rank`` as in
    :func:`balance_by_time` (``None``: stage ``s`` on rank ``s``).

    Raises:
        ValueError: ``values`` not a sequence of finite numbers >= 0 (names ``values[i]`` and its value: a negative,
            NaN or infinite load), ``balance`` not a sequence of integers >= 1 summing to ``len(values)``, or
            ``stage_to_rank`` not one integer rank >= 0 per stage (names the argument, its value and what is valid).
    """
    _numbers("values", values)  # checked only: the sums keep the values' own numbers (a Fraction stays exact)
    balance, s2r = _checked_cut(values, balance, stage_to_rank)
    loads = [0] * (max(s2r) + 1)
    start = 0
    for s, count in enumerate(balance):
        loads[s2r[s]] += sum(values[start:start + count])
        start += count
    return tuple(loads)


# ---- checks and exact numbers ---------------------------------------------------------------------------------

def _checked_cut(values, balance, stage_to_rank) -> tuple[tuple, tuple]:
    """:func:`rank_loads`' ``balance`` and ``stage_to_rank`` as tuples of plain ints (see there for the errors)."""
    def ints(seq, minimum):
        if isinstance(seq, (str, bytes)) or not hasattr(seq, "__iter__"):
            return None
        out = tuple(as_int(v) for v in seq)
        return out if out and all(v is not None and v >= minimum for v in out) else None

    n = len(values)
    counts = ints(balance, 1)
    if counts is None or sum(counts) != n:
        raise ValueError(f"balance must be a sequence of layer counts (integers >= 1) summing to len(values)={n}, "
                         f"got {balance!r}")
    if stage_to_rank is None:
        return counts, tuple(range(len(counts)))
    s2r = ints(stage_to_rank, 0)
    if s2r is None or len(s2r) != len(counts):
        raise ValueError(f"stage_to_rank must be None or one integer rank >= 0 per stage ({len(counts)} stages), "
                         f"got {stage_to_rank!r}")
    return counts, s2r


def _checked(layer_costs, num_stages, stage_to_rank, memory, memory_limit):
    if as_int(num_stages) is None:
        raise TypeError(f"num_stages must be an int, got {num_stages!r}")
    num_stages = as_int(num_stages)
    costs = _numbers("layer_costs", layer_costs)
    n = len(costs)
    if num_stages < 1 or n < num_stages:
        raise ValueError(f"cannot cut {n} layer{'' if n == 1 else 's'} into num_stages={num_stages} non-empty "
                         f"stages: valid num_stages is 1 .. {n} (one layer at least per stage)")
    if memory is None:
        if memory_limit is not None:
            raise ValueError(f"memory_limit={memory_limit!r} needs memory (bytes per layer)")
        mem = [0] * n
    else:
        mem = _numbers("memory", memory)
        if len(mem) != n:
            raise ValueError(f"memory has {len(mem)} values but layer_costs has {n} (one per layer)")
    if memory_limit is not None:
        memory_limit, = _numbers("memory_limit", [memory_limit])
    if stage_to_rank is None:
        s2r = tuple(range(num_stages))
    else:
        s2r = tuple(stage_to_rank)
        if len(s2r) != num_stages or not all(as_int(r) is not None and r >= 0 for r in s2r):
            raise ValueError(f"stage_to_rank={list(s2r)} must give a rank (int >= 0) for each of the {num_stages} "
                             f"stages")
        s2r = tuple(as_int(r) for r in s2r)
    return n, costs, mem, memory_limit, s2r


def _numbers(name, values) -> list:
    """``values`` as a list of plain ints and floats: any real number but a bool (numpy's: ``np.int64``,
    ``np.float32``) is accepted, a sequence or a 1-d array of them."""
    if isinstance(values, (str, bytes)) or not (isinstance(values, Sequence) or getattr(values, "ndim", None) == 1):
        raise ValueError(f"{name} must be a sequence of numbers >= 0, got {values!r}")
    for i, v in enumerate(values):
        if not is_real(v) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{name}[{i}] must be a finite number >= 0, got {v!r}" if name != "memory_limit"
                             else f"memory_limit must be a finite number of bytes >= 0, got {v!r}")
    return [plain_number(v) for v in values]


def _exact_prefixes(costs, mem, limit):
    """Prefix sums of costs and memory as exact ints (scaled by a power of two), and the limit on the same scale
    (rounded down: a sum of scaled ints is <= limit iff it is <= floor(limit * scale))."""
    def scaled(values, extra=()):
        fracs = [Fraction(v) for v in list(values) + list(extra)]
        scale = max((f.denominator for f in fracs), default=1)
        return [int(f * scale) for f in fracs[:len(values)]], [math.floor(f * scale) for f in fracs[len(values):]]

    c, _ = scaled(costs)
    m, lim = scaled(mem, [] if limit is None else [limit])
    C, M = [0], [0]
    for a, b in zip(c, m):
        C.append(C[-1] + a)
        M.append(M[-1] + b)
    return C, M, (lim[0] if lim else None)


# ---- one stage per rank ---------------------------------------------------------------------------------------

def _one_stage_per_rank(C, M, S, limit):
    """Cut positions (0 .. n) for one stage per rank, or None when ``limit`` cannot be met."""
    n = len(C) - 1
    big = M[n] if limit is None else limit
    if not _fits(C, M, S, C[n], big):
        return None
    t = _least(sorted({C[b] - C[a] for a in range(n) for b in range(a + 1, n + 1)}), lambda x: _fits(C, M, S, x, big))
    m = _least(sorted({M[b] - M[a] for a in range(n) for b in range(a + 1, n + 1) if M[b] - M[a] <= big}),
               lambda x: _fits(C, M, S, t, x))
    return _lexicographic_cut(C, M, S, t, m)


def _least(candidates, feasible):
    """The smallest candidate that is feasible (feasibility is monotone; the largest is)."""
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(candidates[mid]):
            hi = mid
        else:
            lo = mid + 1
    return candidates[lo]


def _fits(C, M, S, t, m) -> bool:
    """Whether some cut into at most S parts (so exactly S: parts split without growing) keeps every part's cost
    <= t and memory <= m: greedy, each part as long as it can be."""
    return _parts(C, M, 0, t, m) <= S


def _parts(C, M, i, t, m) -> float:
    """The fewest parts covering layers i .. n-1 with each within (t, m); inf when a single layer exceeds them."""
    n, parts = len(C) - 1, 0
    while i < n:
        e = i
        while e < n and C[e + 1] - C[i] <= t and M[e + 1] - M[i] <= m:
            e += 1
        if e == i:
            return math.inf
        i, parts = e, parts + 1
    return parts


def _lexicographic_cut(C, M, S, t, m):
    """The lexicographically smallest cut into exactly S parts within (t, m) (one exists)."""
    n = len(C) - 1
    need = [0] * (n + 1)  # need[i]: the fewest parts for layers i .. n-1
    for i in range(n - 1, -1, -1):
        e = i
        while e < n and C[e + 1] - C[i] <= t and M[e + 1] - M[i] <= m:
            e += 1
        need[i] = math.inf if e == i else 1 + need[e]
    cut, i = [0], 0
    for k in range(S):
        rest = S - k - 1
        e = i + 1
        while not (need[e] <= rest <= n - e):
            e += 1
        cut.append(e)
        i = e
    return cut


# ---- several stages per rank: branch and bound ----------------------------------------------------------------

def _branch_and_bound(C, M, s2r, limit, max_nodes, ties):
    """Cut positions for several stages per rank, or None when ``limit`` cannot be met. Searches in turn: the
    least per-rank time T (within the limit), the least per-rank memory within T, the least stage time within
    both, then the first cut within all three: lexicographically (``ties="first"``) or in the even-share order
    (``"even"``, :func:`pipesched.partition_search._ends`)."""
    n, S = len(C) - 1, len(s2r)
    stages = tuple(range(S))
    limits = [] if limit is None else [(M, s2r, limit)]
    seeds = [cut for cut in (_even_cut(n, S), _one_stage_per_rank(C, M, S, None))
             if all(evaluate(Q, owners, cut) <= cap for Q, owners, cap in limits)]
    p = max(s2r) + 1
    if limit is None and p >= 2 and tuple(s2r) == vshape(p):  # exact in polynomial time (partition_v)
        cut = least_v_load(C, p, min(evaluate(C, s2r, c) for c in seeds))[1]
    else:
        budget = [max_nodes]
        cut = least_max((C, s2r), limits, seeds, budget)
        if cut is not None and budget[0] is not None and budget[0] <= 0:  # not proven: another order, from it
            cut = least_max((C, s2r), limits, [cut], [max_nodes], order="layers")
    if cut is None:
        return None
    limits = [(C, s2r, evaluate(C, s2r, cut))] + limits
    for objective in ([(M, s2r)] if M[n] else []) + [(C, stages)]:
        cut = least_max(objective, limits, [cut], [max_nodes])
        limits.append((*objective, evaluate(*objective, cut)))
    return least_max((C, s2r), limits, [], [max_nodes], first=True,
                      order="lexicographic" if ties == "first" else "cost") or cut


def _even_cut(n, S):
    base, extra = divmod(n, S)
    cut = [0]
    for s in range(S):
        cut.append(cut[-1] + base + (1 if s < extra else 0))
    return cut
