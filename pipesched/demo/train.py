"""The demo's training: each rank's loop (under torchrun, or spawned by ``pipesched demo``), the validation
loss before and after, a sample from the trained model, and the measured timeline next to the simulated one."""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..planner import PlanError
from ..runtime import Pipeline, PipelineError, latest_checkpoint, launch, load_checkpoint, save_checkpoint
from ..runtime.launch import RankDied
from .corpus import load_text
from .data import batch_at, batches
from .model import generate, lm_loss, make_gpt
from .options import options
from .planning import plan_demo, report_honesty, step_seconds


def main(argv=None, prog: str | None = None) -> None:
    """Entry point: under torchrun, train this rank; otherwise spawn ``--ranks x --dp`` local ranks."""
    args = options(argv, prog)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if args.plan:
            raise SystemExit("error: --plan profiles and plans before the ranks start: run it with pipesched demo "
                             "(not under torchrun)")
        train(int(os.environ["RANK"]), args)
        dist.destroy_process_group()
    else:
        if args.plan:  # profile and plan here, then start the winner's ranks (pipesched/demo/planning.py)
            try:
                plan_demo(args, autocast_dtype(args.autocast))
            except PlanError as exc:  # nothing fits --memory: exit 1, as `pipesched plan` does, naming the option
                print(f"error: {str(exc).replace('memory_per_rank=', '--memory=')}", file=sys.stderr, flush=True)
                raise SystemExit(1) from None
        try:
            launch(train, args.ranks * args.dp, args, timeout=24 * 3600.0)
        except (PipelineError, RankDied) as exc:  # a rank failed, was lost or killed: said without a traceback
            print(f"error: {exc}", file=sys.stderr, flush=True)
            if args.checkpoint_dir is not None:
                print(f"continue from the newest checkpoint in {args.checkpoint_dir} with the same command and "
                      f"--resume", file=sys.stderr, flush=True)
            raise SystemExit(1) from None


def train(rank: int, args: argparse.Namespace) -> None:
    """Rank ``rank``'s training loop; rank 0 prints the progress, the sample and the files it wrote."""
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    text = load_text(args.data, args.corpus_bytes)
    corpus = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()  # (N,)
    split = int(0.9 * len(corpus))
    model = make_gpt(256, args.context, args.width, args.depth, args.heads, dropout=0.0, tied=not args.untied)
    pipe = make_pipeline(model, args)
    pipe.anticipate_clip = True  # this loop clips right after step() and changes no gradient in between
    val_stream = batches(corpus[split:], args.batch, args.context, torch.Generator().manual_seed(args.seed + 7))
    val_data = [next(val_stream) for _ in range(8)]  # the same batches before and after training
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))
    first = resume(args, pipe, optimizer, schedule)
    report = rank == 0
    if first > args.steps:  # every rank returns here: no collective below is left unmatched
        if report:
            print(f"nothing to do: the checkpoint is at step {first - 1} and --steps is {args.steps} (raise --steps "
                  f"to train further)", flush=True)
        return
    start_val = evaluate(pipe, val_data)
    if report:
        print_start(args, pipe, model, len(text), first, start_val)
    step_times = train_steps(args, pipe, corpus, split, optimizer, schedule, first, report)
    finish(args, pipe, model, val_data, start_val, step_times, report)


def make_pipeline(model: nn.Sequential, args: argparse.Namespace) -> Pipeline:
    """The demo's pipeline: ``--plan``'s winner (``args.candidate``) if there is one, else the options'."""
    candidate = getattr(args, "candidate", None)  # --plan's winner
    if candidate is not None:
        return Pipeline.from_plan(model, candidate, loss_fn=lm_loss, timeout=args.timeout,
                                  autocast=autocast_dtype(args.autocast))
    return Pipeline(model, schedule=args.schedule, num_microbatches=args.microbatches, loss_fn=lm_loss,
                    virtual_stages=args.virtual_stages, dp_size=args.dp, recompute=args.recompute,
                    balance=args.balance, timeout=args.timeout, autocast=autocast_dtype(args.autocast))


def print_start(args: argparse.Namespace, pipe: Pipeline, model: nn.Sequential, text_bytes: int, first: int,
                start_val: float) -> None:
    """Rank 0's first line: the run's shape and the validation loss before the first step."""
    ranks = pipe.program.num_ranks
    print(f"{args.schedule}: {ranks} pipeline rank{'s' if ranks != 1 else ''} x {args.dp} dp, {args.microbatches} "
          f"microbatches, "
          f"{args.virtual_stages} virtual stage(s) per rank, {args.depth} blocks ({args.depth + 3} layers in "
          f"{pipe.program.num_stages} stages), {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters"
          f"{' (embedding tied to the head)' if pipe.ties else ''}, autocast {str(pipe.autocast).replace('torch.', '') if pipe.autocast else 'off'}, clip "
          f"{args.clip or 'off'}, {text_bytes / 1e3:,.0f} kB of text; validation loss at step {first - 1} "
          f"{start_val:.3f}", flush=True)


def train_steps(args: argparse.Namespace, pipe: Pipeline, corpus, split: int, optimizer, schedule, first: int,
                report: bool) -> list:
    """Steps ``first`` .. ``--steps`` on ``corpus[:split]`` (rank 0 prints every 10th, checkpoints as asked);
    returns each step's seconds in ``pipe.step``."""
    started, tokens, step_times = time.perf_counter(), 0, []
    for step in range(first, args.steps + 1):
        # every replica sees different data; all ranks of one pipeline see the same batches; seeded by the step
        x, y = batch_at(corpus[:split], args.batch, args.context, args.seed + 1000 * pipe.dp_rank + 10**6 * step)
        begun = time.perf_counter()
        loss = pipe.step(x, target=y)
        step_times.append(time.perf_counter() - begun)
        if args.clip:
            pipe.clip_grad_norm_(args.clip)  # the norm over every stage, not this rank's (collective)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        tokens += x.numel() * args.dp
        if step % 10 == 0 or step == args.steps:
            bubble = pipe.gather_timeline().bubble_fraction  # collective: every rank reports together
        if report and (step % 10 == 0 or step == args.steps):
            rate = tokens / (time.perf_counter() - started)
            print(f"step {step:>4}/{args.steps}  loss {loss.item():.6f}  {rate:,.0f} tokens/s  "
                  f"measured bubble {bubble:.2f}", flush=True)
        if args.checkpoint_dir and (step % args.checkpoint_every == 0 or step == args.steps):
            path = save_checkpoint(Path(args.checkpoint_dir) / f"step-{step:06d}", pipe, optimizer, step=step,
                                   extra={"lr_schedule": schedule.state_dict()})
            if report:
                print(f"saved {path}", flush=True)
    return step_times


def finish(args: argparse.Namespace, pipe: Pipeline, model: nn.Sequential, val_data: list, start_val: float,
           step_times: list, report: bool) -> None:
    """After the last step (collective): the validation loss, the timelines, the plan's prediction next to the
    run, and on rank 0 the losses, a sample and the files written."""
    candidate = getattr(args, "candidate", None)  # --plan's winner
    measured = pipe.gather_timeline()  # the last training step, every pipeline rank (collective)
    end_val = evaluate(pipe, val_data)
    paths = write_timelines(pipe, measured, Path(args.out))
    if candidate is not None:  # the plan's prediction next to the run (collective: every rank's peak)
        peaks = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, pipe.peak_activation_bytes)
        if report:
            paths += report_honesty(candidate, measured, step_seconds(step_times), peaks[:candidate.pp], Path(args.out))
    gather_model(model, pipe)
    if report:
        print(f"validation loss {start_val:.3f} -> {end_val:.3f} "
              f"({'fell' if end_val < start_val else 'DID NOT FALL'})")
        sample = generate(model, b"def ", 120, args.context, args.seed)
        print("sample:\n" + sample)
        for path in paths:
            print(f"wrote {path}")


def autocast_dtype(choice: str):
    """``--autocast``: ``torch.bfloat16`` or ``None``; ``auto``: bf16 where the CPU computes it natively."""
    if choice == "auto":
        return torch.bfloat16 if native_bf16() else None
    return torch.bfloat16 if choice == "bf16" else None


def native_bf16() -> bool:
    """Whether this CPU has bf16 instructions (``avx512_bf16`` or ``amx_bf16`` in /proc/cpuinfo; False if unknown):
    without them bf16 autocast is emulated, slower than float32."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resume(args: argparse.Namespace, pipe: Pipeline, optimizer, schedule) -> int:
    """``--resume``: load the newest complete checkpoint of ``--checkpoint-dir`` (model, AdamW, RNG, LR schedule);
    returns the first step to run (1 without one)."""
    path = latest_checkpoint(args.checkpoint_dir) if args.resume else None
    if path is None:
        if args.resume and dist.get_rank() == 0:
            print(f"no checkpoint in {args.checkpoint_dir}: starting from step 1", flush=True)
        return 1
    info = load_checkpoint(path, pipe, optimizer)
    schedule.load_state_dict(info.extra["lr_schedule"])
    if dist.get_rank() == 0:
        print(f"resumed from {path} (step {info.step})", flush=True)
    return info.step + 1


def evaluate(pipe: Pipeline, data: list) -> float:
    """Mean validation loss over the batches ``data``; every rank gets it (the last stage computes it)."""
    total = torch.zeros(2)  # (sum of losses, count)
    with torch.no_grad():
        for x, y in data:
            logits = pipe.forward(x)  # (B, T, V) on the last stage, None elsewhere
            if logits is not None:
                total += torch.tensor([lm_loss(logits, y).item(), 1.0])
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def gather_model(model: nn.Sequential, pipe: Pipeline) -> None:
    """Copy every rank's trained parameters into rank 0's full copy of the model (collective)."""
    mine = {id(p) for p in pipe.parameters()}
    local = {name: p.detach().clone() for name, p in model.named_parameters() if id(p) in mine}
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local, parts, dst=0)
    if dist.get_rank() == 0:
        state = {name: t for part in parts for name, t in part.items()}
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(state[name])


def write_timelines(pipe: Pipeline, measured, out: Path) -> list[Path]:
    """The measured timeline of a training step next to the simulated one, plus a Chrome trace (rank 0)."""
    if dist.get_rank() != 0:
        return []
    from ..viz import plot_comparison, save_chrome_trace, simulate_like

    out.mkdir(parents=True, exist_ok=True)
    simulated = simulate_like(pipe.program, measured)
    figure = plot_comparison(simulated, measured)
    paths = [out / "timeline.png", out / "trace.json", out / "measured.json"]
    figure.savefig(paths[0], dpi=110, bbox_inches="tight")
    save_chrome_trace(measured, paths[1])
    measured.save(paths[2])
    return paths
