"""Runtime benchmark: our Pipeline next to torch.distributed.pipelining on the same model and split.

Model 8 x (Linear(512, 512) + Tanh), batch 128, 8 microbatches, MSE, float32, one thread per process,
p=2 ranks on gloo (127.0.0.1). Prints the median step time (forward + backward of every microbatch) of
ours and torch's for gpipe / 1f1b / interleaved-1f1b, their ratio, and single-process references.

    python benchmarks/bench_runtime.py [--steps 40] [--warmup 8] [--profile]
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
SCHEDULES = (("gpipe", 1, "ScheduleGPipe"), ("1f1b", 1, "Schedule1F1B"), ("interleaved-1f1b", 2, "ScheduleInterleaved1F1B"))


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


def ours(rank, schedule, v, steps, warmup, profile=False):
    net = model()
    pipe = Pipeline(net, schedule=schedule, num_microbatches=M, loss_fn=F.mse_loss, virtual_stages=v)
    x, y = data()

    def zero():
        for p in pipe.parameters():
            p.grad = None

    if profile and rank == 0:
        import cProfile
        import pstats
        _time(lambda: pipe.step(x, target=y), 0, warmup, zero)
        prof = cProfile.Profile()
        prof.enable()
        _time(lambda: pipe.step(x, target=y), steps, 0, zero)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    times = _time(lambda: pipe.step(x, target=y), steps, warmup, zero)
    return times, pipe.gather_timeline().bubble_fraction


def theirs(rank, schedule_name, v, steps, warmup):
    import torch.distributed as dist
    from torch.distributed import pipelining

    net = model()
    blocks = list(net)
    per = LAYERS // (P * v)
    stage_ids = [rank + k * P for k in range(v)]
    stages = [pipelining.PipelineStage(nn.Sequential(*blocks[s * per:(s + 1) * per]), s, P * v, torch.device("cpu"))
              for s in stage_ids]
    cls = getattr(pipelining, schedule_name)
    sched = cls(stages if v > 1 else stages[0], n_microbatches=M, loss_fn=F.mse_loss)
    x, y = data()
    last = rank == P - 1

    def step():
        if rank == 0:
            sched.step(x, target=y) if last else sched.step(x)
        elif last:
            sched.step(target=y, losses=[])
        else:
            sched.step()

    def zero():
        for st in stages:
            for p in st.submod.parameters():
                p.grad = None

    times = _time(step, steps, warmup, zero)
    dist.barrier()
    return times


def worker(rank, steps, warmup, profile):
    results = {}
    for name, v, torch_name in SCHEDULES:
        results[(name, "ours")] = ours(rank, name, v, steps, warmup, profile and name == "1f1b")
        results[(name, "torch")] = theirs(rank, torch_name, v, steps, warmup)
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--profile", action="store_true", help="cProfile our 1f1b steps on rank 0")
    args = parser.parse_args()
    seq, full = single_process(args.steps, args.warmup)
    results = launch(worker, P, args.steps, args.warmup, args.profile, timeout=1200)
    limit = seq / P * (M + P - 1) / M
    print(f"\nmodel {LAYERS} x (Linear({WIDTH}, {WIDTH}) + Tanh), batch {BATCH}, m={M}, p={P} gloo, 1 thread/process, "
          f"median of {args.steps} steps (ms)")
    print(f"single process: {M} microbatches one after another {seq * 1e3:.1f} ms, one full batch {full * 1e3:.1f} ms; "
          f"2-rank limit {seq * 1e3:.1f}/2 x (m+p-1)/m = {limit * 1e3:.1f} ms")
    print(f"{'schedule':<18}{'ours':>8}{'torch':>8}{'ours/torch':>12}{'ours/limit':>12}{'bubble':>8}")
    for name, _, _ in SCHEDULES:
        ours_t = statistics.median(max(r[(name, 'ours')][0][i] for r in results) for i in range(args.steps))
        torch_t = statistics.median(max(r[(name, 'torch')][i] for r in results) for i in range(args.steps))
        bubble = results[0][(name, "ours")][1]
        print(f"{name:<18}{ours_t * 1e3:>8.1f}{torch_t * 1e3:>8.1f}{ours_t / torch_t:>12.2f}{ours_t / limit:>12.2f}"
              f"{bubble:>8.2f}")


if __name__ == "__main__":
    main()
