"""A collective call whose arguments do not fit its signature on ONE rank (a misspelled keyword: Python's
``TypeError``, raised before the method's body runs) is refused on every rank, and the ranks stay in step.

Found by a hunt: rank 1 called ``pipe.step(x, target=y, targets=y)``, caught the TypeError and went on; its next
step (batch k+1) then ran against rank 0's current one (batch k): two optimizer steps on mismatched data, no error
anywhere. A misspelled ``Pipeline(...)`` keyword caught on one rank left the other waiting the whole timeout with a
TimeoutError that did not say why. runtime/misfit.py binds the arguments first and hands a misfit to the call's own
refusal path. step()/forward() are pinned in test_one_rank_bad_call.py; here the construction and the other
collective calls (rt_misfit.py, 2 ranks, Pipeline timeout 60 s)."""
from __future__ import annotations

import inspect

import pytest

from pipesched.runtime import Pipeline, launch
from pipesched.runtime.misfit import misfit_error

import rt_misfit

pytestmark = pytest.mark.multiprocess

CONSTRUCT = "Pipeline.__init__() got an unexpected keyword argument 'schedul'"
CLIP = "Pipeline.clip_grad_norm_() got an unexpected keyword argument 'norm'"
TIMELINE = "Pipeline.gather_timeline() got an unexpected keyword argument 'kinds'"
COLLECTIVE = "Pipeline.run_collective() got an unexpected keyword argument 'meat'"
RUN_FAILED = ("PipelineError: pipeline rank failure: world rank 1 (pipeline rank 1) failed in a collective call "
              "outside any step (run_collective): TypeError: ")
SAVE = "save_checkpoint() got an unexpected keyword argument 'optimiser'"
LOAD = "load_checkpoint() too many positional arguments"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch(rt_misfit.misfits, 2, str(tmp_path_factory.mktemp("misfit")), timeout=600)


def test_a_misfit_construction_on_one_rank_is_that_rank_s_error_on_the_other(results):
    assert results[1]["Pipeline"] == f"TypeError: {CONSTRUCT}"
    # rank 0 raises rank 1's error, not its own timeout
    assert results[0]["Pipeline"] == f"ValueError: world rank 1 refused its Pipeline arguments: TypeError: {CONSTRUCT}"


def test_after_a_refused_construction_the_next_one_trains_as_the_unsplit_model(results):
    for res in results:
        assert res["step"] == res["reference step"]


#: call -> (what rank 0 raises, what rank 1 raises): each call's own refusal wording
EXPECTED = {
    "clip_grad_norm_": (f"ValueError: clip_grad_norm_: world rank 1 (pipeline rank 1) refused its arguments: {CLIP}; "
                        f"no gradient was changed", f"TypeError: {CLIP}"),
    "gather_timeline": (f"TypeError: gather_timeline: pipeline rank 1 refused its call: {TIMELINE}",) * 2,
    # whether the others meet first is unknown (a misspelled meet=): every rank ends, naming rank 1's error
    "run_collective": (f"{RUN_FAILED}{COLLECTIVE} [reported to world rank 0: while waiting for the collective of "
                       f"run_collective]", f"{RUN_FAILED}{COLLECTIVE}"),
    # functions: their first vote carries it (rank 0 waited for the vote's timeout, pipe.timeout, before)
    "save_checkpoint": (f"TypeError: save_checkpoint: world rank 1 refused its arguments: {SAVE}",
                        f"TypeError: {SAVE}"),
    "load_checkpoint": (f"TypeError: load_checkpoint: world rank 1 refused its arguments: {LOAD}",
                        f"TypeError: {LOAD}"),
}


@pytest.mark.parametrize("call", list(EXPECTED))
def test_a_misfit_collective_call_on_one_rank_is_refused_on_both(results, call):
    assert [res[call] for res in results] == list(EXPECTED[call])


def test_a_misfit_gradscaler_call_on_one_rank_ends_every_rank_with_it(results):
    # as any error of this rank alone in the scaler's collective call (amp.py, _collective_call): every rank ends
    # with a PipelineError caused by rank 1's TypeError, at once (a waiting rank's timeout would not quote it)
    origin = ("PipelineError: pipeline rank failure: world rank 1 (pipeline rank 1) failed in a collective call "
              "outside any step (GradScaler's unscale_/step/update): TypeError: GradScaler.unscale_() too many "
              "positional arguments")
    assert results[1]["GradScaler.unscale_"] == origin
    assert results[0]["GradScaler.unscale_"] == origin + (
        " [reported to world rank 0: while waiting for the GradScaler's overflow vote (an all-gather over the "
        "pipeline group)]")


def test_a_subclass_s_own_step_is_guarded_too(results):
    # Python bound TaggedPipeline.step's arguments before Pipeline.step's guard ran: rank 1 caught the error and ran
    # its next step against rank 0's current one (a hunt of this session's changes)
    text = "TypeError: pipeline rank 1 refused its step: TaggedPipeline.step() too many positional arguments"
    assert [res["subclass step"] for res in results] == [text, text]
    for res in results:
        assert res["subclass next step"] == res["subclass reference"]


def test_calling_a_subclass_runs_its_own_forward_and_its_misfit_is_refused_on_both(results):
    # Pipeline.__call__ was Pipeline.forward itself: sub(x, "tag") bypassed the subclass's forward (a misfit)
    assert [res["subclass call"] for res in results] == [None, ("tag", True)]  # rank 1 holds the last stage
    text = "TypeError: pipeline rank 1 refused its forward(): TaggedPipeline.forward() too many positional arguments"
    assert [res["subclass call misfit"] for res in results] == [text, text]


def test_the_ranks_stay_in_step_after_the_refused_calls(results):
    for res in results:
        assert res["total"] == pytest.approx(res["reference total"], rel=1e-6)
        assert res["timeline ranks"] == [0, 1]
        assert res["collective"] == 2
        assert res["saved"] and res["loaded step"] == 1


def test_misfit_error_words_what_python_would_say():
    sig = inspect.signature(Pipeline.step)
    assert misfit_error(Pipeline.step, sig, (object(), 1), {"target": 2}) is None
    error = misfit_error(Pipeline.step, sig, (object(),), {"targets": 2})
    assert str(error) == "object.step() got an unexpected keyword argument 'targets'"  # the class of self
    error = misfit_error(Pipeline.step, sig, (), {})
    assert str(error) == "Pipeline.step() missing a required argument: 'self'"
    # the public signature is still the method's own (help(), IDEs)
    assert list(inspect.signature(Pipeline.step).parameters) == ["self", "x", "target", "scaler"]
