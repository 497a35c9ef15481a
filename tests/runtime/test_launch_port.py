"""``launch``'s store: the launch process binds it to a port the OS picks (no "free a moment ago" race), two
launches at once never share a store, and a rank that reaches another job's store says so (the launch token)."""
import datetime
import re
import subprocess
import sys
import textwrap

import pytest
import torch.distributed as dist

from pipesched.runtime import launch
from pipesched.runtime.launch_child import TOKEN_KEY as _TOKEN_KEY, connect_checked as _connect_checked

pytestmark = pytest.mark.multiprocess

# fn is defined in __main__ of python -c: launch forks the children
_JOB = textwrap.dedent("""\
    import os, sys
    import torch.distributed as dist
    from pipesched.runtime import launch
    def fn(rank, tag):
        tags = [None] * dist.get_world_size()
        dist.all_gather_object(tags, tag)
        return tags, os.environ["MASTER_PORT"]
    tag = sys.argv[1]
    for _ in range(3):
        out = launch(fn, 2, tag, timeout=200)
        assert [tags for tags, _ in out] == [[tag, tag], [tag, tag]], out
        assert len({port for _, port in out}) == 1, out
    print("ok", tag)
    """)


def test_two_launches_at_once_keep_their_ranks_apart():
    jobs = [subprocess.Popen([sys.executable, "-c", _JOB, f"job{i}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for i in range(2)]
    outs = [job.communicate(timeout=600) for job in jobs]
    for i, (job, (out, err)) in enumerate(zip(jobs, outs)):
        assert job.returncode == 0, err[-3000:]
        assert out.splitlines() == [f"ok job{i}"]


def _store_with(token):
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    if token is not None:
        store.set(_TOKEN_KEY, token)
    return store


def test_a_store_without_the_token_is_another_jobs():
    other = _store_with(None)
    with pytest.raises(RuntimeError) as info:
        _connect_checked(1, 2, other.port, "mine", datetime.timedelta(seconds=30))
    assert str(info.value) == (f"launch: world rank 1 connected to another job's store at 127.0.0.1:{other.port} "
                               "(it has no launch token); this launch's ranks would mix with that job's, so it "
                               "stops here")


def test_a_store_with_this_launchs_token_is_accepted():
    own = _store_with("mine")
    client = _connect_checked(1, 2, own.port, "mine", datetime.timedelta(seconds=30))
    assert client.get(_TOKEN_KEY) == b"mine"


# a child pointed at another launch's store (as a port collision would): launch raises the clear error
_MISPOINTED = textwrap.dedent("""\
    import datetime, sys
    import torch.distributed as dist
    import pipesched.runtime.launch_child as C
    from pipesched.runtime import launch
    other = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    other.set(C.TOKEN_KEY, "someone-else")
    real = C.connect_checked
    C.connect_checked = lambda rank, size, port, token, wait: real(rank, size, other.port if rank == 1 else port,
                                                                   token, wait)  # rank 0 then waits: grace ends it
    def fn(rank):
        return rank
    try:
        launch(fn, 2, timeout=120, grace=1)
    except RuntimeError as exc:
        print(other.port)
        print(exc)
    """)


def test_a_child_pointed_at_another_launchs_store_names_it():
    done = subprocess.run([sys.executable, "-c", _MISPOINTED], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    port, message = done.stdout.splitlines()
    assert re.fullmatch(
        rf"launch: world rank 1 connected to another job's store at 127\.0\.0\.1:{port} \(its launch token is "
        r"'someone-else', this launch's '[0-9a-f]{32}'\); this launch's ranks would mix with that job's, so it "
        r"stops here", message), message


@pytest.mark.parametrize("fn", ["notfn", None, 3])
def test_fn_not_callable_is_refused_before_any_child_starts(fn):
    with pytest.raises(TypeError) as info:
        launch(fn, 2)
    assert str(info.value) == (f"launch: fn must be a callable run as fn(rank, *args) on each rank, got {fn!r} "
                               f"({type(fn).__name__})")
