"""A rank SIGKILLed in the middle of a step: every other rank ends with a PipelineError naming the lost rank (world
and pipeline rank), whatever it was blocked on, and launch reports the killed child instead of hanging.

Each case is one launch (a killed process cannot run a second case); 3-4 ranks of Linear(4, 4) layers. No timing
assertion: the Pipeline timeout is 60 s and launch's 120 s, so a rank that only ended by its timeout would still pass
the bound, but it would name itself (a timed-out wait finds no lost rank), which the assertions refuse.
"""
import json
import re

import pytest

from pipesched.runtime import launch

import rt_lost_rank
from memory_store import MemoryStore

pytestmark = pytest.mark.multiprocess


def _run(tmp_path, world, victim, when, schedule, dp_size=1):
    """Launch the case; return the survivors' reports by world rank. launch raises the killed child's error."""
    with pytest.raises(RuntimeError) as info:
        launch(rt_lost_rank.run_case, world, str(tmp_path), victim, when, schedule, dp_size, timeout=120,
               start_method="fork")  # no interpreter start and import per rank: each case is a fresh launch
    assert re.fullmatch(rf"launch: rank {victim} exited with code -9 without reporting \(killed by signal 9\).*",
                        str(info.value), re.S), str(info.value)[:500]
    reports = {}
    for rank in range(world):
        if rank != victim:
            with open(tmp_path / f"{rank}.json") as handle:
                reports[rank] = json.load(handle)
    return reports


def _assert_names(reports, victim, pp_rank, steps_before=1):
    for rank, rep in reports.items():
        assert rep["type"] == "PipelineError", (rank, rep)
        assert (rep["rank"], rep["pp_rank"], rep["lost"], rep["steps"]) == (victim, pp_rank, True, steps_before), \
            (rank, rep)
        assert rep["message"].startswith(f"pipeline rank failure: world rank {victim} (pipeline rank {pp_rank}) "
                                         f"was lost: its process ended in the middle of the step"), (rank, rep)
        assert f"[reported to world rank {rank}: while waiting for " in rep["message"], (rank, rep)


def _waited_for(rep) -> str:
    return rep["message"].rsplit("while waiting for ", 1)[1]


def test_store_host_killed_in_a_forward(tmp_path, monkeypatch):
    # world rank 0 hosts the store (env://'s layout; launch's own process hosts it otherwise); rank 1 waits on it,
    # rank 2 waits on rank 1 (a different peer)
    monkeypatch.setenv("PIPESCHED_LAUNCH_STORE", "rank0")
    reports = _run(tmp_path, 3, 0, "F", schedule="gpipe")
    _assert_names(reports, 0, 0)
    assert _waited_for(reports[1]).startswith("RECV_F1.") and _waited_for(reports[2]).startswith("RECV_F2.")
    assert "it hosts the store, which no longer answers" in reports[1]["message"]


def test_last_rank_killed_in_a_backward_reaches_the_first_through_the_middle(tmp_path):
    reports = _run(tmp_path, 3, 2, "B", schedule="1f1b")
    _assert_names(reports, 2, 2)
    assert _waited_for(reports[1]).startswith("RECV_B1.") and _waited_for(reports[0]).startswith("RECV_B0.")


def test_dp2_pp2_the_other_replica_ends_in_the_data_parallel_all_reduce(tmp_path):
    # world rank 1 = pipeline rank 1 of replica 0; replica 1 (world ranks 2, 3) waits in the all-reduce
    reports = _run(tmp_path, 4, 1, "B", schedule="1f1b", dp_size=2)
    _assert_names(reports, 1, 1)
    assert _waited_for(reports[0]).startswith("RECV_B0.")
    for rank in (2, 3):
        assert _waited_for(reports[rank]).startswith("the data-parallel all-reduce"), reports[rank]


@pytest.mark.parametrize("victim", [1, 0], ids=["middle", "store-host"])
def test_killed_between_steps_the_others_end_in_the_step_opening_all_gather(tmp_path, victim):
    reports = _run(tmp_path, 3, victim, "between", schedule="1f1b")
    _assert_names(reports, victim, victim)
    for rep in reports.values():
        assert _waited_for(rep) == "the step signature]", rep


@pytest.mark.parametrize("when, waited", [
    ("gather", "the all-gather of gather_timeline over the pipeline group]"),
    ("collective", "the collective of run_collective]"),
    ("clip", "the all-gather of clip_grad_norm_ over the pipeline group]")])
def test_killed_between_steps_the_others_end_in_a_collective_outside_step(tmp_path, when, waited):
    # world rank 2 dies after step 0; ranks 0 and 1 call gather_timeline / run_collective(all_reduce) / clip:
    # each raises a PipelineError naming world rank 2 (not a raw gloo error, not itself), as step() would
    reports = _run(tmp_path, 3, 2, when, schedule="1f1b")
    _assert_names(reports, 2, 2)
    for rep in reports.values():
        assert _waited_for(rep) == waited, rep


class _Group:
    """A gloo group of which members ``closed`` (group ranks) closed their connections."""

    def __init__(self, me, closed):
        self.me, self.closed = me, closed

    def rank(self):
        return self.me

    def recv(self, tensors, src, tag):
        if src in self.closed:
            raise RuntimeError(f"[pair.cc:553] Connection closed by peer [127.0.0.1]:{4000 + src}")
        return object()


def test_a_collective_names_the_member_whose_connection_closed_and_publishes_it(monkeypatch):
    """No peer to blame in a collective: the closed member of this rank's data-parallel group is named (world
    rank 1 = pipeline rank 1 of replica 0, seen from world rank 3 = pipeline rank 1 of replica 1, DP 2 x PP 2),
    and the record is published for the ranks that wait on this one."""
    import torch

    from pipesched.runtime.comm import make_grid
    from pipesched.runtime.failure import CommError, FailureChannel
    from pipesched.runtime.lost_rank import lost_record

    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    exc = CommError("the data-parallel all-reduce of stage 1", RuntimeError("Connection reset by peer"))
    channel = FailureChannel(MemoryStore(), ["pp", "dp"])
    groups = (_Group(1, closed=()), _Group(1, closed=(0,)))  # pipeline group (world 2, 3); DP group (world 1, 3)
    record = lost_record(exc, make_grid(3, 4, 2), channel, groups, torch.device("cpu"))
    assert (record.rank, record.pp_rank, record.lost) == (1, 1, True)
    assert record.cause.endswith("world rank 3 (pipeline rank 1) found it while waiting for the data-parallel "
                                 "all-reduce of stage 1: it closed its connection")
    assert channel.lookup() == record  # published under both groups' keys
    assert all(key in channel.store.data for key in channel.keys)
    # every member still answers: nothing to name (the rank then reports its own failure)
    fresh = FailureChannel(MemoryStore(), ["pp"])
    assert lost_record(exc, make_grid(3, 4, 2), fresh, (_Group(1, ()), None), torch.device("cpu")) is None
    # under torchrun's agent store an unreachable store names no host: the closed member is named
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    dead = FailureChannel(MemoryStore(), ["pp"])
    dead.unreachable = True
    record = lost_record(exc, make_grid(2, 3, 1), dead, (_Group(2, closed=(1,)), None), torch.device("cpu"))
    assert (record.rank, record.pp_rank) == (1, 1)


def test_the_store_host_lingers_for_the_survivors_only_after_a_lost_record():
    """World rank 0 keeps the store up until every rank read the record; the lost rank never reads it, so for a
    lost record the survivors (world size - 1) are everyone."""
    from pipesched.runtime.failure import FailureChannel, FailureRecord

    class Counting:
        def add(self, key, n):
            return 2  # two of three ranks have read it

    linger = FailureChannel(Counting(), ["g"]).keep_alive_for(FailureRecord(rank=1, id="lost:1:5", lost=True), 3, 30.0)
    assert linger(max_s=5.0) < 1.0  # returns at once, not after the grace


def test_outside_step_only_a_peer_that_closed_its_connection_becomes_a_comm_error():
    """run_collective's conversion: gloo's closed-connection error -> CommError (connection_lost, no peer: the
    Pipeline probes its groups); the caller's own error and a timeout stay as they are (they name this rank)."""
    from pipesched.runtime.collective import peer_loss_as_comm_error
    from pipesched.runtime.failure import CommError

    def raising(exc):
        def run():
            raise exc
        return run

    closed = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                          "[127.0.0.1]:10670")
    with pytest.raises(CommError) as info:
        peer_loss_as_comm_error(raising(closed), "the collective of run_collective")
    assert (info.value.what, info.value.original, info.value.peer, info.value.connection_lost) == \
        ("the collective of run_collective", closed, None, True)
    for own in (RuntimeError("Timed out waiting 3000ms for recv operation to complete"), ValueError("bad shape")):
        with pytest.raises(type(own)) as info:
            peer_loss_as_comm_error(raising(own), "x")
        assert info.value is own
    passed = CommError("a send to pipeline rank 1", closed, 1)
    with pytest.raises(CommError) as info:
        peer_loss_as_comm_error(raising(passed), "x")
    assert info.value is passed
    assert peer_loss_as_comm_error(lambda: 7, "x") == 7
