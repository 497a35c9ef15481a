"""Session fixtures: each spawns one set of gloo ranks on 127.0.0.1 and runs many cases on them."""
import pytest

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
