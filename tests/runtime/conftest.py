"""Session fixtures: each spawns one set of gloo ranks on 127.0.0.1 and runs many cases on them."""
import pytest
import torch.distributed as dist

from pipesched.runtime import launch

import rt_workers


@pytest.fixture(scope="session")
def two_ranks():
    return launch(rt_workers.two_rank_suite, 2, timeout=240)


@pytest.fixture(scope="session")
def four_ranks():
    return launch(rt_workers.four_rank_suite, 4, timeout=240)


@pytest.fixture(scope="session")
def failures():
    return launch(rt_workers.failure_suite, 2, timeout=120)


@pytest.fixture
def no_launcher(monkeypatch):
    """No launcher's environment and no process group: a Pipeline made in the test runs as one rank here."""
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert not dist.is_initialized()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
