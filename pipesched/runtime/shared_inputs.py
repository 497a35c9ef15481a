"""Stage inputs that shared memory on the sending rank. A stage that returns one tensor twice, or a tensor and a
view of it (``(h, mask, mask)``), hands the next stage names of one memory in the unsplit model: a write in place
through one name shows through the other. Sent to another rank, each element arrives as its own copy, so such a
write would silently give other values (a hunt found it: another loss and gradients, no error). The message's
meta says which elements shared memory (:func:`~pipesched.runtime.wire.shared_memory`); the receiving stage's
forward is refused if it writes to one of them in place. On one rank the elements are still one memory (the
values are the unsplit model's), and where none is written in place nothing changes."""
from __future__ import annotations


def shared_versions(meta, inputs) -> dict | None:
    """``{element: version}`` of the received ``inputs`` whose memory another element of the message shared on
    the sending rank (``meta[3]``), read before the stage's forward; ``None`` where none did."""
    shares = meta[3]
    linked = {k for k, j in enumerate(shares) if j >= 0} | {j for j in shares if j >= 0}
    return {k: inputs[k]._version for k in sorted(linked)} or None


def check_shared_writes(stage: int, microbatch: int, meta, before: dict | None, inputs) -> None:
    """Raise if the forward of ``stage`` wrote in place to an input element that shared memory with another on
    the sending rank (``before``: :func:`shared_versions`, read before that forward).

    Raises:
        ValueError: names the stage, the microbatch, the element written and the one it shared memory with.
    """
    if before is None:
        return
    written = [k for k, version in before.items() if inputs[k]._version != version]
    if not written:
        return
    k = written[0]
    j = meta[3][k] if meta[3][k] >= 0 else meta[3].index(k)
    raise ValueError(
        f"stage {stage} wrote in place to element {k} of its input (microbatch {microbatch}), which shared memory "
        f"with element {j} in the previous stage's output (the same tensor twice, or a view of it): in the unsplit "
        f"model the write shows through both, but each arrives on this rank as its own copy, so the values would "
        f"differ; write out of place (a = a + 1, not a.add_(1)), or return that tensor once")
