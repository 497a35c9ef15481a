"""The last stage's rank's verdict on the target, carried in the step's opening all-gather (runtime/handshake.py):
checked on that rank before the gather, ruled on alike by every rank after it, with the messages the step always
gave (the multi-rank behaviour is in test_dataflow.py and test_devices.py)."""
from __future__ import annotations

import pytest
import torch

from pipesched.runtime.handshake import HEAD, ROW_LEN
from pipesched.runtime.refusals import (
    SIG_LEN, VERDICT_LEN, Rejected, TargetVerdict, check_target, decode_text, encode_text, judge_target,
    target_microbatches, verdict_words)

PREFIX = "the rank of the last stage (pipeline rank 2) rejected the step's target: "


def _meta_refused(batch):
    raise ValueError("target is on the meta device, which holds no data")


def _ruling(verdict: TargetVerdict, total: int) -> list:
    """What each of 3 ranks (the last is 2) raises for ``verdict`` (gathered as words) and x's ``total``."""
    words = verdict_words(verdict)
    out = []
    for rank in range(3):
        try:
            judge_target(words, total, 2, rank, verdict if rank == 2 else None)
            out.append(None)
        except Rejected as exc:
            out.append(str(exc))
    return out


def test_the_verdict_fills_its_words_and_the_rows_keep_one_length():
    assert VERDICT_LEN == SIG_LEN == 64 and ROW_LEN == HEAD + SIG_LEN + VERDICT_LEN == 136
    assert verdict_words(None) == [0] * VERDICT_LEN  # other ranks, forward(): no verdict
    assert verdict_words(TargetVerdict(None)) == [0] * VERDICT_LEN  # no target, none needed
    assert verdict_words(TargetVerdict(8, "", "t"))[:4] == [0, 1, 8, 0]
    refused = verdict_words(TargetVerdict(None, "bad"))
    assert len(refused) == VERDICT_LEN and refused[:3] == [1, 0, 0] and decode_text(refused) == "bad"


def test_accepted_targets_pass_on_every_rank_and_split_like_x():
    y = torch.arange(10.0).reshape(5, 2)
    verdict = check_target(y, "", lambda t: t)
    assert verdict == TargetVerdict(5, "", y)
    assert _ruling(verdict, 5) == [None, None, None]
    parts = target_microbatches(verdict, 2)
    assert [p.tolist() for p in parts] == [y[:3].tolist(), y[3:].tolist()]
    pair = check_target((y, y[:, 0]), "", lambda t: t)
    assert [tuple(t.shape) for t in target_microbatches(pair, 2)[1]] == [(2, 2), (2,)]
    assert target_microbatches(TargetVerdict(None), 2) is None and target_microbatches(None, 2) is None
    assert _ruling(TargetVerdict(None), 7) == [None, None, None]  # no target and none needed: any batch


@pytest.mark.parametrize("target,missing,text", [
    (None, "step() needs target", "step() needs target"),
    ("abc", "", "target must be a tensor or a non-empty tuple or list of tensors, got str"),
    ((torch.zeros(3), torch.zeros(4)), "", "the tensors of target have different batch sizes (dim 0): [3, 4]"),
    (torch.tensor(1.0), "", "target[0] is a scalar; every tensor needs a batch dimension 0"),
])
def test_refused_targets_are_the_last_ranks_message_everywhere(target, missing, text):
    verdict = check_target(target, missing, lambda t: t)
    assert verdict == TargetVerdict(None, text)
    assert _ruling(verdict, 3) == [PREFIX + text, PREFIX + text, text]


def test_the_batch_size_is_ruled_on_every_rank_before_a_device_error():
    size = "target has batch size 5 but x has 8"
    assert _ruling(check_target(torch.zeros(5, 2), "", lambda t: t), 8) == [PREFIX + size, PREFIX + size, size]
    meta = check_target(torch.zeros(5, 2), "", _meta_refused)  # both wrong: the size, as the step always said
    assert meta == TargetVerdict(5, "target is on the meta device, which holds no data")
    assert _ruling(meta, 8) == [PREFIX + size, PREFIX + size, size]
    assert _ruling(meta, 5) == [PREFIX + meta.error, PREFIX + meta.error, meta.error]


def test_a_long_message_is_cut_on_the_other_ranks_as_the_verdict_message_cut_it():
    text = "x" * 600
    cut = decode_text(encode_text([1, 0, 0], text))  # the former message: SIG_LEN words, head 3
    assert len(cut) == 480 and cut.endswith("...")
    assert _ruling(TargetVerdict(None, text), 4) == [PREFIX + cut, PREFIX + cut, text]
