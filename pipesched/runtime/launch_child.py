"""What each child of :func:`~pipesched.runtime.launch.launch` runs: its rank's side of the job's store (the launch
process hosts it on a port the OS picks, as torchrun's agent does; every child connects and checks the launch's token),
``init_process_group``, the user's ``fn``, and reporting its outcome to the parent (a failure published for the peers
first). With ``PIPESCHED_LAUNCH_STORE=rank0`` in launch's environment, world rank 0's child hosts it instead
(``env://``'s layout, to test its failure paths).

Each child's environment says who hosts the store (:data:`STORE_ENV`: ``parent`` or ``rank0``;
:func:`~pipesched.runtime.lost_rank.store_host` reads it)."""
from __future__ import annotations

import gc
import os
import pickle
import sys
import threading
import traceback


def run_child(rank, world_size, store_at, threads, fn, args, results, grace, released) -> None:
    gc.freeze()  # what a forked child inherited is never collected here (see launch: it would hang)
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), **{STORE_ENV: store_at[-1]})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    store = None
    try:
        tcp = job_store(rank, world_size, *store_at)
        os.environ["MASTER_PORT"] = str(tcp.port)
        # the key space env:// rendezvous gives the default group (init_process_group wraps its store the same way)
        dist.init_process_group("gloo", store=dist.PrefixStore("default_pg", tcp), rank=rank, world_size=world_size)
        # every rank has finished connecting before any fn runs: one whose fn returns at once would otherwise close
        # its connections (finally) while a slower peer is still connecting to it, which fails that peer's
        # init_process_group ("Connection closed by peer"); this barrier ends on a rank only once all have joined it
        dist.barrier()
        store = dist.distributed_c10d._get_default_store()  # held: a hosting rank 0 keeps the store up after teardown
        value = pickle.dumps(fn(rank, *args))
        mark_returned(store, rank)  # before its connections close: a peer left in a collective with it names it
        results.put(("ok", rank, value, ""))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        text = traceback.format_exc()
        exc = told(exc, rank, store)  # before this rank's connections close (finally)
        if store is not None:
            mark_raised(store, rank)  # as mark_returned: a peer that finds its connection closed knows it from lost
        try:
            payload = pickle.dumps(exc)
        except Exception:  # noqa: BLE001
            payload = None
        results.put(("err", rank, payload, text))
    finally:
        results.close()
        results.join_thread()
        gc.collect()  # the Pipelines fn left unclosed announce it to peers still waiting (runtime/departure.py)
        leave_live_pipelines()  # those still referenced (a global): os._exit below skips their exit announcement
        close_groups(dist)  # peers blocked on this rank fail at once, as if it had exited
        # every rank stays until every rank's fn has ended (or died), at most grace. Under the parent's store (the
        # default) this changes nothing, as the store and the records in it outlive every child; it matters where
        # world rank 0's child hosts the store (rank0, env://'s layout), whose records go with its process (os._exit
        # skips a Pipeline's atexit Linger), and both layouts end alike
        released.wait(grace)
        os._exit(0)  # skip interpreter teardown (gloo threads); closes this rank's connections at once


TOKEN_KEY = "pipesched/launch-token"
#: the environment variable that says who hosts a launch's store: ``parent`` (the launch process, the default) or
#: ``rank0`` (world rank 0's child, as under ``env://``); set in launch's environment to choose, in each child's by it
STORE_ENV = "PIPESCHED_LAUNCH_STORE"


def _store_wait():
    import datetime

    return datetime.timedelta(minutes=30)  # the store timeout env:// rendezvous gave it (torch's default)


def host_store(world_size: int, port_value, port_ready, token: str):
    """Host this launch's c10d ``TCPStore`` on a port the OS picks while binding (no port is ever "free a moment
    ago"), write the launch's ``token`` into it, then publish the port (``port_value``, ``port_ready``)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=_store_wait(), wait_for_workers=False)
    store.set(TOKEN_KEY, token)  # before the port is published: every rank that connects finds it
    port_value.value = store.port
    port_ready.set()
    return store


def job_store(rank: int, world_size: int, port_value, port_ready, token: str, timeout: float, host: str = "parent"):
    """This launch's c10d ``TCPStore`` as a client: waits for the port the host publishes (``port_value``,
    ``port_ready``; at most ``timeout`` seconds), connects and checks the token (:func:`connect_checked`). The host
    is the launch process (``host="parent"``), or world rank 0's child (``"rank0"``), which hosts it here
    (:func:`host_store`)."""
    if host == "rank0" and rank == 0:
        return host_store(world_size, port_value, port_ready, token)
    if not port_ready.wait(min(timeout, threading.TIMEOUT_MAX)):
        who = "world rank 0" if host == "rank0" else "the launch process"
        raise TimeoutError(f"launch: world rank {rank}: {who} did not publish its store's port within "
                           f"timeout={timeout:g} s")
    return connect_checked(rank, world_size, port_value.value, token, _store_wait())


def connect_checked(rank: int, world_size: int, port: int, token: str, wait):
    """A client of the store at 127.0.0.1:``port`` that holds this launch's ``token``.

    Raises:
        RuntimeError: the store there is another job's (no token, or another launch's): names the address.
    """
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=wait)
    found = store.get(TOKEN_KEY).decode(errors="replace") if store.check([TOKEN_KEY]) else None
    if found != token:
        what = "it has no launch token" if found is None else f"its launch token is {found!r}, this launch's {token!r}"
        raise RuntimeError(f"launch: world rank {rank} connected to another job's store at 127.0.0.1:{port} ({what}); "
                           f"this launch's ranks would mix with that job's, so it stops here")
    return store


def told(exc: BaseException, rank: int, store) -> BaseException:
    """What this rank reports for ``exc``, its ``fn``'s exception outside any Pipeline call: its own failure is
    published for the others (:func:`~pipesched.runtime.failure.publish_job_failure`: a peer's Pipeline, or a peer
    waiting in a store round, names it); a collective error or timeout that followed another rank's published
    failure is reported as a ``PipelineError`` naming that rank; gloo's "Connection closed by peer" after peers' ``fn``
    returned (:func:`mark_returned`) as a ``PipelineError`` naming them (``record.ended == "returned"``), not as this
    rank's own failure. A ``PipelineError`` is reported as it is."""
    from .failure import PipelineError, describe, job_failure, publish_job_failure
    from .torch_errors import peer_closed_connection

    if store is None or isinstance(exc, PipelineError):
        return exc
    import torch.distributed as dist

    earlier = job_failure(store)
    waited = peer_closed_connection(exc) or isinstance(exc, (TimeoutError, getattr(dist, "DistError", TimeoutError)))
    if earlier is not None and earlier.rank != rank and waited:
        return PipelineError(earlier, rank, f"its launch fn then raised {describe(exc)}")
    gloo_closed = (isinstance(exc, RuntimeError) and peer_closed_connection(exc)  # gloo's, not an OSError's
                   and not isinstance(exc, (dist.DistNetworkError, dist.DistStoreError)))  # nor the store's
    record = _closed_peer_record(store, rank) if earlier is None and gloo_closed else None
    if record is not None:
        return PipelineError(record, rank, f"its launch fn then raised {type(exc).__name__}")
    publish_job_failure(store, rank, exc)
    return exc


def _closed_peer_record(store, rank: int):
    """Who closed the connection this rank's collective failed on: a peer killed meanwhile (the ``lost`` record: the
    cause, whether or not another peer's fn returned, whose closed connection is no error by itself), else peers whose
    fn returned (``ended="returned"``; read again after :func:`_lost_peers`' wait, in which a fn that closed its
    connections itself may have returned); ``None``: neither, this rank's own failure."""
    gone = returned_peers(store, rank)
    lost = _lost_peers(store, rank, gone)
    if lost:
        return _lost_record(lost, gone, rank)
    gone = gone or returned_peers(store, rank)
    return _returned_record(gone, rank) if gone else None


_RETURNED = "pipesched/job/returned/{rank}"
_RAISED = "pipesched/job/raised/{rank}"


def mark_returned(store, rank: int) -> None:
    """Say (one store key, best effort) that world rank ``rank``'s ``fn`` returned: set before its connections
    close, so that a peer whose own collective fails on that closed connection names it (:func:`told`)."""
    _mark(store, _RETURNED, rank)


def mark_raised(store, rank: int) -> None:
    """Say (one store key, best effort) that world rank ``rank``'s ``fn`` raised and was reported (:func:`told`): set
    before its connections close, so that a peer probing its closed connection does not take it for a lost rank
    (:func:`_lost_peers`)."""
    _mark(store, _RAISED, rank)


def _mark(store, key: str, rank: int) -> None:
    try:
        store.set(key.format(rank=rank), "1")
    except Exception:  # noqa: BLE001 - a store that does not answer: the peer reports its own error
        pass


_MARK_GRACE_S = 1.0  #: seconds a closed peer gets to show its returned/raised mark before it is called lost


def _lost_peers(store, rank: int, gone: list[int]) -> list[int]:
    """The world ranks whose connection to this rank (in the default group) is closed although their ``fn`` neither
    returned (``gone``, :func:`mark_returned`) nor raised (:func:`mark_raised`): their process ended without a word
    (killed, ``os._exit``), ascending; ``[]`` if none or the store does not answer. Each such rank's mark is read
    after the probe, for up to :data:`_MARK_GRACE_S`: a rank that closes its connections when its fn ends has
    marked itself before, but a fn may close them itself (``dist.destroy_process_group()``) and then return."""
    import time

    import torch
    import torch.distributed as dist

    from .lost_rank import closed_members

    def unmarked(r):
        return not store.check([_RAISED.format(rank=r)]) and not store.check([_RETURNED.format(rank=r)])

    try:
        group = dist.distributed_c10d._get_default_group()
        closed = [r for r in closed_members(group, list(range(group.size())), torch.device("cpu")) if r not in gone]
        deadline = time.monotonic() + _MARK_GRACE_S
        while True:
            closed = [r for r in closed if unmarked(r)]
            if not closed or time.monotonic() >= deadline:
                return sorted(closed)
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - no group, or a store that does not answer: nothing can be said
        return []


def returned_peers(store, rank: int) -> list[int]:
    """The world ranks other than ``rank`` whose ``fn`` has returned (:func:`mark_returned`), ascending; ``[]`` if
    none or the store does not answer."""
    import torch.distributed as dist

    try:
        world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])
        return [r for r in range(world_size) if r != rank and store.check([_RETURNED.format(rank=r)])]
    except Exception:  # noqa: BLE001 - as above
        return []


def _returned_record(gone: list[int], rank: int):
    """The ``ended="returned"`` record naming the peers in ``gone`` to ``rank``, which was in a collective with them."""
    import time

    from .failure import FailureRecord, world_ranks_text

    who = world_ranks_text(gone)
    its, them = ("its", "it") if len(gone) == 1 else ("their", "them")
    cause = (f"{who}'s launch fn returned while world rank {rank} was still in a collective with {them} (a collective "
             f"the launch fns call themselves, outside any Pipeline call): every rank's fn must make the same "
             f"collective calls before it returns; {its} connections closed as {its} fn ended")
    return FailureRecord(rank=gone[0], ended="returned", id=f"returned:{gone[0]}:{time.time_ns()}", cause=cause)


def _lost_record(lost: list[int], gone: list[int], rank: int):
    """The ``lost`` record naming the first of ``lost`` to ``rank``, which was in a call with it; the peers in
    ``gone`` (if any), whose fn returned, are said not to be the cause."""
    import time

    from .failure import FailureRecord, world_ranks_text

    who = world_ranks_text(lost[:1])
    cause = (f"{who} was lost: its process ended without a failure record (killed, e.g. by SIGKILL or the "
             f"out-of-memory killer, or exited) while world rank {rank} was in a call with it (a collective or "
             f"point-to-point call the launch fns make themselves, outside any Pipeline call): its connection "
             f"closed")
    if gone:
        cause += f"; {world_ranks_text(gone)}'s launch fn had returned, which is not the cause named here"
    return FailureRecord(rank=lost[0], lost=True, id=f"lost:{lost[0]}:{time.time_ns()}", cause=cause)


def leave_live_pipelines() -> None:
    """Announce and close every Pipeline of this child still alive after ``fn`` (best effort; see
    :func:`~pipesched.runtime.departure.leave_unclosed`)."""
    module = sys.modules.get(__package__ + ".pipeline")  # not imported: fn made no Pipeline
    if module is None:
        return
    try:
        from .departure import leave_unclosed

        leave_unclosed([obj for obj in gc.get_objects() if issubclass(type(obj), module.Pipeline)])
    except Exception:  # noqa: BLE001 - a Pipeline broken meanwhile: close_groups still closes the connections
        pass


def close_groups(dist) -> None:
    """Destroy every process group of this child (best effort): its gloo connections close, its store stays."""
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a group already broken by a failure
        pass
