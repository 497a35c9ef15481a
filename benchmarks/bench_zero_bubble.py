"""Zero-bubble schedules, ours next to torch.distributed.pipelining's, on the identical model and split.

p=2 ranks on gloo (127.0.0.1), one thread per process, float32, MSE, 8 layers of (Linear(w, w) + Tanh) cut
evenly into stages. Two models: "narrow" (w=512, 16-row microbatches, the model of ``bench_runtime.py``) and
"wide" (default w=2048, 64-row microbatches: the split's bookkeeping is ~1% of a backward there, so the split
can pay). For each model and each m in ``--m`` (default 8 and 4), every side below is built once in the same
processes and the sides run in alternating blocks of ``--block`` steps, ``--rounds`` times, so all see the same
machine noise:

    ours: 1f1b, zb-h1, zb-h2, zbv, dualpipev, zb-auto (built for the F/I/W/latency measured on zb-h1 in this run)
    torch: Schedule1F1B, ScheduleInterleavedZeroBubble (one stage per rank, torch's ZB-H1), ScheduleZBVZeroBubble,
           ScheduleDualPipeV

Prints per row: median step ms (per step the max over ranks), ours / torch's same schedule, ours / torch's
Schedule1F1B (each followed by ``[q1-q3]``, the middle half of the per-round ratios: a ratio whose interval
straddles 1 is not decided by the run; ``--block 1`` makes each round one pair of adjacent steps, the
measurement least moved by load that drifts, e.g. ``--models narrow --rounds 40 --block 1``), CPU ms per step (user + system, ``resource.getrusage``: unlike the step time it leaves out waiting,
for messages or for a core, so it is the least load-dependent cost; max over ranks, median) and minor page faults
per step (``resource.getrusage``, max over ranks, mean over steps) of each side,
and for ours the measured bubble (``Pipeline.gather_timeline()`` after each block, median) next to the simulated
bubble of the same program (``pipesched.simulate`` of ``pipe.program``) under a :class:`pipesched.CostModel` of
the F / B / I / W seconds per stage and the message time measured in that block's timeline. The load average
(``os.getloadavg``) before and after is printed with the table: on a shared machine read the ratios, not the ms.

    python benchmarks/bench_zero_bubble.py [--rounds 4] [--block 5] [--warmup 5] [--models narrow,wide] [--m 8,4]
                                           [--wide-width 2048] [--wide-rows 64] [--profile]

(also ``python benchmarks/bench_runtime.py --zero-bubble [same options]``). A quick run: ``--rounds 1 --block 2
--warmup 1``. ``--profile``: cProfile of ours' zb-h1 and zbv steps on the last rank, the top functions.
``--fusion``: ours' fused rows (``gradient_accumulation_fusion=True``, "+fusion"); ``--pairs``: those again with
``pair_weight_grads=True`` too ("+fusion +pairs": two microbatches' weight-gradient GEMMs of a stage as one).
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

LAYERS, P = 8, 2
MODELS = {"narrow": (512, 16), "wide": (2048, 64)}  # (width, rows per microbatch)
# (row label, our schedule, virtual stages, torch's class of the same schedule or None)
OURS = (("1f1b", "1f1b", 1, "Schedule1F1B"), ("zb-h1", "zb-h1", 1, "ScheduleInterleavedZeroBubble"),
        ("zb-h2", "zb-h2", 1, None), ("zbv", "zbv", 2, "ScheduleZBVZeroBubble"),
        ("dualpipev", "dualpipev", 2, "ScheduleDualPipeV"), ("zb-auto", "zb-auto", 1, None))
THEIRS = ("Schedule1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")
V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
AT_1F1B_MEMORY = ("zb-h1", "zbv", "zb-auto")  # peak in-flight activations no more than 1F1B's
FUSED = ("1f1b", "zb-h1", "zbv", "dualpipev", "zb-auto")  # --fusion: these again with gradient_accumulation_fusion=True
PAIRS = "pairs"  # a row's fusion field for --pairs: gradient_accumulation_fusion=True and pair_weight_grads=True


def rows(fusion: bool, only=None, pairs: bool = False) -> tuple:
    """(row label, our schedule, virtual stages, torch's class or None, fusion) of ours, fusion ``False``,
    ``True`` (gradient_accumulation_fusion) or :data:`PAIRS` (and pair_weight_grads); ``only``: the schedules to
    keep (``None``: all), 1f1b and zb-h1 always (the ceiling and zb-auto's costs); ``pairs``: a "+fusion +pairs"
    row after each fused schedule's (its "+fusion" row with ``fusion``)."""
    keep = [row for row in OURS if only is None or row[0] in {*only, "1f1b", "zb-h1"}]
    plain = tuple((*row, False) for row in keep)
    fused = tuple(row for label, name, v, theirs in keep if label in FUSED
                  for row in ((f"{label} +fusion", name, v, theirs, True),) * fusion
                  + ((f"{label} +fusion +pairs", name, v, theirs, PAIRS),) * pairs)
    return plain + fused


def torch_sides(ours_rows) -> tuple:
    """torch's classes that ``ours_rows`` are compared with, Schedule1F1B first (always)."""
    return tuple(name for name in THEIRS if name == "Schedule1F1B" or any(row[3] == name for row in ours_rows))


# ---- the model, the data, the two sides -------------------------------------------------------------------------

def model(width: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(LAYERS)])


def data(width: int, rows: int, m: int):
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows * m, width, generator=g), torch.randn(rows * m, width, generator=g)


def ours(cfg, schedule: str, v: int, costs=None, fuse=False):
    """(step, zero_grad, pipeline) of our Pipeline on this rank; cfg = (width, rows, m); ``fuse``: ``False``,
    ``True`` (gradient_accumulation_fusion) or :data:`PAIRS` (and pair_weight_grads)."""
    from pipesched.runtime import Pipeline

    width, rows, m = cfg
    pipe = Pipeline(model(width), schedule=schedule, num_microbatches=m, loss_fn=F.mse_loss, virtual_stages=v,
                    split_backward=False, costs=costs, gradient_accumulation_fusion=bool(fuse),
                    pair_weight_grads=fuse == PAIRS)
    x, y = data(width, rows, m)

    def zero():
        for p in pipe.parameters():
            p.grad = None

    return (lambda: pipe.step(x, target=y)), zero, pipe


def theirs(rank: int, cfg, name: str):
    """(step, zero_grad, None) of torch's ``name`` on the same split: stage s holds layers
    [s * 8 / S, (s + 1) * 8 / S); rank r holds stage r (one per rank) or stages r and 2p-1-r (V)."""
    from torch.distributed import pipelining

    width, rows, m = cfg
    blocks = list(model(width))
    v_shaped = name in V_SHAPED
    num_stages = 2 * P if v_shaped else P
    per = LAYERS // num_stages
    ids = (rank, 2 * P - 1 - rank) if v_shaped else (rank,)
    stages = [pipelining.PipelineStage(nn.Sequential(*blocks[s * per:(s + 1) * per]), s, num_stages,
                                       torch.device("cpu")) for s in ids]
    multi = name != "Schedule1F1B"
    sched = getattr(pipelining, name)(stages if multi else stages[0], n_microbatches=m, loss_fn=F.mse_loss)
    x, y = data(width, rows, m)
    first, last = 0 in ids, num_stages - 1 in ids

    def step():
        kwargs = {"target": y, "losses": []} if last else {}
        if first:
            sched.step(x, **kwargs)
        else:
            sched.step(**kwargs)

    def zero():
        for st in stages:
            for p in st.submod.parameters():
                p.grad = None

    return step, zero, None


# ---- measuring -----------------------------------------------------------------------------------------------

def _usage() -> tuple[int, float]:
    """(minor page faults, CPU seconds, user + system) of this process so far."""
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_minflt, u.ru_utime + u.ru_stime


def timed(step, zero, steps: int) -> list:
    """[(seconds, minor page faults, CPU seconds)] of ``steps`` steps; gradients set to None between them (not
    timed). CPU seconds do not count time spent waiting (for a message, or for a core on a loaded machine)."""
    out = []
    for _ in range(steps):
        f0, c0 = _usage()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        f1, c1 = _usage()
        out.append((t1 - t0, f1 - f0, c1 - c0))
        zero()
    return out


def measured_costs(timeline, num_stages: int):
    """A :class:`pipesched.CostModel` of a measured timeline: per stage the median F / B / I / W seconds (a kind
    that did not run: the others' estimate), as ``send_overhead`` the median time inside a SEND call (the sending
    rank's own time: LogP's ``o``), and as ``latency`` the median message time less that overhead: the message time
    runs from the start of a SEND to the end of the wait for its data, over the messages whose receiver was already
    waiting."""
    from pipesched import CostModel
    from pipesched.ir import Op
    from pipesched.viz.analysis import send_seconds

    per: dict = {}
    for e in timeline.events:
        if e.instr.op in (Op.F, Op.B, Op.I, Op.W):
            per.setdefault((e.instr.op, e.instr.stage), []).append(e.duration)
    med = {k: statistics.median(v) for k, v in per.items()}
    fwd = [med.get((Op.F, s), 0.0) for s in range(num_stages)]
    inp = [med.get((Op.I, s), med.get((Op.B, s), 2 * fwd[s]) / 2) for s in range(num_stages)]
    wgt = [med.get((Op.W, s), med.get((Op.B, s), 2 * fwd[s]) / 2) for s in range(num_stages)]
    bwd = [med.get((Op.B, s), inp[s] + wgt[s]) for s in range(num_stages)]
    sends = send_seconds(timeline)
    overhead = statistics.median(sends) if sends else 0.0
    return CostModel(forward=fwd, backward=bwd, input_grad=inp, weight_grad=wgt, send_overhead=overhead,
                     latency=max(0.0, message_time(timeline) - overhead))


def message_time(timeline) -> float:
    """Median seconds from a SEND's start to the end of its receiver's wait, over the messages whose receiver was
    already waiting when the SEND started (the instruction before the consumer ended before it); 0 if none.
    (A consumer's measured start is moved past its wait, so the wait began where the rank's previous instruction
    ended; a previous RECV's end is moved too, its start is used.)"""
    from pipesched.ir import Op

    sends, arrivals, began = {}, {}, {}
    for rank in range(timeline.num_ranks):
        events = sorted((e for e in timeline.events if e.rank == rank), key=lambda e: e.start)
        for before, e in zip([None] + events, events):
            i = e.instr
            if i.op in (Op.SEND_F, Op.SEND_B):
                sends[(i.op == Op.SEND_F, i.stage + (1 if i.op == Op.SEND_F else -1), i.microbatch)] = e.start
            elif i.op in (Op.RECV_F, Op.RECV_B):
                arrivals[(i.op == Op.RECV_F, i.stage, i.microbatch)] = e.end
            elif i.op in (Op.F, Op.B, Op.I) and before is not None:
                recv = before.instr.op in (Op.RECV_F, Op.RECV_B)
                began[(i.op == Op.F, i.stage, i.microbatch)] = before.start if recv else before.end
    times = [arrivals[k] - start for k, start in sends.items()
             if k in arrivals and k in began and began[k] <= start]
    return statistics.median(times) if times else 0.0


def bubbles(pipe) -> tuple[float, float, float, object]:
    """(measured bubble, simulated bubble, share of the ranks' time inside SEND calls, measured costs) of
    ``pipe``'s last step (collective). The measured bubble counts time in SEND calls as idle, and so does the
    simulator's, whose SEND takes its rank the measured send overhead."""
    from pipesched import simulate
    from pipesched.ir import Op

    tl = pipe.gather_timeline()
    costs = measured_costs(tl, pipe.program.num_stages)
    sending = sum(e.duration for e in tl.events if e.instr.op in (Op.SEND_F, Op.SEND_B))
    share = sending / (tl.num_ranks * tl.makespan) if tl.makespan > 0 else 0.0
    return tl.bubble_fraction, simulate(pipe.program, costs).bubble_fraction, share, costs


def _profile(step, zero, steps: int, label: str) -> None:
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    timed(step, zero, steps)
    prof.disable()
    print(f"\n---- cProfile: ours {label}, last rank, {steps} steps ----")
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)


def _shared(value, rank: int):
    """``value`` of rank 0 on every rank."""
    import torch.distributed as dist

    box = [value if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def worker(rank: int, cfgs, rounds: int, block: int, warmup: int, profile: bool, fusion: bool = False, only=None,
           pairs: bool = False):
    """Per config: {side: {"steps": [(s, faults, CPU s)], "bubbles": [(measured, simulated, in SEND calls)]},
    "zb-auto costs": CostModel}; side = ("ours", label) or ("torch", class name)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    out, mine = [], rows(fusion, only, pairs)
    for cfg in cfgs:
        sides = {("ours", label): ours(cfg, name, v, fuse=fuse)
                 for label, name, v, _, fuse in mine if name != "zb-auto"}
        sides.update({("torch", name): theirs(rank, cfg, name) for name in torch_sides(mine)})
        for step, zero, _ in sides.values():
            timed(step, zero, max(1, warmup))
        costs = _shared(bubbles(sides["ours", "zb-h1"][2])[3], rank)  # zb-auto is built for zb-h1's costs
        for label, name, _, _, fuse in mine:
            if name == "zb-auto":
                sides["ours", label] = ours(cfg, "zb-auto", 1, costs, fuse)
                timed(*sides["ours", label][:2], max(1, warmup))
        got = {key: {"steps": [], "bubbles": []} for key in sides}
        order = [("ours", label) for label, *_ in mine] + [("torch", name) for name in torch_sides(mine)]
        for _ in range(rounds):
            for key in order:  # ours and torch's alternate: 1f1b, zb-h1, ..., then torch's four
                step, zero, pipe = sides[key]
                dist.barrier()
                got[key]["steps"] += timed(step, zero, block)
                if pipe is not None:
                    *measured, costs_now = bubbles(pipe)
                    got[key]["bubbles"].append(tuple(measured))
                    got[key].setdefault("costs", []).append(costs_now)
        if profile and rank == P - 1:
            for label in [lb for lb in ("zb-h1", "zbv") if ("ours", lb) in sides]:
                _profile(*sides["ours", label][:2], rounds * block, f"{label} {cfg}")
        elif profile:
            for label in [lb for lb in ("zb-h1", "zbv") if ("ours", lb) in sides]:
                timed(*sides["ours", label][:2], rounds * block)
        for key, (_, _, pipe) in sides.items():
            if pipe is not None:
                pipe.close()
        got["zb-auto costs"], got["m"] = costs, cfg[2]
        out.append(got)
    return out


# ---- the table ----------------------------------------------------------------------------------------------

def summarize(results, key) -> tuple[float, float, float]:
    """(median step seconds, mean minor faults per step, median CPU seconds per step) of side ``key``; per step
    the max over ranks of each."""
    per_rank = [r[key]["steps"] for r in results]
    per_step = [[max(s[i][k] for s in per_rank) for i in range(len(per_rank[0]))] for k in range(3)]
    return statistics.median(per_step[0]), statistics.fmean(per_step[1]), statistics.median(per_step[2])


def round_ratios(results, ours_key, theirs_key, block: int) -> list[float]:
    """Per round, the median step of ``ours_key`` over that of ``theirs_key`` in the same round (the blocks ran
    back to back, so load that drifts between rounds cancels; with ``--block 1`` each ratio is one pair of
    adjacent steps)."""
    def rounds(key):
        per_rank = [r[key]["steps"] for r in results]
        steps = [max(s[i][0] for s in per_rank) for i in range(len(per_rank[0]))]
        return [statistics.median(steps[k:k + block]) for k in range(0, len(steps), block)]
    return [a / b for a, b in zip(rounds(ours_key), rounds(theirs_key))]


def spread(ratios: list[float]) -> str:
    """The middle half of the per-round ratios, ``[q1-q3]`` (one round: ``[-]``)."""
    if len(ratios) < 2:
        return "[-]"
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return f"[{q1:.2f}-{q3:.2f}]"


def table(results, label: str, block: int = 1, fusion: bool = False, only=None, pairs: bool = False) -> list[str]:
    """Rows of the markdown table of one config (results: one dict per rank); after each ratio, the middle half
    of the per-round ratios (:func:`round_ratios`)."""
    lines = [f"\n{label}",
             "| schedule (torch's same) | ours ms | torch ms | ours/torch | ours/torch 1F1B | CPU ms ours / torch | "
             "faults/step ours / torch | bubble measured / simulated | in SEND calls |",
             "|---|---|---|---|---|---|---|---|---|"]
    ref = summarize(results, ("torch", "Schedule1F1B"))[0]
    best = fused_best = paired_best = None
    for row, _, _, torch_name, fuse in rows(fusion, only, pairs):
        t, f, c = summarize(results, ("ours", row))
        bub = results[0]["ours", row]["bubbles"]
        measured, simulated, sending = (statistics.median(b[k] for b in bub) for k in range(3))
        tt, ff, cc = summarize(results, ("torch", torch_name)) if torch_name else (None, None, None)
        theirs_ms, ratio = (f"{tt * 1e3:.1f}", f"{t / tt:.2f}") if tt else ("-", "-")
        if tt:
            ratio += " " + spread(round_ratios(results, ("ours", row), ("torch", torch_name), block))
        to_1f1b = f"{t / ref:.2f} " + spread(round_ratios(results, ("ours", row), ("torch", "Schedule1F1B"), block))
        lines.append(f"| {row} ({torch_name or '-'}) | {t * 1e3:.1f} | {theirs_ms} | {ratio} | {to_1f1b} | "
                     f"{c * 1e3:.1f} / {'-' if cc is None else f'{cc * 1e3:.1f}'} | "
                     f"{f:.0f} / {'-' if ff is None else f'{ff:.0f}'} | {measured:.3f} / {simulated:.3f} | {sending:.3f} |")
        if row in AT_1F1B_MEMORY and (best is None or t < best[1]):
            best = (row, t)
        if fuse is True and row.split()[0] in AT_1F1B_MEMORY and (fused_best is None or t < fused_best[1]):
            fused_best = (row, t)
        if fuse == PAIRS and row.split()[0] in AT_1F1B_MEMORY and (paired_best is None or t < paired_best[1]):
            paired_best = (row, t)
    lines.append(f"best at 1F1B's memory: {best[0]}, {best[1] / ref:.2f}x torch's Schedule1F1B; zb-auto built for "
                 f"{results[0]['zb-auto costs'].describe()}")
    if fused_best:
        lines.append(f"with gradient_accumulation_fusion (not bitwise): {fused_best[0]}, "
                     f"{fused_best[1] / ref:.2f}x torch's Schedule1F1B")
    if paired_best:
        lines.append(f"with gradient_accumulation_fusion and pair_weight_grads (not bitwise): {paired_best[0]}, "
                     f"{paired_best[1] / ref:.2f}x torch's Schedule1F1B")
    lines.append(ceiling(results[0]))
    return lines


def ceiling(result) -> str:
    """What the split can gain at all here: the simulated makespan of zb-h1 and of zb-auto over 1F1B's, each
    program under one round's costs (F, B and messages of ours 1f1b's block, I and W of zb-h1's in the same round),
    the median over rounds: the ratio "best at 1F1B's memory / torch's Schedule1F1B" reaches it only if our runtime
    is as fast as torch's."""
    import dataclasses

    from pipesched import compile_program, simulate

    m, ratios = result["m"], {"zb-h1": [], "zb-auto": []}
    for fused, split in zip(result["ours", "1f1b"]["costs"], result["ours", "zb-h1"]["costs"]):
        costs = dataclasses.replace(fused, input_grad=split.input_grad, weight_grad=split.weight_grad)
        base = simulate(compile_program("1f1b", P, m), costs).makespan
        for name, found in ratios.items():
            program = compile_program(name, P, m, costs=costs) if name == "zb-auto" else compile_program(name, P, m)
            found.append(simulate(program, costs).makespan / base)
    return ("simulated under each round's costs (F, B of 1f1b; I, W of zb-h1), median over rounds: "
            + ", ".join(f"{name} {statistics.median(r):.3f}x 1f1b" for name, r in ratios.items())
            + " (the most the split can gain here)")


def main(argv=None) -> None:
    from pipesched.runtime import launch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    run(parser.parse_args(argv), launch)


def add_arguments(parser) -> None:
    parser.add_argument("--rounds", type=int, default=4, help="alternations of the sides")
    parser.add_argument("--block", type=int, default=5, help="steps per block")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per side first")
    parser.add_argument("--models", default="narrow,wide", help="comma-separated: narrow, wide")
    parser.add_argument("--m", default="8,4", help="comma-separated microbatch counts")
    parser.add_argument("--wide-width", type=int, default=MODELS["wide"][0])
    parser.add_argument("--wide-rows", type=int, default=MODELS["wide"][1], help="rows per microbatch")
    parser.add_argument("--profile", action="store_true", help="cProfile ours' zb-h1 and zbv on the last rank")
    parser.add_argument("--schedules", default=None,
                        help="comma-separated: only these of ours (and torch's same); 1f1b and zb-h1 always run")
    parser.add_argument("--fusion", action="store_true",
                        help="also ours' " + ", ".join(FUSED) + " with gradient_accumulation_fusion=True")
    parser.add_argument("--pairs", action="store_true",
                        help="also ours' " + ", ".join(FUSED) + " with gradient_accumulation_fusion=True and "
                             "pair_weight_grads=True (rows '+fusion +pairs')")


def run(args, launch) -> None:
    sizes = dict(MODELS, wide=(args.wide_width, args.wide_rows))
    names = [n for n in args.models.split(",") if n]
    if any(n not in sizes for n in names):
        raise SystemExit(f"--models: {args.models!r}; valid: comma-separated names from {sorted(sizes)}")
    cfgs = [(*sizes[n], int(m)) for n in names for m in args.m.split(",")]
    load0, start = os.getloadavg(), time.perf_counter()
    only = None if args.schedules is None else [s for s in args.schedules.split(",") if s]
    if only is not None and any(s not in {row[0] for row in OURS} for s in only):
        raise SystemExit(f"--schedules: {args.schedules!r}; valid: comma-separated names from "
                         f"{[row[0] for row in OURS]}")
    results = launch(worker, P, cfgs, args.rounds, args.block, args.warmup, args.profile, args.fusion, only,
                     args.pairs, timeout=7200)
    load1 = os.getloadavg()
    print(f"\np={P} gloo, 1 thread/process, {LAYERS} x (Linear(w, w) + Tanh), MSE; medians of {args.rounds} x "
          f"{args.block} steps per side in alternating blocks; {time.perf_counter() - start:.0f} s; load average "
          f"(1/5/15 min) {load0[0]:.1f}/{load0[1]:.1f}/{load0[2]:.1f} before, "
          f"{load1[0]:.1f}/{load1[1]:.1f}/{load1[2]:.1f} after ({os.cpu_count()} cores)")
    for k, (width, rows, m) in enumerate(cfgs):
        label = f"w={width}, {rows} rows per microbatch, m={m}"
        print("\n".join(table([r[k] for r in results], label, args.block, args.fusion, only,
                               args.pairs)))


if __name__ == "__main__":
    main()
