"""A channels_last CNN end to end (everything but the rank boundary itself, which test_layout_wire*.py cover): the
model converted with ``model.to(memory_format=torch.channels_last)`` (Conv, BN, ReLU, Conv, ReLU, Conv, BN, ReLU,
AdaptiveAvgPool2d, Flatten, Linear), channels_last 8x8 images, trained by a Pipeline on 2 ranks and DP 2 x PP 2 on
4, against the same model unsplit run one microbatch at a time. Bitwise where the README promises it: losses,
gradients and their strides, ``.grad is None``, weights and their strides after SGD-momentum / Adam steps, the
optimizer state's values and strides, BatchNorm running statistics, with 1f1b, zb-h1, zbv, recompute,
``balance="time"``, ``forward()``, GradScaler, a checkpoint round trip, and the replica copy at construction.

Found and fixed (runtime/grad_sum.py ``write_sum``): a replica whose data skipped a conv (``.grad`` None there) got
the all-reduced gradient as ``total.clone()`` of the flat buffer, row-major (27, 9, 3, 1), while the other replica
and the unsplit model have it channels_last (27, 1, 9, 3); its SGD momentum buffer followed (values were equal).
And (runtime/optim_state.py ``load_flat_state``): load_checkpoint gave a channels_last conv weight row-major Adam
state (exp_avg (27, 9, 3, 1)), read into the checkpoint's row-major buffers; now laid out as the parameter, as
torch's own state is. Both existed at 7587f27 too; values were bitwise either way.
"""
import pytest
import torch
import torch.nn.functional as F

from pipesched.runtime import launch

import rt_channels_last_s13 as rt

EMPTY = {"value": [], "stride": []}
BITWISE_CASES = ["1f1b-sgd", "1f1b-adam-zeros", "1f1b-recompute", "zb-h1", "zbv", "zbv-recompute", "frozen", "time"]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return launch(rt.suite2, 2, str(tmp_path_factory.mktemp("cl")), timeout=240)


@pytest.fixture(scope="module")
def four():
    return launch(rt.suite4, 4, timeout=240)


def assert_bitwise_row(row, where):
    assert row["loss"] is True, where
    assert row["grads"]["value"] == row["grads"]["stride"] == row["grads"]["none"] == [], (where, row["grads"])
    assert row["after"] == EMPTY, (where, row["after"])  # parameters and BN running statistics, values and strides
    assert row["opt"]["value"] == row["opt"]["stride"] == [] and row["opt"]["count"] > 0, (where, row["opt"])


@pytest.mark.parametrize("case", BITWISE_CASES)
def test_training_is_bitwise_the_unsplit_models_with_its_layouts(two, case):
    for rank in (0, 1):
        got = two[rank][case]
        assert got["names"], rank
        for step, row in enumerate(got["rows"]):
            assert_bitwise_row(row, (case, rank, step))


def test_conv_weights_and_their_gradients_stay_channels_last(two):
    """Conv2d(3, 8, 3): weight (8, 3, 3, 3) channels_last has strides (27, 1, 9, 3), its .grad too."""
    for case in BITWISE_CASES:
        strides = two[0][case]["rows"][-1]["strides"]
        assert strides["0.weight"] == ((27, 1, 9, 3), (27, 1, 9, 3)), case
        assert all(p == g and p[1] == 1 for p, g in strides.values()), (case, strides)


def test_grad_none_as_unsplit(two):
    """A frozen bias keeps .grad None; zero_grad() sets None, zero_grad(set_to_none=False) keeps zeros."""
    frozen = two[0]["frozen"]["rows"][0]
    assert frozen["grad_none"] == ["0.bias"]
    assert two[0]["1f1b-sgd"]["rows"][0]["grad_none"] == []
    assert two[0]["1f1b-sgd"]["rows"][0]["none_after_zero"] == two[0]["1f1b-sgd"]["names"]
    assert two[0]["1f1b-adam-zeros"]["rows"][0]["none_after_zero"] == []


def test_forward_outputs_and_running_statistics(two):
    """forward() in training mode: output bitwise with the unsplit model's strides, on the last stage's rank (rank 1
    for 1f1b, rank 0 for zbv); BN running statistics afterwards bitwise on both ranks."""
    assert two[1]["frozen"]["forward"] == (True, True) and "forward" not in two[0]["frozen"]
    assert two[0]["zbv"]["forward"] == (True, True) and "forward" not in two[1]["zbv"]
    for rank in (0, 1):
        assert two[rank]["frozen"]["forward_after"] == EMPTY
        assert two[rank]["zbv"]["forward_after"] == EMPTY


def test_profile_layers_leaves_the_model_as_it_was(two):
    for rank in (0, 1):
        assert two[rank]["time"]["profile"] == EMPTY


def test_gradient_accumulation_fusion_leaves_the_convolutions_bitwise(two):
    """Step 1: every conv/BN gradient bitwise; only the fused Linear's weight (10.weight, rank 1) may differ, to
    rounding (README: not bitwise); strides equal throughout."""
    first = [two[rank]["zb-h1-fusion"]["rows"][0] for rank in (0, 1)]
    assert_bitwise_row(first[0], "rank 0")
    assert first[1]["grads"]["value"] in ([], ["10.weight"]) and first[1]["grads"]["rel"] <= 1e-6
    for rank in (0, 1):
        for row in two[rank]["zb-h1-fusion"]["rows"]:
            assert row["grads"]["stride"] == row["after"]["stride"] == row["opt"]["stride"] == [], rank


def test_tied_conv_weights_across_ranks(two):
    """Layer 5's weight is layer 3's (ranks 0 and 1, balance [4, 7]): the tie's sum adds in another order than
    autograd (README: to rounding), so one step: its gradient within 1e-5, every other bitwise; strides equal."""
    for rank in (0, 1):
        row = two[rank]["tied"]["rows"][0]
        assert row["loss"] is True
        assert row["grads"]["value"] in ([], ["3.weight"]) and row["grads"]["rel"] <= 1e-5, row["grads"]
        assert row["grads"]["stride"] == row["grads"]["none"] == row["after"]["stride"] == row["opt"]["stride"] == []
        assert row["strides"]["3.weight"] == ((72, 1, 24, 8), (72, 1, 24, 8)), rank  # held on both ranks


def test_clip_grad_norm_keeps_layouts(two):
    """README: the total norm and clipped gradients within 1e-6 relative (here 0.0 measured)."""
    for rank in (0, 1):
        for row in two[rank]["clip"]:
            assert row["norm_rel"] <= 1e-6 and row["grad_rel"] <= 1e-6, row
            assert row["stride"] == row["param_stride"] == [], row


def test_grad_scaler_float16_bitwise(two):
    for rank in (0, 1):
        rows = two[rank]["scaler"]
        assert [r["scale"] for r in rows] == [(1024.0, 1024.0), (2048.0, 2048.0), (2048.0, 2048.0)]
        for step, row in enumerate(rows):
            assert_bitwise_row(row, (rank, step))


def test_checkpoint_round_trip_keeps_channels_last_and_resumes_bitwise(two):
    """Loaded into another channels_last model: parameters, BN statistics and Adam state bitwise the unsplit
    model's after 2 steps, with its strides (exp_avg of Conv2d(3, 8, 3): (27, 1, 9, 3)); 2 more steps bitwise the
    unsplit model trained 4 steps without interruption."""
    for rank in (0, 1):
        got = two[rank]["checkpoint"]
        assert got["loaded"] == EMPTY
        assert got["loaded_opt"]["value"] == got["loaded_opt"]["stride"] == [] and got["loaded_opt"]["count"] > 0
        for step, row in enumerate(got["rows"]):
            assert_bitwise_row(row, (rank, step))
    assert two[0]["checkpoint"]["strides"]["0.weight"] == ((27, 1, 9, 3),) * 3


def test_dp_replicas_copy_keeps_channels_last_and_train_bitwise(four):
    """Seed = world rank: right after construction every rank holds replica 0's values with the unsplit model's
    strides; 3 SGD-momentum steps: gradients (both halves' average), weights, momentum and each replica's own BN
    statistics bitwise the unsplit model's, strides equal."""
    for rank in range(4):
        got = four[rank]["dp"]
        assert got["init"] == EMPTY, rank
        for step, row in enumerate(got["rows"]):
            row = dict(row, loss=True)
            assert_bitwise_row(row, (rank, step))


def _skipped_reference():
    """The unsplit model: replica 0's half (positive images) uses layer 0's conv, replica 1's skips it; each
    parameter's gradient (g0 + g1) / 2, a missing one as zeros. One thread, as the ranks (a conv's backward rounds
    otherwise on several)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _skipped_gradients()
    finally:
        torch.set_num_threads(threads)


def _skipped_gradients():
    torch.manual_seed(0)
    model = torch.nn.Sequential(rt.Maybe(), torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                torch.nn.Linear(8, 4)).to(memory_format=torch.channels_last)
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(2, 3, 8, 8, generator=g).abs(), torch.randn(2, 4, generator=g)
    halves = []
    for sign in (1, -1):
        F.mse_loss(model((sign * x).contiguous(memory_format=torch.channels_last)), y).backward()
        halves.append({n: p.grad for n, p in model.named_parameters()})
        model.zero_grad()
    return {n: (halves[0][n] + (halves[1][n] if halves[1][n] is not None else 0)) / 2 for n in halves[0]}


def test_dp_gradient_of_a_conv_one_replica_skipped_is_channels_last(four):
    """Both replicas: 0.conv.weight's .grad and momentum buffer (3, 3, 3, 3) channels_last, (27, 1, 9, 3), and
    the gradient bitwise the unsplit average. Before the fix, the replica that skipped it had (27, 9, 3, 1)."""
    want = _skipped_reference()
    for rank in range(4):
        got = four[rank]["skipped"]
        for n, grad in got["grads"].items():
            assert torch.equal(grad, want[n]), (rank, n)
        if got["pp_rank"] == 0:
            assert got["grad_strides"] == {"0.conv.weight": (27, 1, 9, 3), "1.weight": (27, 1, 9, 3)}, rank
            assert got["momentum_strides"] == got["grad_strides"], rank


def test_loaded_optimizer_state_keeps_the_strides_of_a_parameters_size_1_dims():
    """A parameter (8, 3, 1, 1) with strides (3, 1, 3, 3) (what a channels_last layout gives a tensor with size-1
    dims): ``is_contiguous()`` is True all the same, yet torch's Adam state (``zeros_like``) has those strides, and
    so has the state loaded from row-major tensors."""
    from pipesched.runtime.optim_state import flat_state, load_flat_state
    w = torch.nn.Parameter(torch.empty_strided((8, 3, 1, 1), (3, 1, 3, 3)).normal_())
    assert w.is_contiguous()
    opt = torch.optim.Adam([w])
    w.grad = torch.ones_like(w)
    opt.step()
    assert opt.state[w]["exp_avg"].stride() == (3, 1, 3, 3)
    names = {id(w): "w"}
    flat = {k: v.clone(memory_format=torch.contiguous_format) if torch.is_tensor(v) and v.dim() == 4 else v
            for k, v in flat_state(opt, names).items()}
    assert flat["state.w.exp_avg"].stride() == (3, 1, 1, 1)
    fresh = torch.optim.Adam([w])
    load_flat_state(fresh, names, flat)
    state = fresh.state[w]
    assert state["exp_avg"].stride() == state["exp_avg_sq"].stride() == (3, 1, 3, 3)
    assert torch.equal(state["exp_avg"], opt.state[w]["exp_avg"])
