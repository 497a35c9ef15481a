"""Per-rank body of tests/runtime/test_torch_errors.py: the errors gloo really raises, as ``(type, text)``."""
from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist


def gloo_errors(rank):
    """Rank 0 waits on a receive from rank 1 twice: until a 1 s timeout ends it, then until rank 1's process exits
    (``launch`` ends a child with ``os._exit`` once it returns, which closes its connections)."""
    short = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=1))
    other = dist.new_group([0, 1])
    found = {}
    if rank == 1:
        time.sleep(2.0)  # past rank 0's timeout
        dist.barrier()
        return found
    for name, group in (("timeout", short), ("closed", other)):
        try:
            group.recv([torch.zeros(1)], 1, 0).wait()
        except Exception as exc:  # noqa: BLE001 - recorded for the test
            found[name] = (type(exc).__name__, str(exc))
        if name == "timeout":
            dist.barrier()
    return found
