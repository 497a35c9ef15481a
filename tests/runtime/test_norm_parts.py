"""Anticipated clip_grad_norm_ (runtime/norm_parts.py): after a step that sent every rank's norm part, the call
combines them without a collective. Each step of each case is checked against torch.nn.utils.clip_grad_norm_ on
the unsplit model (the total within 1e-6 relative, 1e-5 with tied parameters, whose summed gradients differ from the
unsplit model's in the last bits: rt_tied.RTOL; the clipped gradients within the same) and against the same
pipeline with ``anticipate_clip = False``, whose every call takes the collective: total, clipped gradients and the
weights after AdamW bitwise equal. A switch of norm_type (or of the gradients on every rank) takes the collective
once, then the new one is anticipated; ranks that differ are a PipelineError on every rank, not a hang."""

import pytest

from pipesched.runtime import launch

import rt_norm_parts

RTOL = 1e-6
# per step of rt_norm_parts.SWITCH: 1 where the call combined the step's parts (no collective)
SWITCH_PATHS = [0, 1, 1, 0, 1, 0, 1]


@pytest.fixture(scope="module")
def two():
    return launch(rt_norm_parts.two_rank_suite, 2, timeout=300)


@pytest.fixture(scope="module")
def four():
    return launch(rt_norm_parts.four_rank_suite, 4, timeout=300)


def check_loop(results, case, paths, rtol=RTOL):
    for rank, res in enumerate(results):
        rows = res[case]
        assert [r[0] for r in rows] == paths, (rank, case, rows)
        for used, total, twin_total, ref_total, bitwise, worst, weights in rows:
            assert total == twin_total, (rank, case, rows)  # bitwise: the collective's value
            assert abs(total - ref_total) <= rtol * ref_total, (rank, case, total, ref_total)
            assert bitwise and weights, (rank, case, rows)  # clipped gradients, then weights: the collective's
            assert worst <= rtol, (rank, case, worst)
            assert total > rt_norm_parts.MAX_NORM  # every call clipped
    for k in range(len(paths)):  # the same total on every rank
        assert len({res[case][k][1] for res in results}) == 1, (case, k)


def test_a_switch_of_norm_type_falls_back_then_anticipates_the_new_one(two):
    check_loop(two, "switch", SWITCH_PATHS)


def test_tied_parameters_are_counted_once(two):
    check_loop(two, "tied", [0, 1, 0, 1, 0], rtol=1e-5)


def test_data_parallel_2x2(four):
    check_loop(four, "dp2xpp2", [0, 1, 0, 1])


def test_interleaved_on_four_ranks(four):
    check_loop(four, "interleaved-p4", [0, 1, 0, 1])


def test_grad_scaler_unscale_with_a_power_of_two_scale_rescales_the_parts(two):
    # loss scaled by 1024, scaler.unscale_ before the clip: the parts (of the scaled gradients) times 1/1024, exact
    check_loop(two, "scaler", [0, 1, 1, 0, 1])


def test_grad_scaler_unscale_with_another_scale_takes_the_collective(two):
    # a scale of 3 is not exact: the scaled backward rounds otherwise than the unsplit model's unscaled one, and
    # AdamW carries it on (1e-4 relative to torch); still bitwise the twin's, which always takes the collective
    check_loop(two, "odd_scale", [0, 0, 0], rtol=1e-4)


def test_gradients_changed_on_every_rank_take_the_collective(two):
    # step 1: every gradient halved in place after the step: no rank's part is the one it sent
    check_loop(two, "all_changed", [0, 0, 1])


def test_gradient_accumulation_uses_the_last_steps_parts(two):
    # two steps per clip: the second step's parts are of the accumulated gradients
    check_loop(two, "accumulate", [0, 1, 1])


def test_a_second_call_after_one_step_takes_the_collective(two):
    for res in two:
        assert [r[0] for r in res["twice"]] == [0, 0, 1, 0], res["twice"]
        for _, total, ref_total, worst in res["twice"]:
            assert abs(total - ref_total) <= RTOL * ref_total and worst <= RTOL, res["twice"]


OUT_OF_STEP = ("RuntimeError: clip_grad_norm_: pipeline ranks [1] are in clip_grad_norm_'s collective while ranks [0] "
               "opened the next step: the ranks' clip_grad_norm_ calls differed.")


@pytest.mark.parametrize("name,expect", [
    ("grads_on_one_rank", OUT_OF_STEP),
    ("max_norm_on_one_rank", OUT_OF_STEP),
    ("clip_on_one_rank", "RuntimeError: clip_grad_norm_: the pipeline ranks made different numbers of "
                         "clip_grad_norm_ calls (by pipeline rank: [2, 1]); call it on every rank alike")])
def test_ranks_that_differ_end_every_rank_with_a_pipeline_error(two, name, expect):
    for rank, res in enumerate(two):
        got = res["deviations"][name]
        assert got["anticipated"], got
        assert got["error"].startswith(expect), (rank, got)
