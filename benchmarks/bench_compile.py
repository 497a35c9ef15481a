"""Compile-time benchmark: pipesched's build + lower + validate + simulate next to torch.distributed.pipelining.

For interleaved 1F1B at growing sizes it times, in one process:

- ours: what ``pipesched.compile_program`` runs, then ``pipesched.simulate``: ``pipesched.build``
  (compute-only program), ``pipesched.lower.add_send_recv(check=False)`` (sends and receives; it
  times the compute-only program internally to place them), ``pipesched.validate``
  (structure, completeness, order, pairing and the deadlock-freedom execution) and
  ``pipesched.simulate(check=False)`` (the timeline of every instruction, bubble, in-flight peaks);
- torch: ``ScheduleInterleaved1F1B``'s compute-only ``pipeline_order`` (``_calculate_single_rank_operations``
  per rank) and its lowering ``_prepare_schedule_with_comms`` (its ``_validate_schedule``, the FSDP
  unshard/reshard and reduce-grad passes, and ``_add_send_recv``), built without stages or a process
  group: the object is made with ``__new__`` and given the attributes those methods read.

It prints one row per size with the seconds of each step, the instruction (action) counts, microseconds
per instruction (flat when the cost is linear) and torch / ours. Not a test: nothing is asserted.

    python benchmarks/bench_compile.py              # (8,32,2) (32,128,2) (64,256,2) (128,512,2)
    python benchmarks/bench_compile.py --sizes small
"""
from __future__ import annotations

import argparse
import gc
import sys
import time

import pipesched
from pipesched.lower import REFERENCE_COST, add_send_recv

SIZES = {
    "small": [(8, 32, 2), (32, 128, 2)],
    "full": [(8, 32, 2), (32, 128, 2), (64, 256, 2), (128, 512, 2)],
}


def _timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def ours(p: int, m: int, v: int) -> dict:
    """Seconds of each pipesched step and the number of instructions of the lowered program."""
    compute, build_s = _timed(pipesched.build, "interleaved-1f1b", p, m, v)
    program, lower_s = _timed(add_send_recv, compute, REFERENCE_COST, False)  # as compile_program
    _, validate_s = _timed(pipesched.validate, program)
    timeline, simulate_s = _timed(pipesched.simulate, program, pipesched.CostModel(), False)
    assert len(timeline.events) == len(program)
    return {"build": build_s, "lower": lower_s, "validate": validate_s, "simulate": simulate_s,
            "total": build_s + lower_s + validate_s + simulate_s, "instructions": len(program)}


def torch_interleaved(p: int, m: int, v: int) -> dict | None:
    """Seconds of torch's compute-only build and its comm lowering, and its number of actions
    (None if torch is not installed)."""
    try:
        from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B
    except ImportError:
        return None
    schedule = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)
    # what __init__ would set from live stages (see ScheduleInterleaved1F1B.__init__)
    schedule.pp_group_size, schedule.n_local_stages, schedule.rank = p, v, 0
    schedule._n_microbatches, schedule._num_stages, schedule._stages = m, p * v, []
    schedule.number_of_rounds = max(1, m // p)
    schedule.microbatches_per_round = m // schedule.number_of_rounds
    schedule._defer_pp_recv = False

    def build():
        return {rank: schedule._calculate_single_rank_operations(rank) for rank in range(p)}

    schedule.pipeline_order, build_s = _timed(build)
    _, lower_s = _timed(schedule._prepare_schedule_with_comms, schedule.pipeline_order)
    actions = sum(len(a) for a in schedule.pipeline_order_with_comms.values())
    return {"build": build_s, "lower": lower_s, "total": build_s + lower_s, "actions": actions}


def _fastest(step, p: int, m: int, v: int, repeat: int) -> dict | None:
    """Run ``step`` ``repeat`` times; per timed step the fastest run (counts are the same every run)."""
    runs = []
    for _ in range(max(1, repeat)):
        runs.append(step(p, m, v))
        gc.collect()  # each run starts from a clean heap
    if runs[0] is None:
        return None
    return {key: min(run[key] for run in runs) for key in runs[0]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", choices=sorted(SIZES), default="full", help="small: the first two sizes")
    parser.add_argument("--no-torch", action="store_true", help="time pipesched only")
    parser.add_argument("--repeat", type=int, default=1, help="run each size N times, keep the fastest of each step")
    args = parser.parse_args(argv)
    print(f"interleaved-1f1b, python {sys.version.split()[0]}, times in seconds")
    header = (f"{'(p, m, v)':>15} | {'build':>6} {'lower':>6} {'valid.':>6} {'sim.':>6} {'total':>6} "
              f"{'instrs':>7} {'us/instr':>8} | {'torch build':>11} {'lower':>6} {'total':>6} {'actions':>7} "
              f"{'us/action':>9} | {'torch/ours':>10}")
    print(header)
    print("-" * len(header))
    for p, m, v in SIZES[args.sizes]:
        print(f"pipesched ({p}, {m}, {v}) ...", file=sys.stderr, flush=True)
        mine = _fastest(ours, p, m, v, args.repeat)
        theirs = None
        if not args.no_torch:
            print(f"torch     ({p}, {m}, {v}) ...", file=sys.stderr, flush=True)
            theirs = _fastest(torch_interleaved, p, m, v, args.repeat)
        row = (f"{str((p, m, v)):>15} | {mine['build']:6.3f} {mine['lower']:6.3f} {mine['validate']:6.3f} "
               f"{mine['simulate']:6.3f} {mine['total']:6.3f} {mine['instructions']:7d} "
               f"{1e6 * mine['total'] / mine['instructions']:8.2f} | ")
        if theirs is None:
            row += f"{'n/a':>11} {'':>6} {'':>6} {'':>7} {'':>9} | {'n/a':>10}"
        else:
            row += (f"{theirs['build']:11.3f} {theirs['lower']:6.3f} {theirs['total']:6.3f} {theirs['actions']:7d} "
                    f"{1e6 * theirs['total'] / theirs['actions']:9.2f} | {theirs['total'] / mine['total']:9.1f}x")
        print(row, flush=True)


if __name__ == "__main__":
    main()
