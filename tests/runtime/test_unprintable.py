"""A fault whose exception cannot be printed (its __str__ raises) still ends every rank with a PipelineError naming
the failing rank and instruction, at once: before, the failing rank raised a raw error from inside the failure
handling, published nothing, and the other rank waited for the whole timeout."""
import pytest

from pipesched.runtime import launch

import rt_unprintable


@pytest.mark.parametrize("at, instr", [(1, "F0.0"), (3, "F0.0"), (4, "F0.1")])  # step 1's F0.0; step 2's F0.0, then F0.1
def test_an_unprintable_failure_ends_every_rank_naming_its_origin(at, instr):
    got = launch(rt_unprintable.unprintable, 2, at, timeout=120)
    for out in got:
        assert out["type"] == "PipelineError" and out["rank"] == 0, out
        assert instr in out["text"] and "Unprintable: <str() of this exception raised TypeError>" in out["text"], out
