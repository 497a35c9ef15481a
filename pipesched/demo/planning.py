"""``pipesched demo --plan``: profile the demo's model in this process, plan its pipeline for the demo's ranks
and memory, print the table, train with the winner; after the run, the plan's predicted step time and activation
memory next to the measured ones (and a picture of both timelines)."""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
from dataclasses import replace
from pathlib import Path

import torch

from ..plan_cli import format_table
from ..planner import format_bytes, plan
from .model import lm_loss, make_gpt


def available_memory() -> float:
    """Bytes of memory available now (``MemAvailable`` of /proc/meminfo; else free pages x page size)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def plan_demo(args: argparse.Namespace, autocast) -> None:
    """Profile the demo model (a microbatch of ``--batch x --dp / ranks`` sequences and its halvings down to 1,
    for the layers' fixed seconds; one thread, as a rank runs it), plan for ``--ranks x --dp`` ranks, ``--memory``
    per rank and a global batch of ``--batch x --dp``,
    print the ranked table, and set ``args`` to the winner (``args.candidate``, ranks, dp, schedule, microbatches,
    virtual stages, batch per replica)."""
    from ..runtime import profile_layers

    world, global_batch = args.ranks * args.dp, args.batch * args.dp
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    model = make_gpt(256, args.context, args.width, args.depth, args.heads, dropout=0.0, tied=not args.untied)
    size = max(1, global_batch // world)  # the largest microbatch with every rank busy (dp = ranks, m = 1)
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randint(0, 256, (size, args.context), generator=g)
    y = torch.randint(0, 256, (size, args.context), generator=g)
    context = torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext()
    with context:
        profile = profile_layers(model, x, target=y, loss_fn=lm_loss, sizes=profile_sizes(size))
    if world >= 2:  # messages between two local ranks: latency, bandwidth and the send calls' overhead
        profile = replace(profile, **measure_link()._asdict())
    memory = args.memory if args.memory is not None else available_memory() / world
    result = plan(profile, world, memory, global_batch, top=args.plan_top)
    print(f"plan for {world} ranks, {format_bytes(memory)} per rank, global batch {global_batch} (profiled on "
          f"{profile.device}, microbatches of {size} and {list(profile_sizes(size))} sequences):\n{format_table(result)}", flush=True)
    best = result.best
    args.candidate = best
    args.ranks, args.dp, args.batch = best.pp, best.dp, global_batch // best.dp
    args.schedule, args.microbatches, args.virtual_stages = best.schedule, best.num_microbatches, best.virtual_stages
    args.recompute = any(best.recompute)


def profile_sizes(size: int) -> tuple[int, ...]:
    """The smaller microbatch sizes to profile besides ``size`` (its halvings down to 1): the layers' fixed
    seconds are fitted over the sizes a plan scales to."""
    return tuple(sorted({max(1, size >> i) for i in range(1, size.bit_length())} - {size}))


def measure_link():
    """Latency (s), bandwidth (bytes/s) and send overhead (s) between two local ranks (gloo): the
    :class:`~pipesched.runtime.link_profile.Link` of :func:`pipesched.runtime.profile_link` on two processes started
    for it."""
    from ..runtime import launch

    return launch(_link, 2, timeout=120)[0]


def _link(rank: int):
    from ..runtime import profile_link

    return profile_link()  # launch's default group: gloo between the two ranks


def step_seconds(times: list[float]) -> float:
    """The median of the measured step times after the first fifth (warm-up), seconds."""
    kept = times[len(times) // 5:] or times
    return statistics.median(kept)


def report_honesty(candidate, measured_timeline, step_time: float, peaks, out: Path) -> list[Path]:
    """Print the plan's predicted step time and peak activation bytes next to the measured ones, and draw the plan's
    simulated timeline beside the measured one (``out/plan_vs_measured.png``). Rank 0 only."""
    from ..viz import plot_comparison

    predicted_acts = candidate.timeline.peak_activation_bytes or (0.0,) * candidate.pp
    ratio = step_time / candidate.step_time if candidate.step_time else float("nan")
    print(f"plan vs measured: step {candidate.step_time:.4f} s predicted, {step_time:.4f} s measured "
          f"(measured / predicted = {ratio:.2f})", flush=True)
    for rank, (p, m) in enumerate(zip(predicted_acts, peaks)):
        print(f"  rank {rank}: peak activations {format_bytes(p)} predicted, "
              f"{'n/a' if m is None else format_bytes(m)} measured", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "plan_vs_measured.png"
    figure = plot_comparison(candidate.timeline, measured_timeline,
                             title=f"plan ({candidate.describe()}): predicted {candidate.step_time * 1e3:.1f} ms, "
                                   f"measured {step_time * 1e3:.1f} ms per step (the whole step() call; the "
                                   f"panels span its first to its last instruction)")
    figure.savefig(path, dpi=110, bbox_inches="tight")
    return [path]
