"""A live rank is never named lost (chaos trial, helper-97): a rank whose wait timed out may have its connections
closed by gloo, so a peer blocked on it sees a closed connection, finds no record within its 1 s read and would name
it "lost: its process ended" -- and the timed-out rank, alive, would adopt that record naming itself.

Two rules, checked with fake pipes and in-memory stores (no process groups, no timing):
1. a ``lost`` record naming this rank is not adopted by this rank (it gives its own account);
2. a timed-out rank answers the roll call before it reads the store, and a peer whose connection to it closed does
   not name a rank that answered the roll call as lost (it takes that rank's own record).
"""
import types

import pytest
import torch

from pipesched.runtime import lost_rank, pipeline_failure
from pipesched.runtime.comm import make_grid
from pipesched.runtime.failure import CommError, FailureChannel, FailureRecord, PipelineError
from pipesched.runtime.lost_rank import adoptable, lost_record
from pipesched.runtime.stalled import roll_call_keys

from memory_store import MemoryStore

_TIMED_OUT = RuntimeError("[../gloo/transport/unbound_buffer.cc:81] Timed out waiting 15000ms for recv operation "
                          "to complete")
_CLOSED = RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer")
_KEY = "pipesched/pp0/error"


class _LoggingStore(MemoryStore):
    """Logs every call; ``reveal``: records that appear in the store once a roll-call key is checked (a peer that
    publishes while this rank reads the roll call)."""

    def __init__(self, reveal=None):
        super().__init__()
        self.log, self.reveal = [], dict(reveal or {})

    def set(self, key, value):
        self.log.append(("set", key))
        super().set(key, value)

    def check(self, keys):
        self.log.append(("check", *keys))
        if any("/timed-out/" in key for key in keys):
            self.data.update(self.reveal)
            self.reveal = {}
        return super().check(keys)


def _pipe(world_rank, world_size, store):
    """What ``pipeline_failure.fail`` reads of a Pipeline: a grid, a failure channel, no process groups."""
    executor = types.SimpleNamespace(current=None, step=None, transport=types.SimpleNamespace(group=None),
                                     dp_group=None, failed_input=None)
    return types.SimpleNamespace(grid=make_grid(world_rank, world_size, 1), _executor=executor,
                                 _failures=FailureChannel(store, ["pp0"]), _pp_group=None, _dp_group=None,
                                 _tie_groups={}, _handshake=types.SimpleNamespace(dp_group=None), _departure=None,
                                 device=torch.device("cpu"), timeout=15.0, _away_s=0.0, _broken=None)


def _lost(rank, pp_size):
    return FailureRecord(rank=rank, pp_rank=rank % pp_size, lost=True, id=f"lost:{rank}:1",
                         cause=f"world rank {rank} (pipeline rank {rank % pp_size}) was lost: its process ended")


@pytest.fixture(autouse=True)
def _no_linger(monkeypatch):
    monkeypatch.setattr(pipeline_failure, "_ORIGIN_GRACE_S", 0.0)  # a fake store: nobody reads it at exit
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)


def test_a_record_calling_this_rank_lost_is_not_adopted_by_it():
    mine, other = _lost(1, 4), _lost(2, 4)
    assert adoptable(mine, 1) is None
    assert adoptable(mine, 0) is mine and adoptable(other, 1) is other and adoptable(None, 1) is None
    timed_out = FailureRecord(rank=1, pp_rank=1, cause="RuntimeError: timed out", id="1:1")
    assert adoptable(timed_out, 1) is timed_out  # its own (not lost) record: read back as it is


def test_a_timed_out_rank_that_finds_itself_named_lost_gives_its_own_timeout():
    # world rank 1 of 4 (PP=4) timed out waiting on rank 2; rank 0 has meanwhile published "rank 1 lost"
    store = MemoryStore()
    store.set(_KEY, _lost(1, 4).to_json())
    for rank in (0, 3):  # they answered the roll call: only rank 2 is silent
        store.set(roll_call_keys(FailureChannel(store, ["pp0"]), rank)[0], "1")
    pipe = _pipe(1, 4, store)
    error = pipeline_failure.fail(pipe, CommError("RECV_B1.2 from pipeline rank 2", _TIMED_OUT, 2))
    assert isinstance(error, PipelineError) and pipe._broken is error
    assert (error.rank, error.pp_rank, error.record.lost) == (1, 1, False)
    assert error.cause.startswith("CommError: RECV_B1.2 from pipeline rank 2: RuntimeError: [../gloo/transport/"
                                  "unbound_buffer.cc:81] Timed out waiting 15000ms"), error.cause
    assert "; world rank 2 (pipeline rank 2) did not time out within 1 s of this rank" in error.cause
    assert "was lost" not in str(error)


def test_a_rank_whose_lost_probe_reads_back_a_record_naming_itself_gives_its_own_account():
    # world rank 1 waits on rank 0, whose connection closed; a record naming rank 1 lost is already there
    store = MemoryStore()
    store.set(_KEY, _lost(1, 2).to_json())
    pipe = _pipe(1, 2, store)
    error = pipeline_failure.fail(pipe, CommError("RECV_F1.1 from pipeline rank 0", _CLOSED, 0))
    assert (error.rank, error.record.lost) == (1, False)
    assert error.cause.startswith("CommError: RECV_F1.1 from pipeline rank 0: RuntimeError: "), error.cause


def test_a_timed_out_rank_answers_the_roll_call_before_it_reads_the_store():
    store = _LoggingStore()
    pipe = _pipe(1, 2, store)
    pipeline_failure.fail(pipe, CommError("RECV_B1.2 from pipeline rank 0", _TIMED_OUT, 0))
    answered = store.log.index(("set", "pipesched/pp0/error/timed-out/1"))
    first_read = next(i for i, call in enumerate(store.log) if call[:2] == ("check", "pipesched/job/error"))
    assert answered < first_read, store.log[:6]


def test_a_closed_peer_that_answered_the_roll_call_is_not_named_lost_its_record_is_taken():
    # world rank 0 of 4 waits on rank 1 (pipeline rank 1), whose connection closed when its own wait on rank 2
    # timed out; rank 1 answered the roll call and publishes its timeout while rank 0 reads the roll call
    theirs = FailureRecord(rank=1, pp_rank=1, id="1:5", cause="CommError: RECV_B1.2 from pipeline rank 2: timed out")
    store = _LoggingStore(reveal={_KEY: theirs.to_json()})
    store.data["pipesched/pp0/error/timed-out/1"] = "1"
    channel = FailureChannel(store, ["pp0"])
    exc = CommError("RECV_B0.2 from pipeline rank 1", _CLOSED, 1)
    record = lost_record(exc, make_grid(0, 4, 1), channel, (None, None), torch.device("cpu"))
    assert record == theirs
    assert store.data["pipesched/pp0/error/timed-out/0"] == "1"  # rank 0 is not the stalled one either
    assert FailureRecord.from_json(store.data[_KEY]) == theirs  # no "lost" record published over it


def test_a_closed_peer_that_answered_the_roll_call_but_published_nothing_is_still_not_named(monkeypatch):
    monkeypatch.setattr(lost_rank, "_TIMED_OUT_PEER_S", 0.0)
    store = MemoryStore()
    store.set("pipesched/pp0/error/timed-out/1", "1")
    pipe = _pipe(0, 4, store)
    error = pipeline_failure.fail(pipe, CommError("RECV_B0.2 from pipeline rank 1", _CLOSED, 1))
    assert (error.rank, error.record.lost) == (0, False)  # this rank's own account: its wait's closed connection
    assert error.cause.startswith("CommError: RECV_B0.2 from pipeline rank 1: RuntimeError: ")
    assert _KEY in store.data and not FailureRecord.from_json(store.data[_KEY]).lost


def test_a_closed_peer_that_did_not_answer_is_named_lost_as_before():
    store = MemoryStore()
    store.set("pipesched/pp0/error/timed-out/2", "1")  # another member answered; the waited-on peer did not
    channel = FailureChannel(store, ["pp0"])
    exc = CommError("RECV_B0.2 from pipeline rank 1", _CLOSED, 1)
    record = lost_record(exc, make_grid(0, 4, 1), channel, (None, None), torch.device("cpu"))
    assert (record.rank, record.pp_rank, record.lost) == (1, 1, True)
    assert FailureRecord.from_json(store.data[_KEY]) == record
