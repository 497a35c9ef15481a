"""The ``measured`` fixture: a hand-made measured-like timeline (see viz_support.measured_like)."""
import pytest

from viz_support import measured_like


@pytest.fixture
def measured():
    return measured_like()
