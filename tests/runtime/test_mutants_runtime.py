"""Runtime tests written to kill mutants that survived a mutation-testing pass (helper-86)."""
from pipesched.runtime.wire import TAG_LOSS, tag_of


def test_message_tags_are_exact_and_unique_per_kind_stage_and_microbatch():
    # 16 + ((mb * S + s) * 4 + kind), kind: act_header 0, act 1, grad 2
    assert tag_of("act_header", 0, 0, 4) == 16
    assert tag_of("act", 0, 0, 4) == 17
    assert tag_of("grad", 1, 2, 4) == 16 + (2 * 4 + 1) * 4 + 2 == 54
    S, M = 3, 5
    tags = [tag_of(kind, s, mb, S) for kind in ("act_header", "act", "grad") for s in range(S) for mb in range(M)]
    assert len(set(tags)) == 3 * S * M  # two messages of one step never share a tag
    assert min(tags) > TAG_LOSS
