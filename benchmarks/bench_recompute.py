"""Recompute benchmark: activation memory and step time with and without recomputation.

Model 8 x (Linear(1024, 1024) + GELU + Dropout(0.1)), batch 128, 8 microbatches, MSE, float32,
p=2 ranks on gloo (127.0.0.1), one thread per process. For gpipe / 1f1b / interleaved-1f1b, prints per
rank the measured peak bytes of activations held for backward (saved-tensor hooks), the prediction of
``pipesched.memory.peak_activation_bytes`` for the same program, and the median step time.

    python benchmarks/bench_recompute.py [--rounds 4] [--block 5] [--warmup 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from pipesched import CostModel
from pipesched.memory import peak_activation_bytes
from pipesched.runtime import Pipeline, launch, stage_activation_bytes

WIDTH, LAYERS, BATCH, M, P = 1024, 8, 128, 8, 2
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2))


def model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Dropout(0.1)) for _ in range(LAYERS)])


def build(schedule, v, recompute):
    net = model()
    pipe = Pipeline(net, schedule=schedule, num_microbatches=M, loss_fn=F.mse_loss, virtual_stages=v,
                    recompute=recompute)
    return net, pipe


def timed_steps(pipe, x, y, count):
    times = []
    for _ in range(count):
        start = time.perf_counter()
        pipe.step(x, target=y)
        times.append(time.perf_counter() - start)
        for p in pipe.parameters():
            p.grad = None
    return times


def memory(net, pipe, x, y):
    mb = BATCH // M
    sizes = stage_activation_bytes(net, x[:mb], pipe.program.num_stages, loss_fn=F.mse_loss, target=y[:mb])
    predicted = peak_activation_bytes(pipe.program, CostModel(**sizes))[pipe.pp_rank]
    mine = pipe.stage_ids
    inflight = pipe.timeline().peak_inflight[pipe.pp_rank]
    # the bound with recompute: the stage inputs of every in-flight microbatch + one microbatch's stash
    bound = inflight * max(sizes["input_bytes"][s] for s in mine) + max(sizes["stash_bytes"][s] for s in mine)
    return {"peak": pipe.peak_activation_bytes, "predicted": predicted, "bound": bound}


def worker(rank, rounds, block, warmup):
    """Per schedule, the pipelines with and without recompute alternate in blocks of steps (same noise)."""
    import torch.distributed as dist

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)
    results = {}
    for name, v in SCHEDULES:
        built = {flag: build(name, v, flag) for flag in (False, True)}
        times = {False: [], True: []}
        for flag in (False, True):
            timed_steps(built[flag][1], x, y, warmup)
        for _ in range(rounds):
            for flag in (False, True):
                times[flag] += timed_steps(built[flag][1], x, y, block)
                dist.barrier()
        for flag in (False, True):
            results[(name, flag)] = {"times": times[flag], **memory(*built[flag], x, y)}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--block", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    steps = args.rounds * args.block
    results = launch(worker, P, args.rounds, args.block, args.warmup, timeout=1800)
    mib = 2 ** 20
    print(f"\nmodel {LAYERS} x (Linear({WIDTH}) + GELU + Dropout), batch {BATCH}, m={M}, p={P} gloo, "
          f"median of {steps} steps (alternating blocks of {args.block}); memory in MiB per rank (measured / predicted)")
    print(f"{'schedule':<18}{'recompute':>10}{'step ms':>9}{'rank 0':>17}{'rank 1':>17}{'bound r0':>10}{'bound r1':>10}")
    for name, _ in SCHEDULES:
        for flag in (False, True):
            rows = [r[(name, flag)] for r in results]
            step = statistics.median(max(r["times"][i] for r in rows) for i in range(steps))
            cells = "".join(f"{r['peak'] / mib:>8.2f} /{r['predicted'] / mib:>7.2f}" for r in rows)
            bounds = "".join(f"{r['bound'] / mib:>10.2f}" for r in rows)
            print(f"{name:<18}{str(flag):>10}{step * 1e3:>9.1f}{cells}{bounds}")


if __name__ == "__main__":
    main()
