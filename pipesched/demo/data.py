"""The demo's data, with no download: the Python standard library's own source on this machine (found through
``sysconfig``), or any text file or folder; cut into random windows of bytes."""
from __future__ import annotations

import sysconfig
from pathlib import Path

import torch


def stdlib_sources() -> list[Path]:
    """The standard library's own .py files (no site-packages, no tests), in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3"}
    files = [p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts)]
    return sorted(files)


def load_text(data: str | None, limit_bytes: int) -> bytes:
    """Bytes of the corpus: ``data`` (a file or a folder of text files) or the stdlib's source, at most
    ``limit_bytes``.

    Raises:
        SystemExit: fewer than 10,000 bytes of text.
    """
    if data is None:
        files = stdlib_sources()
    else:
        path = Path(data)
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    chunks, total = [], 0
    for file in files:
        raw = file.read_bytes()
        chunks.append(raw)
        total += len(raw)
        if total >= limit_bytes:
            break
    text = b"".join(chunks)[:limit_bytes]
    if len(text) < 10_000:
        raise SystemExit(f"the corpus has only {len(text)} bytes; give --data a larger text file or folder")
    return text


def batches(corpus: torch.Tensor, batch: int, context: int, generator: torch.Generator):
    """Endless random (inputs, targets) windows: two (B, T) int64 tensors, targets shifted by one."""
    while True:
        starts = torch.randint(len(corpus) - context - 1, (batch,), generator=generator)  # (B,)
        window = torch.stack([corpus[s : s + context + 1] for s in starts.tolist()])  # (B, T+1)
        yield window[:, :-1], window[:, 1:]
