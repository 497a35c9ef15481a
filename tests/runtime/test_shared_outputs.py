"""A stage that returns one tensor twice, or a tensor and a view of it, hands the next stage two names of one
memory in the unsplit model. Across ranks each arrives as its own copy: before, a write in place through one name
(``a.add_(1)`` on a mask also given as ``b``) silently gave another loss, other gradients and another forward()
output (a hunt's finding: 0.7762 against the unsplit 1.1521). The message's meta now carries which elements
shared memory (runtime/wire.py, shared_memory) and such a write is refused at the receiving stage's F
(runtime/shared_inputs.py); reading both names stays bitwise the unsplit model's, and on one rank (zbv's stages 1
and 2) the elements stay one memory, so even the write gives the unsplit values. 2 ranks, m=2
(rt_shared_outputs.py)."""
from __future__ import annotations

import pytest

from pipesched.runtime import launch

import rt_shared_outputs

pytestmark = pytest.mark.multiprocess

ORIGIN = ("PipelineError: pipeline rank failure: world rank 1 (pipeline rank 1) failed at instruction F1.0 (kind F, "
          "stage 1, microbatch 0): ValueError: stage 1 wrote in place to element 1 of its input (microbatch 0), "
          "which shared memory with element 2 in the previous stage's output (the same tensor twice, or a view of "
          "it): in the unsplit model the write shows through both, but each arrives on this rank as its own copy, "
          "so the values would differ; write out of place (a = a + 1, not a.add_(1)), or return that tensor once")


@pytest.fixture(scope="module")
def results():
    return launch(rt_shared_outputs.shared, 2, timeout=300)


@pytest.mark.parametrize("name", ["1f1b same tensor", "1f1b view", "zbv same tensor", "zbv same tensor write"])
def test_shared_outputs_read_or_written_on_one_rank_give_the_unsplit_values(results, name):
    last = 1 if name.startswith("1f1b") else 0  # the rank of the last stage (zbv: stage 3 is rank 0's)
    for rank, res in enumerate(results):
        assert res[name] == {"step": "ok", "loss and grads": True, "forward": "ok",
                             "output": True if rank == last else None}, (rank, name)


@pytest.mark.parametrize("name", ["1f1b same tensor write", "1f1b view write"])
@pytest.mark.parametrize("call", ["step", "forward"])
def test_a_write_in_place_to_a_received_shared_element_is_refused_on_every_rank(results, name, call):
    assert results[1][name][call] == ORIGIN
    assert results[0][name][call].startswith(ORIGIN + " [reported to world rank 0: ")
