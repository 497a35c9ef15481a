"""Training that survives a lost rank: checkpoints every K steps, and under ``torchrun --max-restarts N`` a job
whose rank died comes back, resumes from the latest complete checkpoint and finishes with the same result.

    torchrun --nnodes 1 --nproc-per-node 2 --max-restarts 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29500 \\
        --local-addr 127.0.0.1 examples/train_resilient.py --checkpoint-dir ckpt --kill-at 5
    # rank 1 SIGKILLs itself in step 5 of the first attempt; rank 0 raises PipelineError naming it; torchrun
    # restarts both; they resume from ckpt/step-000004 and print the same final loss as a run never killed:
    torchrun --nnodes 1 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29500 \\
        --local-addr 127.0.0.1 examples/train_resilient.py --checkpoint-dir ckpt2

The model (a tiny MLP, seed 0) and every step's batch (drawn from seed ``1000 + step``) are the same in every
attempt, so a restarted rank rebuilds them; ``load_checkpoint`` restores the weights, AdamW's state and every
rank's random generators, so the steps after the resume are bitwise those of a run that was never killed.
"""
from __future__ import annotations

import argparse
import json
import os
import signal

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline, latest_checkpoint, load_checkpoint, save_checkpoint


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps in all (default 8)")
    parser.add_argument("--every", type=int, default=2, help="save a checkpoint after every K steps (default 2)")
    parser.add_argument("--checkpoint-dir", required=True, help="folder of the checkpoints (step-NNNNNN)")
    parser.add_argument("--kill-at", type=int, default=None,
                        help="SIGKILL --kill-rank in the forward of this step (0-based), first attempt only")
    parser.add_argument("--kill-rank", type=int, default=1, help="world rank that dies (default 1)")
    parser.add_argument("--result", default=None, help="world rank 0 writes the final loss (hex) here, as JSON")
    args = parser.parse_args(argv)
    for name in ("steps", "every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.kill_at is not None and not 0 <= args.kill_at < args.steps:
        parser.error(f"--kill-at must be a step in [0, {args.steps}), got {args.kill_at}")
    return args


def build_model(width: int = 8, layers: int = 4) -> nn.Sequential:
    torch.manual_seed(0)  # the same initial model on every rank and in every attempt
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)])


def batch(step: int, n: int = 16, width: int = 8):
    """Step ``step``'s batch ``(x, y)``, each ``(n, width)`` float32: a pure function of ``step``."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, width, generator=g), torch.randn(n, width, generator=g)


def arm_kill(pipe: Pipeline, rank: int, args) -> dict:
    """On the first attempt (``TORCHELASTIC_RESTART_COUNT`` 0 or unset), world rank ``--kill-rank`` SIGKILLs itself
    in its first layer's forward once ``state["step"] == --kill-at``: in the middle of that step."""
    state = {"step": -1}
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if args.kill_at is None or rank != args.kill_rank or not first_attempt:
        return state

    def die(module, inputs):
        if state["step"] == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    first = min(pipe.stage_ids)
    next(iter(pipe.stages[first].children())).register_forward_pre_hook(die)
    return state


def main(argv=None) -> float:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    pipe = Pipeline(build_model(), schedule="1f1b", num_microbatches=4, loss_fn=F.mse_loss, timeout=60.0)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    start, resumed = 0, None
    path = latest_checkpoint(args.checkpoint_dir)
    if path is not None:
        start = resumed = load_checkpoint(path, pipe, optimizer).step  # steps completed when it was saved
    state = arm_kill(pipe, rank, args)
    loss = None
    for step in range(start, args.steps):
        state["step"] = step
        loss = pipe.step(*batch(step))
        optimizer.step()
        optimizer.zero_grad()
        if (step + 1) % args.every == 0:
            save_checkpoint(os.path.join(args.checkpoint_dir, f"step-{step + 1:06d}"), pipe, optimizer, step=step + 1)
    final = float("nan") if loss is None else loss.item()
    if rank == 0:
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        start = "started afresh" if resumed is None else f"resumed from step {resumed}"
        print(f"final loss {final.hex()} ({final:.6f}) after {args.steps} steps; attempt {attempt}, {start}")
        if args.result:
            with open(args.result, "w") as handle:
                json.dump({"final_loss": final.hex(), "resumed_from": resumed, "attempt": attempt}, handle)
    pipe.close()
    torch.distributed.destroy_process_group()
    return final


if __name__ == "__main__":
    main()
