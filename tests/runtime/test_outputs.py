"""The step loss is the same value on every rank, and the last stage may return dicts and tuples with
non-tensor parts (issue 10, items 4 and 5). One launch of 2 gloo ranks runs every multi-process case
(rt_outputs.suite); merge and stage_activation_bytes are tested in this process."""
import collections
import re

import pytest
import torch

from pipesched.runtime import launch, stage_activation_bytes
from pipesched.runtime.microbatch import merge

import rt_outputs
from rt_outputs import LOSS_CASES, SIZES, dict_loss, head_model


@pytest.fixture(scope="module")
def ranks():
    return launch(rt_outputs.suite, 2, timeout=240)


# ---- item 4 ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape, dtype", LOSS_CASES)
def test_step_returns_the_same_0_dim_loss_on_every_rank(ranks, shape, dtype):
    """loss_fn returns ``shape`` (one element) of ``dtype``: every rank returns shape (), that dtype, on CPU,
    requires_grad False, the same bits, equal to the unsplit model's loss; grads bitwise."""
    for rank, results in enumerate(ranks):
        case = results["loss"][(shape, dtype)]
        loss = case["loss"]
        assert (tuple(loss.shape), loss.dtype, case["device"], case["requires_grad"]) == ((), dtype, "cpu", False), rank
        assert case["ref"].shape == shape and case["ref"].dtype == dtype  # the reference keeps loss_fn's shape
        assert torch.equal(loss, case["ref"].reshape(())), (rank, loss, case["ref"])
        assert case["bitwise"], rank
    assert torch.equal(ranks[0]["loss"][(shape, dtype)]["loss"], ranks[1]["loss"][(shape, dtype)]["loss"])


# ---- item 5: merge (one process) ------------------------------------------------------------------------------

def _t(*shape):
    return torch.arange(float(torch.Size(shape).numel())).reshape(shape)


def test_merge_concatenates_tensors_and_keeps_equal_non_tensors_once():
    """dict: per key; tuple: per element; a non-tensor equal on every microbatch once, else the list of them."""
    a, b = _t(2, 3), _t(1, 3) + 10
    merged = merge([{"logits": a, "aux": a[:, 0], "tag": "x"}, {"logits": b, "aux": b[:, 0], "tag": "x"}])
    assert list(merged) == ["logits", "aux", "tag"]
    assert torch.equal(merged["logits"], torch.tensor([[0., 1., 2.], [3., 4., 5.], [10., 11., 12.]]))
    assert torch.equal(merged["aux"], torch.tensor([0., 3., 10.]))
    assert merged["tag"] == "x"
    merged = merge([(a, "tag", 3, 2, None), (b, "tag", 3, 1, None)])
    assert isinstance(merged, tuple) and merged[1:] == ("tag", 3, [2, 1], None)
    assert torch.equal(merged[0], torch.cat([a, b]))


def test_merge_keeps_the_container_type():
    """A bare tensor stays a tensor (N, ...), a list a list, a namedtuple that namedtuple; nested ones recurse."""
    pair = collections.namedtuple("Pair", "h tag")
    assert torch.equal(merge([_t(2), _t(1)]), torch.tensor([0., 1., 0.]))
    got = merge([[_t(2)], [_t(1)]])
    assert isinstance(got, list) and torch.equal(got[0], torch.tensor([0., 1., 0.]))
    got = merge([pair(_t(2), "a"), pair(_t(1), "a")])
    assert type(got) is pair and got.tag == "a" and torch.equal(got.h, torch.tensor([0., 1., 0.]))
    got = merge([{"a": (_t(1), {"b": 1})}, {"a": (_t(1), {"b": 2})}])
    assert torch.equal(got["a"][0], torch.tensor([0., 0.])) and got["a"][1] == {"b": [1, 2]}


def test_merge_keeps_values_of_another_type_per_microbatch():
    """1 and 1.0 are equal but of other types: not merged into one; an object whose == raises: a list."""
    class NoEq:
        def __eq__(self, other):
            raise TypeError("no ==")

    x, y = NoEq(), NoEq()
    got = merge([(_t(1), 1), (_t(1), 1.0)])[1]
    assert got == [1, 1.0] and [type(v) for v in got] == [int, float]
    got = merge([(_t(1), x), (_t(1), y)])[1]
    assert isinstance(got, list) and len(got) == 2 and got[0] is x and got[1] is y


@pytest.mark.parametrize("outputs, message", [
    ([{"logits": _t(2, 3), "aux": torch.tensor(1.)}] * 2,
     r"^element 'aux' of the last stage's output is 0-dim \(shape \(\)\) on microbatch 0; forward\(\) concatenates"),
    ([(_t(2), torch.tensor(1.))] * 2, r"^element 1 of the last stage's output is 0-dim"),
    ([torch.tensor(1.)] * 2, r"^the last stage's output is 0-dim"),
    ([(_t(2), {"z": [torch.tensor(1.)]})] * 2, r"^element \[1\]\['z'\]\[0\] of the last stage's output is 0-dim"),
    ([(_t(2), "a"), (_t(2),)], r"the last stage's output has another structure on microbatch 1 than on microbatch 0: "
                               r"\(Tensor,\) vs \(Tensor, str\)$"),
    ([{"h": _t(2), "t": "a"}, {"h": _t(2), "t": _t(2)}],
     r"^element 't' of the last stage's output is a str on microbatch 0 but a Tensor on microbatch 1"),
    ([{"h": _t(2, 2)}, {"h": _t(2, 3)}],
     r"^element 'h' of the last stage's output cannot be concatenated along dim 0 over the microbatches "
     r"\(shapes \[\(2, 2\), \(2, 3\)\]\)"),
    ([], "merge needs at least one microbatch"),
])
def test_merge_errors_name_the_element_of_the_last_stages_output(outputs, message):
    with pytest.raises(ValueError, match=message) as info:
        merge(outputs)
    assert not re.search(r"\bbatch\b", str(info.value).replace("batch dimension", ""))  # blames no "batch"


def test_stage_activation_bytes_takes_a_dict_output_of_the_last_stage():
    """The last stage's output goes to loss_fn only: a dict there is measured (2 stages, ints per stage)."""
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    sizes = stage_activation_bytes(head_model("dict"), x, 2, loss_fn=dict_loss, target=y)
    assert sizes["input_bytes"] == (3 * 8 * 4, 3 * 8 * 4)  # x, then stage 0's output: (3, 8) float32 each
    assert all(len(v) == 2 and all(b > 0 for b in v) for v in sizes.values())


# ---- item 5: through the pipeline --------------------------------------------------------------------------

OUTPUT_CASES = [("dict", "1f1b"), ("dict", "interleaved-1f1b"), ("tagged", "1f1b"), ("tagged", "interleaved-1f1b"),
                ("dict", "1f1b", "recompute+split"), ("tagged", "interleaved-1f1b", "recompute+split")]


@pytest.mark.parametrize("key", OUTPUT_CASES, ids="-".join)
def test_step_passes_the_last_stages_output_to_loss_fn_as_is(ranks, key):
    """step(): loss bitwise the unsplit model's (0-dim float32, both ranks), grads bitwise on each rank."""
    for rank, results in enumerate(ranks):
        case = results[key]
        assert case["grads"] > 0 and case["bitwise"], (rank, case["grads"])
        assert case["loss"].shape == () and torch.equal(case["loss"], case["ref_loss"]), rank


@pytest.mark.parametrize("key", OUTPUT_CASES, ids="-".join)
def test_forward_merges_the_last_stages_output_per_key_and_element(ranks, key):
    """forward() on rank 1 (last stage): dict -> {"logits": (10, 8), "aux": (10,)}, the unsplit model's
    microbatch outputs concatenated; tagged -> ((10, 8), "tag", 3, [3, 3, 2, 2]). Rank 0: None."""
    assert ranks[0][key]["forward"] is None
    got, parts = ranks[1][key]["forward"], ranks[1][key]["ref_parts"]
    if key[0] == "dict":
        assert isinstance(got, dict) and list(got) == ["logits", "aux"]
        assert got["logits"].shape == (10, 8) and got["aux"].shape == (10,)
        assert torch.equal(got["logits"], torch.cat([p["logits"] for p in parts]))
        assert torch.equal(got["aux"], torch.cat([p["aux"] for p in parts]))
    else:
        assert isinstance(got, tuple) and got[1:] == ("tag", 3, SIZES)
        assert got[0].shape == (10, 8) and torch.equal(got[0], torch.cat([p[0] for p in parts]))


def test_a_0_dim_element_of_the_last_stages_output_is_explained_and_the_pipeline_stays_usable(ranks):
    """forward() with "aux" 0-dim: ValueError naming element 'aux' on the last stage's rank, None on rank 0;
    the next forward() works on both."""
    assert ranks[0][("dict", "1f1b")]["scalar_aux"] is None
    message = ranks[1][("dict", "1f1b")]["scalar_aux"]
    assert message.startswith("ValueError: element 'aux' of the last stage's output is 0-dim (shape ()) on "
                              "microbatch 0; forward() concatenates each tensor of it along dim 0"), message
    assert [r[("dict", "1f1b")]["again"] for r in ranks] == [None, True]


@pytest.mark.parametrize("kind, cause", [
    ("dict", "TypeError: the output of stage 0 must be a tensor or a non-empty tuple or list of tensors, got dict (it is "
             "sent to the next stage; only the last stage's output, which goes to loss_fn and forward() as-is, may "
             "be a dict or hold other values)"),
    ("tag", "TypeError: element 1 of the output of stage 0 must be a torch.Tensor, got str; the output of stage 0 "
            "must be a tensor or a non-empty tuple or list of tensors (it is sent to the next stage; only the last stage's "
            "output, which goes to loss_fn and forward() as-is, may be a dict or hold other values)"),
])
def test_a_middle_stage_returning_a_dict_or_a_non_tensor_names_the_stage_and_what_is_allowed(ranks, kind, cause):
    """Stage 0 of 2 ends in a dict / (tensor, "tag"): PipelineError on both ranks, from rank 0 at F0.0."""
    for results in ranks:
        assert results[f"middle_{kind}"] == {"rank": 0, "instr": "F0.0", "cause": cause}


def test_a_loss_that_is_not_floating_is_refused_at_the_first_forward_of_the_last_stage(ranks):
    """loss_fn returns an int64 scalar: PipelineError on both ranks from rank 1 at F1.0 (before any backward)."""
    cause = ("ValueError: loss_fn must return a floating-point tensor (torch.float32, torch.float64, torch.float16, "
             "torch.bfloat16), got torch.int64")
    for results in ranks:
        assert results["int_loss"] == {"rank": 1, "instr": "F1.0", "cause": cause}
