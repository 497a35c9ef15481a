"""The demo's corpus, with no download: the Python standard library's own source on this machine (found through
``sysconfig``), or any text file or folder. Torch-free: ``pipesched demo`` checks ``--data`` before any rank starts."""
from __future__ import annotations

import sysconfig
from pathlib import Path


def stdlib_sources() -> list[Path]:
    """The standard library's own .py files (no site-packages, no tests), in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3"}
    files = [p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts)]
    return sorted(files)


MIN_CORPUS_BYTES = 10_000


def corpus_files(data: str | None) -> list[Path]:
    """The files the corpus is read from, in order: ``data`` (a file, or a folder's files) or the stdlib's source."""
    if data is None:
        return stdlib_sources()
    path = Path(data)
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def check_corpus(data: str | None, limit_bytes: int) -> str | None:
    """Why ``data`` and ``limit_bytes`` cannot make the corpus (a message naming the option), or ``None`` if they
    can; from file sizes only."""
    if limit_bytes < MIN_CORPUS_BYTES:
        return f"--corpus-bytes {limit_bytes}: the demo needs at least {MIN_CORPUS_BYTES} bytes of text"
    total = 0
    for file in corpus_files(data):
        total += file.stat().st_size
        if total >= MIN_CORPUS_BYTES:
            return None
    return (f"--data {data!r} has only {total} bytes of text; the demo needs at least {MIN_CORPUS_BYTES}: "
            f"give a larger text file or folder")


def load_text(data: str | None, limit_bytes: int) -> bytes:
    """Bytes of the corpus: ``data`` (a file or a folder of text files) or the stdlib's source, at most
    ``limit_bytes``.

    Raises:
        SystemExit: fewer than 10,000 bytes of text.
    """
    chunks, total = [], 0
    for file in corpus_files(data):
        raw = file.read_bytes()
        chunks.append(raw)
        total += len(raw)
        if total >= limit_bytes:
            break
    text = b"".join(chunks)[:limit_bytes]
    if len(text) < MIN_CORPUS_BYTES:
        raise SystemExit(f"the corpus has only {len(text)} bytes; give --data a larger text file or folder")
    return text
