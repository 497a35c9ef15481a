"""Session 11 (helper): what every rank must agree on, and the measured timeline's origin.

- Pipeline(timeout=...) is compared in the construction agreement (one timeout: the lost-rank roll call and the
  stalled-rank logic assume it), refused on every rank naming the argument and both ranks' values; so is the
  device type (``cpu``/``cuda``: the groups' backend follows it).
- save_checkpoint(extra=...): the checkpoint keeps one ``extra`` and load_checkpoint gives it to every rank, so ranks
  passing different ones are refused in the save's vote (naming both ranks and values), not one rank's kept.
- clock.bracketed: a step's origin pairs its mark with the wall clock read between two marks, retried while the
  marks are more than 50 us apart (a preemption between them would shift that rank's aligned events).
"""
import hashlib
import json
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline, launch, load_checkpoint, save_checkpoint
from pipesched.runtime import clock as clock_module
from pipesched.runtime.checkpoint_write import extra_summary
from pipesched.runtime.clock import BRACKET_S, BRACKET_TRIES, HostClock, bracketed

SAME_ARGS = "every rank must construct Pipeline with the same arguments (and the same model)"
SAME_EXTRA = ("every rank must pass the same extra (the checkpoint keeps one extra, which load_checkpoint gives "
              "every rank: make values that differ between ranks equal first, e.g. all-reduce them, or leave them out)")


# ---- the bracketed origin --------------------------------------------------------------------------------------


class FakeClock:
    """``mark`` hands out ``marks`` in order and ``wall`` hands out ``walls``; counts the calls."""

    def __init__(self, marks, walls):
        self.marks, self.walls = list(marks), list(walls)
        self.mark_calls = self.wall_calls = 0

    def mark(self):
        self.mark_calls += 1
        return self.marks.pop(0)

    def wall(self):
        self.wall_calls += 1
        return self.walls.pop(0)


def test_a_bracket_split_by_a_preemption_is_retried_and_the_tight_pair_kept():
    # first bracket: 0.25 s between its marks (preempted); the second is 10 us wide
    fake = FakeClock([1.0, 1.25, 2.0, 2.00001, 9.0, 9.0], [1000.0, 2000.0, 9000.0])
    origin, wall = bracketed(fake.mark, fake.wall)
    assert origin == pytest.approx(2.000005, abs=1e-12)  # the midpoint of the tight pair's marks
    assert wall == 2000.0  # the wall clock read inside the tight pair, not the first
    assert (fake.mark_calls, fake.wall_calls) == (4, 2)  # it stops at the first tight bracket


def test_a_tight_first_bracket_costs_two_marks_and_one_wall_reading():
    fake = FakeClock([5.0, 5.00002], [123.0])
    assert bracketed(fake.mark, fake.wall) == (pytest.approx(5.00001, abs=1e-12), 123.0)
    assert (fake.mark_calls, fake.wall_calls) == (2, 1)


def test_every_bracket_wide_keeps_the_narrowest_after_the_last_try():
    assert (BRACKET_S, BRACKET_TRIES) == (50e-6, 5)
    widths = [0.3, 0.1, 0.002, 0.2, 0.05]  # all wider than 50 us: the third (2 ms) is the narrowest
    marks = [m for k, w in enumerate(widths) for m in (10.0 * k, 10.0 * k + w)]
    fake = FakeClock(marks, [100.0, 200.0, 300.0, 400.0, 500.0, 600.0])
    origin, wall = bracketed(fake.mark, fake.wall)
    assert (origin, wall) == (pytest.approx(20.001, abs=1e-12), 300.0)
    assert (fake.mark_calls, fake.wall_calls) == (10, 5)  # five tries, no more


def test_the_host_clock_origin_brackets_perf_counter_around_time_time(monkeypatch):
    fake = FakeClock([7.0, 7.5, 8.0, 8.00004], [70.0, 80.0])
    monkeypatch.setattr(clock_module.time, "perf_counter", fake.mark)
    monkeypatch.setattr(clock_module.time, "time", fake.wall)
    assert HostClock().origin() == (pytest.approx(8.00002, abs=1e-12), 80.0)


# ---- extra's summary (what the save's vote compares) -----------------------------------------------------------


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def test_extra_is_compared_as_sorted_json_and_tensor_bytes():
    assert extra_summary({"b": 2, "a": [1, (2, 3)]}) == '{"a": [1, [2, 3]], "b": 2}'
    assert extra_summary({"b": 2, "a": 1}) == extra_summary({"a": 1, "b": 2})  # insertion order does not count
    assert extra_summary({"x": {1: "i", "k": "s"}}) == '{"x": {"1": "i", "k": "s"}}'  # nested int keys: as JSON
    assert extra_summary(None) == "null"
    t = torch.arange(3)
    assert extra_summary({"n": 1, "t": t}) == (f'{{"n": 1}}; tensor \'t\': int64 [3], digest '
                                               f'{_digest(t.numpy().tobytes())}')
    assert extra_summary({"t": t}) != extra_summary({"t": t + 1})
    long = {"text": "x" * 200}
    text = json.dumps(long)
    assert extra_summary(long) == f"{text[:100]}... ({len(text)} characters, digest {_digest(text.encode())})"


# ---- two ranks -----------------------------------------------------------------------------------------------------


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh())


def _pipe(timeout):
    return Pipeline(_model(), schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, timeout=timeout)


def _error_of(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test compares type and message
        return type(exc).__name__, str(exc)
    return None


def ranks_agree(rank: int, root: str) -> dict:
    out = {"other_timeouts": _error_of(lambda: _pipe(30.0 if rank == 0 else 45.0))}
    pipe = _pipe(45.0)  # equal timeouts: constructed, and it trains
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g)
    out["same_timeouts"] = (pipe.timeout, bool(torch.isfinite(pipe.step(x, target=y))))
    # a metric only the last stage's rank (world rank 1) has: None on rank 0
    out["other_extra"] = _error_of(lambda: save_checkpoint(os.path.join(root, "a"), pipe, step=1,
                                                           extra={"val_acc": 0.5 if rank == 1 else None}))
    out["other_tensor"] = _error_of(lambda: save_checkpoint(os.path.join(root, "b"), pipe, step=1,
                                                            extra={"epoch": 3, "t": torch.arange(3) + rank}))
    keys = ("epoch", "t") if rank == 0 else ("t", "epoch")  # another insertion order on each rank: the same extra
    given = {"epoch": 3, "t": torch.arange(3)}
    save_checkpoint(os.path.join(root, "c"), pipe, step=2, extra={k: given[k] for k in keys})
    info = load_checkpoint(os.path.join(root, "c"), pipe)
    out["loaded"] = (info.step, info.extra["epoch"], info.extra["t"].tolist())
    out["written"] = sorted(os.listdir(root))  # after the refusals nothing, not even a hidden temporary directory
    pipe.close()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("agreement_s11")
    return launch(ranks_agree, 2, str(root), timeout=240)


@pytest.mark.multiprocess
def test_ranks_with_different_timeouts_are_refused_on_every_rank(runs):
    assert [r["other_timeouts"] for r in runs] == [
        ("ValueError", f"world rank 1 built its Pipeline with timeout=45.0 but world rank 0 with timeout=30.0; "
                       f"{SAME_ARGS}"),
        ("ValueError", f"world rank 0 built its Pipeline with timeout=30.0 but world rank 1 with timeout=45.0; "
                       f"{SAME_ARGS}")]


@pytest.mark.multiprocess
def test_ranks_with_equal_timeouts_construct_and_train(runs):
    assert [r["same_timeouts"] for r in runs] == [(45.0, True), (45.0, True)]


@pytest.mark.multiprocess
def test_ranks_saving_different_extra_are_refused_on_every_rank(runs):
    expected = ("ValueError", "save_checkpoint: world rank 1 gave extra='{\"val_acc\": 0.5}' but world rank 0 "
                              f"extra='{{\"val_acc\": null}}'; {SAME_EXTRA}")
    assert [r["other_extra"] for r in runs] == [expected, expected]
    digests = [_digest((torch.arange(3) + k).numpy().tobytes()) for k in (0, 1)]
    expected = ("ValueError", f"save_checkpoint: world rank 1 gave extra='{{\"epoch\": 3}}; tensor \\'t\\': int64 [3], "
                              f"digest {digests[1]}' but world rank 0 extra='{{\"epoch\": 3}}; tensor \\'t\\': int64 "
                              f"[3], digest {digests[0]}'; {SAME_EXTRA}")
    assert [r["other_tensor"] for r in runs] == [expected, expected]
    assert [r["written"] for r in runs] == [["c"], ["c"]]  # only the agreeing save


@pytest.mark.multiprocess
def test_an_equal_extra_in_another_key_order_is_saved_and_loaded(runs):
    assert [r["loaded"] for r in runs] == [(2, 3, [0, 1, 2]), (2, 3, [0, 1, 2])]
