"""``launch``'s own process hosts the job's store (as torchrun's agent does), so a world rank 0 that stalls -- here
SIGSTOPped in the middle of a step -- takes neither the store nor the roll call with it: the ranks that time out on it
name it, before launch's timeout (before: their failure path blocked in store calls rank 0's frozen child never
answered, until launch's TimeoutError named no one). Forked gloo ranks; no timing assertion."""
import os

import pytest

from pipesched.runtime import PipelineError, launch

import rt_launch_store_host

pytestmark = pytest.mark.multiprocess


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_stopped_world_rank_0_is_named_by_the_ranks_that_timed_out_on_it(tmp_path):
    with pytest.raises(PipelineError) as info:
        launch(rt_launch_store_host.stop_rank0_in_a_step, 3, str(tmp_path), timeout=120, grace=5,
               start_method="fork")
    err = info.value
    assert err.rank in (1, 2), str(err)  # the origin: a rank that timed out waiting (rank 0 never reports)
    message = str(err)
    assert ("world rank 0 (pipeline rank 0) did not time out within 1 s of this rank and kept their connections "
            "open") in message, message
    assert "world rank 1 (pipeline rank 1) did not" not in message, message
    assert "world rank 2 (pipeline rank 2) did not" not in message, message
    pids = [int((tmp_path / f"{rank}.pid").read_text()) for rank in range(3)]
    assert [_gone(pid) for pid in pids] == [True, True, True], pids  # the stopped child too (SIGKILL), reaped


def test_store_host_is_none_under_launch():
    assert launch(rt_launch_store_host.who_hosts, 2, timeout=120, start_method="fork") == [(None, "parent")] * 2


def test_store_host_is_rank_0_when_launch_is_told_to_lay_the_store_out_as_env(monkeypatch):
    monkeypatch.setenv("PIPESCHED_LAUNCH_STORE", "rank0")
    assert launch(rt_launch_store_host.who_hosts, 2, timeout=120, start_method="fork") == [(0, "rank0")] * 2
