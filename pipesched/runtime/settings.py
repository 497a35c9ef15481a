"""The local settings a stage's messages depend on besides the input: a fingerprint every rank contributes to
the step signature, so a change on any rank (a stage frozen or unfrozen, ``train()``/``eval()``, a dtype,
grad or autocast mode) makes every rank re-learn the message metas of the step together."""
from __future__ import annotations

import hashlib

import torch

from .wire import DTYPES, DTYPE_CODE

#: the settings :func:`fingerprint` covers, in words (quoted by errors about metas that changed anyway)
SETTINGS = ("requires_grad and dtype of each parameter, dtype of each buffer, train/eval mode of each module, "
            "grad mode, autocast")


def fingerprint(stages: dict, device: torch.device, autocast: torch.dtype | None = None) -> int:
    """A signed 64-bit digest of this rank's settings (:data:`SETTINGS`) for its ``stages`` ({stage: module}).

    The autocast covered is the one the stages' forwards run under: the Pipeline's own ``autocast`` dtype when
    given (it overrides the caller's), else the caller's autocast state on ``device``'s type.

    Deterministic across processes (a hash of their text, not Python's per-process ``hash``); it costs one
    pass over the stages' modules and tensors, a few microseconds per module.
    """
    kind = device.type
    if autocast is not None:
        amp = [True, autocast]
    else:
        amp = [torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)]
    words = [torch.is_grad_enabled(), *amp]
    for s in sorted(stages):
        for module in stages[s].modules():
            words.append(module.training)
            # the module's own tensors, read from its dicts (the generator API costs 3x the whole digest)
            words.extend((p.requires_grad, p.dtype) for p in module._parameters.values() if p is not None)
            words.extend(b.dtype for b in module._buffers.values() if b is not None)
    digest = hashlib.blake2b(repr(words).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def caller_autocast(device: torch.device, autocast: torch.dtype | None) -> int:
    """The autocast the caller entered around a ``step()``/``forward()`` on ``device``'s type, as one word of the
    step's opening row: 0 where it is off or the Pipeline's own ``autocast`` dtype overrides it (``autocast``
    not None), else 1 + the dtype's :data:`~pipesched.runtime.wire.DTYPE_CODE`. Ranks whose words differ would
    run their stages at different precisions (the step is refused: ``Handshake``)."""
    kind = device.type
    if autocast is not None or not torch.is_autocast_enabled(kind):
        return 0
    return 1 + DTYPE_CODE[torch.get_autocast_dtype(kind)]


def describe_autocast(word: int, kind: str) -> str:
    """:func:`caller_autocast`'s ``word`` in words, for errors: ``without autocast`` or
    ``under torch.autocast('cpu', dtype=torch.bfloat16)``."""
    return "without autocast" if word == 0 else f"under torch.autocast({kind!r}, dtype={DTYPES[word - 1]})"
