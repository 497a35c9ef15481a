"""Checkpoint benchmark: save and load time of the demo GPT across 4 pipeline ranks (pipesched.runtime's
save_checkpoint / load_checkpoint, on torch.distributed.checkpoint) next to torch.save / torch.load of the unsplit
model's state_dict in one process.

Model: ``pipesched.demo.model.make_gpt(256, 128, width, depth, 4)`` (the demo's defaults: width 128, depth 4),
1f1b on 4 ranks (gloo, 127.0.0.1, one thread each), balance by parameters, AdamW after one step (so its state
exists). Each row is the median of ``--repeat`` runs in ms; a save is collective: the time is world rank 0's, from
the call to its return (every rank has written its shard, rank 0 renamed the directory). torch.save writes one
file and is fsynced (DCP fsyncs its files too).

    python benchmarks/bench_checkpoint.py [--repeat 5] [--width 128] [--depth 4]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

from pipesched.demo.model import lm_loss, make_gpt
from pipesched.runtime import Pipeline, launch, load_checkpoint, save_checkpoint

RANKS, CONTEXT, HEADS = 4, 128, 4


def demo_model(width: int, depth: int):
    torch.manual_seed(0)
    return make_gpt(256, CONTEXT, width, depth, HEADS, dropout=0.0)


def one_step(step, params):
    """One AdamW step, so the optimizer has its state (step, exp_avg, exp_avg_sq)."""
    opt = torch.optim.AdamW(params, lr=1e-3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (8, CONTEXT + 1), generator=g)
    step(ids[:, :-1], ids[:, 1:])
    opt.step()
    opt.zero_grad()
    return opt


def timed(fn, repeat: int) -> float:
    times = []
    for i in range(repeat):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def ranks(rank: int, folder: str, width: int, depth: int, repeat: int) -> dict:
    pipe = Pipeline(demo_model(width, depth), schedule="1f1b", num_microbatches=4, loss_fn=lm_loss,
                    balance="params")
    opt = one_step(lambda x, y: pipe.step(x, target=y), pipe.parameters())
    out = {"save model": timed(lambda i: save_checkpoint(os.path.join(folder, f"m{i}"), pipe), repeat),
           "save model + AdamW": timed(lambda i: save_checkpoint(os.path.join(folder, f"o{i}"), pipe, opt, step=i),
                                       repeat),
           "load model": timed(lambda i: load_checkpoint(os.path.join(folder, f"m{i}"), pipe), repeat),
           "load model + AdamW": timed(lambda i: load_checkpoint(os.path.join(folder, f"o{i}"), pipe, opt), repeat)}
    out["bytes"] = {"save model": _size(os.path.join(folder, "m0")),
                    "save model + AdamW": _size(os.path.join(folder, "o0"))}
    pipe.close()
    return out


def one_process(folder: str, width: int, depth: int, repeat: int) -> dict:
    model = demo_model(width, depth)
    opt = one_step(lambda x, y: lm_loss(model(x), y).backward(), model.parameters())

    def save(obj, path):
        with open(path, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())

    both = lambda: {"model": model.state_dict(), "optim": opt.state_dict()}  # noqa: E731
    out = {"save model": timed(lambda i: save(model.state_dict(), os.path.join(folder, f"m{i}.pt")), repeat),
           "save model + AdamW": timed(lambda i: save(both(), os.path.join(folder, f"o{i}.pt")), repeat),
           "load model": timed(lambda i: model.load_state_dict(torch.load(os.path.join(folder, f"m{i}.pt"))), repeat),
           "load model + AdamW": timed(lambda i: _load_both(model, opt, os.path.join(folder, f"o{i}.pt")), repeat)}
    out["bytes"] = {"save model": os.path.getsize(os.path.join(folder, "m0.pt")),
                    "save model + AdamW": os.path.getsize(os.path.join(folder, "o0.pt"))}
    return out


def _load_both(model, opt, path):
    state = torch.load(path)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=4)
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="bench-ckpt-")
    try:
        os.makedirs(os.path.join(folder, "dcp"))
        os.makedirs(os.path.join(folder, "torch"))
        ours = launch(ranks, RANKS, os.path.join(folder, "dcp"), args.width, args.depth, args.repeat, timeout=600)[0]
        torch.set_num_threads(1)
        plain = one_process(os.path.join(folder, "torch"), args.width, args.depth, args.repeat)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    params = sum(p.numel() for p in demo_model(args.width, args.depth).parameters())
    print(f"demo GPT width {args.width}, depth {args.depth}: {params / 1e6:.2f} M parameters; median of "
          f"{args.repeat}, ms")
    print(f"| what | pipesched, {RANKS} ranks (DCP) | torch.save/load, 1 process | ratio | MB on disk (ours / torch) |")
    print("|---|---|---|---|---|")
    for row in ("save model", "save model + AdamW", "load model", "load model + AdamW"):
        size = ""
        if row in ours["bytes"]:
            size = f"{ours['bytes'][row] / 1e6:.1f} / {plain['bytes'][row] / 1e6:.1f}"
        print(f"| {row} | {ours[row]:.1f} | {plain[row]:.1f} | {ours[row] / plain[row]:.1f}x | {size} |")


if __name__ == "__main__":
    main()
