"""Per-rank body of tests/runtime/test_checkpoint_lost_rank.py: 2 ranks (PP=2) step once, then world rank 1's process
exits (``os._exit(1)``, no failure record) inside DCP's write of ``save_checkpoint``, or of ``load_checkpoint``'s
read; world rank 0 writes what it raised, and what a later call raises, to ``<out>/0.json``."""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from pipesched.runtime import Pipeline, PipelineError, load_checkpoint, save_checkpoint


def _exit_inside(cls, name: str) -> None:
    """``cls.name`` (DCP's shard write or read) exits the process once its own part is done, within a collective
    ``dcp.save`` / ``dcp.load`` only (load_checkpoint also reads metadata through ``dcp.load(no_dist=True)``)."""
    original, collective = getattr(cls, name), {"on": False}

    def then_exit(self, *args, **kwargs):
        done = original(self, *args, **kwargs)
        if collective["on"]:
            done.wait()  # this rank's part is done; the others wait in DCP's gather
            os._exit(1)
        return done

    def marked(run):
        def call(*args, no_dist=False, **kwargs):
            collective["on"] = not no_dist
            return run(*args, no_dist=no_dist, **kwargs)
        return call

    setattr(cls, name, then_exit)
    dcp.save, dcp.load = marked(dcp.save), marked(dcp.load)


def run(rank: int, out: str, during: str) -> None:
    torch.manual_seed(0)
    pipe = Pipeline(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)), num_microbatches=2,
                    loss_fn=F.mse_loss, timeout=60)
    pipe.step(torch.randn(4, 4), target=torch.randn(4, 4))
    path = os.path.join(out, "ckpt")
    if during == "reading":
        save_checkpoint(path, pipe, step=1)
    if rank == 1:
        _exit_inside(*((FileSystemWriter, "write_data") if during == "writing" else (FileSystemReader, "read_data")))
    report = {}
    try:
        (save_checkpoint if during == "writing" else load_checkpoint)(path, pipe, **(
            {"step": 2} if during == "writing" else {}))
    except PipelineError as exc:
        report = {"type": "PipelineError", "rank": exc.rank, "pp_rank": exc.pp_rank, "lost": exc.record.lost,
                  "message": str(exc)}
    except BaseException as exc:  # noqa: BLE001 - reported, not raised: the test reads it
        report = {"type": type(exc).__name__, "message": str(exc)}
    try:
        pipe.step(torch.randn(4, 4), target=torch.randn(4, 4))
        report["after"] = "stepped"
    except BaseException as exc:  # noqa: BLE001 - as above
        report["after"] = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(out, f"{dist.get_rank()}.json"), "w") as handle:
        json.dump(report, handle)
