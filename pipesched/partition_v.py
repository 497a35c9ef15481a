"""The least slowest rank of a V placement, exactly and in polynomial time: what makes
:func:`pipesched.partition.balance_by_time` exact for ``zbv`` and ``dualpipev`` whatever the layer count. Torch-free.

In a V (:func:`pipesched.placement.vshape`: rank ``r`` holds stages ``r`` and ``2p-1-r``) the ranks nest: rank 0
holds a prefix ``[0, a_0)`` and a suffix ``[b_0, n)`` of the layers, rank 1 the next prefix and suffix, ..., the
innermost rank ``p-1`` the middle ``[a_{p-2}, b_{p-2})`` (two stages, so at least two layers). With ``Z(a, b)`` the
cost of the layers outside ``[a, b)``, rank ``k``'s load is ``Z(a_k, b_k) - Z(a_{k-1}, b_{k-1})``: the loads are the
steps of one increasing sequence. So whether every rank can stay within ``T`` is a walk from the outside in over
the pairs ``(a, b)``: the pairs ranks ``0..k`` can end at are those reachable from a pair of ranks ``0..k-1``
inside them (``a' < a``, ``b' > b``) with ``Z(a, b) - Z(a', b') <= T``, i.e. whose largest ``Z`` over that quadrant
is at least ``Z(a, b) - T``: a running maximum over the quadrant, O(n^2) per rank, O(p n^2) per test. The least
``T`` is found by bisection over the integers (exact prefix sums, :func:`pipesched.partition._exact_prefixes`),
each feasible test lowering the upper end to the largest load of the walk it found.
"""
from __future__ import annotations


def least_v_load(C, p: int, upper: int) -> tuple[int, list] | None:
    """``(T, cut)``: the least largest per-rank load of the V placement of ``p >= 2`` ranks over prefix sums ``C``
    (ints), and cut positions ``0 .. n`` reaching it; ``upper``: a load some cut reaches (the bisection's start).
    None when the layers cannot fill ``2p`` stages."""
    n = len(C) - 1
    if n < 2 * p:
        return None
    lower = -(-C[n] // p) - 1  # unreachable: the slowest rank carries at least the average, total / p
    best = _walk(C, p, upper)
    if best is None:
        return None
    upper, cut = best
    while lower + 1 < upper:  # invariant: lower is not reachable, upper is (by cut)
        middle = (lower + upper) // 2
        found = _walk(C, p, middle)
        if found is None:
            lower = middle
        else:
            upper, cut = found
    return upper, cut


def _walk(C, p, T):
    """``(largest load, cut)`` of a cut keeping every rank within ``T``, or None if none does."""
    n = len(C) - 1
    total = C[n]

    def Z(a, b):
        return C[a] + total - C[b]

    levels = [{(a, b) for a in range(1, n) for b in range(a + 2 * (p - 1), n) if Z(a, b) <= T}]
    for k in range(1, p - 1):
        reach = levels[-1]
        if not reach:
            return None
        need = 2 * (p - 1 - k)  # layers the ranks inside still take: a layer per side each, two in the middle
        best = _quadrant_max(reach, Z, n)
        levels.append({(a, b) for a in range(k + 1, n) for b in range(a + need, n - k)
                       if best[a - 1][b + 1] is not None and Z(a, b) - best[a - 1][b + 1] <= T})
    ends = [(a, b) for a, b in levels[-1] if C[b] - C[a] <= T]  # b - a >= 2: the level's room
    if not ends:
        return None
    a, b = min(ends)
    pairs = [(a, b)]
    for reach in reversed(levels[:-1]):
        a, b = min((x, y) for x, y in reach if x < a and y > b and Z(a, b) - Z(x, y) <= T)
        pairs.append((a, b))
    pairs.reverse()
    mid = pairs[-1][0] + (pairs[-1][1] - pairs[-1][0]) // 2
    cut = [0] + [a for a, _ in pairs] + [mid] + [b for _, b in reversed(pairs)] + [n]
    loads = [Z(*pairs[0])] + [Z(*q) - Z(*r) for r, q in zip(pairs, pairs[1:])] + [C[pairs[-1][1]] - C[pairs[-1][0]]]
    return max(loads), cut


def _quadrant_max(reach, Z, n):
    """``best[a][b]``: the largest ``Z(x, y)`` over reachable pairs with ``x <= a`` and ``y >= b`` (None: none)."""
    best = [[None] * (n + 2) for _ in range(n + 1)]
    for a in range(n + 1):
        row, above = best[a], best[a - 1] if a else None
        for b in range(n, -1, -1):
            value = Z(a, b) if (a, b) in reach else None
            for other in (row[b + 1], above[b] if above else None):
                if other is not None and (value is None or other > value):
                    value = other
            row[b] = value
    return best
