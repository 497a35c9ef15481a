"""Chaos trial s11 (after launch came to host the job's store, 27bcc82): one rank of a launched job STALLS
(SIGSTOP, as a swapped-out or debugger-held process) at a point where the others must still end within the Pipeline's
``timeout`` and name it (README, Failure: "a rank that stalls makes the others fail after ``timeout`` seconds").
A third case: one rank's fn RETURNS while another waits in the
fn's own collective (dist.barrier). The first is fixed (DCP's collectives run on a group with the Pipeline's
timeout); so are the other two (the waiting rank names the rank whose groups count is behind; a returned fn marks
so in the store for a peer left in its collective). 2 forked gloo ranks; the stalled child is
killed by launch when it stops the job. No timing assertion: a launch ``timeout`` far above the Pipeline's (3 s)
only bounds a run that would otherwise wait out torch's 30-minute default."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline, PipelineError, launch, save_checkpoint

pytestmark = pytest.mark.multiprocess

PIPE_TIMEOUT = 3.0
LAUNCH_TIMEOUT = 40.0  # the job ends well before it when the stalled rank is named after PIPE_TIMEOUT


def _stall() -> None:
    os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(3600)  # not reached while stopped; launch SIGKILLs this process when it stops the job


def _pipe() -> Pipeline:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh())
    return Pipeline(model, num_microbatches=2, loss_fn=F.mse_loss, timeout=PIPE_TIMEOUT)


def stall_in_dcp_write(rank: int, directory: str, origin: int) -> str:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    pipe = _pipe()
    pipe.step(torch.ones(4, 4), torch.zeros(4, 4))
    if rank == origin:
        FileSystemWriter.write_data = lambda self, plan, planner: _stall()
    save_checkpoint(f"{directory}/ckpt", pipe)
    return "saved"


def stall_before_groups(rank: int, origin: int) -> str:
    import pipesched.runtime.pipeline as pipeline_module

    if rank == origin:
        pipeline_module.make_groups = lambda *args, **kwargs: _stall()
    _pipe().close()
    return "constructed"


def test_a_rank_stalled_inside_the_checkpoint_write_is_named_within_the_pipeline_timeout(tmp_path):
    # DCP's collectives run on the Pipeline's checkpoint group (timeout=pipe.timeout, checkpoint_group.py): rank 0's
    # wait for the stalled rank 1 times out, and the roll call over every world rank names rank 1
    with pytest.raises(PipelineError) as info:
        launch(stall_in_dcp_write, 2, str(tmp_path), 1, timeout=LAUNCH_TIMEOUT, grace=5, start_method="fork")
    message, target = str(info.value), f"{tmp_path}/ckpt"
    assert "did not finish within" not in message  # launch's own timeout: no rank ended on its own
    assert message.startswith(
        f"pipeline rank failure: world rank 0 (pipeline rank 0) failed while writing checkpoint {target!r} (DCP's "
        f"collectives): CommError: DCP's collectives while writing {target!r}: RuntimeError: "), message
    assert f"Timed out waiting {PIPE_TIMEOUT * 1000:.0f}ms for " in message, message  # gloo's, on the checkpoint group
    assert message.endswith(
        f"; world rank 1 (pipeline rank 1) did not time out within 1 s of this rank and kept their connections open: "
        f"alive but not at this point of the checkpoint save within timeout={PIPE_TIMEOUT:g} s. The stall is there (a "
        f"hang or a long pause in that rank's code before or inside the checkpoint save), or that rank began waiting "
        f"later, on one that is"), message  # the save's words, not a step's (test_failure_wording_s12.py)
    assert not os.path.exists(target)  # nothing committed


def test_a_rank_stalled_before_creating_the_groups_is_named_by_the_rank_that_waited_for_it():
    # fixed: comm._groups_failed, finding no published record, reads every rank's make_groups count and names the
    # rank whose count is below its own (it never began the creation), not the waiting rank's own timeout
    with pytest.raises(PipelineError) as info:
        launch(stall_before_groups, 2, 1, timeout=LAUNCH_TIMEOUT, grace=5, start_method="fork")
    assert str(info.value) == (
        "pipeline rank failure: world rank 1 (pipeline rank 1) failed before creating the Pipeline's process groups "
        "(dist.new_group, every rank of the job): TimeoutError: world rank 1 did not begin creating them within "
        "timeout=3 s of world rank 0, after the construction agreement: stalled or hung in between [reported to "
        "world rank 0: its own wait ended with DistStoreError]")
    assert (info.value.rank, info.value.seen_by) == (1, 0)


def return_while_others_barrier(rank: int, origin: int) -> str:
    import torch.distributed as dist

    if rank != origin:
        dist.barrier()  # the origin's fn has returned: this can never complete
    return "returned"


def test_a_rank_whose_fn_returned_is_named_to_a_peer_left_in_its_own_collective():
    # fixed: each child marks in the store that its fn returned before its connections close (launch_child.
    # mark_returned); the peer whose own collective then fails on the closed connection names it (told)
    with pytest.raises(PipelineError) as info:
        launch(return_while_others_barrier, 2, 1, timeout=LAUNCH_TIMEOUT, grace=5, start_method="fork")
    assert str(info.value) == (
        "pipeline rank failure: world rank 1's launch fn returned while world rank 0 was still in a collective with "
        "it (a collective the launch fns call themselves, outside any Pipeline call): every rank's fn must make the "
        "same collective calls before it returns; its connections closed as its fn ended [reported to world rank 0: "
        "its launch fn then raised RuntimeError]")
    assert (info.value.rank, info.value.record.ended, info.value.seen_by) == (1, "returned", 0)
