"""The only place pipesched reads an exception's text: torch raises a plain ``RuntimeError`` for each case below,
with no type, attribute or code to tell it apart (checked on torch 2.13; ``tests/runtime/test_torch_errors.py`` pins
the texts, so a torch that words them otherwise fails there, not in a silent wrong turn at run time).

Each function answers one question about one ``RuntimeError``; the caller stores the answer in its own exception
(:class:`~pipesched.runtime.failure.CommError` ``.connection_lost``) or raises a clearer one, so no other code
looks at messages.
"""
from __future__ import annotations

# gloo, a peer's process exited or failed: "[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer
# [127.0.0.1]:10670 ..."; the other phrasings are the OS's, from the same transport. A timeout reads "... Timed
# out waiting 3000ms for recv operation to complete" and matches none of them.
_PEER_GONE = ("closed by peer", "connection reset", "broken pipe", "connection refused")

# autograd, an in-place operation on a leaf that requires grad: "a leaf Variable that requires grad is being
# used in an in-place operation."
_INPLACE_ON_LEAF = "leaf Variable that requires grad is being used in an in-place operation"


def peer_closed_connection(exc: BaseException) -> bool:
    """Whether a failed point-to-point or collective call failed because the peer closed the connection (its
    process failed or exited), rather than timing out. gloo raises a ``RuntimeError`` either way."""
    text = str(exc).lower()
    return any(phrase in text for phrase in _PEER_GONE)


def wait_timed_out(exc: BaseException) -> bool:
    """Whether a failed gloo point-to-point or collective call timed out (its group's ``timeout``: "Timed out
    waiting 3000ms for recv operation to complete"), the peer's connection still open: a stalled peer."""
    return isinstance(exc, RuntimeError) and "timed out waiting" in str(exc).lower()


def inplace_on_leaf(exc: BaseException) -> bool:
    """Whether autograd refused an in-place operation on a leaf tensor that requires grad (a stage's input is
    such a leaf, so a first layer like ``nn.ReLU(inplace=True)`` raises this although it works unsplit)."""
    return isinstance(exc, RuntimeError) and _INPLACE_ON_LEAF in str(exc)
