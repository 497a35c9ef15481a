"""Session 15's finds: what a step's bookkeeping learned at construction or at a signature's first step must
follow a setting changed later. 2 spawned gloo ranks (tests/runtime/rt_s15_hunt.py).

1. ``x.requires_grad_()`` on a later step (a caller asking for the input's gradient, e.g. for saliency) changed
   stage 0's output from not requiring grad to requiring it where stage 0 is frozen, with the same input
   signature: the step failed at stage 0's send, blaming a data-dependent output. x's ``requires_grad`` is now
   part of the signature, so the metas are re-learned.
2. ``inplace=True`` set on a stage's first layer after construction (``model[2].inplace = True``) failed with
   autograd's in-place-on-a-leaf error, although the same layer at construction is supported (the stage gets a
   copy of its input): the copy is now decided at each forward.
"""
import pytest
import torch

from pipesched.runtime import launch
from pipesched.runtime.handshake import REQUIRES_GRAD, encode_signature
from pipesched.runtime.comm import DTYPE_CODE

import rt_s15_hunt


@pytest.fixture(scope="module")
def results():
    return launch(rt_s15_hunt.suite, 2, timeout=300)


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
@pytest.mark.parametrize("frozen", [False, True])
def test_input_requiring_grad_on_a_later_step(results, schedule, frozen):
    name = f"input-grad-{'frozen-' if frozen else ''}{schedule}"
    counts = [4, 2]  # this rank's parameters (frozen ones too), by rank
    for rank, res in enumerate(results):
        assert res[name] == [(True, True, counts[rank], True)] * 3, (rank, res[name])


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["inplace-later-1f1b", "inplace-later-zbv", "inplace-later-recompute"])
def test_inplace_set_after_construction(results, name):
    counts = [4, 2]  # zbv: rank 0 holds stages 0 and 3 (two Linears), rank 1 stages 1 and 2 (Linear, ReLU)
    for rank, res in enumerate(results):
        assert res[name] == [(True, counts[rank], True)] * 2, (rank, res[name])


def test_signature_says_whether_x_requires_grad():
    x = torch.zeros(4, 3)
    plain = encode_signature(True, 2, [(x[:2],), (x[2:],)], 0)
    x.requires_grad_()
    wanting = encode_signature(True, 2, [(x[:2],), (x[2:],)], 0)
    assert plain[6] == DTYPE_CODE[torch.float32] and wanting[6] == DTYPE_CODE[torch.float32] + REQUIRES_GRAD
    assert plain[:6] + plain[7:] == wanting[:6] + wanting[7:]
