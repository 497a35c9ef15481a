"""The branch and bound behind :func:`pipesched.partition.balance_by_time` for several stages per rank: the cut
whose largest per-owner sum of one quantity is least, under caps on others, depth-first over the cut positions with
the stage ends most likely to balance tried first. Torch-free; exact integer sums (prefix sums scaled by
:func:`pipesched.partition._exact_prefixes`).
"""
from __future__ import annotations

from bisect import bisect_right


def least_max(objective, limits, seeds, budget, first=False, order="cost"):
    """The cut (positions 0 .. n) whose largest per-owner sum of the objective is least, among cuts whose
    per-owner sums of each ``(prefix sums, owner of each stage, cap)`` in ``limits`` are <= cap; None if none.
    ``objective``: ``(prefix sums, owner of each stage)``; ``seeds``: cuts known to meet the limits (the best is
    the bound to beat); ``first``: the first cut found meeting the limits instead; ``budget``:
    ``[nodes left]`` (None: no limit); once spent, the best cut found so far; ``order``: :func:`_ends`'s.

    Depth-first over the cut positions, each stage's ends in :func:`_ends`'s order; a partial cut is dropped when an owner exceeds a
    cap (the objective's cap: the best found minus one, as all numbers are ints), when the owners still to receive
    stages cannot hold the rest within their caps (by sum, and by count: each holds at most as many of the
    remaining layers as its cap fits of the smallest ones, and the last stage's owner holds the last layer), or
    when the same (stage, position, per-owner sums) already failed."""
    P, s2r_objective = objective
    quantities = [(P, s2r_objective, None)] + list(limits)
    n, S = len(P) - 1, len(s2r_objective)
    caps = [cap for _, _, cap in quantities]
    best = {"cut": None}
    for cut in seeds:
        value = evaluate(P, s2r_objective, cut)
        if caps[0] is None or value - 1 < caps[0]:
            caps[0], best["cut"] = value - 1, list(cut)
    if first:
        caps[0] = None
    owners = [_Owners(s2r) for _, s2r, _ in quantities]
    items = [_sorted_suffixes(Q) for Q, _, _ in quantities]
    sums = [[0] * o.count for o in owners]
    cut, failed = [0], set()

    def fits(k, e) -> bool:
        for q, (Q, s2r, _) in enumerate(quantities):
            cap = caps[q]
            if cap is None:
                continue
            active = owners[q].active[k]
            room = [cap - sums[q][r] for r in active]
            if Q[n] - Q[e] > sum(room):
                return False
            last = active.index(s2r[-1])
            room[last] -= Q[n] - Q[n - 1]
            if room[last] < 0:
                return False
            if sum(bisect_right(items[q][e], x) - 1 for x in room) < n - 1 - e:
                return False
        return True

    def share(k, i):
        """The objective's cost this stage would take if every owner still to receive stages ended equal."""
        here, r = owners[0].holding[k], s2r_objective[k]
        level = P[n] - P[i] + sum(sums[0][o] for o in here)  # x len(here); ints: no float overflow at any scale
        den = len(here) * owners[0].left[k]
        return (2 * (level - len(here) * sums[0][r]) + den) // (2 * den)  # rounded to the nearest int

    def dfs(k, i) -> bool:
        """True: stop (the first cut found in ``first`` mode, or the budget spent)."""
        if budget[0] is not None:
            if budget[0] <= 0:
                return True
            budget[0] -= 1
        key = (k, i, tuple(map(tuple, sums)))
        if key in failed:
            return False
        found, rest = best["cut"], S - k - 1
        for e in _ends(i, n, rest, order, P, share(k, i) if order == "cost" and rest else None):
            new = [sums[q][s2r[k]] + Q[e] - Q[i] for q, (Q, s2r, _) in enumerate(quantities)]
            if any(cap is not None and x > cap for x, cap in zip(new, caps)):
                if order == "lexicographic":
                    break  # a longer stage only adds
                continue
            if rest == 0:
                best["cut"] = cut + [n]
                if first:
                    return True
                caps[0] = evaluate(P, s2r_objective, best["cut"]) - 1
                break
            old = [sums[q][s2r[k]] for q, (_, s2r, _) in enumerate(quantities)]
            for q, (_, s2r, _) in enumerate(quantities):
                sums[q][s2r[k]] = new[q]
            ok = fits(k, e)
            if ok:
                cut.append(e)
                stop = dfs(k + 1, e)
                cut.pop()
            for q, (_, s2r, _) in enumerate(quantities):
                sums[q][s2r[k]] = old[q]
            if ok and stop:
                return True
        if best["cut"] is found:
            failed.add(key)
        return False

    dfs(0, 0)
    return best["cut"]


def _ends(i, n, rest, order, P, share):
    """The ends to try for a stage starting at layer ``i`` with ``rest`` stages after it. ``order``:
    ``"lexicographic"``, increasing (the lexicographically first cut first); else good cuts first (the search then
    ends sooner and, if ``max_nodes`` stops it, has found a balanced one): ``"cost"``, the stage's cost (prefix
    sums ``P``) nearest ``share``, what it would take if every owner still to receive stages ended level;
    ``"layers"``, nearest an even share of the layers left."""
    if not rest:
        return (n,)
    ends = range(i + 1, n - rest + 1)
    if order == "lexicographic":
        return ends
    if order == "layers":
        target = i + (n - i) / (rest + 1)
        return sorted(ends, key=lambda e: (abs(e - target), e))
    return sorted(ends, key=lambda e: (abs(P[e] - P[i] - share), e))


class _Owners:
    """For a stage-to-owner map: the owner count and, after each stage, the owners that receive a later stage."""

    def __init__(self, s2r):
        self.count = max(s2r) + 1
        last = [-1] * self.count
        for s, r in enumerate(s2r):
            last[r] = s
        self.active = [[r for r in range(self.count) if last[r] > k] for k in range(len(s2r))]
        self.holding = [[r for r in range(self.count) if last[r] >= k] for k in range(len(s2r))]
        self.left = [sum(1 for t in range(k, len(s2r)) if s2r[t] == s2r[k]) for k in range(len(s2r))]


def _sorted_suffixes(Q):
    """For each start e, the prefix sums of the layers e .. n-2 sorted ascending (the last layer is placed)."""
    n = len(Q) - 1
    out = []
    for e in range(n + 1):
        values = sorted(Q[j + 1] - Q[j] for j in range(e, n - 1))
        sums = [0]
        for v in values:
            sums.append(sums[-1] + v)
        out.append(sums)
    return out


def evaluate(Q, s2r, cut):
    """The largest per-owner sum of ``Q`` (prefix sums) for the cut positions ``cut``."""
    loads = [0] * (max(s2r) + 1)
    for s, (a, b) in enumerate(zip(cut, cut[1:])):
        loads[s2r[s]] += Q[b] - Q[a]
    return max(loads)
