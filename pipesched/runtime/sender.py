"""A background thread that issues this rank's sends, so a send that blocks (gloo writes on the calling
thread until the peer's socket drains) never stalls the compute stream. Sends keep their order."""
from __future__ import annotations

import queue
import threading


class Ticket:
    """A send handed to the :class:`Sender`; ``wait()`` waits for it to be issued, then for the send."""

    __slots__ = ("group", "buf", "peer", "tag", "work", "error", "done", "timeout")

    def __init__(self, group, buf, peer, tag, timeout):
        self.group, self.buf, self.peer, self.tag, self.timeout = group, buf, peer, tag, timeout
        self.work = self.error = None
        self.done = threading.Event()

    def wait(self) -> bool:
        """Raises RuntimeError if issuing or completing the send failed, or issuing took over ``timeout`` s."""
        if not self.done.wait(self.timeout):
            raise RuntimeError(f"the send to pipeline rank {self.peer} was not issued within {self.timeout} s")
        if self.error is not None:
            raise RuntimeError(f"{type(self.error).__name__}: {self.error}")
        return self.work.wait()


class Sender:
    """One daemon thread per transport, started on first use; ``close()`` stops it."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = None

    def submit(self, group, buf, peer: int, tag: int) -> Ticket:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="pipesched-sender", daemon=True)
            self._thread.start()
        ticket = Ticket(group, buf, peer, tag, self.timeout)
        self._queue.put(ticket)
        return ticket

    def _loop(self) -> None:
        while True:
            ticket = self._queue.get()
            if ticket is None:
                return
            try:
                ticket.work = ticket.group.send([ticket.buf], ticket.peer, ticket.tag)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                ticket.error = exc
            ticket.group = None  # no reference to the group may outlive the send (teardown closes it)
            ticket.done.set()
            ticket = None

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread = None
