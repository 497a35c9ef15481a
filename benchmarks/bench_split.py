"""What the split backward costs next to a fused one, on one stage of the runtime benchmark, in one process.

The stage is 4 x (Linear(512, 512) + Tanh) on a microbatch of 16 rows. Prints median milliseconds of
a fused ``backward``, and of the split one: ``I`` (input gradient, recording where ``W`` restarts) and
``W`` (weight gradients). ``I + W - fused`` is the split's bookkeeping; ``I`` alone is what the previous
stage waits for.

    python benchmarks/bench_split.py [--width 512] [--layers 4] [--rows 16] [--steps 300]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from pipesched.runtime.split import backward_input, backward_weight


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    stage = nn.Sequential(*[nn.Sequential(nn.Linear(args.width, args.width), nn.Tanh()) for _ in range(args.layers)])
    params = list(stage.parameters())
    x, grad = torch.randn(args.rows, args.width), torch.randn(args.rows, args.width)
    times: dict = {"fused": [], "I": [], "W": []}
    for _ in range(args.steps):  # alternate, so both see the same machine noise
        inp = x.clone().requires_grad_(True)
        out = stage(inp)
        start = time.perf_counter()
        out.backward(grad)
        times["fused"].append(time.perf_counter() - start)
        inp = x.clone().requires_grad_(True)
        out = stage(inp)
        start = time.perf_counter()
        _, work = backward_input([out], [grad], [inp], params)
        middle = time.perf_counter()
        backward_weight(work)
        times["I"].append(middle - start)
        times["W"].append(time.perf_counter() - middle)
    fused, i, w = (statistics.median(times[k][args.steps // 10:]) * 1e3 for k in ("fused", "I", "W"))
    print(f"{args.layers} x (Linear({args.width}) + Tanh), {args.rows} rows, 1 thread, median of {args.steps} (ms)")
    print(f"fused B {fused:.3f}   I {i:.3f}   W {w:.3f}   I + W - B {i + w - fused:+.3f} ({(i + w) / fused - 1:+.0%})")


if __name__ == "__main__":
    main()
