"""DCP's collectives in save_checkpoint / load_checkpoint run on the Pipeline's own group over every world rank
(pipesched/runtime/checkpoint_group.py: timeout=pipe.timeout, the stages' backend), created at the first save or load
and destroyed with the Pipeline's other groups: a rank stalled (SIGSTOP) inside DCP's read is named within
``pipe.timeout``, also where the stalled rank is in none of the waiting rank's pipeline and DP groups (the roll call
runs over every world rank). The write case is tests/runtime/test_chaos_s11.py. Forked gloo ranks; the stalled child
is killed by launch when it stops the job; a launch ``timeout`` far above the Pipeline's only bounds a broken run."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline, PipelineError, launch, load_checkpoint, save_checkpoint
from pipesched.runtime.torch_errors import peer_closed_connection, wait_timed_out

pytestmark = pytest.mark.multiprocess

PIPE_TIMEOUT = 3.0
LAUNCH_TIMEOUT = 60.0


def _pipe(dp_size: int = 1) -> Pipeline:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh())
    return Pipeline(model, num_microbatches=2, loss_fn=F.mse_loss, timeout=PIPE_TIMEOUT, dp_size=dp_size)


def _stall_in_collective_read() -> None:
    """This rank stops inside DCP's shard read of a collective ``dcp.load`` (not load_checkpoint's metadata reads,
    ``no_dist=True``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    original_load = dcp.load

    def load(*args, no_dist=False, **kwargs):
        if not no_dist:
            FileSystemReader.read_data = lambda self, plan, planner: (os.kill(os.getpid(), signal.SIGSTOP),
                                                                      time.sleep(3600))
        return original_load(*args, no_dist=no_dist, **kwargs)

    dcp.load = load


def stall_in_dcp_read(rank: int, directory: str, origin: int, dp_size: int) -> str:
    pipe = _pipe(dp_size)
    pipe.step(torch.ones(4, 4), torch.zeros(4, 4))
    save_checkpoint(f"{directory}/ckpt", pipe)
    if rank == origin:
        _stall_in_collective_read()
    try:
        load_checkpoint(f"{directory}/ckpt", pipe)
    except PipelineError as exc:  # each waiting rank's own view (its roll call, or the record it adopted)
        with open(f"{directory}/{rank}.json", "w") as handle:
            json.dump({"rank": exc.rank, "stalled": list(exc.stalled), "message": str(exc)}, handle)
        raise
    return "loaded"


def _note(rank: int, pp_rank: int) -> str:
    return (f"world rank {rank} (pipeline rank {pp_rank}) did not time out within 1 s of this rank and kept their "
            f"connections open")


def test_a_rank_stalled_inside_the_checkpoint_read_is_named_within_the_pipeline_timeout(tmp_path):
    with pytest.raises(PipelineError) as info:
        launch(stall_in_dcp_read, 2, str(tmp_path), 1, 1, timeout=LAUNCH_TIMEOUT, grace=5, start_method="fork")
    message, target = str(info.value), f"{tmp_path}/ckpt"
    assert message.startswith(
        f"pipeline rank failure: world rank 0 (pipeline rank 0) failed while reading checkpoint {target!r} (DCP's "
        f"collectives): CommError: DCP's collectives while reading {target!r}: RuntimeError: "), message
    assert f"Timed out waiting {PIPE_TIMEOUT * 1000:.0f}ms for " in message, message
    assert _note(1, 1) in message, message
    assert (info.value.rank, info.value.stalled) == (0, (1,))


def test_a_stalled_rank_outside_the_waiting_ranks_groups_is_named_by_the_roll_call_of_every_world_rank(tmp_path):
    # PP=2 x DP=2: world rank 3 (pipeline rank 1 of replica 1) shares no pipeline or DP group with world rank 0
    with pytest.raises(PipelineError) as info:
        launch(stall_in_dcp_read, 4, str(tmp_path), 3, 2, timeout=LAUNCH_TIMEOUT, grace=5, start_method="fork")
    message = str(info.value)
    assert info.value.rank in (0, 1, 2), message  # whichever timed-out rank published first
    assert info.value.stalled == (3,), message
    assert _note(3, 1) in message, message
    for rank in (0, 1, 2):  # every waiting rank names rank 3 alone, through the roll call's key shared by all ranks
        with open(tmp_path / f"{rank}.json") as handle:
            got = json.load(handle)
        assert (got["rank"] in (0, 1, 2), got["stalled"]) == (True, [3]), got
        assert _note(3, 1) in got["message"], got
        for other in (0, 1, 2):
            assert f"world rank {other} (pipeline rank {other % 2}) did not time out" not in got["message"], got


def group_life(rank: int, directory: str) -> dict:
    pipe = _pipe()
    before = getattr(pipe, "_checkpoint_group", None)
    save_checkpoint(f"{directory}/a", pipe)
    group = pipe._checkpoint_group
    save_checkpoint(f"{directory}/b", pipe)
    load_checkpoint(f"{directory}/a", pipe)
    seen = {"before": before is None, "same": pipe._checkpoint_group is group, "size": dist.get_world_size(group),
            "ranks": dist.get_process_group_ranks(group), "backend": dist.get_backend(group),
            "default": group is dist.group.WORLD}
    pipe.close()
    seen["after_close"] = pipe._checkpoint_group is None
    return seen


def test_the_checkpoint_group_is_made_once_at_the_first_save_and_destroyed_at_close(tmp_path):
    got = launch(group_life, 2, str(tmp_path), timeout=LAUNCH_TIMEOUT, grace=5, start_method="fork")
    assert got == [{"before": True, "same": True, "size": 2, "ranks": [0, 1], "backend": "gloo", "default": False,
                    "after_close": True}] * 2


def test_a_gloo_timeout_is_told_from_a_closed_connection():
    timed_out = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting "
                             "3000ms for send operation to complete")
    closed = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                          "[127.0.0.1]:10670")
    assert (wait_timed_out(timed_out), peer_closed_connection(timed_out)) == (True, False)
    assert (wait_timed_out(closed), peer_closed_connection(closed)) == (False, True)
    assert wait_timed_out(ValueError("Timed out waiting 3000ms")) is False  # torch raises a RuntimeError


def stall_before_the_group(rank: int, directory: str, origin: int) -> str:
    import pipesched.runtime.checkpoint as checkpoint_module

    pipe = _pipe()
    pipe.step(torch.ones(4, 4), torch.zeros(4, 4))
    if rank == origin:  # after save_checkpoint's vote, before its first collective: the group's creation
        checkpoint_module.checkpoint_group = lambda pipe: (os.kill(os.getpid(), signal.SIGSTOP), time.sleep(3600))
    save_checkpoint(f"{directory}/ckpt", pipe)
    return "saved"


def test_a_rank_stalled_before_creating_the_checkpoint_group_is_named_within_the_pipeline_timeout(tmp_path):
    with pytest.raises(PipelineError) as info:
        launch(stall_before_the_group, 2, str(tmp_path), 1, timeout=LAUNCH_TIMEOUT, grace=5, start_method="fork")
    message = str(info.value)
    assert message.startswith(
        "pipeline rank failure: world rank 0 (pipeline rank 0) failed while creating the checkpoint's process group "
        "(dist.new_group, every world rank): CommError: every world rank to create the checkpoint's process group: "
        "DistStoreError: "), message
    assert _note(1, 1) in message, message
    assert (info.value.rank, info.value.stalled) == (0, (1,))
