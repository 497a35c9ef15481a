"""What splitting an ``nn.Sequential`` into stages would silently skip or reorder is refused (found by the session-11
silent-wrong hunt; before, each ran and gave another loss and other gradients than the unsplit model, no error):

- the container's own behaviour: an ``nn.Sequential`` subclass's ``forward`` (``x * 2`` before the layers) and hooks
  registered on the container itself (the stages are new containers holding the layers): refused at construction,
  on every rank (``stage.refuse_container_behaviour``);
- one module whose forward updates and reads a buffer (an EMA, not a norm layer) used by two stages of ONE rank
  (zbv's stages 0 and 3, interleaved's 0 and 2): the rank runs one stage's microbatches before the other's, so the
  updates come in another order than the unsplit model's. Now watched as buffers shared across ranks are
  (``shared_buffers.checked_on``): the step ends every rank naming the buffer. With one microbatch the order is the
  unsplit model's, and the run is bitwise equal to it (not refused). Bodies in rt_split_skips.py."""
import pytest

from pipesched.runtime import launch

import rt_split_skips as R

_CONTAINER = ("a Pipeline runs the model's layers (its children) in order, one stage after another, so what "
              "Doubled.forward adds would silently not run; move that code into a layer (an nn.Module among its "
              "children), or pass nn.Sequential(*model) if it adds nothing")
_HOOKS = ("ValueError: model has 1 forward pre-hook and 1 forward hook registered on the nn.Sequential itself: a "
          "Pipeline runs its layers in new stage containers, so these would silently not run; register them on a "
          "layer instead (a forward pre-hook on model[0], a forward or backward hook on model[-1])")


@pytest.fixture(scope="module")
def container():
    return launch(R.container, 2, timeout=300)


def test_a_sequential_subclass_with_its_own_forward_is_refused_on_every_rank(container):
    assert [r["subclass"] for r in container] == [
        {"error": "ValueError: model is a Doubled, an nn.Sequential subclass with a forward() of its own: "
                  + _CONTAINER}] * 2


def test_hooks_on_the_model_container_are_refused_on_every_rank(container):
    assert [r["hooks"] for r in container] == [{"error": _HOOKS}] * 2


@pytest.mark.parametrize("schedule, pattern, v, stages", [("zbv", "elle", 2, "'0.mean' = '3.mean' is used by stages "
                                                          "[0, 3]"), ("interleaved-1f1b", "elel", 2, "'0.mean' = "
                                                          "'2.mean' is used by stages [0, 2]")],
                         ids=["zbv", "interleaved"])
def test_a_changing_buffer_shared_by_two_stages_of_one_rank_ends_the_step_naming_it(schedule, pattern, v, stages):
    res = launch(R.shared_ema_one_rank, 2, schedule, pattern, v, timeout=300)
    expected = ("PipelineError: pipeline rank failure: world rank 0 (pipeline rank 0) failed outside any instruction "
                f"(while preparing or finishing the step): RuntimeError: buffer {stages} on pipeline ranks [0], and "
                "this rank's forward changed it: its stages ran their microbatches' uses in another order than the "
                "unsplit model (this rank runs one stage's microbatches before the next stage's), so its values would "
                "differ from the unsplit model's; put its uses in one stage (balance=), or give each use its own "
                "buffer")
    assert res[0] == {"error": expected}
    assert res[1]["error"].startswith(expected + " [reported to world rank 1: "), res[1]  # at its next call


def test_with_one_microbatch_the_shared_buffer_runs_in_the_unsplit_order_and_is_bitwise_the_unsplit_models():
    res = launch(R.shared_ema_one_rank, 2, "zbv", "elle", 2, 1, timeout=300)
    for rank, out in enumerate(res):
        assert "error" not in out, out
        assert out["loss"][0] == out["loss"][1], (rank, out["loss"])
        assert out["grads"] and all(out["grads"].values()), (rank, out["grads"])
    assert [out["mean"] for out in res] == [True, None]  # rank 0 holds the EMA: its buffer equals the unsplit one's


def test_control_the_same_ema_used_once_is_bitwise_the_unsplit_models():
    res = launch(R.shared_ema_one_rank, 2, "zbv", "elll", 2, timeout=300)
    for rank, out in enumerate(res):
        assert "error" not in out, out
        assert out["loss"][0] == out["loss"][1], (rank, out["loss"])
        assert out["grads"] and all(out["grads"].values()), (rank, out["grads"])
    assert [out["mean"] for out in res] == [True, None]
