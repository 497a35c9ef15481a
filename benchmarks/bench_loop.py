"""Training-loop cost benchmark: what the tied-gradient sum (``TIE_REDUCE``) and the global gradient clipping
(``Pipeline.clip_grad_norm_``) add to a training step of the demo GPT on 4 pipeline ranks.

Model: ``pipesched.demo.model.make_gpt(256, context, width, depth, 4, dropout=0.0)`` (the demo's defaults: width 128,
context 128, 4 blocks, embedding tied to the LM head), 1F1B on 4 ranks (gloo, 127.0.0.1, one thread each), batch 16
in 4 microbatches, balance by parameters (the demo's), autocast as the demo's ``--autocast auto``, AdamW. The same
model untied (``tied=False``: the head gets its own weight, of the same shape, so the same compute) runs as the
reference, cut into the same stages, and the tied model a second time with the default ``pipe.anticipate_clip = False`` (every
``clip_grad_norm_`` through the all-gather, as before anticipation: "collective"); the three pipelines take turns in
blocks of ``--block`` steps (the order rotates), after ``--warmup`` steps each that are not counted.

Each loop iteration: barrier, ``pipe.step()``, barrier, ``pipe.clip_grad_norm_(1.0)``, AdamW step, zero_grad. The
barriers keep the ranks' skew out of both times: a step's time is the longest of the 4 ranks' ``step()`` wall times
(seconds, ``time.perf_counter``), a clip's the longest of their ``clip_grad_norm_`` wall times. Reported, as medians
over the measured steps, in ms:

- step: the tied pipeline's step time (and the untied one's);
- tie (timeline): on each rank holding the tie, its ``TIE_REDUCE`` event in the measured timeline (flatten the
  gradient, start the all-reduce) plus the step end's wait for the sum and the copy back (``TieReducer.finish``, not
  in the timeline: timed here by wrapping it), on the rank of stage 0, whose ``TIE_REDUCE`` comes last;
- tie (A/B): the median over i of (i-th tied step - i-th untied step), two steps from the same rotation of blocks
  (end to end, noisier: the quartiles of those differences are printed too);
- clip: ``clip_grad_norm_(1.0)`` wall time (tied pipeline; after the first step it combines the norm parts the step
  sent at its end, ``runtime/norm_parts.py``, without a collective); and the same for the "collective" pipeline;
- parts: what sending the norm parts at the step's end adds to the step: per step, the longest rank's ``step()``
  minus the longest of the ranks' ``step()`` less their own ``NormParts.exchange`` time (compute the part, send
  it, wait for the others' parts); the end of the step without the exchange, estimated in the same step;
- clip cost: clip + parts (what anticipated clipping costs the loop); collective A/B: the median over i of
  ((step + clip) of the tied pipeline - (step + clip) of the collective one), from the same rotation of blocks
  (end to end, noisy);
- bare all-reduce: a ``dist.all_reduce`` of 6 float64 over the 4 ranks after a barrier, once per iteration: the
  latency of a collective such as the one clipping made before anticipation, without its norm and scaling.

    python benchmarks/bench_loop.py [--steps 40] [--block 5] [--warmup 3] [--autocast auto|bf16|fp32]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from pipesched.demo.model import lm_loss, make_gpt
from pipesched.demo.train import autocast_dtype
from pipesched.ir import Op
from pipesched.runtime import Pipeline, launch

RANKS, VOCAB, HEADS, MAX_NORM = 4, 256, 4, 1.0


def make_pipe(args, tied: bool, balance):
    """A 1F1B pipeline of the demo GPT (the same weights for the same seed), with its AdamW."""
    torch.manual_seed(0)
    model = make_gpt(VOCAB, args.context, args.width, args.depth, HEADS, dropout=0.0, tied=tied)
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=args.microbatches, loss_fn=lm_loss,
                    balance=balance, autocast=autocast_dtype(args.autocast))
    return pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-4)


def timed_method(owner, name: str) -> list:
    """Wrap ``owner.name`` (a method called once per step) so that each call appends its seconds to the returned
    list."""
    times: list = []
    method = getattr(owner, name)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        result = method(*args, **kwargs)
        times.append(time.perf_counter() - t0)
        return result

    setattr(owner, name, timed)
    return times


def probe_tie_wait(pipe) -> list:
    """Time the step end's wait for the tied-gradient sum (``TieReducer.finish``; not an instruction, so not in
    the timeline): the list each call appends its seconds to (empty forever on a rank without a tie)."""
    ties = pipe._executor.ties  # benchmark probe: the executor's TieReducer, None on a rank without a tie
    return [] if ties is None else timed_method(ties, "finish")


def probe_parts(pipe) -> list:
    """Time each step's exchange of the norm parts (``NormParts.exchange``, at the step's end, not an instruction):
    the list each call appends its seconds to."""
    return timed_method(pipe._norm_parts, "exchange")  # benchmark probe: runtime/norm_parts.py


def timed(fn) -> float:
    """Seconds ``fn()`` took on this rank, after a barrier."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def tie_start(pipe) -> float:
    """Seconds of this rank's ``TIE_REDUCE`` instructions in the last step's measured timeline (0 without)."""
    return sum(e.end - e.start for e in pipe.timeline().events if e.instr.op == Op.TIE_REDUCE)


def one_step(pipe, opt, batch, record, waits, exchanges) -> None:
    """One loop iteration; appends (step s, clip s, TIE_REDUCE s, tie wait s, bare all-reduce s, norm-part exchange
    s, 1 if the clip used the step's parts) of this rank to ``record``. The bare all-reduce (6 float64 over the 4
    ranks) is a collective's latency alone, without the norm and the scaling."""
    x, y = batch
    before, exchanged, used = len(waits), len(exchanges), pipe._norm_parts.used
    step = timed(lambda: pipe.step(x, target=y))
    clip = timed(lambda: pipe.clip_grad_norm_(MAX_NORM))
    opt.step()
    opt.zero_grad()
    bare = timed(lambda: dist.all_reduce(torch.zeros(6, dtype=torch.float64)))
    if record is not None:
        record.append((step, clip, tie_start(pipe), sum(waits[before:]), bare, sum(exchanges[exchanged:]),
                       pipe._norm_parts.used - used))


def batches(args):
    g = torch.Generator().manual_seed(1)
    while True:
        ids = torch.randint(0, VOCAB, (args.batch, args.context + 1), generator=g)  # (B, T+1) int64
        yield ids[:, :-1], ids[:, 1:]


def ranks(rank: int, args) -> dict:
    torch.set_num_threads(1)
    tied, tied_opt = make_pipe(args, True, "params")
    untied, untied_opt = make_pipe(args, False, list(tied.balance))  # the same stages
    collective, collective_opt = make_pipe(args, True, list(tied.balance))
    tied.anticipate_clip = untied.anticipate_clip = True  # opt in (`collective` keeps the default: the all-gather)
    if not tied.ties or untied.ties or list(untied.balance) != list(tied.balance):
        raise RuntimeError(f"expected a tie across ranks in the tied model only, the same stages in both: ties "
                           f"{tied.ties} / {untied.ties}, balance {tied.balance} / {untied.balance}")
    variants = {"tied": (tied, tied_opt, probe_tie_wait(tied), probe_parts(tied)),
                "untied": (untied, untied_opt, [], probe_parts(untied)),
                "collective": (collective, collective_opt, [], probe_parts(collective))}
    data, records = batches(args), {name: [] for name in variants}
    for name, (pipe, opt, waits, exchanges) in variants.items():
        for _ in range(args.warmup):
            one_step(pipe, opt, next(data), None, waits, exchanges)
    blocks = -(-args.steps // args.block)
    for b in range(blocks):
        order = list(variants)[b % 3:] + list(variants)[:b % 3]
        for name in order:
            pipe, opt, waits, exchanges = variants[name]
            for _ in range(min(args.block, args.steps - b * args.block)):
                one_step(pipe, opt, next(data), records[name], waits, exchanges)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    info = {"balance": list(tied.balance), "ties": [str(t) for t in tied.ties], "autocast": str(tied.autocast)}
    tied.close()
    untied.close()
    collective.close()
    return {"ranks": gathered, **info} if rank == 0 else None


def summarize(result: dict) -> dict:
    """Medians in ms from every rank's records (see the module docstring)."""
    per_rank = result["ranks"]  # [rank][variant] -> [(step, clip, tie start, tie wait, bare, exchange, used)]
    ms = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    out, longest = {}, {}
    for name in ("tied", "untied", "collective"):
        steps = list(zip(*(r[name] for r in per_rank)))  # per step: the 4 ranks' tuples
        longest[name] = [[max(t[i] for t in s) for s in steps] for i in range(7)]  # [field][step]
        # the step's end without the norm-part exchange: each rank's step less its exchange, the longest of them
        parts = [max(t[0] for t in s) - max(t[0] - t[5] for t in s) for s in steps]
        out[name] = {"step": ms(longest[name][0]), "clip": ms(longest[name][1]), "bare": ms(longest[name][4]),
                     "parts": ms(parts), "cost": ms([c + p for c, p in zip(longest[name][1], parts)]),
                     "used": min(longest[name][6]), "n": len(steps)}
    loop = {name: [s + c for s, c in zip(longest[name][0], longest[name][1])] for name in ("tied", "collective")}
    out["clip_ab"] = ms(sorted(a - b for a, b in zip(loop["tied"], loop["collective"])))
    # the i-th tied and the i-th untied step ran in the same pair of blocks: the median of their differences
    diffs = sorted(t - u for t, u in zip(longest["tied"][0], longest["untied"][0]))
    out["ab"] = ms(diffs)
    out["ab_iqr"] = (diffs[len(diffs) // 4] * 1e3, diffs[(3 * len(diffs)) // 4] * 1e3)
    tie_ranks = [k for k, r in enumerate(per_rank) if any(t[2] > 0 for t in r["tied"])]
    if not tie_ranks:
        raise RuntimeError("no rank ran a TIE_REDUCE in the tied pipeline's measured timelines")
    out["tie_parts"] = {k: (ms([t[2] for t in per_rank[k]["tied"]]), ms([t[3] for t in per_rank[k]["tied"]]))
                        for k in tie_ranks}
    first = min(tie_ranks)  # stage 0's rank: its TIE_REDUCE comes last in the step
    out["tie"] = ms([t[2] + t[3] for t in per_rank[first]["tied"]])
    out["tie_rank"] = first
    return out


def table(s: dict) -> str:
    t, u, c = s["tied"], s["untied"], s["collective"]
    pct = lambda v: f"{100 * v / t['step']:.1f}%"  # noqa: E731
    ab = s["ab"]
    rows = ["| step ms (tied) | step ms (untied) | tie ms (timeline) | tie % | tie ms (A/B) | tie % (A/B) "
            "| bare all-reduce ms | steps |",
            "|---|---|---|---|---|---|---|---|",
            f"| {t['step']:.1f} | {u['step']:.1f} | {s['tie']:.2f} | {pct(s['tie'])} | {ab:+.2f} | {pct(ab)} "
            f"| {t['bare']:.2f} | {t['n']} + {u['n']} + {c['n']} |",
            "",
            "| clipping | step ms | clip ms | parts ms | clip + parts ms | % of the step | (step + clip) A/B ms |",
            "|---|---|---|---|---|---|---|",
            f"| anticipated | {t['step']:.1f} | {t['clip']:.2f} | {t['parts']:.2f} | {t['cost']:.2f} "
            f"| {pct(t['cost'])} | {s['clip_ab']:+.2f} |",
            f"| collective | {c['step']:.1f} | {c['clip']:.2f} | - | {c['clip']:.2f} | {pct(c['clip'])} | 0 |"]
    if t["used"] != 1 or c["used"] != 0:
        rows.append(f"\nWARNING: not every measured clip of the tied pipeline used the anticipated parts "
                    f"({t['used']}), or the collective one did ({c['used']})")
    parts = ", ".join(f"rank {k}: TIE_REDUCE {a:.3f} ms + end wait {b:.3f} ms" for k, (a, b) in s["tie_parts"].items())
    lo, hi = s["ab_iqr"]
    return "\n".join(rows) + (f"\n\ntie parts (medians): {parts}; tied - untied step, paired: median {ab:+.2f} ms, "
                              f"quartiles {lo:+.2f} / {hi:+.2f} ms; untied clip {u['clip']:.2f} ms")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="measured steps per variant (default 40)")
    parser.add_argument("--block", type=int, default=5, help="steps per block; tied and untied alternate (default 5)")
    parser.add_argument("--warmup", type=int, default=3, help="uncounted steps per variant first (default 3)")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--autocast", choices=("auto", "bf16", "fp32"), default="auto")
    args = parser.parse_args(argv)
    for name in ("steps", "block", "width", "context", "depth", "batch", "microbatches"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    load = os.getloadavg()[0]
    result = launch(ranks, RANKS, args, timeout=1800)[0]
    print(f"demo GPT width {args.width}, context {args.context}, {args.depth} blocks, batch {args.batch}, "
          f"{args.microbatches} microbatches, 1f1b on {RANKS} ranks, balance {result['balance']}, "
          f"autocast {result['autocast']}, ties {result['ties']}; load average {load:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after, {os.cpu_count()} CPUs")
    print(table(summarize(result)))


if __name__ == "__main__":
    main()
