"""Per-rank body of tests/runtime/test_chaos_s10.py: load_checkpoint whose local read of the checkpoint's pipesched
entries (``checkpoint_read.read_locally``, before the checkpoint vote) fails on ONE rank. DCP raises a
``CheckpointException``, a ``BaseException``: it escaped the vote's ``except Exception`` and the other ranks waited in
the vote until the Pipeline's timeout. The failing rank catches its own error and stays in ``fn`` until the other has
raised (a store counter, at most ``WAIT_S``), so the other can learn it only from the vote, not from launch."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader

from pipesched.runtime import Pipeline, load_checkpoint, save_checkpoint

WAIT_S = 30.0


def load_read_fails(rank: int, directory: str, origin: int) -> dict:
    torch.manual_seed(0)
    pipe = Pipeline(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)), num_microbatches=2,
                    loss_fn=F.mse_loss, timeout=20)
    x, y = torch.ones(4, 4), torch.zeros(4, 4)
    pipe.step(x, y)
    path = save_checkpoint(f"{directory}/ckpt", pipe)
    if rank == origin:
        def read_data(self, plan, planner):
            raise OSError("disk gone")
        FileSystemReader.read_data = read_data
    try:
        load_checkpoint(path, pipe)
        got = {"type": None}
    except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException: reported to the test
        got = {"type": type(exc).__name__, "message": str(exc).replace(path, "PATH")}
    store, key = dist.distributed_c10d._get_default_store(), "test-chaos-s10/ended"
    if rank != origin:
        store.add(key, 1)
    else:
        deadline = time.monotonic() + WAIT_S
        while store.add(key, 0) < dist.get_world_size() - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        got["others_ended"] = store.add(key, 0) >= dist.get_world_size() - 1
    pipe.step(x, y)  # the pipeline is still usable: nothing was loaded
    got["then"] = True
    pipe.close()
    return got
