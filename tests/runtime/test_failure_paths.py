"""Failure paths outside a step's instructions: one rank's fault ends every rank with that rank's error named.

- a launch ``fn`` raising outside any Pipeline call (before constructing one, after, before its own collective);
- process-group creation (``make_groups``) failing on one rank;
- ``run_collective(work)`` failing on one rank (the message says what ran);
- a rank away longer than the timeout waking after the store host exited (not "rank 0 was lost");
- the failure channel's lingering held per record (no module-level state).

2 forked gloo ranks per case; each rank writes what it raised to a file (launch re-raises only one exception). No
timing assertion: the Pipeline timeouts are long where a prompt end is asserted (a rank left waiting would report a
``TimeoutError`` instead of the expected text)."""
import json
import os
import re
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from memory_store import MemoryStore
from pipesched.runtime import Pipeline, PipelineError, launch
from pipesched.runtime import failure
from pipesched.runtime.failure import FailureChannel, FailureRecord, publish_job_failure
from pipesched.runtime.launch_child import told as _told

pytestmark = pytest.mark.multiprocess

BAD = "ValueError: bad batch on rank 1"
JOB = f"pipeline rank failure: world rank 1 failed in its launch fn, outside any Pipeline call: {BAD}"


def _pipe(timeout: float) -> Pipeline:
    torch.manual_seed(0)
    return Pipeline(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), num_microbatches=2, loss_fn=F.mse_loss,
                    timeout=timeout)


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g)


def _note(out: str, rank: int, exc: BaseException) -> None:
    with open(os.path.join(out, str(rank)), "w") as handle:
        json.dump([type(exc).__name__, str(exc), getattr(exc, "rank", None)], handle)


def _noted(out) -> dict:
    return {int(name): json.loads((out / name).read_text()) for name in os.listdir(out)}


def _run(fn, out, *args, grace: float = 60.0):
    return launch(fn, 2, str(out), *args, timeout=180, grace=grace, start_method="fork")


# ---- a launch fn raising outside any Pipeline call -----------------------------------------------------------

def _raises_before_pipeline(rank, out):
    if rank == 1:
        raise ValueError("bad batch on rank 1")
    try:
        _pipe(timeout=120.0)  # would wait 120 s for rank 1's construction entry
    except Exception as exc:
        _note(out, rank, exc)
        raise


def test_a_fn_raising_before_its_pipeline_is_named_at_once_by_the_rank_constructing_one(tmp_path):
    with pytest.raises(ValueError, match="^bad batch on rank 1$"):  # rank 1's own error, not rank 0's
        _run(_raises_before_pipeline, tmp_path)
    assert _noted(tmp_path) == {0: ["PipelineError", f"{JOB} [reported to world rank 0: while waiting for every "
                                                     f"rank's entry in pipesched/construct/1]", 1]}


def _raises_after_pipeline(rank, out):
    pipe = _pipe(timeout=120.0)
    if rank == 1:
        raise ValueError("bad batch on rank 1")
    try:
        pipe.step(*_batch())
    except Exception as exc:
        _note(out, rank, exc)
        raise


def test_a_fn_raising_after_its_pipeline_is_named_by_the_rank_in_a_step(tmp_path):
    with pytest.raises(ValueError, match="^bad batch on rank 1$"):
        _run(_raises_after_pipeline, tmp_path)
    # before: "world rank 1 (pipeline rank 1) ended without closing its Pipeline (...)", without rank 1's error
    assert _noted(tmp_path) == {0: ["PipelineError", f"{JOB} [reported to world rank 0: while waiting for the step "
                                                     f"signature]", 1]}


def _raises_before_collective(rank, out):
    if rank == 1:
        raise ValueError("bad batch on rank 1")
    try:
        dist.all_reduce(torch.ones(1))
    except Exception as exc:
        _note(out, rank, exc)
        raise


def test_a_fn_raising_before_its_own_collective_ends_the_job_with_its_error(tmp_path):
    with pytest.raises(ValueError, match="^bad batch on rank 1$") as raised:
        _run(_raises_before_collective, tmp_path)
    assert str(raised.value.__cause__).startswith("in rank 1:\n")
    kind, text, _ = _noted(tmp_path)[0]  # what fn saw on rank 0: torch's own error (launch reports it as below)
    assert kind == "RuntimeError" and "Connection closed by peer" in text


def test_a_peers_collective_error_after_a_published_failure_is_reported_naming_that_rank():
    store = MemoryStore()
    assert publish_job_failure(store, 1, ValueError("bad batch on rank 1")).rank == 1
    closed = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234")
    told = _told(closed, 0, store)
    assert isinstance(told, PipelineError) and told.rank == 1
    assert str(told) == (f"{JOB} [reported to world rank 0: its launch fn then raised RuntimeError: [pair.cc:553] "
                         f"Connection closed by peer [127.0.0.1]:1234]")
    own = KeyError("rank 0's own")  # not a wait: its own failure, reported as it is (the first record stays)
    assert _told(own, 0, store) is own
    assert FailureRecord.from_json(store.get(failure.JOB_KEY).decode()).cause == BAD
    first = MemoryStore()
    assert _told(own, 0, first) is own  # the first to fail publishes
    assert FailureChannel(first, ["g"]).lookup().cause == "KeyError: \"rank 0's own\""


# ---- process-group creation failing on one rank --------------------------------------------------------------

def _groups_fail(rank, out):
    if rank == 1:
        def refused(*args, **kwargs):
            raise RuntimeError("no route to world rank 0")
        dist.new_group = refused  # this forked child's own torch module
    try:
        _pipe(timeout=5.0)
    except Exception as exc:
        _note(out, rank, exc)
        raise


def test_process_group_creation_failing_on_one_rank_names_it_on_every_rank(tmp_path):
    with pytest.raises(PipelineError):
        _run(_groups_fail, tmp_path)
    said = ("pipeline rank failure: world rank 1 (pipeline rank 1) failed while creating the Pipeline's process "
            "groups (dist.new_group, every rank of the job, timeout=5 s): RuntimeError: no route to world rank 0")
    # before: rank 0 raised torch's DistStoreError ("wait timeout after 5000ms, keys: ...") naming nobody
    assert _noted(tmp_path) == {
        0: ["PipelineError", f"{said} [reported to world rank 0: its own wait ended with DistStoreError]", 1],
        1: ["PipelineError", said, 1]}


# ---- run_collective failing on one rank, no step ever run ---------------------------------------------------

def _collective_fails(rank, out):
    pipe = _pipe(timeout=120.0)

    def work(pp_group, _dp_group):
        if rank == 1:
            raise ValueError("work failed on rank 1")
        dist.all_reduce(torch.ones(1), group=pp_group)

    try:
        pipe.run_collective(work)
    except Exception as exc:
        _note(out, rank, exc)
        raise


def test_run_collective_failing_before_any_step_says_a_collective_ran(tmp_path):
    with pytest.raises(PipelineError):
        _run(_collective_fails, tmp_path)
    said = ("pipeline rank failure: world rank 1 (pipeline rank 1) failed in a collective call outside any step "
            "(run_collective): ValueError: work failed on rank 1")  # before: "(while preparing or finishing the step)"
    assert _noted(tmp_path) == {
        0: ["PipelineError", f"{said} [reported to world rank 0: while waiting for the collective of run_collective]",
            1],
        1: ["PipelineError", said, 1]}


# ---- a rank away past the timeout wakes after the store host exited -----------------------------------------

PAUSE_S = 15.0  # rank 1's pause between steps: past rank 0's timeout (3 s), its roll call (1 s) and its exit


def _away_then_store_gone(rank, out):
    pipe = _pipe(timeout=3.0)
    pipe.step(*_batch())
    if rank == 1:
        time.sleep(PAUSE_S)
    try:
        pipe.step(*_batch())
    except PipelineError as exc:
        _note(out, rank, exc)
        if rank == 0:
            os._exit(0)  # the store host leaves once it has named the failure (as at the end of a torchrun job)
        raise


def test_a_rank_away_past_the_timeout_is_told_the_job_ended_not_that_the_store_host_was_lost(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPESCHED_LAUNCH_STORE", "rank0")  # env://'s layout: world rank 0's process hosts the store
    with pytest.raises(RuntimeError, match="^launch: rank 0 exited with code 0 without reporting"):
        _run(_away_then_store_gone, tmp_path)
    noted = _noted(tmp_path)
    assert noted[0][:1] + noted[0][2:] == ["PipelineError", 0]  # rank 0 timed out waiting on rank 1: the origin
    assert "world rank 1 (pipeline rank 1) did not time out within 1 s of this rank" in noted[0][1]
    kind, text, named = noted[1]
    assert (kind, named) == ("PipelineError", 0)
    assert re.fullmatch(
        r"pipeline rank failure: the job most likely ended already: world rank 0 \(pipeline rank 0\), which hosts "
        r"the store, has exited \(the store no longer answers\), and world rank 1 \(pipeline rank 1\) began this "
        r"call \d+ s after its previous one ended, more than timeout=3 s, so a rank waiting on it meanwhile timed "
        r"out; the failure record that named the rank that failed first went with the store\. world rank 1 "
        r"\(pipeline rank 1\) found this while waiting for the step signature \[reported to world rank 1: while "
        r"waiting for the step signature\]", text), text  # before: "world rank 0 (pipeline rank 0) was lost: ..."


# ---- lingering: one Linger per record, no module state -------------------------------------------------------

class _Reads(MemoryStore):
    def __init__(self, read: int) -> None:
        super().__init__()
        self.read = read

    def add(self, key, n):
        return self.read


def test_each_record_lingers_on_its_own_and_the_module_keeps_no_mutable_state():
    waits = [FailureChannel(_Reads(read), ["g"]).keep_alive_for(FailureRecord(rank=0, id=f"0:{read}"), 2, 30.0)
             for read in (2, 1)]  # both ranks read the first record, only one the second
    assert [w.key for w in waits] == ["pipesched/seen/0:2", "pipesched/seen/0:1"]
    assert waits[0]() < 10.0  # read by both: at once, far inside the grace
    assert waits[1](max_s=0.2) < 10.0  # bounded by max_s
    assert (waits[0].grace_s, waits[1].grace_s) == (0.0, 0.0)  # each waited once: interpreter exit waits no more
    mutable = [name for name, value in vars(failure).items()
               if not name.startswith("__") and isinstance(value, (list, dict, set))]
    assert mutable == []
