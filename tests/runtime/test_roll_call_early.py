"""A rank whose wait saw a closed connection answers the roll call as soon as another rank has (a race found by
slowing one rank down after test_checkpoint_group failed once in CI): rank A's wait times out, gloo closes A's connections, rank B (alive, still waiting) sees the close.
B used to answer only after its 1 s store read and the probe of its groups, about 1 s into A's 1 s roll call, so a B
held off the CPU a little longer was named stalled in A's record. Now B polls one job-wide "some rank answered" key
while it reads the store and answers at once. In-memory store, no timing."""
import types

import torch

from pipesched.runtime import lost_rank, pipeline_failure
from pipesched.runtime.comm import make_grid
from pipesched.runtime.failure import CommError, FailureChannel, FailureRecord
from pipesched.runtime.stalled import another_answered, answer_roll_call, lookup_answering, roll_call_keys

from memory_store import MemoryStore

JOB = "pipesched/pipeline-7"


class _LoggingStore(MemoryStore):
    def __init__(self):
        super().__init__()
        self.log = []

    def set(self, key, value):
        self.log.append(("set", key))
        super().set(key, value)

    def check(self, keys):
        self.log.append(("check", *keys))
        return super().check(keys)


def _channel():
    return FailureChannel(_LoggingStore(), ["pp1", "dp0"], job_key=JOB)


def test_an_answer_sets_the_job_wide_key_under_every_roll_call_key_too():
    channel = _channel()
    assert not another_answered(channel)
    assert answer_roll_call(channel, 0)
    assert set(channel.store.data) == {*roll_call_keys(channel, 0), f"{JOB}/timed-out/any"}
    assert another_answered(channel)


def test_a_closed_connection_is_answered_at_the_first_poll_after_another_rank_answered():
    channel = _channel()
    answer_roll_call(channel, 0)  # rank 0 timed out: gloo closed its connections
    channel.store.log.clear()
    assert lookup_answering(channel, 1, wait_s=0.0) is None  # no record yet
    first_any = channel.store.log.index(("check", f"{JOB}/timed-out/any"))
    sets = [entry[1] for entry in channel.store.log if entry[0] == "set"]
    assert sets == [*roll_call_keys(channel, 1), f"{JOB}/timed-out/any"]
    assert channel.store.log.index(("set", roll_call_keys(channel, 1)[0])) == first_any + 1  # at once


def test_nobody_answered_no_answer_and_a_record_found_is_returned_without_one():
    channel = _channel()
    assert lookup_answering(channel, 1, wait_s=0.0) is None
    assert not [entry for entry in channel.store.log if entry[0] == "set"]  # a lost peer: nothing said yet
    record = FailureRecord(rank=0, pp_rank=0, id="0:1", cause="CommError: timed out")
    channel.store.data["pipesched/pp1/error"] = record.to_json()
    answer_roll_call(channel, 0)
    channel.store.log.clear()
    assert lookup_answering(channel, 1, wait_s=0.0) == record
    assert not [entry for entry in channel.store.log if entry[0] == "set"]  # the record: nothing to wait for


def test_fail_answers_before_it_probes_for_the_closed_member(monkeypatch):
    monkeypatch.setattr(lost_rank, "_TIMED_OUT_PEER_S", 0.0)
    channel = _channel()
    answer_roll_call(channel, 0)
    channel.store.log.clear()
    executor = types.SimpleNamespace(current=None, step=None, transport=types.SimpleNamespace(group=None),
                                     dp_group=None, failed_input=None)
    pipe = types.SimpleNamespace(grid=make_grid(1, 4, 2), _executor=executor, _failures=channel, _pp_group=None,
                                 _dp_group=None, _tie_groups={}, _handshake=types.SimpleNamespace(dp_group=None),
                                 _departure=None, device=torch.device("cpu"), timeout=3.0, _away_s=0.0, _broken=None)
    closed = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:63631")
    error = pipeline_failure.fail(pipe, CommError("DCP's collectives while reading '/tmp/ckpt'", closed))
    answered = channel.store.log.index(("set", roll_call_keys(channel, 1)[0]))
    probed = channel.store.log.index(("check", roll_call_keys(channel, 0)[0]))  # lost_record: did rank 0 answer?
    assert answered < probed, channel.store.log
    assert (error.rank, error.record.lost) == (1, False)  # rank 0 published nothing: this rank's own account
