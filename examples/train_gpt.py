"""Train a small GPT (byte level) across pipeline ranks with pipesched, then show where the bubble was.

The model is written the way a pipesched user has to write it: one ``nn.Sequential`` whose layers are
cut into stages — token+position embedding, N pre-norm transformer blocks, final norm + LM head.

Data needs no download: by default the source of the Python standard library on this machine
(found through ``sysconfig``), or any text file or folder given with ``--data``.

Run (4 pipeline ranks on this machine's CPUs, gloo):

    torchrun --nproc-per-node 4 examples/train_gpt.py --schedule 1f1b --steps 200
    pipesched demo                     # the same, spawning the ranks itself

World size = ranks x dp; see ``--help`` for the options.
"""
from __future__ import annotations

import argparse
import os
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipesched import ScheduleArgumentError, UnknownScheduleError, build, get_schedule
from pipesched.runtime import Pipeline, launch

# ----------------------------------------------------------------------------------------------- model


class Embedding(nn.Module):
    """Token ids (B, T) int64 -> token + position embedding (B, T, C)."""

    def __init__(self, vocab: int, context: int, width: int) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab, width)
        self.position = nn.Embedding(context, width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)  # (T,)
        return self.token(ids) + self.position(positions)  # (B, T, C)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x)); (B, T, C) -> (B, T, C)."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)  # 3 x (B, T, C)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        x = x + self.drop(self.proj(y))  # (B, T, C)
        return x + self.drop(self.mlp(self.ln2(x)))  # (B, T, C)


def make_gpt(vocab: int, context: int, width: int, depth: int, heads: int, dropout: float) -> nn.Sequential:
    """The whole model as one nn.Sequential: ids (B, T) int64 -> logits (B, T, vocab) float32."""
    return nn.Sequential(
        Embedding(vocab, context, width),
        *[Block(width, heads, dropout) for _ in range(depth)],
        nn.LayerNorm(width),
        nn.Linear(width, vocab),
    )


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross entropy: logits (B, T, V), targets (B, T) int64 -> scalar."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# ------------------------------------------------------------------------------------------------ data


def stdlib_sources() -> list[Path]:
    """The standard library's own .py files (no site-packages, no tests), in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3"}
    files = [p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts)]
    return sorted(files)


def load_text(data: str | None, limit_bytes: int) -> bytes:
    """Bytes of the corpus: ``data`` (a file or a folder of text files) or the stdlib's source."""
    if data is None:
        files = stdlib_sources()
    else:
        path = Path(data)
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    chunks, total = [], 0
    for file in files:
        raw = file.read_bytes()
        chunks.append(raw)
        total += len(raw)
        if total >= limit_bytes:
            break
    text = b"".join(chunks)[:limit_bytes]
    if len(text) < 10_000:
        raise SystemExit(f"the corpus has only {len(text)} bytes; give --data a larger text file or folder")
    return text


def batches(corpus: torch.Tensor, batch: int, context: int, generator: torch.Generator):
    """Endless random (inputs, targets) windows: two (B, T) int64 tensors, targets shifted by one."""
    while True:
        starts = torch.randint(len(corpus) - context - 1, (batch,), generator=generator)  # (B,)
        window = torch.stack([corpus[s : s + context + 1] for s in starts.tolist()])  # (B, T+1)
        yield window[:, :-1], window[:, 1:]


# ------------------------------------------------------------------------------------------- training


def options(argv=None, prog: str | None = None) -> argparse.Namespace:
    """Parse and check the command line; a bad option exits 2 with a message naming it and what is valid."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b or interleaved-1f1b (default 1f1b)")
    parser.add_argument("--ranks", type=int, default=4, help="pipeline ranks (pipesched demo only; torchrun: "
                        "world size / dp)")
    parser.add_argument("--microbatches", type=int, default=4, help="microbatches per step (default 4)")
    parser.add_argument("--virtual-stages", type=int, default=None,
                        help="stages per rank (default: the schedule's: 2 for interleaved-1f1b, else 1)")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas (default 1)")
    parser.add_argument("--recompute", action="store_true", help="recompute activations in backward")
    parser.add_argument("--balance", default="params",
                        help="'params' (default: equal parameters per stage), 'layers', or layer counts like 2,2,2,1")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    parser.add_argument("--context", type=int, default=128, help="bytes per sequence (default 128)")
    parser.add_argument("--width", type=int, default=128, help="model width (default 128)")
    parser.add_argument("--depth", type=int, default=None,
                        help="transformer blocks (default: 4, or one per stage when ranks x virtual stages is more); "
                             "the model has depth + 3 layers (embedding, blocks, final norm, head), and every stage "
                             "needs at least one")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", default=None, help="text file or folder (default: the stdlib's source)")
    parser.add_argument("--corpus-bytes", type=int, default=2_000_000, help="bytes of text to use (default 2e6)")
    parser.add_argument("--out", default="out/demo", help="folder for the timeline pictures and trace")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before a stuck rank gives up")
    args = parser.parse_args(argv)
    _check(parser, args)
    return args


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("ranks", "microbatches", "virtual_stages", "dp", "steps", "batch", "context", "width", "depth",
                 "heads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.width % args.heads:
        parser.error(f"--width {args.width} must be a multiple of --heads {args.heads} (each head gets width/heads)")
    if args.batch < args.microbatches:
        parser.error(f"--batch {args.batch} must be >= --microbatches {args.microbatches} (every microbatch needs "
                     f"at least one sequence)")
    if args.data is not None and not Path(args.data).exists():
        parser.error(f"--data {args.data!r}: no such file or folder")
    try:
        args.balance = _balance(args.balance)
    except ValueError:
        parser.error(f"--balance must be 'params', 'layers' or layer counts per stage like 2,2,2,1; got {args.balance!r}")
    _fit_model_to_stages(parser, args)


def _fit_model_to_stages(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Resolve ``--virtual-stages`` (None: the schedule's default, as ``Pipeline`` does) and ``--depth`` (None: 4
    blocks, or one per stage when there are more stages), and check the model has a layer for every stage.

    The pipeline ranks are ``--ranks``, or under torchrun ``WORLD_SIZE / --dp``.
    """
    try:
        info = get_schedule(args.schedule)
    except UnknownScheduleError as exc:
        parser.error(f"--schedule: {exc}")
    if args.virtual_stages is None:
        args.virtual_stages = info.default_virtual_stages
    ranks = args.ranks
    if "WORLD_SIZE" in os.environ:  # under torchrun: the pipeline has WORLD_SIZE / dp ranks
        ranks = max(1, int(os.environ["WORLD_SIZE"]) // args.dp)
    try:
        build(args.schedule, ranks, args.microbatches, args.virtual_stages)
    except ScheduleArgumentError as exc:
        parser.error(f"--schedule {args.schedule} with --virtual-stages {args.virtual_stages}: {exc}")
    stages = ranks * args.virtual_stages
    if args.depth is None:
        args.depth = max(4, stages)
    layers = args.depth + 3  # embedding, the blocks, final norm, head
    if layers < stages:
        parser.error(f"--depth {args.depth} gives the model {layers} layers (embedding, {args.depth} blocks, final "
                     f"norm, head) but {ranks} ranks x {args.virtual_stages} virtual stages = {stages} stages need "
                     f"at least {stages}: use --depth {stages - 3} or more (or leave --depth out), or fewer "
                     f"--ranks or --virtual-stages")
    if isinstance(args.balance, list) and (len(args.balance) != stages or sum(args.balance) != layers):
        parser.error(f"--balance {','.join(map(str, args.balance))}: needs {stages} layer counts (one per stage) "
                     f"summing to the model's {layers} layers, got {len(args.balance)} summing to {sum(args.balance)}")


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


@torch.no_grad()
def generate(model: nn.Sequential, prompt: bytes, length: int, context: int, seed: int) -> str:
    """Sample ``length`` bytes after ``prompt`` from the whole model, in one process."""
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor([list(prompt)], dtype=torch.long)  # (1, T)
    for _ in range(length):
        logits = model(ids[:, -context:])[:, -1]  # (1, V)
        probs = torch.softmax(logits / 0.8, dim=-1)  # (1, V)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator)], dim=1)  # (1, T+1)
    return bytes(ids[0].tolist()).decode("utf-8", errors="replace")


def write_timelines(pipe: Pipeline, measured, out: Path) -> list[Path]:
    """The measured timeline of a training step next to the simulated one, plus a Chrome trace (rank 0)."""
    if dist.get_rank() != 0:
        return []
    from pipesched.viz import plot_comparison, simulate_like, write_chrome_trace

    out.mkdir(parents=True, exist_ok=True)
    simulated = simulate_like(pipe.program, measured)
    figure = plot_comparison(simulated, measured)
    paths = [out / "timeline.png", out / "trace.json", out / "measured.json"]
    figure.savefig(paths[0], dpi=110, bbox_inches="tight")
    write_chrome_trace(measured, paths[1])
    measured.save(paths[2])
    return paths


def _balance(text: str):
    if text == "params":
        return "params"
    if text == "layers":
        return None
    return [int(x) for x in text.split(",")]


def train(rank: int, args: argparse.Namespace) -> None:
    """Rank ``rank``'s training loop (under torchrun or spawned by ``pipesched demo``)."""
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    text = load_text(args.data, args.corpus_bytes)
    corpus = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()  # (N,)
    split = int(0.9 * len(corpus))
    model = make_gpt(256, args.context, args.width, args.depth, args.heads, dropout=0.0)
    pipe = Pipeline(model, schedule=args.schedule, num_microbatches=args.microbatches, loss_fn=lm_loss,
                    virtual_stages=args.virtual_stages, dp_size=args.dp, recompute=args.recompute,
                    balance=args.balance,
                    timeout=args.timeout)
    # every replica sees different data; all ranks of one pipeline see the same batches
    generator = torch.Generator().manual_seed(args.seed + 1000 * pipe.grid.dp_rank)
    train_data = batches(corpus[:split], args.batch, args.context, generator)
    val_stream = batches(corpus[split:], args.batch, args.context, torch.Generator().manual_seed(args.seed + 7))
    val_data = [next(val_stream) for _ in range(8)]  # the same batches before and after training
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))
    report = rank == 0
    start_val = evaluate(pipe, val_data)
    if report:
        print(f"{args.schedule}: {pipe.program.num_ranks} pipeline ranks x {args.dp} dp, {args.microbatches} microbatches, "
              f"{args.virtual_stages} virtual stage(s) per rank, {args.depth} blocks ({args.depth + 3} layers in "
              f"{pipe.program.num_stages} stages), {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
              f"{len(text) / 1e6:.1f} MB of text; validation loss at start {start_val:.3f}", flush=True)
    started, tokens = time.perf_counter(), 0
    for step in range(1, args.steps + 1):
        x, y = next(train_data)
        loss = pipe.step(x, target=y)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        tokens += x.numel() * args.dp
        if step % 10 == 0 or step == args.steps:
            bubble = pipe.gather_timeline().bubble_fraction  # collective: every rank reports together
        if report and (step % 10 == 0 or step == args.steps):
            rate = tokens / (time.perf_counter() - started)
            print(f"step {step:>4}/{args.steps}  loss {loss.item():.3f}  {rate:,.0f} tokens/s  "
                  f"measured bubble {bubble:.2f}", flush=True)
    measured = pipe.gather_timeline()  # the last training step, every pipeline rank (collective)
    end_val = evaluate(pipe, val_data)
    paths = write_timelines(pipe, measured, Path(args.out))
    gather_model(model, pipe)
    if report:
        print(f"validation loss {start_val:.3f} -> {end_val:.3f} "
              f"({'fell' if end_val < start_val else 'DID NOT FALL'})")
        sample = generate(model, b"def ", 120, args.context, args.seed)
        print("sample:\n" + sample)
        for path in paths:
            print(f"wrote {path}")


def main(argv=None, prog: str | None = None) -> None:
    """Entry point: under torchrun, train this rank; otherwise spawn ``--ranks x --dp`` local ranks."""
    args = options(argv, prog)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        train(int(os.environ["RANK"]), args)
        dist.destroy_process_group()
    else:
        launch(train, args.ranks * args.dp, args, timeout=24 * 3600.0)


if __name__ == "__main__":
    main()
