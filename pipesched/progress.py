"""Progress of long command-line work, on stderr, only for a person watching a terminal.

Library code marks where its long phases begin with :func:`note` (``"zb-auto: scoring candidate 3 of 6"``,
``"simulating: timing 4000000 instructions"``); that is a no-op unless the command line runs the work inside
:func:`on_terminal`, which shows each note on one status line of stderr, rewritten in place, and clears it when
the work ends. Nothing is shown when stderr is not a TTY (a pipe, a file, a test's capture), so no output a
script reads changes; on a TTY, notes are shown from the start of work the caller expects to be long
(``show_now``), else only once :data:`AFTER_SECONDS` have passed (quick commands stay silent).
"""
from __future__ import annotations

import contextlib
import contextvars
import sys
import time

#: seconds of work after which notes are shown on a terminal, when the caller did not expect long work
AFTER_SECONDS = 1.0

_CLEAR = "\r\x1b[K"  # back to the line's start, erase it
_sink: contextvars.ContextVar = contextvars.ContextVar("pipesched_progress", default=None)


def note(message: str) -> None:
    """Say that a phase of long work begins (shown only inside :func:`on_terminal` on a TTY)."""
    sink = _sink.get()
    if sink is not None:
        sink(message)


def clear() -> None:
    """Erase the status line, if one is shown, before printing a line of one's own to stderr."""
    sink = _sink.get()
    if sink is not None:
        sink(None)


def _is_tty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


@contextlib.contextmanager
def on_terminal(show_now: bool = False, stream=None):
    """Show the :func:`note` calls made inside on ``stream`` (default ``sys.stderr``) if it is a TTY: each as
    ``"[N s] message"`` on one line rewritten in place, erased when the block ends. ``show_now``: from the first
    note (work known to be long); else only notes made :data:`AFTER_SECONDS` or more after the block began."""
    stream = sys.stderr if stream is None else stream
    if not _is_tty(stream):
        yield
        return
    began, shown = time.monotonic(), False

    def sink(message) -> None:
        nonlocal shown
        if message is None:  # clear()
            if shown:
                stream.write(_CLEAR)
                stream.flush()
                shown = False
            return
        elapsed = time.monotonic() - began
        if show_now or elapsed >= AFTER_SECONDS:
            stream.write(f"{_CLEAR}[{elapsed:.0f} s] {message}")
            stream.flush()
            shown = True

    token = _sink.set(sink)
    try:
        yield
    finally:
        _sink.reset(token)
        sink(None)
