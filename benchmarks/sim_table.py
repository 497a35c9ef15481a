"""Simulated bubble and activation memory of every built-in schedule at sizes no machine here can run.

For p in {8, 16, 32} pipeline ranks and m = 4p microbatches, the same model under each schedule: a rank's share of
one microbatch's forward costs 1 s, its input-gradient and weight-gradient halves 1 s each (a GPT-style layer:
F : I : W = 1 : 1 : 1, a fused B = 2 s), split over the rank's ``v`` stages (a stage of interleaved-1f1b, zbv or
dualpipev costs 1/v of that). "peak act." is the largest in-flight count on any rank times 1/v: activations held,
in units of one microbatch through one rank's share of the model. Second table: the same with 0.05 s of latency per
message (5% of a forward).

Run: ``python benchmarks/sim_table.py`` (torch-free; about a minute).
"""
from __future__ import annotations

import argparse

import pipesched as ps

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-h2", 1), ("zbv", 2),
             ("dualpipev", 2))


def row(schedule: str, v: int, p: int, m: int, latency: float) -> tuple[float, float]:
    """(bubble fraction, peak activations in one-rank-share units) of ``schedule`` at p, m, v."""
    program = ps.compile_program(schedule, p, m, v)
    share = 1.0 / v
    cost = ps.CostModel(forward=share, backward=2 * share, input_grad=share, weight_grad=share, latency=latency)
    timeline = ps.simulate(program, cost)
    return timeline.bubble_fraction, max(timeline.peak_inflight) * share


def table(latency: float, sizes) -> str:
    head = "| schedule | " + " | ".join(f"p={p}, m={4 * p}: bubble, peak act." for p in sizes) + " |"
    lines = [head, "|---|" + "---|" * len(sizes)]
    for schedule, v in SCHEDULES:
        cells = []
        for p in sizes:
            bubble, peak = row(schedule, v, p, 4 * p, latency)
            cells.append(f"{bubble:.3f}, {peak:g}")
        lines.append(f"| `{schedule}` (v={v}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8,16,32", help="pipeline ranks p, comma separated (m = 4p)")
    args = parser.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    for latency in (0.0, 0.05):
        print(f"\nF : I : W = 1 : 1 : 1 per rank's share, latency {latency:g} s per message\n")
        print(table(latency, sizes), flush=True)


if __name__ == "__main__":
    main()
