"""Mixed precision on CPU: step time of float32 next to ``Pipeline(autocast=torch.bfloat16)``.

Model 8 x (Linear(W, W) + Tanh), batch B (128), 8 microbatches, MSE, 1F1B on p=2 gloo ranks, one thread per
process; the two settings run in alternating blocks of steps on the same pipeline ranks, medians in ms. Also
prints the bytes of one activation message (the measured timeline's ``message_bytes``) for each.

    python benchmarks/bench_amp.py [--width 512] [--batch 128] [--rounds 4] [--block 10] [--warmup 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline, launch

LAYERS, M, P = 8, 8, 2
SETTINGS = (("float32", None), ("bf16 autocast", torch.bfloat16))


def model(width: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(LAYERS)])


def rank_main(rank, width, batch, rounds, block, warmup):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)
    pipes = {name: Pipeline(model(width), schedule="1f1b", num_microbatches=M, loss_fn=F.mse_loss, autocast=dtype)
             for name, dtype in SETTINGS}
    times = {name: [] for name in pipes}
    for name, pipe in pipes.items():
        for _ in range(warmup):
            pipe.step(x, target=y)
    for _ in range(rounds):
        for name, pipe in pipes.items():
            for _ in range(block):
                start = time.perf_counter()
                pipe.step(x, target=y)
                times[name].append(time.perf_counter() - start)
                for p in pipe.parameters():
                    p.grad = None
    sent = {name: pipe.gather_timeline().meta["message_bytes"].get("SEND_F0.0>1") for name, pipe in pipes.items()}
    for pipe in pipes.values():
        pipe.close()
    return {name: (statistics.median(t) * 1e3, sent[name]) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    results = launch(rank_main, P, args.width, args.batch, args.rounds, args.block, args.warmup, timeout=1800)
    print(f"8 x (Linear({args.width}) + Tanh), batch {args.batch}, m={M}, 1f1b, p={P} (gloo, 1 thread per rank); "
          f"median step ms over {args.rounds * args.block} steps, rank 0")
    print(f"{'setting':<16} {'step ms':>8} {'SEND_F0.0 bytes':>16}")
    for name, (ms, nbytes) in results[0].items():
        print(f"{name:<16} {ms:8.1f} {nbytes:>16}")
    base, amp = (results[0][name][0] for name, _ in SETTINGS)
    print(f"bf16 / float32 step time: {amp / base:.2f}")


if __name__ == "__main__":
    main()
