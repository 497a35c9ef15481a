"""A collective's closed connection in a group outside this rank's pipeline and data-parallel groups (CI, session
19: PP=2 x DP=2, world rank 3 stalled inside DCP's read; world rank 0's wait on the checkpoint group timed out and
gloo closed its connections there; world rank 1, still waiting, saw the closed connection, probed only its pipeline
and DP groups, found no closed member, and published its own "connection closed" as the first failure, naming no
stalled rank). Now lost_record probes the checkpoint group too, and where no probed member is closed but a rank
answered the roll call, this rank answers and takes that rank's record. Fake groups, in-memory stores, no timing."""
import torch

from pipesched.runtime import lost_rank
from pipesched.runtime.comm import make_grid
from pipesched.runtime.failure import CommError, FailureChannel, FailureRecord
from pipesched.runtime.lost_rank import lost_record
from pipesched.runtime.stalled import roll_call_keys

from memory_store import MemoryStore
from test_lost_rank import _Group  # a gloo group some of whose members closed their connections

_CLOSED = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:63631")
_WHAT = "DCP's collectives while reading '/tmp/ckpt'"
# world rank 0 timed out, answered the roll call and named world rank 3 as stalled
_THEIRS = FailureRecord(rank=0, pp_rank=0, id="0:7", stalled=(3,),
                        cause="CommError: DCP's collectives while reading '/tmp/ckpt': timed out; world rank 3 ...")


class _PublishingStore(MemoryStore):
    """World rank 0 publishes ``_THEIRS`` under ``key`` once this rank has answered the roll call (rank 0's roll
    call waits for it)."""

    def __init__(self, key):
        super().__init__()
        self.key = key

    def set(self, key, value):
        super().set(key, value)
        if "/timed-out/1" in key:
            super().set(self.key, _THEIRS.to_json())


def _channel(answered=(0,)):
    store = _PublishingStore("pipesched/ckpt/error")
    channel = FailureChannel(store, ["pp0", "dp1", "ckpt"], job_key="pipesched/job7")
    for rank in answered:
        for key in roll_call_keys(channel, rank):
            store.data[key] = "1"
    return channel


def _world_rank_1(channel, groups):
    exc = CommError(_WHAT, _CLOSED)
    assert exc.connection_lost
    return lost_record(exc, make_grid(1, 4, 2), channel, groups, torch.device("cpu"))  # PP=2 x DP=2, world rank 1


def test_a_closed_checkpoint_group_member_that_answered_the_roll_call_is_not_named_its_record_is_taken(monkeypatch):
    monkeypatch.setattr(lost_rank, "_TIMED_OUT_PEER_S", 0.5)
    channel = _channel()
    # pipeline group (world 0, 1) and DP group (world 1, 3) all still open; in the checkpoint group world 0 closed
    record = _world_rank_1(channel, (_Group(1, ()), _Group(0, ()), _Group(1, closed=(0,))))
    assert record == _THEIRS
    assert channel.store.data["pipesched/job7/timed-out/1"] == "1"  # rank 1 answered: not the stalled one


def test_no_closed_member_found_but_a_rank_answered_the_roll_call_takes_its_record(monkeypatch):
    monkeypatch.setattr(lost_rank, "_TIMED_OUT_PEER_S", 0.5)
    channel = _channel()
    record = _world_rank_1(channel, (_Group(1, ()), _Group(0, ())))  # the closed connection is in a group not probed
    assert record == _THEIRS
    assert channel.store.data["pipesched/job7/timed-out/1"] == "1"


def test_no_closed_member_and_nobody_answered_gives_no_record_and_no_roll_call_answer():
    channel = _channel(answered=())
    assert _world_rank_1(channel, (_Group(1, ()), _Group(0, ()), _Group(1, ()))) is None
    assert not [key for key in channel.store.data if "/timed-out/" in key]


def test_a_closed_checkpoint_group_member_that_did_not_answer_is_named_lost():
    channel = _channel(answered=())
    record = _world_rank_1(channel, (_Group(1, ()), _Group(0, ()), _Group(1, closed=(3,))))
    assert (record.rank, record.pp_rank, record.lost) == (3, 1, True)
    assert record.cause.endswith(f"world rank 1 (pipeline rank 1) found it while waiting for {_WHAT}: it closed its "
                                 f"connection")
