"""Compute alone, no pipeline: the same forwards and backwards in GPipe order and in 1F1B order.

Each process runs one stage of the runtime benchmark (4 x (Linear(512, 512) + Tanh), microbatches of 16
rows, MSE) over 8 microbatches per step, either all forwards then all backwards (GPipe order) or each
backward right after the next forward (1F1B order, 2 in flight), with no communication at all. Run with
``--procs 2`` to load both cores as a 2-rank pipeline does. Prints the median step time of each order (ms)
and their ratio: what the order of work alone costs on this machine, before any schedule or message.

    python benchmarks/bench_compute_order.py [--procs 2] [--rounds 6] [--steps 25]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import launch

WIDTH, LAYERS, ROWS, M = 512, 4, 16, 8


def _stage():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(LAYERS)])


def orders(net, x, y):
    """The two orders of the same work: {name: function running one step of it}."""
    def forward():
        return F.mse_loss(net(x.clone().requires_grad_(True)), y)

    def gpipe():
        for loss in [forward() for _ in range(M)]:
            loss.backward()

    def one_f_one_b():
        held = forward()
        for _ in range(M - 1):
            ahead = forward()
            held.backward()
            held = ahead
        held.backward()

    return {"gpipe order": gpipe, "1f1b order": one_f_one_b}


def worker(rank, rounds, steps):
    net = _stage()
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(ROWS, WIDTH, generator=g), torch.randn(ROWS, WIDTH, generator=g)
    times: dict = {}
    for _ in range(rounds):  # alternate the two orders so both see the same machine noise
        for name, step in orders(net, x, y).items():
            for i in range(steps):
                start = time.perf_counter()
                step()
                elapsed = time.perf_counter() - start
                net.zero_grad(set_to_none=True)
                if i >= 3:
                    times.setdefault(name, []).append(elapsed)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=2, help="processes running at once (default 2)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=25, help="steps per order per round")
    args = parser.parse_args()
    results = launch(worker, args.procs, args.rounds, args.steps, timeout=1800)
    print(f"{LAYERS} x (Linear({WIDTH}) + Tanh), {M} microbatches of {ROWS} rows, {args.procs} process(es), "
          f"1 thread each, no communication; median step (ms)")
    for rank, medians in enumerate(results):
        gpipe, ofob = medians["gpipe order"], medians["1f1b order"]
        print(f"process {rank}: gpipe order {gpipe * 1e3:.1f}  1f1b order {ofob * 1e3:.1f}  ratio {ofob / gpipe:.2f}")


if __name__ == "__main__":
    main()
