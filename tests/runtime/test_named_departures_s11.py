"""Follow-ups of chaos trial s11 (test_chaos_s11.py): a rank stalled INSIDE the creation of the Pipeline's process
groups (after counting its make_groups) is named by the roll call; a rank whose launch fn returned is named to every
peer left in the fns' own collective (3 ranks); and a fn that returns first while the others just return still gives
launch every result (the returned mark is no error by itself). Forked gloo ranks; no timing assertion."""
from __future__ import annotations

import time

import pytest

from pipesched.runtime import PipelineError, launch

import test_chaos_s11 as chaos

pytestmark = pytest.mark.multiprocess


def stall_inside_groups(rank: int, origin: int) -> str:
    import pipesched.runtime.comm as comm

    if rank == origin:
        comm._new_groups = lambda *args, **kwargs: chaos._stall()  # after make_groups counted this attempt
    chaos._pipe().close()
    return "constructed"


def test_a_rank_stalled_inside_creating_the_groups_is_named_by_the_roll_call():
    with pytest.raises(PipelineError) as info:
        launch(stall_inside_groups, 2, 1, timeout=chaos.LAUNCH_TIMEOUT, grace=5, start_method="fork")
    assert str(info.value) == (
        "pipeline rank failure: world rank 1 (pipeline rank 1) failed while creating the Pipeline's process groups "
        "(dist.new_group, every rank of the job, timeout=3 s): TimeoutError: world rank 1 began creating them but "
        "did not finish within timeout=3 s, nor time out within 1 s of world rank 0: stalled or hung inside the "
        "creation [reported to world rank 0: its own wait ended with DistStoreError]")
    assert (info.value.rank, info.value.seen_by) == (1, 0)


def return_or_barrier_and_say(rank: int, origin: int, directory: str) -> str:
    import torch.distributed as dist

    if rank != origin:
        try:
            dist.barrier()  # the origin's fn has returned: this can never complete
        except Exception as exc:
            from pipesched.runtime.launch_child import told

            with open(f"{directory}/{rank}.txt", "w") as out:  # what this rank reports (run_child calls told too)
                out.write(str(told(exc, rank, dist.distributed_c10d._get_default_store())))
            raise
    return "returned"


def test_a_returned_rank_is_named_to_every_peer_left_in_the_collective(tmp_path):
    with pytest.raises(PipelineError) as info:
        launch(return_or_barrier_and_say, 3, 0, str(tmp_path), timeout=chaos.LAUNCH_TIMEOUT, grace=5,
               start_method="fork")
    assert (info.value.rank, info.value.record.ended) == (0, "returned")
    for rank in (1, 2):
        assert (tmp_path / f"{rank}.txt").read_text() == (
            f"pipeline rank failure: world rank 0's launch fn returned while world rank {rank} was still in a "
            f"collective with it (a collective the launch fns call themselves, outside any Pipeline call): every "
            f"rank's fn must make the same collective calls before it returns; its connections closed as its fn "
            f"ended [reported to world rank {rank}: its launch fn then raised RuntimeError]")


def return_first(rank: int) -> str:
    import torch.distributed as dist

    dist.barrier()
    if rank == 1:
        time.sleep(0.5)  # rank 0's fn returns (marks it, closes its groups) while rank 1 is still in its fn
    return f"rank {rank} returned"


def test_a_rank_returning_first_while_the_others_just_return_gives_every_result():
    assert launch(return_first, 2, timeout=chaos.LAUNCH_TIMEOUT, start_method="fork") == [
        "rank 0 returned", "rank 1 returned"]
