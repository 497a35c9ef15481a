"""``launch``: run a function on N local processes (gloo on 127.0.0.1) for tests and notebooks; never hangs."""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback


class ChildTraceback(Exception):
    """The traceback text of an exception raised in a child process (attached as ``__cause__``)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(fn, world_size: int, *args, timeout: float = 300.0, grace: float = 20.0, threads: int = 1,
           start_method: str = "spawn") -> list:
    """Run ``fn(rank, *args)`` on ``world_size`` local processes that share a gloo default process group.

    Each child gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR=127.0.0.1`` and a free
    ``MASTER_PORT``, sets ``torch.set_num_threads(threads)``, and calls ``fn`` after
    ``init_process_group("gloo")``. With ``start_method="spawn"`` (default) ``fn`` must be importable
    (defined at module level of a file); in a notebook, define it in a module or use ``"fork"`` (CPU only).

    Args:
        timeout: seconds for the whole run; grace: seconds the others get to end after one child fails, and
            the most a child whose rank failed first stays up (keeping the store reachable) until the others
            have read its failure record. Children start with ``TORCH_CPP_LOG_LEVEL=ERROR`` unless it is set.

    Returns:
        The return values of ``fn``, by rank (they must be picklable).
    Raises:
        The first failing child's exception (preferring the rank a :class:`PipelineError` names as the
        origin), re-raised with the child's traceback as ``__cause__``; the other children get ``grace``
        seconds to end on their own and are then terminated.
        TimeoutError: the children did not all finish within ``timeout`` seconds (all are terminated).
        RuntimeError: a child died without reporting (e.g. killed); names its rank and exit code.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    ctx = mp.get_context(start_method)
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(rank, world_size, port, threads, fn, args, results, grace), daemon=True)
             for rank in range(world_size)]
    quiet = "TORCH_CPP_LOG_LEVEL" not in os.environ
    if quiet:  # children inherit it at start: no C++ warning stacks when a peer's process (or the store) is gone
        os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    try:
        for proc in procs:
            proc.start()
    finally:
        if quiet:
            del os.environ["TORCH_CPP_LOG_LEVEL"]
    try:
        return _collect(procs, results, timeout, grace)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()


def _collect(procs, results, timeout: float, grace: float) -> list:
    outcome: dict[int, tuple] = {}
    errors: list[tuple[int, bytes, str]] = []
    deadline = time.monotonic() + timeout
    while len(outcome) < len(procs):
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
                if not _drain(results, outcome, errors):
                    if rank not in outcome:
                        raise RuntimeError(f"launch: rank {rank} exited with code {proc.exitcode} without reporting")
    if errors:
        _reraise(errors)
    return [pickle.loads(outcome[r][1]) for r in range(len(procs))]


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
    chosen = errors[0]
    for rank, payload, text in errors:
        exc = _load(payload)
        if exc is not None and getattr(exc, "rank", None) == rank and type(exc).__name__ == "PipelineError":
            chosen = (rank, payload, text)
            break
    rank, payload, text = chosen
    exc = _load(payload)
    if exc is None:
        exc = RuntimeError(f"rank {rank} failed (its exception could not be pickled)")
    raise exc from ChildTraceback(f"in rank {rank}:\n{text}")


def _load(payload):
    try:
        return pickle.loads(payload) if payload is not None else None
    except Exception:  # noqa: BLE001
        return None


def _child(rank, world_size, port, threads, fn, args, results, grace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist

    from .failure import linger

    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        value = fn(rank, *args)
        results.put(("ok", rank, pickle.dumps(value), ""))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        text = traceback.format_exc()
        try:
            payload = pickle.dumps(exc)
        except Exception:  # noqa: BLE001
            payload = None
        results.put(("err", rank, payload, text))
    finally:
        results.close()
        results.join_thread()
        linger(grace)  # a rank that failed first keeps the store up until the others have read its record
        os._exit(0)  # skip interpreter teardown (gloo threads); closes this rank's connections at once
