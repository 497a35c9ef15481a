"""``Pipeline.from_plan`` on 2 ranks (one launch): the pipeline is the candidate's, its loss and gradients are the
unsplit model's bitwise, and a plan for another model or job is refused on every rank before any communication."""
import pytest

from pipesched.runtime import launch

import rt_from_plan


@pytest.fixture(scope="module")
def results():
    return launch(rt_from_plan.suite, 2, timeout=240)


@pytest.mark.parametrize("name", ["roomy", "tight", "zbv"])
def test_builds_the_candidate_with_the_unsplit_gradients(results, name):
    for res in results:
        case = res[name]
        cand, built = case["candidate"], case["built"]
        assert built == {"schedule": cand["schedule"], "pp": cand["pp"], "dp": cand["dp"],
                         "m": cand["num_microbatches"], "v": cand["virtual_stages"], "balance": tuple(cand["balance"]),
                         "recompute": tuple(cand["recompute"]),
                         "split": built["split"]}
        if cand["split_backward"]:
            assert built["split"]
        assert case["loss_equal"] is True and case["grads_equal"] is True and case["count"] > 0


def test_the_plans_are_what_the_cases_mean(results):
    cases = results[0]
    assert cases["roomy"]["candidate"]["pp"] == 2  # one rank cannot hold every layer's parameters
    assert cases["roomy"]["candidate"]["balance"] != [3, 3]  # the skew moves the cut
    assert any(cases["tight"]["candidate"]["recompute"]) and not all(cases["tight"]["candidate"]["recompute"])
    assert cases["zbv"]["candidate"]["schedule"] == "zbv"


def test_a_plan_for_another_job_or_model_is_refused_on_every_rank(results):
    for res in results:
        assert "ValueError: the plan needs world size pp x dp = " in res["world"] and "job has 2 ranks" in res["world"]
        assert "the plan is for a model of 6 layers but this model has 5" in res["layers"]
        assert "schedule is decided by the plan" in res["clash"]
        assert res["type"].startswith("TypeError: plan must be a pipesched.Plan or Candidate")
