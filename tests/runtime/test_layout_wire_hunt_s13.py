"""Hunt (s13) on stage outputs and gradients crossing a rank boundary in their own dim order: a Pipeline against the
unsplit model run one microbatch at a time (rt_cases.reference_step), with two Probes at each boundary recording the
strides of the activation and of the gradient reaching them (rt_layout_wire.Probe). Cases: channels_last 4-D and
channels_last_3d 5-D, 3-D/4-D permutations, a batch of 1 in uneven microbatches, 0-dim and empty tensors and the
bytes path (complex, int16, float16, bfloat16, bool) in tuples, expand, views of the stage input and of a parameter,
a tensor returned twice, a user hook on the stage input, an in-place first layer, layouts that change between
microbatches and steps; 1f1b, gpipe, interleaved-1f1b, zb-h1, zb-h2, zbv, recompute, autocast bfloat16, forward(),
several steps (learned metas reused), and 2 pipeline ranks x dp_size=2.

Found and fixed (each test below failed before its fix):
- a dense tensor whose size-1 dims have other strides than row-major's arrived with row-major's (``wire_order``
  took any ``is_contiguous()`` tensor as row-major): a channels_last (N, C, 1, 1) after a global pool then picked
  other kernels downstream, and gradients differed from the unsplit model's (also before the layout change);
- a stage output of 40 2-D tensors no longer fit the 256-word meta header (each tensor takes 2 * ndim + 3 words
  with its dim order; ndim + 3 before, up to 50 2-D tensors): the header is 512 words now;
- with recompute, a tensor hook the stage's forward registers on its input ran twice (F and R both registered it
  on the same input tensor): the gradient sent back was doubled (also before the layout change). F now runs on
  aliases of its inputs.
One launch of 2 ranks and one of 4 run every multi-process case (rt_layout_wire_hunt_s13)."""
import pytest
import torch

from pipesched.runtime import launch
from pipesched.runtime.wire import encode_meta, meta_of
from pipesched.runtime.layout import from_wire, to_wire, wire_order, wire_shape

import rt_layout_wire_hunt_s13 as hunt


@pytest.fixture(scope="module")
def two():
    return launch(hunt.two_rank_suite, 2, timeout=240)


@pytest.fixture(scope="module")
def four():
    return launch(hunt.four_rank_suite, 4, timeout=240)


KNOWN = {"toggle", "pool", "hook_rc", "many40"}  # tested on their own below
BITWISE = [k for k in hunt.TWO if k not in KNOWN]
# the documented exception: a tensor with repeats (expand, the stride-0 gradient of a sum) arrives dense; an empty
# tensor's strides are not compared
SAME_STRIDES = [k for k in BITWISE if k not in ("expand", "sum_in", "empty_gpipe_rc")]
FORWARD = [k for k, (_, options) in hunt.TWO.items() if options.get("forward")]


def _ok(results, key):
    for rank, got in enumerate(results):
        assert "error" not in got[key], (rank, got[key])
    return [got[key] for got in results]


def _assert_bitwise(results, key, steps=None):
    for rank, got in enumerate(_ok(results, key)):
        want = steps or len(got["steps"])
        assert len(got["steps"]) == want
        for k, step in enumerate(got["steps"][:want]):
            assert step["eq"] and step["loss"][0] == step["loss"][1], (rank, k, step["loss"])
            assert step["unequal"] == [], (rank, k, step["unequal"])


@pytest.mark.parametrize("key", BITWISE)
def test_losses_and_gradients_are_bitwise_the_unsplit_models(two, key):
    """Every step (the first learns the metas, later ones send no header): the loss on both ranks and every
    gradient of each rank's parameters equal the unsplit model's bitwise."""
    _assert_bitwise(two, key)
    assert len(two[0][key]["steps"]) == hunt.TWO[key][1].get("steps", 2)


@pytest.mark.parametrize("key", SAME_STRIDES)
def test_each_probe_sees_the_unsplit_models_strides(two, key):
    """Both sides of each boundary: the activation's and the gradient's strides, every microbatch shape, every step,
    are those of the unsplit model (a dense tensor arrives exactly as laid out)."""
    for rank, got in enumerate(_ok(two, key)):
        for k, step in enumerate(got["steps"]):
            ours, ref = step["probes"]
            assert ours and ours == ref, (rank, k)


@pytest.mark.parametrize("key", FORWARD)
def test_forward_outputs_are_the_unsplit_models(two, key):
    """forward() after training, learning then learned: the last stage's rank returns the unsplit output bitwise
    (rank 0 None); the probes see the unsplit strides (activations only)."""
    for rank, got in enumerate(_ok(two, key)):
        assert len(got["forward"]) == 2
        for same, (ours, ref) in got["forward"]:
            assert same is (True if rank == 1 else None), rank
            if key in SAME_STRIDES:
                assert ours == ref and all(kind == "act" for recs in ours.values() for kind, *_ in recs)


def test_the_strides_at_the_boundaries_are_stated(two):
    """Written out: (53, B, 16) = permute(2, 0, 1) of a (B, 16, 53) Linear output, B = 2 and 1, and its gradient;
    channels_last_3d (B, 4, 4, 4, 4), whose gradient from Conv3d is channels_last_3d for one microbatch shape and
    row-major for the other, in the unsplit model too; zbv's boundaries crossed rank 0 -> 1 and back."""
    perm = {"act": (1, 848, 53), "grad": (1, 848, 53)}
    for rank, probe in ((0, 2), (1, 3)):
        seen = two[rank]["perm3_b1_gpipe"]["steps"][1]["probes"][0]
        assert seen == {probe: [("act", 0, perm["act"]), ("grad", 0, perm["grad"])]}
        seen = two[rank]["cl3d"]["steps"][0]["probes"][0]
        assert seen == {probe: [("act", 0, (256, 1, 64, 16, 4)), ("grad", 0, (256, 1, 64, 16, 4)),
                                ("grad", 0, (256, 64, 16, 4, 1))]}
    zbv = two[1]["chain4_zbv"]["steps"][1]["probes"][0]
    assert zbv[3] == [("act", 0, (848, 1, 53)), ("grad", 0, (848, 1, 53))]
    assert zbv[6] == zbv[7] == [("act", 0, (1, 320, 20)), ("grad", 0, (1, 320, 20))]  # handed over on rank 1
    assert zbv[11] == [("act", 0, (192, 1, 12)), ("grad", 0, (12, 1, 12)), ("grad", 0, (192, 16, 1))]


def test_tensors_with_repeats_arrive_dense_and_gradients_stay_bitwise(two):
    """The documented exception, both directions: an ``expand`` output (strides (8, 0)) arrives dense (8, 1); the
    stride-0 gradient of ``x.sum(-1)`` ((1, 0) on rank 1) arrives dense on rank 0. Gradients bitwise (above)."""
    ours, ref = two[1]["expand"]["steps"][1]["probes"]
    assert (ours, ref) == ({3: [("act", 0, (8, 1)), ("grad", 0, (8, 1))]},
                           {3: [("act", 0, (8, 0)), ("grad", 0, (8, 1))]})
    ours, ref = two[0]["sum_in"]["steps"][1]["probes"]
    assert (ours, ref) == ({1: [("act", 0, (8, 1)), ("grad", 0, (8, 1))]},
                           {1: [("act", 0, (8, 1)), ("grad", 0, (1, 0))]})
    assert two[1]["sum_in"]["steps"][1]["probes"][0] == {2: [("act", 0, (8, 1)), ("grad", 0, (1, 0))]}


def test_an_empty_tensor_in_a_tuple_only_differs_in_its_strides(two):
    """The empty (12, 0) element: its strides are not compared (they differ now, (1, 1) against (1, 12)); every
    other element's are the unsplit ones."""
    for rank, got in enumerate(two):
        ours, ref = got["empty_gpipe_rc"]["steps"][0]["probes"]
        strip = lambda recs: {p: [r for r in rs if r[1] != 1] for p, rs in recs.items()}  # noqa: E731
        assert strip(ours) == strip(ref), rank


def test_a_layout_that_changes_between_steps_is_sent_in_the_learned_one(two):
    """Toggle alternates row-major / column-major per call, 3 microbatches a step: step 2 (index 1) sees the
    other layouts than the learning step, which the receiver keeps (documented). No error; losses bitwise each
    step; steps 1 and 3 (the learned layouts) bitwise gradients; step 2's within rounding."""
    for rank, got in enumerate(_ok(two, "toggle")):
        steps = got["steps"]
        assert [s["eq"] for s in steps] == [True, True, True], rank
        assert steps[0]["unequal"] == steps[2]["unequal"] == [], rank
        assert steps[1]["worst"] < 1e-5, rank


def test_a_tuple_of_30_tensors_still_fits_the_header(two):
    _assert_bitwise(two, "many30", steps=1)


# ---- 2 pipeline ranks x dp_size=2 -------------------------------------------------------------------------------

@pytest.mark.parametrize("key", list(hunt.FOUR))
def test_data_parallel_replicas_are_the_average_of_unsplit_replicas(four, key):
    """Each replica's loss bitwise its batch's unsplit loss; every gradient bitwise (a + b) / 2 of the replicas'
    unsplit gradients; probes see the unsplit strides; forward() bitwise where run."""
    _assert_bitwise(four, key)
    for rank, got in enumerate(four):
        for step in got[key]["steps"]:
            ours, ref = step["probes"]
            assert ours and ours == ref, rank
        for same, _ in got[key]["forward"]:
            assert same is (True if rank % 2 == 1 else None), rank


# ---- found here, fixed ------------------------------------------------------------------------------------------

def test_a_pooled_channels_last_tensor_keeps_its_strides_and_gradients_stay_bitwise(two):
    """channels_last conv, adaptive_avg_pool2d(1): (B, 8, 1, 1) with strides (8, 1, 8, 8) in the unsplit model
    (channels_last for torch's suggest_memory_format). It arrived (8, 1, 1, 1), so the 1x1 conv and upsampling after
    it ran row-major, and 4 of 6 parameters' gradients (and rank 0's, through the gradient sent back) differed."""
    for rank, got in enumerate(_ok(two, "pool")):
        ours, ref = got["steps"][0]["probes"]
        assert ours == ref, rank
    _assert_bitwise(two, "pool")


@pytest.mark.parametrize("key", ["mix_b1", "input_view_b1"])
def test_a_batch_of_1_keeps_its_strides(two, key):
    """A batch of 1 (uneven microbatches): x.t() of a (1, 12) tensor has strides (1, 12) in the unsplit model and
    arrived (1, 1); the (1, 16, 9) gradient of a transposed input has (9, 9, 1) and arrived (144, 9, 1). Gradients
    were bitwise all the same (above)."""
    for rank, got in enumerate(_ok(two, key)):
        ours, ref = got["steps"][0]["probes"]
        assert ours == ref, rank


def test_recompute_with_a_hook_on_the_stage_input_is_the_unsplit_model(two):
    """HookInput registers ``g * 2`` on the stage input in its forward; with recompute rank 0's gradients come out
    twice the unsplit model's (the gradient sent back is doubled twice). Without recompute: bitwise (hook_zbh1,
    hook4_* above)."""
    _assert_bitwise(two, "hook_rc")


def test_a_tuple_of_40_tensors_still_crosses_the_boundary(two):
    _assert_bitwise(two, "many40", steps=1)


def test_the_header_describes_what_it_described_before():
    """50 (B, 8) tensors: 2 + 50 * 5 = 252 words before the change."""
    encode_meta(meta_of([torch.zeros(4, 8)] * 50, True))


def test_the_header_still_describes_36_tensors():
    encode_meta(meta_of([torch.zeros(4, 8).t()] * 36, True))  # 2 + 36 * 7 = 254 words


def _received(t):
    """``t`` sent and received: the row-major wire buffer viewed back (what the receiver's stage gets)."""
    order = wire_order(t)
    buf = torch.empty(wire_shape(t.shape, order), dtype=t.dtype)
    buf.copy_(to_wire(t, order))
    return from_wire(buf, order)


def test_a_pooled_channels_last_tensor_round_trips_its_strides():
    pooled = torch.nn.functional.adaptive_avg_pool2d(
        torch.randn(4, 8, 3, 3).contiguous(memory_format=torch.channels_last), 1)
    assert pooled.stride() == (8, 1, 8, 8) and pooled.is_contiguous()
    assert _received(pooled).stride() == (8, 1, 8, 8)


def test_dense_layouts_without_size_1_dims_round_trip_their_strides():
    base = torch.randn(2, 3, 4, 5)
    for t in (base.contiguous(memory_format=torch.channels_last), base.permute(2, 0, 3, 1), base[0].permute(2, 0, 1),
              torch.randn(2, 3, 4, 5, 6).contiguous(memory_format=torch.channels_last_3d)):
        got = _received(t)
        assert got.stride() == t.stride() and torch.equal(got, t)
