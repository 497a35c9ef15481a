"""Where the measured bubble goes, step by step: ours on the benchmark's model (``bench_zero_bubble.py``), p=2 gloo.

For each of ``--steps`` training steps (after ``--warmup``; ranks start each step together) it gathers the measured
timeline and prints, over the steps, the quartiles of

- the measured bubble and the simulated bubble of the same program under the step's own costs, with per-stage
  medians (as ``bench_zero_bubble.py``: F/B/I/W, the send overhead, the message latency) and with means (the
  simulation then holds the measured busy seconds);
- per rank, the parts of the step (fractions of its makespan): compute, inside SEND calls, waiting for a message
  (idle before a compute, until its message landed), other gaps (idle with the message already there: the runtime's
  own time between instructions), and the idle before the rank's first and after its last instruction.

    python benchmarks/bubble_gap.py [--schedule 1f1b] [--m 8] [--width 512] [--rows 16] [--steps 30] [--warmup 8]
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

import bench_zero_bubble as bench

PARTS = ("compute", "send", "wait", "other", "head", "tail")


def mean_costs(timeline, medians):
    """``medians`` (a :class:`pipesched.CostModel`) with each per-stage seconds and the send overhead replaced by
    the step's means (the latency: the message time less the mean overhead)."""
    from pipesched.ir import Op
    from pipesched.viz.analysis import send_seconds

    seconds: dict = {}
    for e in timeline.events:
        seconds.setdefault((e.instr.op, e.instr.stage), []).append(e.duration)
    n = 1 + max(e.instr.stage for e in timeline.events)

    def per_stage(op, field):
        return [statistics.fmean(seconds[op, s]) if (op, s) in seconds else v
                for s, v in enumerate(medians.per_stage(field, n))]

    sends = send_seconds(timeline)
    overhead = statistics.fmean(sends) if sends else 0.0
    inp, wgt = per_stage(Op.I, "input_grad"), per_stage(Op.W, "weight_grad")
    bwd = [statistics.fmean(seconds[Op.B, s]) if (Op.B, s) in seconds else i + w for s, (i, w) in
           enumerate(zip(inp, wgt))]
    return dataclasses.replace(medians, forward=per_stage(Op.F, "forward"), backward=bwd, input_grad=inp,
                               weight_grad=wgt, send_overhead=overhead,
                               latency=max(0.0, bench.message_time(timeline) - overhead))


def parts(timeline) -> list[list[float]]:
    """Per rank, :data:`PARTS` as fractions of the makespan (see the module docstring)."""
    from pipesched.deps import message, needs
    from pipesched.ir import COMPUTE_OPS, Op

    t0 = min(e.start for e in timeline.events)
    span = timeline.makespan
    stages = 1 + max(e.instr.stage for e in timeline.events)
    landed = {(e.rank, message(e.instr)): e.end for e in timeline.events if e.instr.op in (Op.RECV_F, Op.RECV_B)}
    sending = (Op.SEND_F, Op.SEND_B)
    rows = []
    for rank in range(timeline.num_ranks):
        own = sorted((e for e in timeline.events if e.rank == rank and (e.instr.op in COMPUTE_OPS or
                                                                         e.instr.op in sending)),
                     key=lambda e: e.start)
        wait = other = 0.0
        for before, e in zip(own, own[1:]):
            gap = max(0.0, e.start - before.end)
            arrival = max((landed[rank, item] for item in needs(e.instr, stages, 0) if (rank, item) in landed),
                          default=None) if e.instr.op in COMPUTE_OPS else None
            waited = 0.0 if arrival is None else min(gap, max(0.0, min(arrival, e.start) - before.end))
            wait, other = wait + waited, other + gap - waited
        compute = sum(e.duration for e in own if e.instr.op in COMPUTE_OPS)
        send = sum(e.duration for e in own if e.instr.op in sending)
        head, tail = own[0].start - t0, t0 + span - own[-1].end
        rows.append([x / span for x in (compute, send, wait, other, head, tail)])
    return rows


def worker(rank: int, args) -> list:
    import torch.distributed as dist
    from pipesched import simulate

    torch.set_num_threads(1)
    v = 2 if args.schedule in ("zbv", "dualpipev") else 1  # the V schedules: two stages per rank
    step, zero, pipe = bench.ours((args.width, args.rows, args.m), args.schedule, v)
    for _ in range(args.warmup):
        step()
        zero()
    rows = []
    for _ in range(args.steps):
        dist.barrier()
        step()
        zero()
        timeline = pipe.gather_timeline()
        medians = bench.measured_costs(timeline, pipe.program.num_stages)
        simulated = simulate(pipe.program, medians).bubble_fraction
        with_means = simulate(pipe.program, mean_costs(timeline, medians)).bubble_fraction
        rows.append((timeline.bubble_fraction, simulated, with_means, parts(timeline)))
    pipe.close()
    return rows


def quartiles(values) -> str:
    q1, q2, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
    return f"{q2:.3f} [{q1:.3f}-{q3:.3f}]"


def main(argv=None) -> None:
    from pipesched.runtime import launch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--rows", type=int, default=16, help="rows per microbatch")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=8)
    args = parser.parse_args(argv)
    rows = launch(worker, bench.P, args, timeout=3600)[0]
    print(f"{args.schedule}, m={args.m}, w={args.width}, {args.rows} rows, {len(rows)} steps: median [q1-q3]")
    for k, name in enumerate(("measured bubble", "simulated (medians)", "simulated (means)")):
        print(f"  {name:20s} {quartiles([r[k] for r in rows])}")
    gaps = [r[0] - r[1] for r in rows]
    print(f"  {'measured - simulated':20s} {quartiles(gaps)}")
    for rank in range(bench.P):
        print(f"  rank {rank}: " + ", ".join(f"{name} {statistics.median(r[3][rank][k] for r in rows):.3f}"
                                             for k, name in enumerate(PARTS)))


if __name__ == "__main__":
    main()
