"""A Pipeline built without a launcher (plain ``python train.py``) has one rank: it warns that nothing is split.

Each test builds a 1-rank Pipeline in this process, which initializes a default process group (a 1-process
HashStore group when there is none); the fixture destroys it so later tests start without one.
"""
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipesched.runtime import Pipeline, SingleProcessWarning

from rt_cases import mlp


def _build():
    return Pipeline(mlp(num_layers=4), schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss)


def test_no_launcher_warns_once_that_nothing_is_split(no_launcher):
    with pytest.warns(SingleProcessWarning) as record:
        pipe = _build()
    assert len(record) == 1 and record[0].filename == __file__  # points at the Pipeline(...) line
    message = str(record[0].message)
    assert "this Pipeline has 1 rank and splits nothing: the whole model runs in this one process" in message
    assert "torchrun --nproc-per-node N" in message and "pipesched.runtime.launch(fn, N)" in message
    assert pipe.program.num_ranks == 1 and pipe.stage_ids == (0,)
    with warnings.catch_warnings():  # the first Pipeline created the default group: a second one is silent
        warnings.simplefilter("error")
        _build()
    x, y = torch.randn(4, 8), torch.randn(4, 8)  # it still trains (the whole model in this process)
    assert torch.isfinite(pipe.step(x, target=y))


def test_a_deliberate_one_process_group_does_not_warn(no_launcher):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _build().program.num_ranks == 1


def test_a_launcher_with_one_process_does_not_warn(no_launcher, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")  # torchrun --nproc-per-node 1 sets it (and RANK)
    monkeypatch.setenv("RANK", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _build().program.num_ranks == 1


def test_world_size_set_without_the_other_ranks_ends_after_timeout_saying_why(no_launcher, monkeypatch):
    import socket

    with socket.socket() as sock:  # a free port nobody listens on: rank 1 never reaches a rank 0
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for name, value in dict(WORLD_SIZE="2", RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
        monkeypatch.setenv(name, value)
    with pytest.raises(TimeoutError) as info:
        Pipeline(mlp(num_layers=4), schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, timeout=2)
    message = str(info.value)
    assert message.startswith(f"rank 1 of WORLD_SIZE=2: the other ranks did not join at 127.0.0.1:{port} within "
                              f"timeout=2 s (DistNetworkError: ")
    assert message.endswith("start every rank (e.g. torchrun --nproc-per-node 2 train.py), or unset WORLD_SIZE, "
                            "RANK and MASTER_ADDR to run one process")
    assert not dist.is_initialized()
