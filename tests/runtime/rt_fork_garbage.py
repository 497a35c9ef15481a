"""Per-rank body of tests/runtime/test_fork_garbage.py."""
import gc


def collect(rank: int) -> int:
    gc.collect()  # what the child inherited from its parent must not be collected here (it would hang)
    return rank
