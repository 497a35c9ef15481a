"""The step's opening and its lead, measured: ours with the lead, ours without it, torch's Schedule1F1B.

p=2 gloo (127.0.0.1), one thread per process, the narrow model of ``bench_zero_bubble.py`` (8 x (Linear(512) +
Tanh), 16-row microbatches, MSE), 1f1b. Three sides built once in the same processes run one step each in turn,
``--rounds`` times, after a barrier (the ranks start each step together, the case where the opening's round trip
is all on the critical path):

    lead   ours as it ships: stage 0's rank runs F0.0 while the opening all-gather is in flight (runtime/lead.py)
    plain  ours with the lead turned off (the rows waited for before F0.0, as before the lead)
    torch  torch.distributed.pipelining's Schedule1F1B on the identical split

Prints per m the median step ms (per step the max over ranks) of each side, and the per-round ratios lead / plain,
lead / torch and plain / torch as ``median [q1-q3]``; then, for the lead side, when on each rank (ms after the
step's call, medians) the opening's all-gather was posted and its rows were in.

    python benchmarks/bench_opening.py [--m 2,4,8] [--rounds 150] [--warmup 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench_zero_bubble import ours, theirs, timed

SIDES = ("lead", "plain", "torch")


def _opening_marks(marks: dict):
    """Wrap this process's Handshake.open and Gathering.rows to record (time.perf_counter) when each returned."""
    from pipesched.runtime import handshake, transport

    plain_open, plain_rows = handshake.Handshake.open, transport.Gathering.rows

    def opened(self, *args, **kwargs):
        out = plain_open(self, *args, **kwargs)
        marks["posted"] = time.perf_counter()
        return out

    def rows(self):
        out = plain_rows(self)
        marks["rows in"] = time.perf_counter()
        return out

    handshake.Handshake.open, transport.Gathering.rows = opened, rows


def worker(rank: int, ms, rounds: int, warmup: int):
    import torch.distributed as dist

    torch.set_num_threads(1)
    marks: dict = {}
    _opening_marks(marks)
    out = {}
    for m in ms:
        cfg = (512, 16, m)
        sides = {"lead": ours(cfg, "1f1b", 1), "plain": ours(cfg, "1f1b", 1), "torch": theirs(rank, cfg, "Schedule1F1B")}
        sides["plain"][2]._executor.leads = {True: None, False: None}  # no step of this pipeline runs a lead
        for step, zero, _ in sides.values():
            timed(step, zero, warmup)
        got = {side: [] for side in SIDES}
        opening = []
        for _ in range(rounds):
            for side in SIDES:
                step, zero, _ = sides[side]
                dist.barrier()
                t0 = time.perf_counter()
                got[side] += timed(step, zero, 1)
                if side == "lead":
                    opening.append({k: (v - t0) * 1e3 for k, v in marks.items()})
        for side in ("lead", "plain"):
            sides[side][2].close()
        out[m] = {"steps": got, "opening": opening}
    return out


def _ratio(a: list, b: list) -> str:
    r = sorted(x / y for x, y in zip(a, b))
    q = len(r) // 4
    return f"{statistics.median(r):.3f} [{r[q]:.2f}-{r[-1 - q]:.2f}]"


def report(results, ms) -> list[str]:
    lines = ["| m | lead ms | plain ms | torch ms | lead / plain | lead / torch | plain / torch |",
             "|---|---|---|---|---|---|---|"]
    for m in ms:
        t = {s: [max(a[0], b[0]) for a, b in zip(results[0][m]["steps"][s], results[1][m]["steps"][s])]
             for s in SIDES}
        lines.append(f"| {m} | {statistics.median(t['lead']) * 1e3:.2f} | {statistics.median(t['plain']) * 1e3:.2f} | "
                     f"{statistics.median(t['torch']) * 1e3:.2f} | {_ratio(t['lead'], t['plain'])} | "
                     f"{_ratio(t['lead'], t['torch'])} | {_ratio(t['plain'], t['torch'])} |")
    for m in ms:
        for rank in (0, 1):
            rows = results[rank][m]["opening"]
            marks = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
            lines.append(f"m={m} rank {rank}: opening posted at {marks['posted']:.2f} ms, rows in at "
                         f"{marks['rows in']:.2f} ms (lead side, medians)")
    return lines


def main(argv=None) -> None:
    import os

    from pipesched.runtime import launch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", default="2,4,8", help="comma-separated microbatch counts")
    parser.add_argument("--rounds", type=int, default=150, help="rounds of one step per side")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per side first")
    args = parser.parse_args(argv)
    ms = [int(v) for v in args.m.split(",")]
    before = os.getloadavg()
    results = launch(worker, 2, ms, args.rounds, args.warmup, timeout=3600)
    after = os.getloadavg()
    print(f"p=2 gloo, 1f1b, 8 x (Linear(512) + Tanh), 16 rows per microbatch; {args.rounds} rounds; load average "
          f"{before[0]:.1f} before, {after[0]:.1f} after")
    print("\n".join(report(results, ms)))


if __name__ == "__main__":
    main()
