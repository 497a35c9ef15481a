"""A rank whose process ends inside DCP's collectives of save_checkpoint / load_checkpoint: the other rank raises a
PipelineError naming the lost rank, as a step does (chaos trial: it raised gloo's raw "Connection reset by peer",
naming nobody), and its Pipeline is unusable afterwards (the same error). 2 ranks, one launch per case."""
import json

import pytest

from pipesched.runtime import launch

import rt_checkpoint_lost_rank

pytestmark = [pytest.mark.multiprocess, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


@pytest.mark.parametrize("during", ["writing", "reading"])
def test_a_rank_lost_inside_dcp_is_named_on_the_other_rank(tmp_path, during):
    with pytest.raises(RuntimeError, match=r"launch: rank 1 exited with code 1 without reporting"):
        launch(rt_checkpoint_lost_rank.run, 2, str(tmp_path), during, timeout=120, grace=10, start_method="fork")
    with open(tmp_path / "0.json") as handle:
        report = json.load(handle)
    assert (report["type"], report["rank"], report["pp_rank"], report["lost"]) == ("PipelineError", 1, 1, True), \
        report
    assert report["message"].startswith("pipeline rank failure: world rank 1 (pipeline rank 1) was lost: its process "
                                        "ended in the middle of the step without a failure record"), report
    assert (f"world rank 0 (pipeline rank 0) found it while waiting for DCP's collectives while {during} "
            f"'{tmp_path / 'ckpt'}': it closed its connection") in report["message"], report
    assert report["message"].endswith(f"'{tmp_path / 'ckpt'}': it closed its connection [reported to world rank 0: "
                                      f"while waiting for DCP's collectives while {during} '{tmp_path / 'ckpt'}']")
    cause = report["message"].rsplit(" [reported to", 1)[0]
    assert report["after"] == (f"PipelineError: {cause} [reported to world rank 0: this Pipeline failed in an earlier "
                               f"step]")  # broken, as after a failed step
