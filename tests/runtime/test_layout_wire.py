"""Stage outputs and gradients cross a rank boundary in their own memory layout (dim order), so the next stage's
input and the gradient sent back have the strides they have in the unsplit model, and the same kernels run on them:
a transposed output, ``channels_last``, a tuple of mixed layouts and dtypes, V placement in both directions, with
recompute. Before, each was made contiguous to be sent, and gradients differed from the unsplit model's in the last
bits (a transposed output: one bias; ``channels_last``: four of six parameters)."""
import itertools

import pytest
import torch
from torch import nn

from pipesched.runtime import launch
from pipesched.runtime.wire import decode_meta, encode_meta, meta_of
from pipesched.runtime.layout import Gapped, activation_layout, from_wire, restride, to_wire, wire_order, \
    wire_shape
from pipesched.runtime.input_grads import input_gradients

import rt_layout_wire


@pytest.fixture(scope="module")
def ranks():
    return launch(rt_layout_wire.suite, 2, timeout=240)


CASES = [("transpose", "1f1b", False), ("channels_last", "1f1b", False), ("tuple", "1f1b", False),
         ("slice", "1f1b", False), ("transpose", "zb-h1", False), ("channels_last", "zb-h1", True),
         ("tuple", "gpipe", True), ("zbv", "zbv", False), ("zbv", "zbv", True)]


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_gradients_and_losses_are_bitwise_the_unsplit_models(ranks, case):
    for rank in (0, 1):
        got = ranks[rank][case]
        loss, ref_loss = got["loss"]
        assert loss == ref_loss
        assert got["grads"], "every rank holds parameters"
        unequal = [name for name, (a, b) in got["grads"].items() if not torch.equal(a, b)]
        assert unequal == [], (rank, unequal)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_both_sides_of_each_boundary_see_the_unsplit_models_strides(ranks, case):
    for rank in (0, 1):
        ours, ref = ranks[rank][case]["probes"]
        assert ours and ours == ref, rank


def test_the_strides_at_the_transposed_boundary_are_stated(ranks):
    """What the probes see, written out: the transposed activation ((53, 16) per row, strides (848, 1, 53)) on both
    ranks, and the row-major gradient that Linear(16, 29) gives it on rank 1, which reaches rank 0 row-major too
    (the input's ``.grad`` would be laid out as the input, (848, 1, 53))."""
    seen = [ranks[rank][("transpose", "1f1b", False)]["probes"][0] for rank in (0, 1)]
    assert seen[0] == {2: [("act", 0, (848, 1, 53)), ("grad", 0, (848, 16, 1))]}
    assert seen[1] == {3: [("act", 0, (848, 1, 53)), ("grad", 0, (848, 16, 1))]}


def test_channels_last_arrives_channels_last(ranks):
    ours, _ = ranks[1][("channels_last", "1f1b", False)]["probes"]
    assert ours == {4: [("act", 0, (512, 1, 64, 8)), ("grad", 0, (512, 1, 64, 8))]}


def test_a_slice_arrives_with_its_strides(ranks):
    """A tensor with gaps (``x[..., ::2]``: strides (40, 2)) is sent row-major and copied into a region with its
    strides on the receiver: the next stage sees (40, 2) as unsplit."""
    ours, ref = ranks[1][("slice", "1f1b", False)]["probes"]
    assert ours == ref == {3: [("act", 0, (40, 2)), ("grad", 0, (20, 1))]}


def test_a_layout_that_changes_after_the_learning_step_is_sent_in_the_learned_one(ranks):
    """Step 1 learns a row-major boundary; step 2's output is column-major: no error, the values arrive (stage 1
    is elementwise, so gradients are bitwise the unsplit model's; step 2's loss to float rounding: its mean runs
    over the row-major tensor where the unsplit model's runs over the column-major one, which a vectorised sum
    (AVX-512 here) adds in another order)."""
    (l1, r1), eq1, (l2, r2), eq2 = ranks[0]["layout_change"]
    assert (l1, eq1, eq2) == (r1, True, True) and abs(l2 - r2) <= 1e-6 * abs(r2), (l1, r1, l2, r2, eq1, eq2)
    assert ranks[1]["layout_change"] == [(l1, r1), (l2, r2)]


# ---- units ------------------------------------------------------------------------------------------------------

def _layouts():
    base = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5)
    yield base
    yield base.contiguous(memory_format=torch.channels_last)
    for perm in itertools.permutations(range(4)):
        yield base.permute(perm)
    yield base[0, 0].t()
    yield torch.tensor(3.0)


def test_to_wire_is_a_free_contiguous_view_and_from_wire_gives_the_strides_back():
    for t in _layouts():
        order = wire_order(t)
        wired = to_wire(t, order)
        assert wired.is_contiguous() and wired.data_ptr() == t.data_ptr()
        assert wired.shape == wire_shape(t.shape, order)
        back = from_wire(wired.clone(), order)
        assert back.shape == t.shape and back.stride() == t.stride() and torch.equal(back, t)


def test_wire_orders_of_the_common_layouts():
    x = torch.zeros(2, 3, 4, 5)
    assert wire_order(x) == (0, 1, 2, 3)
    assert wire_order(x.contiguous(memory_format=torch.channels_last)) == (0, 2, 3, 1)
    assert wire_order(x[0, 0].t()) == (1, 0)
    assert wire_order(torch.zeros(3, 1).expand(3, 4)) == (0, 1)  # repeats: row-major, sent materialized


def test_a_gapped_layout_round_trips_its_strides_and_the_header_carries_it():
    base = torch.arange(60.0).reshape(3, 4, 5)
    for t in (base[:, 1:3], base[:, ::2], base.transpose(0, 2)[1:4], base.chunk(2, -1)[0]):
        layout = activation_layout(t)
        assert layout == Gapped(t.stride(), t.storage_offset() % 16)  # 64-byte alignment, in float32 elements
        wired = to_wire(t, layout).contiguous()
        back = from_wire(wired, layout)
        assert back.stride() == t.stride() and back.storage_offset() == layout.offset and torch.equal(back, t)
        meta = meta_of((torch.zeros(2, 3).t(), t, torch.zeros(2, 3).t()), True)  # one after it: decode's offset
        assert decode_meta(encode_meta(meta)) == meta and meta[2] == ((1, 0), layout, (1, 0))
    assert activation_layout(base[2, :, 1:3]).offset == (40 + 1) % 16
    assert activation_layout(torch.zeros(3, 1).expand(3, 4)) == (0, 1)  # repeats: dense, not Gapped
    assert activation_layout(base[..., ::2]) == (0, 1, 2)  # (20, 5, 2): rows interleave, read as sharing: dense
    assert activation_layout(base[:, :, :0]) == wire_order(base[:, :, :0])  # empty: nothing to rebuild


def test_restride_copies_into_the_order():
    x = torch.randn(2, 3, 4, 5)
    y = restride(x, (0, 2, 3, 1))
    assert y.is_contiguous(memory_format=torch.channels_last) and torch.equal(y, x)
    assert restride(x, (0, 1, 2, 3)) is x


def test_meta_header_carries_the_dim_orders():
    tensors = (torch.zeros(2, 3, 4, 5).contiguous(memory_format=torch.channels_last), torch.zeros(3, 4).t(),
               torch.zeros(()), torch.zeros(5, dtype=torch.int16))
    meta = meta_of(tensors, True)
    assert meta[2] == ((0, 2, 3, 1), (1, 0), (), (0,))
    assert decode_meta(encode_meta(meta)) == meta


def test_input_gradients_are_the_gradients_as_they_flow_not_the_inputs_grad():
    """A Linear over a transposed 3-D view of the input: the flowing gradient is transposed (strides (20, 1, 4));
    ``.grad`` is laid out as the input (row-major). A hook the forward registered on the input (doubling) is applied
    first; an input no root depends on gets None; the hooks go when the block ends."""
    lin = nn.Linear(4, 3)
    x = torch.randn(2, 4, 5).requires_grad_()
    unused = torch.randn(2).requires_grad_()
    x.register_hook(lambda g: g * 2)
    out = lin(x.transpose(1, 2))
    with input_gradients([x, torch.zeros(1), unused]) as got:
        out.backward(torch.ones(2, 5, 3))
    assert len(got) == 2 and got[1] is None
    assert got[0].stride() == (20, 1, 4) and x.grad.stride() == (20, 5, 1)
    assert torch.equal(got[0], x.grad)
    assert torch.equal(got[0], 2 * lin.weight.detach().sum(0).reshape(1, 4, 1).expand(2, 4, 5))
    first = got[0]
    lin(x.transpose(1, 2)).backward(torch.ones(2, 5, 3))  # after the block: its hooks are gone
    assert got[0] is first


def test_input_gradients_cost_no_copy_where_the_gradient_has_the_inputs_layout():
    """The usual case: the flowing gradient has the input's strides; autograd hands that tensor over as ``.grad``
    (the hook kept no reference), and it is what is returned: the same storage, no copy."""
    lin = nn.Linear(4, 3)
    x = torch.randn(5, 4).requires_grad_()
    out = lin(x)
    with input_gradients([x]) as got:
        out.backward(torch.ones(5, 3))
    assert got[0] is x.grad and got[0].stride() == (4, 1)
