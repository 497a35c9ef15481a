"""The step's lead: the first forward of stage 0's rank, run while the step's opening all-gather is in flight.

Every step opens with one all-gather (:mod:`~pipesched.runtime.handshake`) that lets every rank refuse the step
before any work. Stage 0's rank starts the critical path of every schedule, and its first instruction is
usually ``F`` of stage 0 on microbatch 0, which needs no message. It runs that forward while the all-gather
is in flight (a round trip, ~0.3 ms on gloo on one host; a device sync on NCCL) and only then waits for the rows; nothing
leaves the rank before they are in, so no peer sees a message of a step that is refused.

A refused step must leave no trace a plain run would not. A forward can leave four: the random number generators
it drew from (captured before, restored on refusal: :mod:`~pipesched.runtime.rng_state`), the buffers it updates
in place (BatchNorm's running statistics), what forward hooks do, and in-place writes to its input (the
caller's ``x``). So the lead runs only where the other three cannot happen (:func:`undoable`): stage 0 holds no
buffer, no forward hook or pre-hook is registered on it or globally, and a plain step of the same kind on this
pipeline has run that forward without writing to its input (:func:`input_versions`); else the step opens as
before, waiting for the rows first.
"""
from __future__ import annotations

from typing import NamedTuple

from torch import nn

from ..ir import Op


def lead_instruction(programs, pp_rank: int, train: bool):
    """The instruction this rank may run as the lead of a step of kind ``train``: the first of its stream in the
    program of that kind, learning the message shapes or not, where that is the same ``F`` of stage 0 in both
    and stage 0 is not the last stage (its forward would then need the target); ``None`` otherwise, and on a
    one-rank pipeline (nothing to hide). (Receives posted early never go before such a first instruction:
    :func:`pipesched.lower.post_receives_early`.)"""
    program = programs.pick(train, False)
    if program.num_ranks == 1 or program.num_stages == 1:
        return None
    firsts = {stream[0] if stream else None for stream in
              (programs.pick(train, learning).ranks[pp_rank] for learning in (False, True))}
    if len(firsts) != 1:
        return None
    (first,) = firsts
    return first if first is not None and first.op is Op.F and first.stage == 0 else None


def undoable(module: nn.Module) -> bool:
    """Whether a forward of ``module`` can be undone by restoring the random number generators alone: it
    holds no buffer (none registered, or all ``None``), and no forward hook or pre-hook is registered on it, on
    any submodule, or globally (``register_module_forward_hook`` and ``..._pre_hook``)."""
    from torch.nn.modules import module as torch_module

    if getattr(torch_module, "_global_forward_hooks", None) or getattr(torch_module, "_global_forward_pre_hooks", None):
        return False
    for sub in module.modules():
        if sub._forward_hooks or sub._forward_pre_hooks:
            return False
        if any(t is not None for t in sub._buffers.values()):
            return False
    return True


def input_versions(tensors) -> tuple[int, ...] | None:
    """Autograd's count of in-place writes to each of ``tensors`` (``None`` where one has none, as inference
    tensors): a forward that writes to its input changes it."""
    try:
        return tuple(t._version for t in tensors)
    except RuntimeError:  # an inference tensor tracks no version
        return None


class Lead(NamedTuple):
    """A lead that ran (:meth:`~pipesched.runtime.executor.Executor.lead`)."""

    step: object  #: the executor's step state holding the forward's output and autograd graph
    instr: object  #: the instruction run
    rng: dict  #: the generator states before it (:func:`pipesched.runtime.rng_state.capture`)
    error: BaseException | None  #: what the forward raised (raised once the opening accepted the step)
