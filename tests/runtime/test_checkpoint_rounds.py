"""The rounds of the store votes (runtime/exchange.py; bodies in rt_checkpoint_rounds.py, one 2-rank launch with a
Pipeline timeout of 5 s): a rank late to a round the others gave up on raises at once naming them (it does not go on
alone into DCP's collectives or the process groups' creation), ranks in different checkpoint calls are named on every
rank, a non-Pipeline ``pipe`` or a bad argument on one rank is refused on every rank naming it, and after each the
ranks' next calls meet. Plus the round's ruling through an in-memory store (no processes)."""
import json

import pytest

from pipesched.runtime import launch
from pipesched.runtime.exchange import publish, read_all

import rt_checkpoint_rounds
from memory_store import MemoryStore

pytestmark = pytest.mark.multiprocess

ORDER = ("every rank must make the same checkpoint calls (save_checkpoint, load_checkpoint) in the same order "
         "(they are collective: on every rank, not only under `if rank == 0`)")
SAVE_LATE = f"reach save_checkpoint (the vote on its arguments) within 5 s; {ORDER}"
BUILD_LATE = "construct their Pipeline within 5 s; every rank must construct the same Pipelines in the same order"
PIPE = "pipe must be a pipesched.runtime.Pipeline, got {}"
STEP = "step must be None or an int >= 0, got -1"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("rounds")
    return launch(rt_checkpoint_rounds.everything, 2, str(root), timeout=200, start_method="fork")


def _timed_out(got, text):
    """A TimeoutError whose message is ``text`` then the store's own words, in parentheses."""
    kind, message = got
    assert kind == "TimeoutError" and message.startswith(f"{text} ("), got


def test_a_rank_late_to_a_save_the_other_gave_up_on_raises_at_once_naming_it(ranks):
    first, second = ranks
    _timed_out(first["late_save"], f"world ranks [1] did not {SAVE_LATE}")
    assert second["late_save"] == ("TimeoutError", f"world ranks [0] gave up on this round (world ranks [1] did not "
                                                   f"{SAVE_LATE}); world rank 1 reached it after that and does not "
                                                   f"go on alone")
    assert first["save_after_late"] is None and second["save_after_late"] is None  # the next saves meet


def test_ranks_in_different_checkpoint_calls_are_named_on_every_rank_and_then_meet(ranks):
    expected = ("ValueError", f"the ranks are in different checkpoint calls: world rank 0 is in save_checkpoint (the "
                              f"vote on its arguments), world rank 1 in load_checkpoint (the vote on its arguments); "
                              f"{ORDER} (no rank goes on with this call)")
    for got in ranks:
        assert got["mismatch"] == expected
        assert got["save_after_mismatch"] is None and got["load_after_mismatch"] == 3


def test_a_pipe_that_is_not_a_pipeline_on_one_rank_is_refused_on_every_rank(ranks):
    first, second = ranks
    assert second["save_none"] == ("TypeError", PIPE.format("NoneType"))  # its own
    assert first["save_none"] == ("TypeError", "save_checkpoint: world rank 1 refused its arguments: "
                                               + PIPE.format("NoneType"))
    assert first["load_str"] == ("TypeError", PIPE.format("str"))
    assert second["load_str"] == ("TypeError", "load_checkpoint: world rank 0 refused its arguments: "
                                               + PIPE.format("str"))
    assert first["save_retry"] is None and second["save_retry"] is None


def test_another_ranks_refused_argument_names_that_rank(ranks):
    first, second = ranks
    assert second["bad_step"] == ("ValueError", STEP)
    assert first["bad_step"] == ("ValueError", f"save_checkpoint: world rank 1 refused its arguments: {STEP}")
    for got in ranks:
        assert got["load_after"] == 4  # the retried save of step 4, the last one that succeeded
        assert got["saved"] == ["after", "late", "none"]  # no hidden directory of a refused or abandoned save


def test_a_rank_late_to_the_construction_agreement_raises_at_once_naming_it(ranks):
    first, second = ranks
    _timed_out(first["late_construct"], f"world ranks [1] did not {BUILD_LATE}")
    assert second["late_construct"] == ("TimeoutError", f"world ranks [0] gave up on this round (world ranks [1] did "
                                                        f"not {BUILD_LATE}); world rank 1 reached it after that and "
                                                        f"does not go on alone")
    assert first["step_after"] is True and second["step_after"] is True  # the next constructions meet


class _WaitingStore(MemoryStore):
    """``wait`` times out (as c10d's does: a store error) when a key is missing."""

    def wait(self, keys, timeout):
        if not all(k in self.data for k in keys):
            raise RuntimeError("wait timeout after 1000ms")


def test_a_round_is_ruled_once_a_late_rank_fails_and_the_next_round_meets():
    store = _WaitingStore()
    key = publish(store, "seq", 0, {"v": 0})
    with pytest.raises(TimeoutError, match=r"^world ranks \[1\] did not arrive within 1 s \(wait timeout"):
        read_all(store, key, 0, 2, 1.0, "arrive within {timeout} s")
    assert publish(store, "seq", 1, {"v": 1}) == key  # rank 1's first entry: the round rank 0 gave up on
    with pytest.raises(TimeoutError) as late:
        read_all(store, key, 1, 2, 1.0, "arrive within {timeout} s")
    assert str(late.value) == ("world ranks [0] gave up on this round (world ranks [1] did not arrive within 1 s); "
                               "world rank 1 reached it after that and does not go on alone")
    nxt = [publish(store, "seq", rank, {"v": rank + 10}) for rank in (0, 1)]
    assert nxt[0] == nxt[1] != key
    assert [read_all(store, nxt[0], rank, 2, 1.0, "x") for rank in (0, 1)] == [[{"v": 10}, {"v": 11}]] * 2


def test_a_wait_that_times_out_as_the_last_entry_arrives_goes_on_with_the_round():
    class LastMoment(_WaitingStore):
        def wait(self, keys, timeout):  # times out, then the missing entry lands before the ruling
            self.set("seq/1/1", json.dumps({"v": 1}))
            raise RuntimeError("wait timeout")

    store = LastMoment()
    key = publish(store, "seq", 0, {"v": 0})
    assert read_all(store, key, 0, 2, 1.0, "x") == [{"v": 0}, {"v": 1}]
    assert store.data[f"{key}/state"] == "complete"
    # a rank whose wait timed out after another ruled the round complete goes on too
    store = _WaitingStore()
    key = publish(store, "seq", 0, {"v": 0})
    store.data[f"{key}/state"] = "complete"
    store.wait = lambda keys, timeout: (_ for _ in ()).throw(RuntimeError("wait timeout"))
    store.data["seq/1/1"] = json.dumps({"v": 1})
    assert read_all(store, key, 0, 2, 1.0, "x") == [{"v": 0}, {"v": 1}]
