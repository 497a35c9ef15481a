"""Ctrl-C and sys.exit() inside a step, and how long a failing rank's process stays up for its peers.

- A ``KeyboardInterrupt`` or ``SystemExit`` raised in a step on one rank stays itself there (before: wrapped in a
  ``PipelineError``, a ``RuntimeError`` that a training loop's ``except Exception`` swallowed, Ctrl-C included); the
  other ranks still raise the ``PipelineError`` naming it, and the broken Pipeline refuses later steps.
- The rank that published a failure record lingers at exit until its readers read it (torchrun's hunt: Ctrl-C and a
  hung rank each kept the job up 30 s more, then SIGKILL): ranks the record names as stalled are not readers, and a
  rank whose record lost the race to another's (both failed at once, as every rank does on Ctrl-C under torchrun)
  reads that one and does not linger for its own.
"""
import torch.distributed as dist
import pytest

import rt_interrupts
from pipesched.runtime import launch
from pipesched.runtime.failure import FailureChannel, FailureRecord
from pipesched.runtime.comm import make_grid
from pipesched.runtime.pipeline_failure import _first, publish_and_linger

NAMED = "pipeline rank failure: world rank 1 (pipeline rank 1) failed at instruction F1.0 (kind F, stage 1, microbatch 0): "


@pytest.mark.parametrize("kind, raised, cause", [("KeyboardInterrupt", "KeyboardInterrupt", "KeyboardInterrupt"),
                                                 ("SystemExit", "SystemExit 3", "SystemExit: 3")])
def test_an_interrupt_in_a_step_stays_itself_and_the_others_are_told(kind, raised, cause):
    rank0, rank1 = launch(rt_interrupts.interrupted, 2, kind, timeout=120)
    assert rank0 == ("returned",
                     f"PipelineError: {NAMED}{cause} [reported to world rank 0: while waiting for RECV_B0.0 from "
                     f"pipeline rank 1]",
                     f"PipelineError: {NAMED}{cause} [reported to world rank 0: this Pipeline failed in an earlier "
                     f"step]")
    assert rank1 == ("returned", raised, f"PipelineError: {NAMED}{cause}")


def test_stalled_ranks_are_not_readers_of_the_record():
    store = dist.HashStore()
    record = FailureRecord(rank=0, id="0:1", stalled=(2, 3))  # world ranks 2 and 3 hung: they cannot read it
    assert FailureChannel(store, ["g"]).keep_alive_for(record, 4, 30.0).readers == 2
    assert FailureChannel(store, ["g"]).keep_alive_for(FailureRecord(rank=0, id="0:2"), 4, 30.0).readers == 4


class _Pipe:
    def __init__(self, store, world_rank=1):
        self._failures = FailureChannel(store, ["g"])
        self.grid = make_grid(world_rank, 2, 1)


def test_a_rank_whose_record_came_second_reads_the_first(monkeypatch):
    monkeypatch.setenv("PIPESCHED_LAUNCH_STORE", "parent")  # the store lives elsewhere: only an origin lingers
    store = dist.HashStore()
    theirs, mine = FailureRecord(rank=0, id="0:5"), FailureRecord(rank=1, id="1:6")
    pipe = _Pipe(store)
    pipe._failures.publish(theirs)
    assert publish_and_linger(pipe, mine, origin=True) is None  # nobody reads its own: it does not linger
    assert _first(pipe, mine) == theirs
    assert store.add("pipesched/seen/0:5", 0) == 1 and store.add("pipesched/seen/1:6", 0) == 0  # it read theirs
    alone = _Pipe(dist.HashStore())
    linger = publish_and_linger(alone, mine, origin=True)
    assert (linger.key, linger.readers) == ("pipesched/seen/1:6", 2)  # its own, first: it lingers for both ranks
    linger(max_s=0.0)  # unregistered: pytest's exit does not wait
