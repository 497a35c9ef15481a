"""Runtime benchmark: our Pipeline next to torch.distributed.pipelining on the same model and split.

Model 8 x (Linear(512, 512) + Tanh), batch 128, 8 microbatches, MSE, float32, one thread per process,
p=2 ranks on gloo (127.0.0.1). Prints the median step time (forward + backward of every microbatch) of
ours and torch's for gpipe / 1f1b / interleaved-1f1b, their ratio, and single-process references. The row
"1f1b split" is our 1F1B with ``split_backward=True`` (input gradient sent before the weight gradient),
next to torch's plain Schedule1F1B.

    python benchmarks/bench_runtime.py [--rounds 6] [--block 10] [--warmup 5] [--profile]

``--zero-bubble``: instead, the zero-bubble table (``benchmarks/bench_zero_bubble.py``, which takes the other
options): ours' 1f1b / zb-h1 / zb-h2 / zbv / dualpipev / zb-auto next to torch's Schedule1F1B /
ScheduleInterleavedZeroBubble / ScheduleZBVZeroBubble / ScheduleDualPipeV, at m=8 and m=4, on this model and a
wider one; page faults per step, measured and simulated bubble.

    python benchmarks/bench_runtime.py --zero-bubble [--rounds 4] [--block 5] [--warmup 5] [--m 8,4] ...
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline, launch

WIDTH, LAYERS, BATCH, M, P = 512, 8, 128, 8, 2
# (row label, our schedule, virtual stages, torch's schedule class, our split_backward)
SCHEDULES = (("gpipe", "gpipe", 1, "ScheduleGPipe", False), ("1f1b", "1f1b", 1, "Schedule1F1B", False),
             ("1f1b split", "1f1b", 1, "Schedule1F1B", True),
             ("interleaved-1f1b", "interleaved-1f1b", 2, "ScheduleInterleaved1F1B", False))


def model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(LAYERS)])


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def _time(fn, steps: int, warmup: int, zero) -> list[float]:
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        zero()
        if i >= warmup:
            times.append(elapsed)
    return times


def ours(rank, schedule, v, split=False):
    """(step function, zero_grad function, pipeline) of our Pipeline on this rank."""
    pipe = Pipeline(model(), schedule=schedule, num_microbatches=M, loss_fn=F.mse_loss, virtual_stages=v,
                    split_backward=split)
    x, y = data()

    def zero():
        for p in pipe.parameters():
            p.grad = None

    return (lambda: pipe.step(x, target=y)), zero, pipe


def theirs(rank, schedule_name, v):
    """(step function, zero_grad function) of torch.distributed.pipelining on the same split."""
    from torch.distributed import pipelining

    blocks = list(model())
    per = LAYERS // (P * v)
    stages = [pipelining.PipelineStage(nn.Sequential(*blocks[s * per:(s + 1) * per]), s, P * v, torch.device("cpu"))
              for s in (rank + k * P for k in range(v))]
    sched = getattr(pipelining, schedule_name)(stages if v > 1 else stages[0], n_microbatches=M, loss_fn=F.mse_loss)
    x, y = data()
    last = rank == P - 1

    def step():
        if rank == 0:
            sched.step(x)
        elif last:
            sched.step(target=y, losses=[])
        else:
            sched.step()

    def zero():
        for st in stages:
            for p in st.submod.parameters():
                p.grad = None

    return step, zero


def _profile(step, zero, steps: int) -> None:
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    _time(step, steps, 0, zero)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(15)


def worker(rank, rounds, block, warmup, profile):
    """Ours and torch's alternate in blocks of ``block`` steps, ``rounds`` times, so both see the same
    machine noise. Returns per schedule the step times of each and our measured bubble fraction."""
    import torch.distributed as dist

    results = {}
    for label, name, v, torch_name, split in SCHEDULES:
        our_step, our_zero, pipe = ours(rank, name, v, split)
        their_step, their_zero = theirs(rank, torch_name, v)
        _time(our_step, 0, warmup, our_zero)
        _time(their_step, 0, warmup, their_zero)
        mine, other = [], []
        for _ in range(rounds):
            mine += _time(our_step, block, 0, our_zero)
            dist.barrier()
            other += _time(their_step, block, 0, their_zero)
            dist.barrier()
        if profile and rank == 0 and label == "1f1b":
            _profile(our_step, our_zero, rounds * block)
        elif profile and label == "1f1b":
            _time(our_step, rounds * block, 0, our_zero)
        results[label] = (mine, other, pipe.gather_timeline().bubble_fraction)
    return results


def single_process(steps: int, warmup: int) -> tuple[float, float]:
    torch.set_num_threads(1)
    net = model()
    x, y = data()

    def sequential():
        for xm, ym in zip(x.chunk(M), y.chunk(M)):
            (F.mse_loss(net(xm), ym) / M).backward()

    def full():
        F.mse_loss(net(x), y).backward()

    zero = lambda: net.zero_grad(set_to_none=True)  # noqa: E731
    return (statistics.median(_time(sequential, steps, warmup, zero)),
            statistics.median(_time(full, steps, warmup, zero)))


def main() -> None:
    import sys

    if "--zero-bubble" in sys.argv[1:]:  # the zero-bubble table, with that module's options
        import bench_zero_bubble

        return bench_zero_bubble.main([a for a in sys.argv[1:] if a != "--zero-bubble"])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zero-bubble", action="store_true", help="the zero-bubble table (bench_zero_bubble.py)")
    parser.add_argument("--rounds", type=int, default=6, help="alternations of ours and torch's")
    parser.add_argument("--block", type=int, default=10, help="steps per block")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="cProfile our 1f1b steps on rank 0")
    args = parser.parse_args()
    steps = args.rounds * args.block
    seq, full = single_process(steps, args.warmup)
    results = launch(worker, P, args.rounds, args.block, args.warmup, args.profile, timeout=1800)
    limit = seq / P * (M + P - 1) / M
    print(f"\nmodel {LAYERS} x (Linear({WIDTH}, {WIDTH}) + Tanh), batch {BATCH}, m={M}, p={P} gloo, 1 thread/process, "
          f"median of {steps} steps, alternating blocks of {args.block} (ms)")
    print(f"single process: {M} microbatches one after another {seq * 1e3:.1f} ms, one full batch {full * 1e3:.1f} ms; "
          f"2-rank limit {seq * 1e3:.1f}/2 x (m+p-1)/m = {limit * 1e3:.1f} ms")
    print(f"{'schedule':<18}{'ours':>8}{'torch':>8}{'ours/torch':>12}{'ours/limit':>12}{'bubble':>8}"
          f"{'best ours':>11}{'best torch':>11}")
    for name, *_ in SCHEDULES:
        per_step = [[max(r[name][k][i] for r in results) for i in range(steps)] for k in (0, 1)]
        ours_t, torch_t = (statistics.median(t) for t in per_step)
        # the quietest block of each: the least disturbed by other load on the machine
        best = [min(statistics.median(t[b * args.block:(b + 1) * args.block]) for b in range(args.rounds))
                for t in per_step]
        bubble = results[0][name][2]
        print(f"{name:<18}{ours_t * 1e3:>8.1f}{torch_t * 1e3:>8.1f}{ours_t / torch_t:>12.2f}{ours_t / limit:>12.2f}"
              f"{bubble:>8.2f}{best[0] * 1e3:>11.1f}{best[1] * 1e3:>11.1f}")


if __name__ == "__main__":
    main()
