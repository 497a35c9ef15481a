"""What the split backward costs next to a fused one, on one stage of the runtime benchmark, in one process.

The stage is 4 x (Linear(512, 512) + Tanh) on a microbatch of 16 rows. Prints median milliseconds of
a fused ``backward``, and of the split one: ``I`` (input gradient, recording where ``W`` restarts) and
``W`` (weight gradients). ``I + W - fused`` is the split's bookkeeping; ``I`` alone is what the previous
stage waits for.

    python benchmarks/bench_split.py [--width 512] [--layers 4] [--rows 16] [--steps 300]

``--pipeline``: the allocation churn of the split backward, before and after the runtime keeps freed memory
(:mod:`pipesched.runtime.heap`): ``zb-h1`` on p=2 gloo ranks, m=8, 8 x (Linear(1024) + Tanh), batch 128, next
to torch's ``Schedule1F1B`` on the same split and data, alternating in blocks. "before" runs in processes with
``PIPESCHED_KEEP_FREED_MEMORY=0`` (glibc's default malloc settings for both), "after" in processes where our
Pipeline set them (torch's 1F1B then runs with them too); the launches alternate ``--rounds`` times. Prints,
per side, the median minor page faults per step (``resource.getrusage``; last rank, max over ranks), the median
``W`` ms on the last rank and the median step ms (max over ranks).

    python benchmarks/bench_split.py --pipeline [--rounds 2] [--block 5] [--blocks 3]
"""
from __future__ import annotations

import argparse
import os
import resource
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
    parser.add_argument("--pipeline", action="store_true", help="page faults and W ms of zb-h1 vs torch's 1F1B")
    parser.add_argument("--rounds", type=int, default=2, help="--pipeline: before/after launches, alternating")
    parser.add_argument("--block", type=int, default=5, help="--pipeline: steps per block")
    parser.add_argument("--blocks", type=int, default=3, help="--pipeline: blocks of ours and torch's, alternating")
    args = parser.parse_args()
    if args.pipeline:
        return pipeline_main(args)
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



# ---- --pipeline: page faults per step, zb-h1 next to torch's 1F1B, before/after -----------------------

PWIDTH, PLAYERS, PBATCH, PM, PP = 1024, 8, 128, 8, 2


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(PWIDTH, PWIDTH), nn.Tanh()) for _ in range(PLAYERS)])


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(PBATCH, PWIDTH, generator=g), torch.randn(PBATCH, PWIDTH, generator=g)


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _ours(rank):
    import torch.nn.functional as F
    from pipesched.ir import Op
    from pipesched.runtime import Pipeline

    pipe = Pipeline(_model(), schedule="zb-h1", num_microbatches=PM, loss_fn=F.mse_loss, split_backward=True)
    x, y = _data()

    def step():
        pipe.step(x, target=y)
        return [e.duration for e in pipe.timeline().events if e.instr.op == Op.W]
    return step, pipe.parameters


def _theirs(rank):
    import torch.nn.functional as F
    from torch.distributed import pipelining

    blocks, per = list(_model()), PLAYERS // PP
    stage = pipelining.PipelineStage(nn.Sequential(*blocks[rank * per:(rank + 1) * per]), rank, PP,
                                     torch.device("cpu"))
    sched = pipelining.Schedule1F1B(stage, n_microbatches=PM, loss_fn=F.mse_loss)
    x, y = _data()

    def step():
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=[])
        return []
    return step, stage.submod.parameters


def _measure(step, params, steps):
    """[(faults, seconds, [W seconds])] of ``steps`` steps, .grad set to None between them (as zero_grad)."""
    out = []
    for _ in range(steps):
        f0, t0 = _faults(), time.perf_counter()
        ws = step()
        out.append((_faults() - f0, time.perf_counter() - t0, ws))
        for p in params():
            p.grad = None
    return out


def pipeline_worker(rank, keep, block, blocks):
    import torch.distributed as dist

    if not keep:
        os.environ["PIPESCHED_KEEP_FREED_MEMORY"] = "0"  # read when the Pipeline is built
    sides = {"ours": _ours(rank), "torch": _theirs(rank)}
    for step, params in sides.values():
        _measure(step, params, 3)  # warm-up
    got: dict = {"ours": [], "torch": []}
    for _ in range(blocks):
        for name, (step, params) in sides.items():
            dist.barrier()
            got[name] += _measure(step, params, block)
    return got


def pipeline_main(args) -> None:
    from pipesched.runtime import launch

    rows: dict = {}
    for _ in range(args.rounds):
        for keep in (False, True):
            results = launch(pipeline_worker, PP, keep, args.block, args.blocks, timeout=1800)
            for name in ("ours", "torch"):
                key = (name, "after" if keep else "before")
                steps = zip(*(r[name] for r in results))
                for per_rank in steps:
                    rows.setdefault(key, []).append((max(f for f, _, _ in per_rank), per_rank[-1][0],
                                                     max(t for _, t, _ in per_rank), per_rank[-1][2]))
    print(f"\nzb-h1 (split backward) vs torch Schedule1F1B: {PLAYERS} x (Linear({PWIDTH}) + Tanh), batch {PBATCH}, "
          f"m={PM}, p={PP} gloo, 1 thread/process; medians over {args.rounds} x {args.blocks} x {args.block} steps")
    print(f"{'side':<16}{'faults/step':>12}{'last rank':>10}{'W ms':>7}{'step ms':>9}")
    for (name, when), vals in rows.items():
        w = [d for *_, ws in vals for d in ws]
        w_ms = f"{statistics.median(w) * 1e3:.1f}" if w else "-"
        print(f"{name + ' ' + when:<16}{statistics.median(v[0] for v in vals):>12.0f}"
              f"{statistics.median(v[1] for v in vals):>10.0f}{w_ms:>7}"
              f"{statistics.median(v[2] for v in vals) * 1e3:>9.1f}")
    step = {k: statistics.median(v[2] for v in vals) for k, vals in rows.items()}
    print(f"ours/torch: before {step['ours', 'before'] / step['torch', 'before']:.2f}, after "
          f"{step['ours', 'after'] / step['torch', 'after']:.2f}, ours after / torch before (default malloc) "
          f"{step['ours', 'after'] / step['torch', 'before']:.2f}")


if __name__ == "__main__":
    main()
