"""load_checkpoint given the folder that holds checkpoints (not a checkpoint itself) says so and how to pick one."""
import os

import pytest

from pipesched.runtime.checkpoint_read import read_checkpoint


def _fake_checkpoints(folder, names):
    for name in names:
        os.makedirs(folder / name)
        (folder / name / ".metadata").write_bytes(b"")


def test_a_folder_of_checkpoints_names_them_and_latest_checkpoint(tmp_path):
    _fake_checkpoints(tmp_path, ["step-000002", "step-000001"])
    os.makedirs(tmp_path / ".step-000003.saving")  # a save's temporary directory: not counted
    with pytest.raises(ValueError) as info:
        read_checkpoint(tmp_path)
    assert str(info.value) == (
        f"checkpoint {str(tmp_path)!r} is incomplete or not a checkpoint: it has no .metadata (written last, when "
        f"every rank has finished); it is a folder of 2 checkpoint(s) ('step-000001', 'step-000002'): load one of "
        f"them, e.g. load_checkpoint(latest_checkpoint({str(tmp_path)!r}))")


def test_many_checkpoints_show_the_last_three(tmp_path):
    _fake_checkpoints(tmp_path, [f"step-{k:06d}" for k in range(5)])
    with pytest.raises(ValueError, match=r"a folder of 5 checkpoint\(s\) \(\.\.\., 'step-000002', 'step-000003', "
                                         r"'step-000004'\)"):
        read_checkpoint(tmp_path)


def test_an_empty_folder_gets_no_hint(tmp_path):
    with pytest.raises(ValueError) as info:
        read_checkpoint(tmp_path)
    assert str(info.value).endswith("it has no .metadata (written last, when every rank has finished)")
