"""Keep freed memory in the process: no page faults for the blocks a step allocates again and again.

Why: every backward allocates a fresh weight gradient per parameter (``dW = dY^T X``, e.g. 4 MiB for a
``Linear(1024, 1024)``): autograd's matmul kernel makes it, then accumulates it into ``.grad`` in place and
frees it. torch's CPU allocator is glibc ``malloc``: a block of at least ``M_MMAP_THRESHOLD`` (dynamic,
128 KiB at start) is ``mmap``-ed and ``munmap``-ed on free, and the free space at the top of the heap beyond
``M_TRIM_THRESHOLD`` is given back to the OS. So the next block of the same size touches fresh pages: one
minor page fault per 4 KiB page, about 1000 per 4 MiB gradient, which more than triples the time of a split
backward's ``W`` (3.5 ms -> 15-26 ms for 4 x Linear(1024) on 16 rows). The gradient block cannot be given to
autograd from outside (the kernel allocates its own output), so the runtime keeps the freed blocks instead.

:func:`keep_freed_memory` sets glibc's two thresholds once per process (``mallopt``): blocks up to 32 MiB come
from the heap, and the heap is not trimmed below 1 GiB of free space. Nothing numeric changes (gradients are
bitwise the same); the process keeps, and reuses, the memory it freed, so its resident size stays near its
peak instead of shrinking between allocations. Skipped (returns False) where the C library is not glibc, where
the user already chose through glibc's own settings (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``,
``MALLOC_TOP_PAD_`` or ``GLIBC_TUNABLES``), or with ``PIPESCHED_KEEP_FREED_MEMORY=0``.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20  # bytes: glibc's largest allowed value on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 1 << 30  # bytes
OPT_OUT = "PIPESCHED_KEEP_FREED_MEMORY"
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")


def keep_freed_memory(environ=None) -> bool:
    """Set glibc's ``M_MMAP_THRESHOLD`` to 32 MiB and ``M_TRIM_THRESHOLD`` to 1 GiB in this process.

    Args:
        environ: the environment to read the opt-out and the user's own malloc settings from
            (default ``os.environ``).
    Returns:
        True when both were set; False when skipped (see the module docstring) or refused by ``mallopt``.
        Never raises; idempotent.
    """
    env = os.environ if environ is None else environ
    if env.get(OPT_OUT, "1") == "0" or any(name in env for name in USER_SETTINGS):
        return False
    mallopt = _mallopt()
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) & bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def _mallopt():
    """glibc's ``int mallopt(int, int)``, or None where the C library is another one."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # glibc only: musl and macOS have no such symbol
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt
