"""Tensors of two layers that are different objects over one memory (a buffer that is ``table[:]`` or
``.view(...)`` of another layer's, a norm layer whose running statistics are views of another's, a Parameter that
is a view or slice of another layer's weight, a buffer over a weight), their uses cut onto two pipeline ranks: each
rank would update only its own copy, silently unlike the unsplit model (it did: losses or buffers differed before
shared_buffers.py grouped tensors by storage). Now a buffer view is a shared buffer (checked around each step, or
refused if running statistics), an aliased parameter is refused at construction naming both tensors, and a view
that never changes, or uses on one rank, train bitwise as the unsplit model (SGD, 3 steps).
And two different Pipelines saved (loaded) at one path by rank-dependent code: refused on every rank.
2 forked gloo ranks; 6 layers cut 3 + 3 (uses at layers 1 and 4 on ranks 0 and 1) or 5 + 1 (both on rank 0)."""
import pytest

from pipesched.runtime import launch

import rt_shared_storage as rt

pytestmark = pytest.mark.multiprocess

ALIASED = ("{a} (stage 0, pipeline rank 0) and {b} (stage 1, pipeline rank 1) are different tensors over the same "
           "memory (a view or slice of one another), used on pipeline ranks [0, 1]: each rank would update only its "
           "own copy, so the values would silently differ from the unsplit model's (only one Parameter object used "
           "by several layers is a tie, kept identical across ranks); tie them with the same Parameter object, give "
           "each layer its own tensor (.clone()), or put their uses on one rank (balance=)")


def _run(kind, balance):
    return launch(rt.case, 2, kind, balance, timeout=120, start_method="fork")


def _same_as_unsplit(got):
    assert got["type"] is None, got
    assert got["losses"] == got["expected"] and len(got["losses"]) == 3, got
    assert got["same_state"] and got["checked"], got


@pytest.mark.parametrize("kind, a, b", [
    ("weight_view", "parameter '1.weight'", "parameter '4.weight'"),
    ("weight_slice", "parameter '1.weight'", "parameter '4.0.weight'"),
    ("weight_buffer", "parameter '1.weight'", "buffer '4.w'"),
])
def test_a_parameter_sharing_memory_with_another_tensor_on_another_rank_is_refused(kind, a, b):
    for got in _run(kind, [3, 3]):
        assert got == {"type": "ValueError", "message": ALIASED.format(a=a, b=b)}, got


@pytest.mark.parametrize("kind", ["weight_view", "weight_slice", "weight_buffer", "counter_view",
                                  "batchnorm_view"])
def test_aliases_on_one_rank_train_bitwise_as_the_unsplit_model(kind):
    for got in _run(kind, [5, 1]):
        _same_as_unsplit(got)


def test_a_buffer_view_that_never_changes_trains_bitwise_as_the_unsplit_model():
    results = _run("table_view", [3, 3])
    for got in results:
        _same_as_unsplit(got)
    assert "1.table" in results[0]["checked"] and "4.t" in results[1]["checked"], results


def test_parameters_over_disjoint_bytes_of_one_storage_are_independent_and_train_bitwise_as_unsplit():
    """Two halves of one packed weight, one per rank: no byte in common, so each rank's update is all there is."""
    results = _run("weight_halves", [3, 3])
    for got in results:
        _same_as_unsplit(got)
    assert "1.0.weight" in results[0]["checked"] and "4.0.weight" in results[1]["checked"], results


def test_a_buffer_view_changed_on_two_ranks_ends_every_rank_naming_both():
    for rank, got in enumerate(_run("counter_view", [3, 3])):
        assert (got["type"], got["origin"]) == ("PipelineError", rank), got  # each rank's own check failed
        assert ("buffers '1.calls' and '4.calls' share memory (views of one storage) and are used by stages [0, 1] "
                "on pipeline ranks [0, 1], and this rank's forward changed it") in got["message"], got


def test_a_norm_layer_whose_running_stats_are_views_of_another_is_refused_at_construction():
    for got in _run("batchnorm_view", [3, 3]):
        assert got == {"type": "ValueError", "message": (
            "buffers '1.running_mean' and '4.running_mean' share memory (views of one storage) and are used by "
            "stages [0, 1] on pipeline ranks [0, 1]: BatchNorm1d updates it in every training forward, and each "
            "rank would update only its own copy (buffers are not summed like tied parameters), so its running "
            "statistics would differ from the unsplit model's; put its uses in one stage (balance=), or give each "
            "use its own module")}, got


def test_two_pipelines_at_one_checkpoint_path_are_refused_on_every_rank(tmp_path):
    def message(call, other, first):
        return ("ValueError", f"{call}: world rank 1 gave pipeline='Pipeline #{other} of the job (1f1b, 4 layers, "
                              f"4 tensors)' but world rank 0 pipeline='Pipeline #{first} of the job (1f1b, 4 layers, "
                              f"4 tensors)'; every rank must pass the same pipeline")
    for got in launch(rt.two_pipelines, 2, str(tmp_path), timeout=200, start_method="fork"):
        assert got["save"] == message("save_checkpoint", 2, 1), got
        assert got["listed"] == [], got  # nothing written, the temporary directory removed
        assert got["load"] == message("load_checkpoint", 2, 3), got
        assert got["unchanged"], got  # nothing loaded into rank 0's Pipeline
        assert got["loaded"] == (2, True) and got["listed_after"] == ["good"], got  # the ranks stayed in step
