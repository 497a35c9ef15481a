"""A public collective call outside ``step()`` that fails on ONE rank ends every rank with that rank's error, at once,
never leaving the others waiting until the timeout: GradScaler's ``update()`` without ``step`` on a rank without
parameters, ``step`` twice, an optimizer that fails inside ``scaler.step`` (a ``PipelineError`` naming the rank on
every rank; a bad ``gather_timeline(kind=)`` on one rank is refused instead: test_call_args_refused.py);
``clip_grad_norm_`` with a bad ``max_norm`` on one
rank (a ``ValueError`` quoting it on every rank, the pipeline still usable). 2 forked gloo ranks per case.

No timing assertion: the Pipeline timeout is 60 s; the failing rank waits (alive) until the other has raised, at most
20 s (rt_one_rank_fault.WAIT_S), and the assertions refuse what a rank left waiting would report instead (no
``others_ended``, a ``lost`` record after the failing rank's process ended, a timed-out wait naming itself). Each
case is its own launch (120 s), so a regression fails its case after about 20 s instead of hanging."""
import pytest

from pipesched.runtime import launch

import rt_one_rank_fault

pytestmark = pytest.mark.multiprocess

UPDATE_ALONE = ("ValueError: scaler: update() on pipeline rank 1 without unscale_ or step since the last update(); "
                "they are collective (every rank votes on an overflow): call scaler.step(opt) (and "
                "scaler.unscale_(opt) before clipping) on every rank, with opt=None on a rank without parameters")

# case: (origin world rank, the origin's exception as PipelineError.cause gives it)
FATAL = {
    "update without step": (1, UPDATE_ALONE),
    "step twice": (0, "RuntimeError: step() has already been called since the last update()."),
    "optimizer fails": (0, "RuntimeError: momentum buffer of a parameter on the wrong device"),
}


def _run(case: str) -> list:
    """Each case in its own launch, forked (no interpreter start per rank)."""
    return launch(rt_one_rank_fault.CASES[case], 2, timeout=120, start_method="fork")


@pytest.mark.parametrize("case", list(FATAL))
def test_one_ranks_error_in_a_collective_call_is_a_pipeline_error_naming_it_on_every_rank(case):
    origin, cause = FATAL[case]
    for rank, got in enumerate(_run(case)):
        assert got["type"] == "PipelineError", (case, rank, got)
        assert (got["rank"], got["cause"], got["lost"]) == (origin, cause, False), (case, rank, got)
        assert (f"pipeline rank failure: world rank {origin} (pipeline rank {origin}) failed in a collective call "
                f"outside any step (GradScaler's unscale_/step/update): {cause}") in got["message"], (case, rank, got)
        if rank == origin:
            assert got["cause_type"] == cause.split(":")[0], (case, got)  # the original exception, chained
            assert got["others_ended"] is True, (case, got)  # the other rank raised while this one still waited


def test_a_bad_clip_argument_on_one_rank_is_a_value_error_on_every_rank_and_the_pipeline_goes_on():
    own = "max_norm must be a number > 0 or a 0-dim tensor holding one (inf: no clipping), got -1.0"
    expected = {1: own, 0: f"clip_grad_norm_: world rank 1 (pipeline rank 1) refused its arguments: {own}; no "
                          f"gradient was changed"}
    results = _run("clip bad max_norm")
    for rank, got in enumerate(results):
        assert (got["type"], got["message"]) == ("ValueError", expected[rank]), (rank, got)
        assert got["then"] is True, (rank, got)  # a valid clip and a step afterwards, on both ranks
    assert results[1]["others_ended"] is True
