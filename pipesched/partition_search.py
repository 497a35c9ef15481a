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
    search = _Search(objective, limits, seeds, budget, first, order)
    search.dfs(0, 0)
    return search.best


class _Search:
    """:func:`least_max`'s state: the quantities (the objective first) with their caps, the per-owner sums of the
    partial cut, its positions, the best cut found and the (stage, position, sums) that already failed."""

    def __init__(self, objective, limits, seeds, budget, first, order):
        P, s2r_objective = objective
        self.P, self.s2r = P, s2r_objective
        self.quantities = [(P, s2r_objective, None)] + list(limits)
        self.n, self.S = len(P) - 1, len(s2r_objective)
        self.caps = [cap for _, _, cap in self.quantities]
        self.best = None
        for cut in seeds:
            value = evaluate(P, s2r_objective, cut)
            if self.caps[0] is None or value - 1 < self.caps[0]:
                self.caps[0], self.best = value - 1, list(cut)
        if first:
            self.caps[0] = None
        self.budget, self.first, self.order = budget, first, order
        self.owners = [_Owners(s2r) for _, s2r, _ in self.quantities]
        self.items = [_sorted_suffixes(Q) for Q, _, _ in self.quantities]
        self.sums = [[0] * o.count for o in self.owners]
        self.cut, self.failed = [0], set()

    def fits(self, k, e) -> bool:
        """Whether the owners still to receive stages after stage ``k`` (ending at ``e``) can hold the rest."""
        n, caps, sums, owners, items = self.n, self.caps, self.sums, self.owners, self.items
        for q, (Q, s2r, _) in enumerate(self.quantities):
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

    def share(self, k, i):
        """The objective's cost this stage would take if every owner still to receive stages ended equal."""
        P, n, sums, owners = self.P, self.n, self.sums, self.owners
        here, r = owners[0].holding[k], self.s2r[k]
        level = P[n] - P[i] + sum(sums[0][o] for o in here)  # x len(here); ints: no float overflow at any scale
        den = len(here) * owners[0].left[k]
        return (2 * (level - len(here) * sums[0][r]) + den) // (2 * den)  # rounded to the nearest int

    def dfs(self, k, i) -> bool:
        """Stage ``k`` starting at layer ``i``, each end in turn. True: stop (the first cut found in ``first``
        mode, or the budget spent)."""
        budget = self.budget
        if budget[0] is not None:
            if budget[0] <= 0:
                return True
            budget[0] -= 1
        quantities, caps, sums, n, order = self.quantities, self.caps, self.sums, self.n, self.order
        key = (k, i, tuple(map(tuple, sums)))
        if key in self.failed:
            return False
        found, rest = self.best, self.S - k - 1
        for e in _ends(i, n, rest, order, self.P, self.share(k, i) if order == "cost" and rest else None):
            new = [sums[q][s2r[k]] + Q[e] - Q[i] for q, (Q, s2r, _) in enumerate(quantities)]
            if any(cap is not None and x > cap for x, cap in zip(new, caps)):
                if order == "lexicographic":
                    break  # a longer stage only adds
                continue
            if rest == 0:
                self.best = self.cut + [n]
                if self.first:
                    return True
                caps[0] = evaluate(self.P, self.s2r, self.best) - 1
                break
            if self.descend(k, e, new):
                return True
        if self.best is found:
            self.failed.add(key)
        return False

    def descend(self, k, e, new) -> bool:
        """Stage ``k`` ends at ``e`` (per-owner sums ``new``): the next stages, if the rest can still fit. True:
        stop."""
        quantities, sums = self.quantities, self.sums
        old = [sums[q][s2r[k]] for q, (_, s2r, _) in enumerate(quantities)]
        for q, (_, s2r, _) in enumerate(quantities):
            sums[q][s2r[k]] = new[q]
        ok = self.fits(k, e)
        if ok:
            self.cut.append(e)
            stop = self.dfs(k + 1, e)
            self.cut.pop()
        for q, (_, s2r, _) in enumerate(quantities):
            sums[q][s2r[k]] = old[q]
        return ok and stop


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
