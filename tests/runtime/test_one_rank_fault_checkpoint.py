"""save_checkpoint / load_checkpoint failing on ONE rank after the argument vote (an optimizer whose state_dict()
refuses, as ZeroRedundancyOptimizer's does before consolidation; read buffers the host cannot allocate): the failure
is voted before DCP's collectives (an optimizer refusing the state read: in a last vote of the load), so every rank raises the same RuntimeError naming that rank at once, nothing is
written or loaded, and the pipeline goes on; the others never wait in DCP's collectives on the default group (whose
timeout, under launch, is 30 min). 2 forked gloo ranks per case; no timing assertion (see
test_one_rank_fault_collectives.py: the failing rank waits, alive, until the other has raised)."""
import pytest

from pipesched.runtime import launch

import rt_one_rank_fault

pytestmark = pytest.mark.multiprocess

EXPECTED = {
    "save state fails": (
        "save_checkpoint: world rank 1 failed while collecting its state to save: RuntimeError: Optimizer state has "
        "not been consolidated on this rank. Please call `consolidate_state_dict(to=0)` on all ranks beforehand if "
        "you meant to save the global state."),
    "load buffers fail": (
        "load_checkpoint: world rank 1 failed while allocating its read buffers: RuntimeError: DefaultCPUAllocator: "
        "not enough memory: you tried to allocate 256 bytes."),
}
COPY = ("load_checkpoint: world rank 1 failed while copying what it read into its model, optimizer and random "
        "generators: ValueError: loaded state dict contains a parameter group that doesn't match the size of "
        "optimizer's group")


@pytest.mark.parametrize("case", list(EXPECTED))
def test_a_checkpoint_failing_on_one_rank_is_one_error_naming_it_on_every_rank(case, tmp_path):
    results = launch(rt_one_rank_fault.CASES[case], 2, str(tmp_path), timeout=120, start_method="fork")
    for rank, got in enumerate(results):
        assert (got["type"], got["message"]) == ("RuntimeError", EXPECTED[case]), (rank, got)
        assert got["then"] is True, (rank, got)  # nothing saved / the weights unchanged; the next step runs
    assert results[1]["others_ended"] is True, results[1]


def test_a_load_whose_copy_fails_on_one_rank_is_that_error_on_every_rank_not_a_wait_in_the_next_step(tmp_path):
    results = launch(rt_one_rank_fault.CASES["load copy fails"], 2, str(tmp_path), timeout=120, start_method="fork")
    for rank, got in enumerate(results):
        assert (got["type"], got["message"]) == ("RuntimeError", COPY), (rank, got)
    assert results[1]["others_ended"] is True, results[1]
