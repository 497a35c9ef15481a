"""Activation recomputation must leave no trace a plain run would not.

The ``R`` of (stage, microbatch) re-runs the forward its ``F`` ran, so that run must see what ``F`` saw and
change nothing ``F`` did not already change:

- **RNG**: :func:`rng_state` at ``F``, :func:`replay_rng` at ``R`` (bitwise the same draws, Dropout included;
  the caller's RNG continues as if ``R`` had not run).
- **Buffers** (BatchNorm's running statistics and ``num_batches_tracked``, counters, spectral-norm vectors):
  :class:`BufferLedger` snapshots a stage's buffers at each ``F`` (a buffer that keeps its value shares one
  snapshot between microbatches) and ``R`` runs on scratch copies of that snapshot, so it computes with
  ``F``'s buffers (even if later forwards changed them) and leaves the module's buffers as they were.
- **Forward hooks** (a module's or torch's global ones) would run twice per microbatch, with whatever they count
  or register: :func:`check_no_forward_hooks` refuses them on a recomputed stage.
- **Inputs changed in place** by the forward are refused by the executor at ``R`` (it compares versions).

Python attributes a forward assigns (not buffers) are not replayed.
"""
from __future__ import annotations

import collections
import contextlib
import random
import sys

import torch
from torch import nn

from .shared_buffers import byte_span, overlapping


def rng_state(device: torch.device, module: nn.Module | None = None) -> tuple:
    """``(cpu_state, cuda_state or None, generators, host)``: what the forward of a recomputed stage must replay;
    ``generators``: ``[(generator, its state)]`` for each ``torch.Generator`` held as an attribute of a module of
    ``module`` (a layer that draws from its own generator, ``torch.rand(..., generator=self.gen)``), each once;
    ``host``: :func:`host_states` (a layer drawing from Python's ``random`` or NumPy's global generator: stochastic
    depth written with ``random.random()``)."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda, [(g, g.get_state()) for g in own_generators(module)], host_states()


def host_states() -> tuple:
    """``(Python's random state, NumPy's global generator's state or None)``: NumPy's only where it is imported
    (a few microseconds each). A ``random.Random`` or NumPy ``Generator`` a layer holds itself is not included."""
    numpy = sys.modules.get("numpy")
    return random.getstate(), (numpy.random.get_state() if numpy is not None else None)


def set_host_states(states: tuple) -> None:
    """Put Python's ``random`` and NumPy's global generator in ``states`` (from :func:`host_states`)."""
    python, numpy_state = states
    random.setstate(python)
    if numpy_state is not None:
        sys.modules["numpy"].random.set_state(numpy_state)


def own_generators(module: nn.Module | None) -> list:
    """The ``torch.Generator`` objects ``module``'s modules hold, each once, in module order: as an attribute of the
    module or of its class (``gen = torch.Generator()`` in the class body), or as an item of a list, tuple or dict
    held so. One held elsewhere (a global, an object of another class) is not found. Runs at each ``F`` of a
    recomputed stage, so it reads only what can hold one: not ``nn.Module``'s own bookkeeping (parameters,
    buffers, submodules, hooks) nor the bodies of torch's own classes (``nn.Module``'s alone has ~200 entries)."""
    found: dict = {}
    for owner in module.modules() if module is not None else ():
        for holder in (owner, *_user_classes(type(owner))):
            for name, value in vars(holder).items():
                if name in _MODULE_STATE:
                    continue
                items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
                for item in items:
                    if isinstance(item, torch.Generator):
                        found.setdefault(id(item), item)
    return list(found.values())


def _user_classes(cls: type) -> list[type]:
    """``cls``'s MRO without torch's classes and ``object`` (their bodies hold no generator)."""
    return [c for c in cls.__mro__ if c is not object and not c.__module__.startswith("torch.")]


# nn.Module's own per-instance bookkeeping (OrderedDicts of parameters, buffers, submodules and hooks): no generator
_MODULE_STATE = frozenset(vars(nn.Module()))


@contextlib.contextmanager
def replay_rng(state: tuple, device: torch.device):
    """Run the block with the RNG state ``state`` (from :func:`rng_state`): the global CPU (and CUDA) generator's,
    each module-held generator's, Python's ``random`` and NumPy's global one; restore the caller's after, so a
    recompute does not shift the random numbers of later forwards."""
    cpu, cuda, generators, host = state
    devices = [device] if device.type == "cuda" else []
    caller = host_states()
    with torch.random.fork_rng(devices=devices), states_kept([g for g, _ in generators]):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        for g, then in generators:
            g.set_state(then)
        set_host_states(host)
        try:
            yield
        finally:
            set_host_states(caller)


@contextlib.contextmanager
def states_kept(generators):
    """Run the block, then put each of ``generators`` back in the state it had before (e.g. :func:`own_generators`
    of layers that a profiler runs)."""
    saved = [(g, g.get_state()) for g in generators]
    try:
        yield
    finally:
        for g, state in saved:
            g.set_state(state)


def _refuse(_):
    raise RuntimeError("the forward of a recomputed stage keeps no activations; backward must follow its R")


def keep_nothing():
    """Record the autograd graph (so outputs know whether they require grad) but save no tensor for backward."""
    return torch.autograd.graph.saved_tensors_hooks(lambda _t: None, _refuse)


# ---- buffers ------------------------------------------------------------------------------------------------

def _buffer_slots(module: nn.Module) -> list[tuple[nn.Module, str]]:
    """Every ``(owner, name)`` that holds a buffer (or ``None``) in ``module``, each once; one tensor registered
    in two places gives two slots."""
    return [(owner, name) for owner in module.modules() for name in owner._buffers]


def _memory_groups(tensors) -> list[list[torch.Tensor]]:
    """The distinct tensors of ``tensors`` (``None`` skipped), grouped by memory as
    :mod:`~pipesched.runtime.shared_buffers` groups a model's (one storage, overlapping bytes); groups in order
    of first appearance (tensors alone on their storage first: the common case, which skips the grouping)."""
    distinct = list({id(t): t for t in tensors if t is not None}.values())
    keys = [_storage_key(t) for t in distinct]
    storages = collections.Counter(key for key in keys if key is not None)
    alone = [key is None or storages[key] == 1 for key in keys]
    shared = [t for t, single in zip(distinct, alone) if not single]
    return [[t] for t, single in zip(distinct, alone) if single] + [
        [shared[i] for i in group] for group in overlapping([byte_span(t) for t in shared])]


def _storage_key(t: torch.Tensor):
    """``(device, storage address)`` of ``t``, or ``None`` where it has no ordinary storage (cheaper than
    :func:`~pipesched.runtime.shared_buffers.byte_span`: only tensors that share a key are grouped further)."""
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return None
    return (t.device, ptr) if ptr else None


def _clone_together(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
    """Clones of ``tensors`` (distinct tensors over one memory: one group of :func:`_memory_groups`) that share
    memory exactly as they do: the bytes they cover are cloned once and each clone is a view of that copy with its
    tensor's dtype, offset, size and stride (so a write through one is read through the other, as in the model).
    One tensor is cloned alone, and so is each of a group that cannot be rebuilt so (no ordinary storage, a
    conjugate or negative view, quantized). Returns the clones and the bytes they hold. Call under ``no_grad``."""
    if len(tensors) == 1:
        clone = tensors[0].detach().clone()
        return [clone], clone.numel() * clone.element_size()
    spans = [byte_span(t) for t in tensors]
    if all(s is not None for s in spans) and not any(
            t.is_conj() or t.is_neg() or t.is_quantized for t in tensors):
        align = max(t.element_size() for t in tensors)  # powers of two: every member's offset stays whole
        first = min(s[1] for s in spans) // align * align
        end = max(s[2] for s in spans)
        size = -(-(end - first) // align) * align
        raw = torch.empty(0, dtype=torch.uint8, device=tensors[0].device).set_(tensors[0].untyped_storage())
        base = torch.empty(size, dtype=torch.uint8, device=raw.device)
        base[:end - first].copy_(raw[first:end])
        return [base.view(t.dtype).as_strided(t.shape, t.stride(),
                                              (t.storage_offset() * t.element_size() - first) // t.element_size())
                for t in tensors], size
    clones = [t.detach().clone() for t in tensors]
    return clones, sum(t.numel() * t.element_size() for t in clones)


def _scratch(tensors, groups=None) -> list:
    """A scratch copy of each of ``tensors`` (``None`` stays ``None``): one tensor in two places gets one copy, and
    tensors that share memory get copies that share it alike (:func:`_clone_together`). ``groups``: those of
    :func:`_memory_groups` for ``tensors``, where known."""
    copies: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for group in _memory_groups(tensors) if groups is None else groups:
            copies.update(zip(map(id, group), _clone_together(group)[0]))
    return [None if t is None else copies[id(t)] for t in tensors]


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as integers of its element size, so comparing tells ``-0.0`` from ``0.0``."""
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.is_floating_point():
        t = t.view(_BITS[t.element_size()])
    return t


def _same_bits(pairs) -> list[bool]:
    """For each ``(a, b)``: whether they have the same dtype, shape, strides, device and bits (a NaN compares
    unequal to itself: a buffer holding one is cloned again). One host synchronisation for all pairs on a GPU."""
    flags: list = []
    for a, b in pairs:
        if (a.dtype, a.shape, a.stride(), a.device) != (b.dtype, b.shape, b.stride(), b.device):
            flags.append(False)
            continue
        try:
            flags.append((_bits(a) == _bits(b)).all())
        except (RuntimeError, KeyError, TypeError):  # sparse, quantized, an unusual element size: clone again
            flags.append(False)
    lazy = [i for i, f in enumerate(flags) if isinstance(f, torch.Tensor)]
    if lazy:
        devices = {flags[i].device for i in lazy}
        values = (torch.stack([flags[i] for i in lazy]).tolist() if len(devices) == 1
                  else [bool(flags[i]) for i in lazy])
        for i, value in zip(lazy, values):
            flags[i] = bool(value)
    return flags


@contextlib.contextmanager
def _swapped(slots, values):
    """Put ``values[i]`` in buffer slot ``slots[i]`` for the block; put back the tensors that were there after it,
    whatever the block did to the slots (a forward that assigns a new tensor to a buffer included)."""
    current = [owner._buffers[name] for owner, name in slots]
    try:
        for (owner, name), value in zip(slots, values):
            owner._buffers[name] = value
        yield
    finally:
        for (owner, name), value in zip(slots, current):
            owner._buffers[name] = value


class BufferLedger:
    """The values the buffers of recomputed stages had at each forward, for one step.

    :meth:`snapshot`, called right before the ``F`` of a recomputed stage, returns a :class:`BufferSnapshot`
    of every buffer of the stage: a clone of its value, shared with the previous snapshot of the same tensor
    when the buffer still has those bits (a constant such as a causal mask is then held once per step, not once
    per microbatch). Whether a forward changed a buffer is decided by comparing values, not autograd's version
    counter: ``batch_norm`` updates BatchNorm's running statistics in place without bumping it. Snapshots are
    never written (a recompute runs on scratch copies), so sharing them is safe in any order of ``R``.
    """

    def __init__(self) -> None:
        # ids of a group of buffers over one memory -> the clones of their values at the last snapshot
        self._latest: dict[tuple, list[torch.Tensor]] = {}

    def snapshot(self, module: nn.Module) -> BufferSnapshot:
        """Every buffer of ``module`` as it is now (see the class). Buffers that share memory (views of one
        storage) are cloned together, into clones that share memory alike (:func:`_clone_together`)."""
        slots = _buffer_slots(module)
        groups = {tuple(map(id, group)): group for group in _memory_groups([owner._buffers[name]
                                                                           for owner, name in slots])}
        known = [key for key in groups if key in self._latest]
        same = iter(_same_bits([pair for key in known for pair in zip(groups[key], self._latest[key])]))
        kept = {key for key in known if all([next(same) for _ in key])}
        values: dict[int, torch.Tensor] = {}
        made = 0
        with torch.no_grad():
            for key, group in groups.items():
                if key not in kept:
                    self._latest[key], nbytes = _clone_together(group)
                    made += nbytes
                values.update(zip(key, self._latest[key]))
        return BufferSnapshot(slots, [None if owner._buffers[name] is None else values[id(owner._buffers[name])]
                                      for owner, name in slots], made, [self._latest[key] for key in groups])


class BufferSnapshot:
    """The buffers of one stage at one forward (from :meth:`BufferLedger.snapshot`), and how to replay them.

    Attributes:
        nbytes: bytes of the clones this snapshot made (those it shares with an earlier one are not counted).
    """

    def __init__(self, slots, values, nbytes: int, groups) -> None:
        self._slots, self._values, self.nbytes = slots, values, nbytes
        self._groups = groups  # the distinct values, grouped by memory (as the buffers they are clones of)

    def replayed(self):
        """A context for the recompute: every buffer slot holds a scratch copy of its value at the snapshot
        (slots that shared a tensor share one copy; buffers that share memory, views of one storage, get copies
        that share it alike, so a write through one is read through the other as in the model), so the recompute
        computes with the values its forward saw, also when another microbatch's forward changed them since, and
        writes only to the copies; on exit (also
        on an exception) every slot holds again the very tensor it held on entry, untouched. Tensors the
        recompute's autograd graph saved from a buffer are the copies, which nothing changes any more."""
        return _swapped(self._slots, _scratch(self._values, self._groups))


def scratch_buffers(module: nn.Module):
    """A context in which every buffer of ``module`` is a scratch copy, so a forward run inside it (a
    measurement) leaves the module's buffers exactly as they were; buffers that share memory get copies that
    share it alike (the W of a split backward recomputes a checkpointed region in it)."""
    slots = _buffer_slots(module)
    return _swapped(slots, _scratch([owner._buffers[name] for owner, name in slots]))


# ---- hooks --------------------------------------------------------------------------------------------------

def _hook_name(hook) -> str:
    target = getattr(hook, "func", hook)  # functools.partial
    qualname = getattr(target, "__qualname__", None) or type(target).__qualname__
    module = getattr(target, "__module__", None) or type(target).__module__
    return f"{module}.{qualname}"


def _global_hooks() -> list[tuple[str, object]]:
    from torch.nn.modules import module as torch_module
    found = []
    for kind, attr in (("forward pre-hook", "_global_forward_pre_hooks"), ("forward hook", "_global_forward_hooks")):
        found += [(kind, hook) for hook in getattr(torch_module, attr, {}).values()]
    return found


def check_no_forward_hooks(module: nn.Module, stage: int, first_layer: int, recompute) -> None:
    """Refuse forward hooks on a recomputed stage: its forward runs twice per microbatch (``F``, then ``R``
    before the backward), so each hook would run twice and repeat whatever it counts or registers.

    Args:
        module: the stage (an ``nn.Sequential`` of the model's layers).
        stage: its index; ``first_layer``: the index in the model of its first layer (for the message).
        recompute: the recompute flag of every stage (the message suggests the same list with this stage off).
    Raises:
        ValueError: a forward hook or forward pre-hook is registered on a layer of ``module`` or on one of its
            submodules (names the layer's index in the model and class, the submodule, and the hook), or a
            global module forward (pre-)hook is registered (``register_module_forward_hook``); says what to do.
            Raised by ``Pipeline`` at construction (before any communication) and by the executor at the
            stage's ``R`` (a hook registered after construction).
    """
    off = [bool(flag) for flag in recompute]
    off[stage] = False
    fix = f"remove the hook, or turn recompute off for stage {stage} (recompute={off})"
    note = ("(torch.nn.utils.spectral_norm and torch.nn.utils.weight_norm are hook-based: use "
            "torch.nn.utils.parametrizations.spectral_norm / weight_norm, which have no hooks)")
    for kind, hook in _global_hooks():
        raise ValueError(f"a global module {kind} ({_hook_name(hook)}, from torch.nn.modules.module."
                         f"register_module_{kind.replace(' ', '_').replace('-', '_')}) is registered and stage "
                         f"{stage} is recomputed: its forward runs twice per microbatch, so the hook would run "
                         f"twice on each of its layers; remove the global hook, or turn recompute off "
                         f"(recompute=False)")
    for name, sub in module.named_modules():
        for kind, hooks in (("forward pre-hook", sub._forward_pre_hooks), ("forward hook", sub._forward_hooks)):
            for hook in hooks.values():
                if name:
                    index, _, rest = name.partition(".")
                    where = f"layer {first_layer + int(index)} ({type(module[int(index)]).__name__})"
                    if rest:
                        where += f", submodule {rest} ({type(sub).__name__}),"
                    where += f" of stage {stage}"
                else:
                    where = f"the {type(module).__name__} of stage {stage}"
                raise ValueError(f"{where} has a {kind} ({_hook_name(hook)}) and stage {stage} is "
                                 f"recomputed: its forward runs twice per microbatch (F, then R before the backward), "
                                 f"so the hook would run twice and repeat whatever it counts or registers; {fix} "
                                 f"{note}")


def refuse_forward_hooks(stages: dict, recompute, first_layers) -> None:
    """:func:`check_no_forward_hooks` for each recomputed stage of ``stages`` ({stage: module}).

    Args:
        recompute: the recompute flag of every stage; ``first_layers``: per stage, the index of its first layer.
    Raises:
        ValueError: as :func:`check_no_forward_hooks`.
    """
    for stage, module in stages.items():
        if recompute[stage]:
            check_no_forward_hooks(module, stage, first_layers[stage], recompute)
