"""Shapes learned per input signature: changing sequence lengths, forward-only calls between steps."""
import math

import pytest

pytestmark = pytest.mark.multiprocess


def test_sequence_length_changes_and_forward_only_calls(two_ranks):
    expected_order = [("forward", 5), ("step", 5), ("forward", 6), ("step", 7), ("step", 5), ("forward", 7)]
    for rank, results in enumerate(two_ranks):
        seq = results["seq"]
        assert [(k, t) for k, t, _ in seq["results"]] == expected_order
        # rank 0 gets None from forward(); rank 1 (last stage) the reference output, bitwise; steps bitwise
        assert [ok for _, _, ok in seq["results"]] == [True] * 6, (rank, seq)
        # forward T=5, step T=5, forward T=6, step T=7, forward T=7: five signatures (step T=5 is reused)
        assert seq["signatures"] == 5


def test_gathered_timeline_has_every_instruction_of_both_ranks(two_ranks):
    tl = two_ranks[0]["gathered"]
    assert tl.source == "measured" and tl.num_ranks == 2
    assert [sum(e.rank == r for e in tl.events) for r in (0, 1)] == [16, 16]  # 1f1b, p=2, m=4
    assert all(e.end >= e.start >= 0 for e in tl.events)
    assert 0.0 <= tl.bubble_fraction < 1.0
    assert tl.peak_inflight == (2, 1)
    assert all(b > 0 and not math.isnan(b) for b in tl.peak_activation_bytes)
    # the same timeline on both ranks
    assert two_ranks[1]["gathered"].events == tl.events
