"""Session 12: what a failure names, and in which words.

1. The roll call (runtime/stalled.py) names the ranks alive but absent in the words of what was waited in: a step,
   a checkpoint save, a checkpoint load, the creation of the checkpoint's process group (the creation of the
   Pipeline's own groups, runtime/groups_failure.py, has its own words: "inside the creation").
2. ``told()`` (runtime/launch_child.py): a launch fn that returned does not take the blame for a peer that was
   killed while another rank waited on it.

Forked gloo ranks (2 or 3), Pipeline timeout 3 s, a stalled rank SIGSTOPs itself (launch kills it when it stops the
job); no timing assertion: a launch ``timeout`` far above the Pipeline's only bounds a broken run."""
from __future__ import annotations

import os
import signal
import time

import pytest

from pipesched.runtime import PipelineError, launch
from pipesched.runtime.stalled import stall_note

import test_chaos_s11 as chaos
import test_checkpoint_group as cg
import test_named_departures_s11 as departures

pytestmark = pytest.mark.multiprocess

LAUNCH_TIMEOUT = 60.0


def _tail(during: str, pause: str, rank: int = 1, pp_rank: int = 1) -> str:
    return (f"; world rank {rank} (pipeline rank {pp_rank}) did not time out within 1 s of this rank and kept their "
            f"connections open: alive but not at this point of {during} within timeout=3 s. The stall is there (a "
            f"hang or a long pause in that rank's code {pause}), or that rank began waiting later, on one that is")


def test_the_note_names_what_was_waited_in():
    assert stall_note([], 2, 3.0) == ""
    assert stall_note([1], 2, 3.0) == _tail("the step", "between its pipeline calls")  # a step: as before
    assert stall_note([1], 2, 3.0, during="the checkpoint save") == _tail(
        "the checkpoint save", "before or inside the checkpoint save")


# -- 1. a rank stalled in each kind of wait ----------------------------------------------------------------------------

def test_a_stall_in_a_step_is_worded_as_the_step():
    import rt_stalled

    reports = launch(rt_stalled.pause_between_steps, 2, 1, 7.0, timeout=120, start_method="fork")
    for got in reports:  # rank 0's record; rank 1 (the stalled one) reads it later, "[reported to ...]" after it
        assert got["type"] == "PipelineError", got
        assert _tail("the step", "between its pipeline calls") in got["message"], got
        assert (got["rank"], got["stalled"]) == (0, (1,)), got


def _stalled_rank_1(body, args, start: str, during: str) -> None:
    """``body`` on 2 ranks stalls rank 1: rank 0's error starts with ``start``, ends with the roll call's words for
    ``during``, never says "step", and names rank 0 (timed out) with rank 1 stalled."""
    with pytest.raises(PipelineError) as info:
        launch(body, 2, *args, timeout=LAUNCH_TIMEOUT, grace=5, start_method="fork")
    message = str(info.value)
    assert message.startswith(f"pipeline rank failure: world rank 0 (pipeline rank 0) failed while {start}"), message
    assert message.endswith(_tail(during, f"before or inside {during}")), message
    assert "step" not in message, message
    assert (info.value.rank, info.value.stalled) == (0, (1,))


def test_a_stall_in_a_checkpoint_save_is_worded_as_the_save(tmp_path):
    _stalled_rank_1(chaos.stall_in_dcp_write, (str(tmp_path), 1),
                    f"writing checkpoint {str(tmp_path / 'ckpt')!r} (DCP's collectives)", "the checkpoint save")


def test_a_stall_in_a_checkpoint_load_is_worded_as_the_load(tmp_path):
    _stalled_rank_1(cg.stall_in_dcp_read, (str(tmp_path), 1, 1),
                    f"reading checkpoint {str(tmp_path / 'ckpt')!r} (DCP's collectives)", "the checkpoint load")


def test_a_stall_in_creating_the_checkpoint_group_is_worded_as_the_group_creation(tmp_path):
    _stalled_rank_1(cg.stall_before_the_group, (str(tmp_path), 1), "creating the checkpoint's process group",
                    "the creation of the checkpoint's process group")


def test_a_stall_in_creating_the_pipelines_groups_is_not_worded_as_a_step():
    with pytest.raises(PipelineError) as info:
        launch(departures.stall_inside_groups, 2, 1, timeout=LAUNCH_TIMEOUT, grace=5, start_method="fork")
    message = str(info.value)
    assert "stalled or hung inside the creation" in message, message
    assert "step" not in message, message
    assert (info.value.rank, info.value.stalled) == (1, (1,))  # the stalled rank, also as data


# -- 2. a returned fn and a killed peer --------------------------------------------------------------------------------

def return_or_die_or_wait(rank: int, directory: str, how: str) -> str:
    """Rank 0's fn returns; rank 2's process ends without a report once rank 0's fn has returned (marked in the
    store); rank 1 waits on a receive from rank 2 and writes what it reports (run_child calls told too)."""
    import torch
    import torch.distributed as dist

    from pipesched.runtime.launch_child import _RETURNED, told

    store = dist.distributed_c10d._get_default_store()
    dist.barrier()  # every rank is in: rank 0's return is the first thing to happen after this
    if rank == 0:
        return "returned"
    if rank == 2:
        while not store.check([_RETURNED.format(rank=0)]):
            time.sleep(0.01)
        if how == "SIGKILL":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(1)
    try:
        dist.recv(torch.zeros(1), src=2)  # rank 2 never sends: its process ends
    except Exception as exc:
        error = told(exc, rank, store)
        with open(f"{directory}/{rank}.txt", "w") as out:
            lost = error.record.lost if isinstance(error, PipelineError) else None
            out.write(f"{type(error).__name__}|{getattr(error, 'rank', None)}|{lost}|{error}")
        raise
    return "received"


@pytest.mark.parametrize("how", ["os._exit", "SIGKILL"])
def test_a_killed_peer_is_named_not_the_rank_whose_fn_returned(tmp_path, how):
    with pytest.raises(RuntimeError) as info:
        launch(return_or_die_or_wait, 3, str(tmp_path), how, timeout=LAUNCH_TIMEOUT, grace=5, start_method="fork")
    code = "code 1" if how == "os._exit" else "code -9"
    assert str(info.value).startswith(f"launch: rank 2 exited with {code} without reporting"), str(info.value)
    kind, rank, lost, message = (tmp_path / "1.txt").read_text().split("|", 3)
    assert (kind, rank, lost) == ("PipelineError", "2", "True"), message
    assert message == (
        "pipeline rank failure: world rank 2 was lost: its process ended without a failure record (killed, e.g. by "
        "SIGKILL or the out-of-memory killer, or exited) while world rank 1 was in a call with it (a collective or "
        "point-to-point call the launch fns make themselves, outside any Pipeline call): its connection closed; "
        "world rank 0's launch fn had returned, which is not the cause named here [reported to world rank 1: its "
        "launch fn then raised RuntimeError]"), message


def die_or_wait(rank: int, directory: str) -> str:
    """No fn returns: rank 2's process ends without a report; ranks 0 and 1 wait on a receive from it and write
    what they report."""
    import torch
    import torch.distributed as dist

    from pipesched.runtime.launch_child import told

    dist.barrier()
    if rank == 2:
        os._exit(1)
    try:
        dist.recv(torch.zeros(1), src=2)
    except Exception as exc:
        error = told(exc, rank, dist.distributed_c10d._get_default_store())
        with open(f"{directory}/{rank}.txt", "w") as out:
            out.write(f"{type(error).__name__}|{getattr(error, 'rank', None)}|{error}")
        raise
    return "received"


def test_a_killed_peer_is_named_by_every_rank_waiting_on_it_when_no_fn_returned(tmp_path):
    with pytest.raises(RuntimeError, match="launch: rank 2 exited with code 1 without reporting"):
        launch(die_or_wait, 3, str(tmp_path), timeout=LAUNCH_TIMEOUT, grace=5, start_method="fork")
    for rank in (0, 1):  # each names rank 2, not its own closed connection, as the origin
        assert (tmp_path / f"{rank}.txt").read_text() == (
            "PipelineError|2|pipeline rank failure: world rank 2 was lost: its process ended without a failure record "
            "(killed, e.g. by SIGKILL or the out-of-memory killer, or exited) while world rank "
            f"{rank} was in a call with it (a collective or point-to-point call the launch fns make themselves, "
            f"outside any Pipeline call): its connection closed [reported to world rank {rank}: its launch fn then "
            "raised RuntimeError]")


def destroy_and_return_or_wait(rank: int, directory: str) -> str:
    """Rank 1's fn closes its own connections (``dist.destroy_process_group()``, as torch's docs end a script) and
    returns while rank 0 still waits on a receive from it: rank 0 writes what it reports."""
    import torch
    import torch.distributed as dist

    from pipesched.runtime.launch_child import told

    dist.barrier()
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        dist.destroy_process_group()
        return "returned"
    try:
        dist.recv(torch.zeros(1), src=1)
    except Exception as exc:
        error = told(exc, rank, store)
        with open(f"{directory}/{rank}.txt", "w") as out:
            out.write(f"{getattr(error, 'rank', None)}|{error.record.ended}|{error.record.lost}")
        raise
    return "received"


def test_a_peer_that_closed_its_own_connections_and_returned_is_named_returned_not_lost(tmp_path):
    with pytest.raises(PipelineError) as info:
        launch(destroy_and_return_or_wait, 2, str(tmp_path), timeout=LAUNCH_TIMEOUT, grace=5, start_method="fork")
    assert (info.value.rank, info.value.record.ended, info.value.record.lost) == (1, "returned", False)
    assert (tmp_path / "0.txt").read_text() == "1|returned|False"  # not "was lost: ... killed"


def return_or_barrier_then_tell(rank: int, directory: str) -> str:
    """Rank 0's fn returns while ranks 1 and 2 are in a barrier; rank 2 raises (reported, its connections then close);
    rank 1 waits until its connection to rank 2 is closed too, then writes what it reports: rank 2 raised, it was
    not lost (run_child marks a raising rank before its connections close)."""
    import torch
    import torch.distributed as dist

    from pipesched.runtime.launch_child import told
    from pipesched.runtime.lost_rank import closed_members

    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        return "returned"
    try:
        dist.barrier()  # rank 0's fn has returned: this can never complete
    except Exception as exc:
        if rank == 1:
            group = dist.distributed_c10d._get_default_group()
            while 2 not in closed_members(group, [0, 1, 2], torch.device("cpu")):
                time.sleep(0.05)
            error = told(exc, rank, store)
            with open(f"{directory}/{rank}.txt", "w") as out:
                out.write(f"{getattr(error, 'rank', None)}|{error.record.ended}|{error.record.lost}")
        raise
    return "passed the barrier"


def test_a_peer_that_raised_and_closed_its_connections_is_not_taken_for_a_lost_one(tmp_path):
    with pytest.raises(PipelineError) as info:
        launch(return_or_barrier_then_tell, 3, str(tmp_path), timeout=LAUNCH_TIMEOUT, grace=5, start_method="fork")
    assert (info.value.rank, info.value.record.ended) == (0, "returned")
    assert (tmp_path / "1.txt").read_text() == "0|returned|False"
