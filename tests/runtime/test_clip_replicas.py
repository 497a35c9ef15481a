"""Pipeline.clip_grad_norm_ agrees its arguments over every rank of the job: data-parallel replicas as well as the
ranks of one pipeline, and error_if_nonfinite and foreach as well as max_norm and norm_type. A refusal or a
difference anywhere is the same ValueError on every rank (the refusing rank: its own message), no gradient changes
(bitwise), and the pipeline goes on: a correct call then matches torch's clip_grad_norm_ on the unsplit model.
Bodies in rt_clip_replicas.py; DP 2 x PP 2 on 4 gloo ranks, PP 2 on 2."""
import pytest

from pipesched.runtime import launch

import rt_clip_replicas

RTOL = 1e-6  # as tests/runtime/test_clipping.py: the total and the clipped gradients against torch's

OWN = "max_norm must be a number > 0 or a 0-dim tensor holding one (inf: no clipping), got -1.0"
NORM = "norm_type must be a number > 0 or inf (float('inf') or 'inf'), got -2.0"


def _by_replica(name, first, second) -> str:
    return (f"clip_grad_norm_: the replicas passed different {name}: {first} on replica(s) [0] (world ranks [0, 1]), "
            f"{second} on replica(s) [1] (world ranks [2, 3]); pass the same {name} on every rank (no gradient was "
            f"changed)")


# what each world rank raises, by case (every rank a ValueError)
REPLICA_CASES = {
    "refusal on world rank 2": {
        **{r: f"clip_grad_norm_: world rank 2 (pipeline rank 0 of replica 1) refused its arguments: {OWN}; no "
              f"gradient was changed" for r in (0, 1, 3)}, 2: OWN},
    "refusals on world ranks 3 and 1": {  # the first refusing rank by replica, then pipeline rank is quoted
        **{r: f"clip_grad_norm_: world rank 1 (pipeline rank 1 of replica 0) refused its arguments: {NORM}; no "
              f"gradient was changed" for r in (0, 2)}, 1: NORM, 3: NORM},
    "max_norm by replica": dict.fromkeys(range(4), _by_replica("max_norm", 1.0, 0.001)),
    "norm_type by replica": dict.fromkeys(range(4), _by_replica("norm_type", 2.0, "inf")),
    "error_if_nonfinite by replica": dict.fromkeys(range(4), _by_replica("error_if_nonfinite", False, True)),
    "foreach by replica": dict.fromkeys(range(4), _by_replica("foreach", None, False)),
    "max_norm on world rank 3": dict.fromkeys(range(4), (
        "clip_grad_norm_: the pipeline ranks of replica 1 passed different max_norm: 1.0 on pipeline rank(s) [0], "
        "0.5 on pipeline rank(s) [1]; pass the same max_norm on every rank (no gradient was changed)")),
}


@pytest.fixture(scope="module")
def replicas():
    return launch(rt_clip_replicas.replica_cases, 4, timeout=240, start_method="fork")


@pytest.fixture(scope="module")
def anticipated():
    return launch(rt_clip_replicas.anticipated_replica_cases, 4, timeout=240, start_method="fork")


@pytest.fixture(scope="module")
def pipeline():
    return launch(rt_clip_replicas.pipeline_cases, 2, timeout=240, start_method="fork")


def _matches_torch(got: dict) -> None:
    assert got["count"] > 0 and got["nones"] == [], got
    assert abs(got["total"] - got["ref"]) <= RTOL * got["ref"] and got["worst"] <= RTOL, got


@pytest.mark.parametrize("case", list(REPLICA_CASES))
def test_a_refusal_or_a_difference_on_any_replica_is_the_same_value_error_on_every_rank(replicas, case):
    for rank, res in enumerate(replicas):
        assert res[case] == ("ValueError", REPLICA_CASES[case][rank], True), (rank, res[case])  # True: grads kept


def test_after_refused_calls_a_correct_call_is_torchs_clip_on_every_replica(replicas):
    totals = set()
    for res in replicas:
        for when in ("then", "then again"):  # "then again": after one more step, so the ranks stayed in step
            _matches_torch(res[when])
            totals.add(res[when]["total"])
    assert len(totals) == 1, totals  # every rank of both replicas: the same total


def test_anticipated_nan_parts_take_the_collective_so_error_if_nonfinite_is_compared(anticipated):
    # every rank holds the step's parts, whose total is nan: none uses them (used 0), all take the collective
    by_replica = _by_replica("error_if_nonfinite", False, True)
    for rank, res in enumerate(anticipated):
        _matches_torch(res["first"])
        assert res["error_if_nonfinite by replica"] == ("ValueError", by_replica, True), (rank, res)
        kind, message, kept = res["error_if_nonfinite everywhere"]
        assert (kind, kept) == ("RuntimeError", True) and message.startswith(
            "The total norm of order 2.0 for gradients from `parameters` is non-finite"), (rank, res)
        assert res["used nan parts"] == 0, (rank, res)
        _matches_torch(res["anticipated"])  # a clean step's parts are still used (no collective)
        assert res["used parts"] == 1, (rank, res)


def test_anticipated_max_norm_by_replica_ends_every_rank_by_the_next_step(anticipated):
    # replica 1's call differs from the one its step anticipated: it takes the collective; replica 0 used the
    # step's parts and opens its next step. They meet over the data-parallel groups: both raise there
    meeting = ("clip_grad_norm_: replicas [1] are in clip_grad_norm_'s agreement of the replicas while replicas [0] "
               "opened the next step (step() or forward())")
    for rank, res in enumerate(anticipated):
        got = res["max_norm by replica"]
        if rank < 2:
            assert got["clip"][0] is None, (rank, got)  # the anticipated parts: clipped, no collective
            assert got["step"][0] == "ValueError" and got["step"][1].startswith(
                "replica 1 refused its step: it is in clip_grad_norm_'s agreement of the replicas while this replica "
                "opened its next step"), (rank, got)
        else:
            assert got["clip"][0] == "PipelineError" and meeting in got["clip"][1], (rank, got)
            assert got["step"][0] == "PipelineError", (rank, got)


def test_one_pipeline_compares_error_if_nonfinite_and_foreach(pipeline):
    # the trial's case: a nan gradient on rank 1 and error_if_nonfinite on rank 0 only (rank 0 raised, rank 1
    # scaled its gradients by nan); foreach by rank; then the same after an anticipating step whose parts are nan
    for rank, res in enumerate(pipeline):
        assert res["error_if_nonfinite by rank"] == ("ValueError", (
            "clip_grad_norm_: the pipeline ranks passed different error_if_nonfinite: True on pipeline rank(s) [0], "
            "False on pipeline rank(s) [1]; pass the same error_if_nonfinite on every rank (no gradient was changed)"),
            True), (rank, res)
        assert res["foreach by rank"] == ("ValueError", (
            "clip_grad_norm_: the pipeline ranks passed different foreach: True on pipeline rank(s) [0], False on "
            "pipeline rank(s) [1]; pass the same foreach on every rank (no gradient was changed)"), True), (rank, res)
        assert res["anticipated error_if_nonfinite by rank"] == ("ValueError", (
            "clip_grad_norm_: the pipeline ranks passed different error_if_nonfinite: False on pipeline rank(s) [0], "
            "True on pipeline rank(s) [1]; pass the same error_if_nonfinite on every rank (no gradient was changed)"),
            True), (rank, res)
        assert res["used nan parts"] == 0, (rank, res)
        _matches_torch(res["first"])
        _matches_torch(res["then"])
        assert res["used parts"] == 1, (rank, res)  # the clean step's parts were used
