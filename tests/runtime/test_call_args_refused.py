"""A bad argument to a collective call outside ``step()`` is refused before anything but the call's marked meeting
row travels (``pipesched/runtime/call_args.py``), never by failing the pipeline: ``gather_timeline(kind=)`` with
the same typo on every rank is that rank's own plain ``TypeError`` / ``ValueError`` (``RuntimeError``: no finished
``kind``), a ``kind`` that differs between ranks (or is bad on one rank only) a ``ValueError`` on every rank naming
both ranks and values; ``run_collective`` with a ``work`` that is not callable (on every rank or one) a
``TypeError`` on every rank; after each, ``step()`` gives the same loss as before, the unsplit model's. 2 forked gloo
ranks, one launch, all cases in turn (the pipeline stays usable between them)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline, launch

pytestmark = pytest.mark.multiprocess

WIDTH = 8


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh())


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, WIDTH, generator=g), torch.randn(4, WIDTH, generator=g)


#: case: what each of the two ranks calls, by rank
CASES = {
    "typo everywhere": ("bogus", "bogus"),
    "int everywhere": (1, 1),
    "differ": ("step", "forward"),
    "typo on one rank": ("step", "fwd"),
    "no forward yet everywhere": ("forward", "forward"),
}
DIFFER = ("gather_timeline: the pipeline ranks passed different kind: 'step' on pipeline rank(s) [0], {} on pipeline "
          "rank(s) [1]; pass the same kind on every rank (nothing was gathered)")
#: case: (type, message) on every rank
EXPECTED = {
    "typo everywhere": ("ValueError", "kind must be 'step' or 'forward', got 'bogus'"),
    "int everywhere": ("TypeError", "kind must be 'step' or 'forward' (a str), got 1"),
    "differ": ("ValueError", DIFFER.format("'forward'")),
    "typo on one rank": ("ValueError", DIFFER.format("'fwd'")),
    "no forward yet everywhere": ("RuntimeError", "gather_timeline(kind='forward') needs a finished forward()"),
}

#: run_collective: what each rank passes as work (meet=True), by rank
RUN_CASES = {"work not callable everywhere": (5, 5), "work not callable on one rank": (lambda pp, dp: 1, "w")}
RUN_EXPECTED = {
    "work not callable everywhere": ("TypeError", "work must be a callable work(pp_group, dp_group), got 5"),
    "work not callable on one rank": ("TypeError", "run_collective: pipeline rank 1 refused its call: work must be a "
                                                   "callable work(pp_group, dp_group), got 'w'"),
}


def _rank(rank: int) -> dict:
    pipe = Pipeline(_model(), schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, timeout=30.0)
    x, y = _batch()
    first = pipe.step(x, target=y).item()
    got = {"first": first}
    for case, kinds in CASES.items():
        try:
            pipe.gather_timeline(kinds[rank])
            got[case] = (None, None, None)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            got[case] = (type(exc).__name__, str(exc), pipe.step(x, target=y).item())
    for case, works in RUN_CASES.items():
        try:
            pipe.run_collective(works[rank])
            got[case] = (None, None, None)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            got[case] = (type(exc).__name__, str(exc), pipe.step(x, target=y).item())
    timeline = pipe.gather_timeline()  # a valid call still gathers every rank's events
    got["ranks"] = sorted({event.rank for event in timeline.events})
    pipe.close()
    return got


def test_a_bad_or_differing_gather_timeline_kind_is_refused_on_every_rank_and_the_pipeline_goes_on():
    x, y = _batch()
    with torch.no_grad():
        expected_loss = F.mse_loss(_model()(x), y).item()  # no optimizer: the parameters never change
    results = launch(_rank, 2, timeout=120, start_method="fork")
    for rank, got in enumerate(results):
        assert got["first"] == pytest.approx(expected_loss, rel=1e-6, abs=1e-7), (rank, got)
        for case, (kind, message) in EXPECTED.items():
            assert got[case] == (kind, message, got["first"]), (case, rank, got[case])
        for case, (kind, message) in RUN_EXPECTED.items():
            assert got[case] == (kind, message, got["first"]), (case, rank, got[case])
        assert got["ranks"] == [0, 1], (rank, got)
