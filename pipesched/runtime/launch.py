"""``launch``: run a function on N local processes (gloo on 127.0.0.1) for tests and notebooks; never hangs."""
from __future__ import annotations

import codecs
import gc
import multiprocessing as mp
import os
import pickle
import queue
import socket
import sys
import tempfile
import time
import uuid

from ..checks import as_int, is_real
from .launch_child import STORE_ENV, host_store, run_child
from .start_method import choose_start_method

_TAIL_CHARS = 3000  # of a child's stderr quoted when it dies without reporting
_STOP_S = 5.0  # after SIGTERM, the children together get this long to exit before SIGKILL


class ChildTraceback(Exception):
    """The traceback text of an exception raised in a child process (attached as ``__cause__``)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(fn, world_size: int, *args, timeout: float = 300.0, grace: float = 20.0, threads: int = 1,
           start_method: str | None = None) -> list:
    """Run ``fn(rank, *args)`` on ``world_size`` local processes that share a gloo default process group.

    Each child gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR=127.0.0.1`` and ``MASTER_PORT``,
    sets ``torch.set_num_threads(threads)``, and calls ``fn`` after ``init_process_group("gloo")`` and a barrier.
    This process hosts the job's c10d ``TCPStore``, as torchrun's agent does, from right after the children start
    until they have all stopped, on a port the OS picks while binding it and passes to the children (so launches running at once on
    one machine never share a store); the store outlives every rank, so a rank that is lost or stalled (world rank 0
    included) never takes it, nor the failure records in it, from the others. Every child connects as a client
    and checks that the store holds this launch's token (a ``RuntimeError`` naming the address if not); the
    children are started before the store exists, so a forked child inherits neither its server thread nor its
    socket. ``PIPESCHED_LAUNCH_STORE=rank0`` in this process's environment makes world rank 0's child host it
    instead (``env://``'s layout, for testing its failure paths). The children's standard error is relayed to this
    process's ``sys.stderr`` (so it shows in a notebook) and kept, to be quoted if a child dies without reporting.

    How the children start (``start_method``):

    - ``None`` (default): ``"spawn"`` (a fresh interpreter that imports ``fn`` by module and name) when a
      spawned child can run ``fn``; else ``"fork"`` (a copy of this process, which needs no import). A
      spawned child cannot run ``fn`` when it is defined in ``__main__`` of a notebook, ``python -c`` or a
      script read from stdin (nothing to import it from), when this process's script was read from stdin at all
      (multiprocessing would re-run a file named ``<stdin>``), when it is a lambda or defined inside a function,
      or when ``launch`` is called from the top level of a script outside an ``if __name__ == "__main__":``
      block (a spawned child re-runs the script's top level, which would launch again).
    - ``"fork"`` is refused (``ValueError``) where it is unsafe: CUDA is initialized in this process (a
      forked child cannot use it; launch before touching CUDA, or move ``fn`` into an importable module
      and call ``launch`` under the ``__main__`` guard so that it spawns); this process already has a
      default process group; or ``threads > 1`` after this process imported torch (a forked child that
      runs more than one OpenMP thread can hang, GNU OpenMP's thread pool does not survive ``fork``).
      Not available on Windows.
    - ``"spawn"`` / ``"forkserver"``: refused (``ValueError``, before any child starts) for an ``fn`` a
      spawned child cannot run (above), with the reason and what to do.

    When a child's ``fn`` returns or raises, the child reports, then destroys its process groups (its gloo
    connections close, so a peer blocked on it fails at once, as if it had exited), its Pipelines first, also one a
    global still holds (each announced as ending unclosed: :func:`~pipesched.runtime.departure.leave_unclosed`).
    Every child then stays up until
    every rank's ``fn`` has ended (reported, or its process died), at most ``grace`` seconds: harmless under this
    process's store, which outlives them all; needed where world rank 0's child hosts it (``rank0``), so that a rank 0
    that returned early never takes the store from ranks still using it (a checkpoint vote, a failure record). A
    ``fn`` that raises outside any Pipeline call publishes its error first (:func:`~pipesched.runtime.failure.publish_job_failure`):
    a peer's Pipeline, or a peer waiting in a construction or checkpoint round, then raises a ``PipelineError``
    naming that rank and its error, at once (a peer blocked in ``fn``'s own collective gets torch's closed-connection
    error there, and its child reports a ``PipelineError`` naming that rank instead). ``launch`` returns as soon as
    every rank has reported or died and stops the children still up (SIGTERM, then SIGKILL after 5 s for all of
    them together). Worst case, from the start: ``timeout`` + 5 s; from the first failure (an exception reported, or a child found dead about 0.2 s
    after it died): ``grace`` + 5 s.

    Ctrl-C (``KeyboardInterrupt`` in this process) prints ``interrupted: stopping N ranks`` to ``sys.stderr``,
    stops every child as above and raises ``KeyboardInterrupt`` again (``pipesched`` commands then exit 130
    without a traceback).

    Args:
        timeout: seconds for the whole run; grace: seconds the others get to end after one child fails; the
            most a child waits for the others' ``fn`` after its own ended (see above). Children start with
            ``TORCH_CPP_LOG_LEVEL=ERROR`` unless it is set (a forked child that inherits an imported torch keeps
            this process's level).

    Returns:
        The return values of ``fn``, by rank (they must be picklable).
    Raises:
        The first failing child's exception (preferring the rank a :class:`PipelineError` names as the
        origin: its own ``PipelineError``, or the exception its ``fn`` raised), re-raised with the child's traceback
        as ``__cause__``; the other children get ``grace`` seconds to end on their own and are then terminated.
        ValueError: a ``start_method`` that cannot run ``fn`` here (says why and what to do); a bad ``world_size``,
            ``timeout``, ``grace`` or ``threads`` (names it and what is valid), before any child starts.
        TypeError: ``fn`` is not callable (names it), before any child starts.
        TimeoutError: the children did not all finish within ``timeout`` seconds (all are terminated).
        KeyboardInterrupt: Ctrl-C while the children ran (all are stopped first).
        RuntimeError: a child died without reporting (killed, ``os._exit``, or failed while starting, e.g.
            could not unpickle an argument); names its rank and exit code (``killed by signal 9`` after a
            SIGKILL) and quotes the end of its stderr. The others get ``grace`` seconds to end on their own first
            (a :class:`PipelineError` they raise naming the lost rank is not re-raised: this error is).
    """
    if not callable(fn):
        raise TypeError(f"launch: fn must be a callable run as fn(rank, *args) on each rank, got {fn!r} "
                        f"({type(fn).__name__})")
    if as_int(world_size) is None or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    world_size = as_int(world_size)  # a numpy integer: a plain int for the children's environment
    if not is_real(timeout) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0 (inf: no limit), got {timeout!r}")
    if not is_real(grace) or not 0 <= grace < float("inf"):  # threading's waits refuse an infinite timeout
        raise ValueError(f"grace must be a finite number of seconds >= 0, got {grace!r}")
    if as_int(threads) is None or threads < 1:
        raise ValueError(f"threads must be an integer >= 1 (torch threads per rank), got {threads!r}")
    threads = as_int(threads)
    ctx = mp.get_context(choose_start_method(fn, start_method, threads))  # decided before this launch's store
    results = ctx.Queue()
    # the store binds a port the OS picks (port 0), published through store_at: no port is ever "free a moment ago",
    # so two launches at once cannot meet; the token lets every rank check its store. This process hosts it (as
    # torchrun's agent does: it outlives every rank, a stalled or lost rank 0 included), unless STORE_ENV=rank0
    host = "rank0" if os.environ.get(STORE_ENV) == "rank0" else "parent"
    store_at = (ctx.Value("i", 0), ctx.Event(), uuid.uuid4().hex, timeout, host)
    released = ctx.Event()  # set when every rank's fn has ended: each child may exit
    procs = [ctx.Process(target=run_child, args=(rank, world_size, store_at, threads, fn, args, results, grace, released),
                         daemon=True) for rank in range(world_size)]
    logs = _Stderr(world_size)
    gc.collect()  # this process's garbage goes here: a forked child collecting it (torch objects of a destroyed
    # group, whose destructors wait on threads a child does not have) would hang
    quiet = "TORCH_CPP_LOG_LEVEL" not in os.environ
    if quiet:  # children inherit it at start: no C++ warning stacks when a peer's process (or the store) is gone
        os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    try:
        for rank, proc in enumerate(procs):
            logs.start(rank, proc)
    finally:
        if quiet:
            del os.environ["TORCH_CPP_LOG_LEVEL"]
    store = None
    try:
        if host == "parent":  # after the children started: a forked child inherits no server thread nor socket
            store = host_store(world_size, *store_at[:3])
        return _collect(procs, results, timeout, grace, logs)
    except KeyboardInterrupt:
        _say(f"interrupted: stopping {world_size} ranks")
        raise KeyboardInterrupt from None  # the CLI exits 130 on it without a traceback
    finally:
        released.set()
        _stop(procs)
        logs.close()
        del store  # its server closes once every child has stopped


def _stop(procs, wait_s: float = _STOP_S) -> None:
    """SIGTERM every child still running, wait at most ``wait_s`` seconds for all of them together, SIGKILL the rest."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + wait_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()


def _say(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except Exception:  # noqa: BLE001 - no stderr to write to
        pass


class _Stderr:
    """Each child's standard error (file descriptor 2) goes to a temporary file of its own from its first
    instruction, so that even a failure before ``fn`` runs (a spawned child that cannot unpickle its
    arguments) is kept; :meth:`relay` copies what is new to this process's ``sys.stderr``."""

    def __init__(self, n: int) -> None:
        self.files = [tempfile.TemporaryFile() for _ in range(n)]
        self.offsets = [0] * n
        self.decoders = [codecs.getincrementaldecoder("utf-8")(errors="replace") for _ in range(n)]

    def start(self, rank: int, proc) -> None:
        """Start ``proc`` with its fd 2 on this rank's file (this process's fd 2 is restored at once)."""
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed or missing stream
                pass
        saved = os.dup(2)
        try:
            os.dup2(self.files[rank].fileno(), 2)
            proc.start()
        finally:
            os.dup2(saved, 2)
            os.close(saved)

    def relay(self) -> None:
        """Write what the children added to their stderr since the last call to ``sys.stderr``."""
        for rank, handle in enumerate(self.files):
            handle.seek(self.offsets[rank])
            data = handle.read()
            if not data:
                continue
            self.offsets[rank] += len(data)
            text = self.decoders[rank].decode(data)
            if text and sys.stderr is not None:
                try:
                    sys.stderr.write(text)
                    sys.stderr.flush()
                except Exception:  # noqa: BLE001 - nowhere to relay to
                    pass

    def tail(self, rank: int) -> str:
        """The last characters the child wrote to its stderr."""
        handle = self.files[rank]
        handle.seek(0, os.SEEK_END)
        size = handle.tell()
        handle.seek(max(0, size - 4 * _TAIL_CHARS))
        text = handle.read().decode("utf-8", errors="replace").strip()
        return text[-_TAIL_CHARS:]

    def close(self) -> None:
        self.relay()
        for handle in self.files:
            handle.close()


def _collect(procs, results, timeout: float, grace: float, logs: _Stderr) -> list:
    outcome: dict[int, tuple] = {}
    errors: list[tuple[int, bytes, str]] = []
    deadline = time.monotonic() + timeout
    while len(outcome) < len(procs):
        logs.relay()
        now = time.monotonic()
        if now >= deadline:
            if errors:
                break  # the grace for the others is over
            running = [r for r in range(len(procs)) if r not in outcome]
            raise TimeoutError(f"launch: ranks {running} did not finish within {timeout} s")
        try:
            kind, rank, payload, text = results.get(timeout=0.05)
            outcome[rank] = (kind, payload)
            if kind == "err":
                errors.append((rank, payload, text))
                deadline = min(deadline, time.monotonic() + grace)
            continue
        except queue.Empty:
            pass
        for rank, proc in enumerate(procs):
            if rank not in outcome and proc.exitcode is not None:
                time.sleep(0.2)  # its report may still be in the pipe
                if not _drain(results, outcome, errors) and rank not in outcome:  # killed: the others get grace
                    died = RankDied(_unreported(rank, proc.exitcode, logs.tail(rank)))
                    outcome[rank] = ("err", None)
                    errors.append((rank, pickle.dumps(died), None))
                    deadline = min(deadline, time.monotonic() + grace)
    if errors:
        _reraise(errors)
    return [pickle.loads(outcome[r][1]) for r in range(len(procs))]


class RankDied(RuntimeError):
    """A child of :func:`launch` ended without reporting a result or an exception (killed, or crashed outside
    Python): its exit code and the end of its stderr are in the message."""


def _unreported(rank: int, code: int, tail: str) -> str:
    """The error for a child that ended without putting a result or an exception on the queue."""
    text = f"launch: rank {rank} exited with code {code} without reporting"
    if code < 0:
        text += f" (killed by signal {-code})"
    if not tail:
        return text + "; its stderr is empty"
    text += f"; the end of its stderr:\n{tail}"
    if "on <module '__main__'" in tail:
        text += ("\n(a spawned child could not find something defined in __main__ that fn or its arguments "
                 "refer to: define it in a module (a .py file) and import it, or pass start_method='fork')")
    return text


def _drain(results, outcome, errors) -> bool:
    got = False
    while True:
        try:
            kind, rank, payload, text = results.get_nowait()
        except queue.Empty:
            return got
        got = True
        outcome[rank] = (kind, payload)
        if kind == "err":
            errors.append((rank, payload, text))


def _reraise(errors) -> None:
    died = [e for e in errors if e[2] is None]  # a child that died without reporting (text None)
    chosen = died[0] if died else errors[0]
    named = {getattr(exc, "rank", None) for exc in map(_load, (e[1] for e in errors))
             if exc is not None and type(exc).__name__ == "PipelineError"}
    for rank, payload, text in errors:
        exc = _load(payload)
        if exc is not None and getattr(exc, "rank", None) == rank and type(exc).__name__ == "PipelineError":
            chosen = (rank, payload, text)
            break
        if not died and rank in named and text is not None:  # the origin's own exception, which the others named
            chosen = (rank, payload, text)
            break
    rank, payload, text = chosen
    exc = _load(payload)
    if exc is None:
        exc = RuntimeError(f"rank {rank} failed (its exception could not be pickled)")
    if text is None:
        raise exc from None
    raise exc from ChildTraceback(f"in rank {rank}:\n{text}")


def _load(payload):
    try:
        return pickle.loads(payload) if payload is not None else None
    except Exception:  # noqa: BLE001
        return None
