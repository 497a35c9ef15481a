"""A local read failing on ONE rank inside load_checkpoint, before its checkpoint vote (the checkpoint's pipesched
entries, read with DCP without collectives): the same RuntimeError naming that rank and the error on every rank, and
the pipeline goes on. Before, DCP's CheckpointException (a BaseException) skipped the vote: that rank raised it bare
(``CheckpointException ranks:dict_keys([0])``) and the other rank waited in the vote for the Pipeline's timeout (under
launch it was told only when the failing rank's fn ended). 2 forked gloo ranks; no timing assertion."""
import pytest

from pipesched.runtime import launch

import rt_chaos_s10

pytestmark = pytest.mark.multiprocess

OWN = "checkpoint 'PATH': reading its pipesched entries failed: OSError: disk gone"


def test_a_local_read_failing_on_one_rank_in_load_checkpoint_is_one_error_naming_it_on_every_rank(tmp_path):
    results = launch(rt_chaos_s10.load_read_fails, 2, str(tmp_path), 0, timeout=120, start_method="fork")
    assert results[0] == {"type": "RuntimeError", "message": OWN, "others_ended": True, "then": True}
    assert results[1] == {"type": "RuntimeError", "then": True,
                          "message": f"load_checkpoint: world rank 0 refused the checkpoint: {OWN}"}
