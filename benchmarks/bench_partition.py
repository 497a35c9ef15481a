"""How good and how fast ``balance_by_time`` is with several stages per rank, at a GPT-like size.

96 layers: a first of cost 3 (embedding), 94 blocks of cost 1 with 0 / 10 / 30% uniform noise, a last of cost 4
(head and loss); one unit of memory per layer. Placements: looped p x v = 4x2, 8x2, 8x4, 16x3 (interleaved) and V
for p = 4, 8, 16 (zbv, dualpipev); three noise seeds each. Per case: the slowest rank over the lower bound
max(total / p, largest layer) (the bound is not always reachable: it ignores that cuts fall between layers), the
seconds of the call, and the stage sizes' spread (largest / smallest stage in layers).

Run: ``python benchmarks/bench_partition.py [--max-nodes N]`` (torch-free; about 20 s).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from pipesched.partition import balance_by_time, rank_loads
from pipesched.placement import looped, vshape

PLACEMENTS = (("looped", 4, 2), ("looped", 8, 2), ("looped", 8, 4), ("looped", 16, 3), ("V", 4, 2), ("V", 8, 2),
              ("V", 16, 2))


def case(seed: int, noise: float, kind: str, p: int, v: int, max_nodes):
    """(gap over the lower bound, seconds, largest / smallest stage) of one call."""
    rng = random.Random(seed)
    costs = [3.0] + [rng.uniform(1 - noise, 1 + noise) for _ in range(94)] + [4.0]
    s2r = looped(p, v) if kind == "looped" else vshape(p)
    start = time.perf_counter()
    balance = balance_by_time(costs, len(s2r), s2r, memory=[1.0] * len(costs), max_nodes=max_nodes)
    seconds = time.perf_counter() - start
    bound = max(sum(costs) / p, max(costs))
    return max(rank_loads(costs, balance, s2r)) / bound - 1, seconds, max(balance) / min(balance)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-nodes", type=int, default=2000, help="balance_by_time's max_nodes (default 2000)")
    args = parser.parse_args(argv)
    print("| placement | p x v | noise | mean gap | max gap | mean s | max s | stage spread (max) |")
    print("|---|---|---|---|---|---|---|---|")
    gaps, times = [], []
    for kind, p, v in PLACEMENTS:
        for noise in (0.0, 0.1, 0.3):
            rows = [case(seed, noise, kind, p, v, args.max_nodes) for seed in range(3)]
            gaps += [r[0] for r in rows]
            times += [r[1] for r in rows]
            print(f"| {kind} | {p}x{v} | {noise:.0%} | {statistics.mean(r[0] for r in rows):.2%} | "
                  f"{max(r[0] for r in rows):.2%} | {statistics.mean(r[1] for r in rows):.2f} | "
                  f"{max(r[1] for r in rows):.2f} | {max(r[2] for r in rows):.1f} |")
    print(f"\nall {len(gaps)} calls: gap over the bound {statistics.mean(gaps):.2%} mean, {max(gaps):.2%} max; "
          f"{statistics.mean(times):.2f} s mean, {max(times):.2f} s max per call")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
