"""Small runtime fixes (s11), on one 2-rank gloo launch (spawned; Pipeline timeouts 20 s, launch timeout 180 s; a
regression shows as another outcome string, or as a TimeoutError after 20 s; nothing here is timed):

- ``profile_link(repeat=...)`` had no upper bound (``repeat=10**9`` allocated 16 GB of send-time slots, then
  ping-ponged for days) and ``nbytes`` none either (a 10**15-byte message): both are refused on every rank of the
  group before any message of the measurement (:data:`pipesched.checks.MAX_RUNS` = 10,000 round trips per size;
  :data:`~pipesched.runtime.link_profile.MAX_NBYTES` = 1 GiB); ``nbytes`` may be a numpy array.
- ``peak_activation_bytes`` / ``peak_memory_allocated`` after a failed step returned the last good step's values;
  now they raise ``PipelineError`` as ``timeline()`` does.
- After a failed ``make_groups`` on one rank (rank 1's creation raised after its ``dist.new_group``, while rank 0's
  had returned), rank 0 had filed its ``connected`` entry and rank 1 none: at the job's next construction rank 1
  met rank 0's stale entry and returned at once while rank 0 waited for rank 1 until its timeout (rank 0:
  TimeoutError; rank 1's Pipeline unusable). Now the failing rank files its entry too
  (:func:`pipesched.runtime.agreement.groups_failed`) and the next Pipeline trains on both ranks.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline, launch, profile_link
from pipesched.runtime import comm
from pipesched.runtime.link_profile import MAX_NBYTES, _checked

pytestmark = pytest.mark.multiprocess

TIMEOUT = 20.0
INJECTED = "RuntimeError: injected: world rank 1's groups failed after dist.new_group"
BOOM = "ValueError: boom on world rank 1"


class Boom(nn.Module):
    """The identity, until ``armed``: then its forward raises."""

    armed = False

    def forward(self, x):
        if self.armed:
            raise ValueError("boom on world rank 1")
        return x


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), Boom())


def _pipe(model=None, timeout=TIMEOUT) -> Pipeline:
    return Pipeline(model if model is not None else _model(), num_microbatches=2, loss_fn=F.mse_loss,
                    balance=[2, 2], timeout=timeout)


def _outcome(call):
    try:
        return ("ok", call())
    except Exception as exc:  # noqa: BLE001 - recorded for the test to judge
        return (type(exc).__name__, str(exc))


def _links(rank) -> dict:
    out = {"huge repeat": _outcome(lambda: profile_link(nbytes=(1024, 4096), repeat=10 ** 9)),
           "repeat on rank 1": _outcome(lambda: profile_link(nbytes=(1024, 4096), repeat=10_001 if rank else 2)),
           "huge nbytes": _outcome(lambda: profile_link(nbytes=(1024, 10 ** 15), repeat=2))}
    link = _outcome(lambda: profile_link(nbytes=np.array([1024, 4096]), repeat=2))  # numpy sizes: refused before
    out["numpy nbytes"] = (link[0], type(link[1]).__name__)
    return out


def _failed_then_again(rank, inject, first_timeout, second_timeout=TIMEOUT) -> dict:
    """A Pipeline whose construction ``inject`` makes fail on world rank 1 (its first call only), then another on
    both ranks, which steps once; with the store's construction counters of both ranks after it."""
    if rank == 1:
        inject()
    out = {"first": _outcome(lambda: _pipe(timeout=first_timeout))}
    out["second"] = _outcome(lambda: _pipe(timeout=second_timeout))
    if out["second"][0] == "ok":
        pipe = out["second"][1]
        x, y = torch.ones(4, 8), torch.zeros(4, 8)
        out["second"] = ("ok", "Pipeline")
        out["loss"] = _outcome(lambda: float(pipe.step(x, target=y)))
        out["reference"] = F.mse_loss(_model()(x), y).item()
        pipe.close()
    store = dist.distributed_c10d._get_default_store()
    out["connected counts"] = [store.add(f"pipesched/connected/count/{r}", 0) for r in (0, 1)]
    out["groups counts"] = [store.add(f"pipesched/groups/count/{r}", 0) for r in (0, 1)]
    return out


def _after_creating():
    """Rank 1's make_groups raises after its dist.new_group returned (as rank 0's does: it goes on to connected)."""
    real = comm._new_groups

    def failing_once(*args, **kwargs):
        real(*args, **kwargs)
        comm._new_groups = real
        raise RuntimeError("injected: world rank 1's groups failed after dist.new_group")

    comm._new_groups = failing_once


def _in_creating():
    """Rank 1's gloo group creation raises (after torch named the group, as a real failure in it does): rank 0 is
    left blocked in its own creation, waiting for rank 1 to connect, until its timeout."""
    c10d = dist.distributed_c10d
    real = c10d._new_process_group_helper

    def failing_once(*args, **kwargs):
        c10d._new_process_group_helper = real
        raise RuntimeError("injected: world rank 1's gloo group creation failed")

    c10d._new_process_group_helper = failing_once


def _groups(rank) -> dict:
    """The job's 2nd to 5th Pipelines: each of the two failures on rank 1, then a good Pipeline on both ranks."""
    return {"after": _failed_then_again(rank, _after_creating, TIMEOUT),
            # rank 0 blocked 8 s; the next construction's agreement waits 4 s: without the wait in groups_failed,
            # rank 1 came to it 8 s before rank 0 and gave up on it (with an equal timeout: a race, lost mostly)
            "blocked": _failed_then_again(rank, _in_creating, 8.0, 4.0)}


def _peaks(rank) -> dict:
    model = _model()
    pipe = _pipe(model)
    x, y = torch.ones(4, 8), torch.zeros(4, 8)
    pipe.step(x, target=y)
    out = {"good": (pipe.peak_activation_bytes, pipe.peak_memory_allocated)}
    model[3].armed = rank == 1  # on rank 1's stage (balance [2, 2])
    out["step"] = _outcome(lambda: pipe.step(x, target=y))
    for name in ("peak_activation_bytes", "peak_memory_allocated"):
        out[name] = _outcome(lambda: getattr(pipe, name))
    out["timeline"] = _outcome(pipe.timeline)
    return out


def body(rank):
    torch.set_num_threads(1)
    out = {"links": _links(rank), "peaks": _peaks(rank)}  # a failed step leaves the job's next Pipeline free
    out["groups"] = _groups(rank)  # last: with the counters out of step, no later Pipeline of the job could meet
    return out


@pytest.fixture(scope="module")
def results():
    return launch(body, 2, timeout=180)


def test_profile_link_refuses_a_huge_repeat_or_message_on_every_rank(results):
    repeat = "repeat must be an int 1..10,000 (round trips per size), got "
    # before: repeat=10**9 allocated 2 x 10**9 float64 slots, then ping-ponged for days
    assert [r["links"]["huge repeat"] for r in results] == [("ValueError", f"{repeat}1000000000")] * 2
    assert [r["links"]["repeat on rank 1"] for r in results] == [
        ("ValueError", f"profile_link: rank 1 refused its arguments: {repeat}10001"), ("ValueError", f"{repeat}10001")]
    nbytes = ("nbytes must hold >= 2 distinct ints 1..1,073,741,824 (bytes of a message; at most 1 GiB), got "
              "(1024, 1000000000000000)")
    assert [r["links"]["huge nbytes"] for r in results] == [("ValueError", nbytes)] * 2
    # before: a numpy array was refused ("must hold >= 2 distinct positive ints"); the refusals left nothing in flight
    assert [r["links"]["numpy nbytes"] for r in results] == [("ok", "Link")] * 2


def test_profile_link_bounds_are_inclusive():
    cpu = torch.device("cpu")
    assert MAX_NBYTES == 1 << 30
    assert _checked(np.array([MAX_NBYTES, 1]), np.int64(10_000), "cpu", None) == ([1, MAX_NBYTES], 10_000, cpu)
    with pytest.raises(ValueError, match=r"^nbytes must hold >= 2 distinct ints 1\.\.1,073,741,824 .*, got "
                                         r"\[1, 1073741825\]$"):
        _checked([1, MAX_NBYTES + 1], 1, "cpu", None)
    with pytest.raises(ValueError, match=r"^repeat must be an int 1\.\.10,000 \(round trips per size\), got 0$"):
        _checked([1, 2], 0, "cpu", None)


def _trains_again(case: dict, counts: int) -> None:
    assert case["second"] == ("ok", "Pipeline")
    assert case["loss"][0] == "ok"
    assert case["loss"][1] == pytest.approx(case["reference"], rel=1e-6)  # the unsplit model's
    assert case["connected counts"] == case["groups counts"] == [counts, counts]


def test_a_second_pipeline_after_make_groups_failed_on_one_rank_trains_on_every_rank(results):
    said = ("pipeline rank failure: world rank 1 (pipeline rank 1) failed while creating the Pipeline's process "
            f"groups (dist.new_group, every rank of the job, timeout=20 s): {INJECTED}")
    assert results[1]["groups"]["after"]["first"] == ("PipelineError", said)
    assert results[0]["groups"]["after"]["first"] == (  # rank 0's creation had returned: connected names rank 1
        "PipelineError", f"{said} [reported to world rank 0: while waiting for every rank's entry in "
                         f"pipesched/connected/2]")
    for r in results:  # before: rank 0 TimeoutError (rank 1 never filed its entry of round 2)
        _trains_again(r["groups"]["after"], 3)  # the job's 3rd construction (after _peaks' and the failed one)


def test_a_second_pipeline_after_gloo_creation_failed_on_one_rank_trains_on_every_rank(results):
    """Rank 0 was blocked in its gloo creation until its timeout (8 s) while rank 1 failed at once: before, rank 1
    reached the next construction's agreement (timeout 4 s) 8 s early and gave up on rank 0 there (TimeoutError on
    both ranks); now rank 1 waits for rank 0's entry of the failed round (groups_failed): they leave it together."""
    said = ("pipeline rank failure: world rank 1 (pipeline rank 1) failed while creating the Pipeline's process "
            "groups (dist.new_group, every rank of the job, timeout=8 s): RuntimeError: injected: world rank 1's "
            "gloo group creation failed")
    assert results[1]["groups"]["blocked"]["first"] == ("PipelineError", said)
    mine, theirs = results[0]["groups"]["blocked"]["first"]
    assert mine == "PipelineError" and theirs.startswith(f"{said} [reported to world rank 0: its own wait ended with ")
    for r in results:
        _trains_again(r["groups"]["blocked"], 5)


def test_peaks_after_a_failed_step_raise_as_timeline_does(results):
    failed = ("pipeline rank failure: world rank 1 (pipeline rank 1) failed at instruction F1.0 (kind F, stage 1, "
              f"microbatch 0): {BOOM}; its input (from stage 0 on pipeline rank 0): tensor (2, 8) float32")
    for rank, r in enumerate(results):
        good = r["peaks"]["good"]
        assert isinstance(good[0], int) and good[0] > 0 and good[1] is None  # CPU: no device peak
        assert r["peaks"]["step"][0] == "PipelineError" and r["peaks"]["step"][1].startswith(failed)
        for name in ("peak_activation_bytes", "peak_memory_allocated"):
            # before: ("ok", good[0]) and ("ok", None): the last good step's, silently
            note = f" [reported to world rank 0: {name}: this Pipeline failed in an earlier step]" if rank == 0 else ""
            assert r["peaks"][name] == ("PipelineError", failed + note)
        timeline = " [reported to world rank 0: timeline(kind='step'): this Pipeline failed in an earlier step]"
        assert r["peaks"]["timeline"] == ("PipelineError", failed + (timeline if rank == 0 else ""))


def test_connected_after_a_rank_filed_its_failed_entry_raises_its_record_and_the_counters_stay_in_step(monkeypatch):
    """Store-level: rank 1's make_groups fails and it files its connected entry (groups_failed); rank 0's connected
    finds every entry of the round present and still raises rank 1's record (not "complete": rank 0 would
    otherwise return a Pipeline whose peer has none); both counters are then 1, and the next round meets."""
    from pipesched.runtime import PipelineError
    from pipesched.runtime.agreement import connected, groups_failed
    from pipesched.runtime.comm import Grid

    store = dist.HashStore()
    monkeypatch.setattr(comm.dist.distributed_c10d, "_get_default_store", lambda: store)
    grids = {rank: Grid(world_rank=rank, world_size=2, pp_size=2, dp_size=1) for rank in (0, 1)}

    def make(rank, fail):
        def new_groups(grid, timeout, device):
            if fail:
                raise RuntimeError("ncclInternalError: rank 1 could not create its communicator")
            return "pp", None
        monkeypatch.setattr(comm, "_new_groups", new_groups)
        return comm.make_groups(grids[rank], 30.0, torch.device("cpu"))

    assert make(0, False) == ("pp", None)
    with pytest.raises(PipelineError) as own:
        make(1, True)
    groups_failed(store, 1, 2, 0.0, own.value)  # as Pipeline does: before, rank 1 filed nothing here
    with pytest.raises(PipelineError) as raised:
        connected(store, 0, 2, timeout=30.0)
    assert (raised.value.rank, raised.value.seen_by) == (1, 0)
    assert raised.value.cause == "RuntimeError: ncclInternalError: rank 1 could not create its communicator"
    assert str(raised.value).endswith("[reported to world rank 0: while waiting for every rank's entry in "
                                      "pipesched/connected/1]")
    assert [store.add(f"pipesched/connected/count/{r}", 0) for r in (0, 1)] == [1, 1]  # before: [1, 0]
    for rank in (0, 1):  # the next construction: both create their groups and meet in round 2
        assert make(rank, False) == ("pp", None)
    store.set("pipesched/connected/2/1", "true")  # rank 1's entry of round 2, as its connected() files it
    store.add("pipesched/connected/count/1", 1)
    assert connected(store, 0, 2, timeout=30.0) is None
