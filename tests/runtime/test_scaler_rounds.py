"""GradScaler's overflow vote is a marked all-gather (rows as long as a step opening's, clip_grad_norm_'s and
gather_timeline's, headed by SCALER_MARK): a rank in the vote while the other opened its next step, is in
gather_timeline() or in clip_grad_norm_'s collective ends every rank with one PipelineError naming both calls, not
a gloo timeout; a scaler disabled on one rank only is one ValueError on every rank (its enabled state rides in the
vote, which a disabled scaler joins in its first call); bad GradScaler arguments are a ValueError naming the
argument before any communication. 2 forked gloo ranks per launch, Pipeline timeout 20 s: a rank left waiting
would report a timeout instead of the messages asserted here (no timing assertion)."""
import pytest

from pipesched.runtime import launch
from pipesched.runtime.amp import check_scaler_arguments

import rt_scaler_rounds

DIFFERENT = "the pipeline ranks made different collective calls: "
IN_VOTE = "are in the GradScaler's overflow vote (scaler.unscale_ or scaler.step)"
SAME_CALLS = "; every rank of a pipeline must make the same calls"
ENABLED = ("ValueError: scaler: the ranks' GradScalers differ in enabled: {} on pipeline rank 0, {} on pipeline "
           "rank 1; build it with the same arguments on every rank")


@pytest.mark.multiprocess
@pytest.mark.parametrize("other, says", [
    ("step", f"pipeline ranks [0] {IN_VOTE}; pipeline ranks [1] opened the next step (step() or forward())"),
    ("timeline", f"pipeline ranks [0] {IN_VOTE}; pipeline ranks [1] are in gather_timeline()"),
    ("clip", f"pipeline ranks [0] are in clip_grad_norm_'s collective; pipeline ranks [1] {IN_VOTE}"),
])
def test_the_vote_against_another_call_is_one_error_naming_both_on_every_rank(other, says):
    results = launch(rt_scaler_rounds.other_call, 2, other, timeout=120, start_method="fork")
    for said in results:
        assert said.startswith("PipelineError: "), results
        assert DIFFERENT + says + SAME_CALLS in said, results


@pytest.mark.multiprocess
def test_a_scaler_disabled_on_one_rank_is_one_value_error_on_every_rank():
    results = launch(rt_scaler_rounds.disabled_on_one_rank, 2, timeout=180, start_method="fork")
    for out in results:
        assert out == {
            "both unscale_": ENABLED.format(True, False),
            "both step": ENABLED.format(True, False),
            "unscale_ on 0": ENABLED.format(True, False),
            "disabled on 0": ENABLED.format(False, True),
            "all enabled": "ok",  # the pipeline stayed usable
            "all disabled": "ok",
        }, results


@pytest.mark.multiprocess
def test_bad_arguments_are_a_value_error_before_any_communication():
    expected = {name: f"ValueError: {text}" for name, (_, text) in rt_scaler_rounds.BAD_ARGUMENTS.items()}
    for out in launch(rt_scaler_rounds.bad_arguments, 2, timeout=120, start_method="fork"):
        assert out == {**expected, "after": "ok"}


@pytest.mark.parametrize("kwargs, says", [
    ({"init_scale": -1.0}, "init_scale must be a finite number > 0, got -1.0"),
    ({"init_scale": float("nan")}, "init_scale must be a finite number > 0, got nan"),
    ({"init_scale": True}, "init_scale must be a finite number > 0, got True"),
    ({"init_scale": "65536"}, "init_scale must be a finite number > 0, got '65536'"),
    ({"growth_factor": 0.5}, "growth_factor must be a finite number > 1, got 0.5"),
    ({"growth_factor": float("inf")}, "growth_factor must be a finite number > 1, got inf"),
    ({"backoff_factor": -0.5}, "backoff_factor must be a number between 0 and 1 (both excluded), got -0.5"),
    ({"growth_interval": -3}, "growth_interval must be an int >= 1, got -3"),
    ({"growth_interval": True}, "growth_interval must be an int >= 1, got True"),
    ({"enabled": None}, "enabled must be True or False, got None"),
])
def test_each_bad_argument_is_named_with_its_value(kwargs, says):
    args = {"init_scale": 2.0 ** 16, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
            "enabled": True, **kwargs}
    with pytest.raises(ValueError) as info:
        check_scaler_arguments(**args)
    assert str(info.value) == says


def test_torchs_defaults_and_edge_values_pass():
    check_scaler_arguments(2.0 ** 16, 2.0, 0.5, 2000, True)
    check_scaler_arguments(1e-30, 1.0000001, 0.999, 1, False)


@pytest.mark.multiprocess
def test_with_data_parallelism_every_rank_of_the_job_raises_the_same_error():
    where = ["pipeline rank {} of replica {} (world rank {})".format(r % 2, r // 2, r) for r in range(4)]
    results = launch(rt_scaler_rounds.replicas, 4, timeout=240, start_method="fork")
    for out in results:
        assert out == {
            "init_scale by replica": (
                f"ValueError: scaler: the ranks' GradScalers differ in scale: 1024 on {', '.join(where[:2])}, 2048 on "
                f"{', '.join(where[2:])}; build it with the same arguments on every rank and call its update() on "
                f"every rank after each step"),
            # replica 1's pipeline decided it; replica 0 raises the text replica 1 sent
            "disabled on world rank 3": (f"ValueError: scaler: the ranks' GradScalers differ in enabled: True on "
                                         f"{where[2]}, False on {where[3]}; build it with the same arguments on "
                                         f"every rank"),
            "disabled on replica 1": (f"ValueError: scaler: the ranks' GradScalers differ in enabled: True on "
                                      f"{', '.join(where[:2])}, False on {', '.join(where[2:])}; build it with the "
                                      f"same arguments on every rank"),
            # replica 0's pipeline passed it and replica 1's did not (helper-77, bug7: every rank said "no
            # pipe.step() got this GradScaler", replica 0's too)
            "no scaler to pipe.step on replica 1": (
                f"ValueError: scaler: the ranks passed this GradScaler to pipe.step(..., scaler=...) in different "
                f"numbers of steps: in 1 step on {', '.join(where[:2])}, in no step (scaler=None) on "
                f"{', '.join(where[2:])}; pass it to pipe.step on every rank in every step"),
            "alike": "ok",
        }, results
