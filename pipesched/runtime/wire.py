"""Point-to-point messages of a step, as they cross the wire between two ranks.

A message is a tensor or a tuple of tensors. A tuple travels as one packed ``uint8`` buffer (each part
16-byte aligned); a single tensor travels as itself, unless gloo or NCCL cannot send its dtype (int16, uint16/32/64,
complex, float8, ...: everything but :data:`NATIVE_DTYPES`): then as bytes too, and the receiver views them back
as the dtype the meta names. Every dtype torch can hold (:data:`DTYPES`) travels; only quantized tensors (their
scale and zero point are not in their bytes) are refused, before any message. Activation messages have a *meta*
(per tensor: shape, dtype, requires_grad and dim order, plus whether it was a tuple); while a rank is learning the
metas of a new input signature it sends a fixed-size ``int64`` header before each activation, afterwards none.
Gradient messages never need a header: their shapes are those of the activations they answer (their dim orders
travel in the learning step's gradient message, see below).

Layout (:mod:`pipesched.runtime.layout`): a tensor crosses the wire in its own memory layout, so the next stage's
input, and the gradient sent back, have the strides the unsplit model's tensor has there: a dense one (transposed,
``channels_last``) as the free view of its dims in memory order, viewed back; one with gaps (a slice) row-major,
copied into a region with its strides; one with repeats (an ``expand``) arrives dense. A gradient keeps its own dim
order (not necessarily its activation's: a ``Linear`` over a transposed input gives a row-major one): the learning
message carries each gradient's, later ones are sent in it.
Every message of a step has its own tag (kind, stage, microbatch), so a receive matches exactly one send
whatever order the receives are posted in; with gloo a send completes only once its receive is posted.
"""
from __future__ import annotations

import torch

from .layout import Gapped, activation_layout

#: the dtypes that may cross a stage boundary, by wire code (a fixed list of names, so the codes are the same on
#: every rank; a name this torch lacks keeps its code, as ``None``). Every dtype torch 2.x can hold except the
#: quantized ones; the ones gloo/NCCL cannot send (all but :data:`NATIVE_DTYPES`) travel as their bytes.
DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
               "complex64", "complex128",
               "uint16", "uint32", "uint64", "complex32",
               "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
               "float4_e2m1fn_x2",
               "bits1x8", "bits2x4", "bits4x2", "bits8", "bits16",
               "int1", "int2", "int3", "int4", "int5", "int6", "int7",
               "uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7")
DTYPES = tuple(getattr(torch, name, None) for name in DTYPE_NAMES)
DTYPE_CODE = {dt: i for i, dt in enumerate(DTYPES) if dt is not None}


def unsendable(dtype) -> str | None:
    """Why a tensor of ``dtype`` cannot cross a stage boundary, in words; ``None`` when it can."""
    if dtype in DTYPE_CODE:
        return None
    if dtype in (torch.quint8, torch.qint8, torch.qint32, torch.quint4x2, getattr(torch, "quint2x4", None)):
        return (f"a quantized tensor (dtype {dtype}) cannot cross a stage boundary: its scale and zero point are "
                f"not in its bytes; dequantize() it first, or pass its int_repr() and its quantization parameters "
                f"as tensors")
    return (f"a tensor of dtype {dtype} cannot cross a stage boundary: pipesched does not know this dtype "
            f"(every other dtype travels: {', '.join(n for n, d in zip(DTYPE_NAMES, DTYPES) if d is not None)})")
HEADER_LEN = 512  # int64 words of a meta header: 3 + 2 * ndim per tensor (dtype, requires_grad, ndim, shape, layout)
_GAPPED = 1 << 16  # set in a tensor's ndim word: its layout words are strides and an offset (Gapped), not a dim order
_ALIGN = 16

# tags: 0..15 control, then 4 per (stage, microbatch): act header, act payload, grad payload
TAG_LOSS = 2  # (the step's opening, with the verdict on the target, is an all-gather, see handshake.py)
_KIND = {"act_header": 0, "act": 1, "grad": 2}


def tag_of(kind: str, stage: int, microbatch: int, num_stages: int) -> int:
    """The message tag of ``kind`` for (stage, microbatch): unique per message within a step."""
    return 16 + ((microbatch * num_stages + stage) * 4 + _KIND[kind])


# ---- metas -----------------------------------------------------------------------------------------

Meta = tuple  # (container, ((shape, dtype, requires_grad), ...), (layout, ...), (shares, ...))


def meta_of(tensors, container: int) -> Meta:
    """The meta of a message: ``(container, ((shape, dtype, requires_grad), ...), (layout, ...), (shares, ...))``,
    each layout a dim order or a :class:`~pipesched.runtime.layout.Gapped`
    (:func:`~pipesched.runtime.layout.activation_layout`), each ``shares`` the index of the first earlier tensor of
    the message whose memory it shares (the same tensor twice, or a view of it; :func:`shared_memory`), else -1."""
    return (container, tuple((tuple(t.shape), t.dtype, bool(t.requires_grad)) for t in tensors),
            tuple(activation_layout(t) for t in tensors), shared_memory(tensors))


def shared_memory(tensors) -> tuple[int, ...]:
    """For each tensor, the index of the first earlier one on the same storage, else -1 (an empty tensor shares
    nothing). They arrive on another rank as separate copies, so the receiving stage must not write to them in
    place (the executor checks: a write that the unsplit model would see through both names)."""
    first: dict = {}
    shares = []
    for k, t in enumerate(tensors):
        ptr = t.untyped_storage().data_ptr() if t.numel() else 0
        shares.append(first.setdefault(ptr, k) if ptr else -1)
    return tuple(-1 if j == k else j for k, j in enumerate(shares))


def grad_specs(meta) -> list:
    """(shape, dtype) of the gradients a message of ``meta`` gets back: one per tensor that requires grad."""
    return [(shape, dtype) for shape, dtype, requires_grad in meta[1] if requires_grad]


def describe_change(what: str, now: Meta, before: Meta) -> str:
    """What differs between two metas of one message, in words: ``"{what} was a tensor, is now a tuple"``,
    ``"element 0 of {what}: requires_grad False -> True"``... (empty if they are equal)."""
    kinds = ("a tensor", "a tuple", "a list")
    if now[0] != before[0]:
        return f"{what} was {kinds[before[0]]}, is now {kinds[now[0]]}"
    if len(now[1]) != len(before[1]):
        return f"{what} had {len(before[1])} tensors, has {len(now[1])} now"
    changes = []
    for k, (new, old) in enumerate(zip(now[1], before[1])):
        for name, a, b in zip(("shape", "dtype", "requires_grad"), old, new):
            if a != b:
                changes.append(f"element {k} of {what}: {name} {a} -> {b}")
    for k, (new, old) in enumerate(zip(now[3], before[3])):
        if new != old:
            changes.append(f"element {k} of {what}: shares memory with {_sharer(old)} -> {_sharer(new)}")
    return "; ".join(changes)


def _sharer(index: int) -> str:
    return "no other element" if index < 0 else f"element {index}"


def encode_meta(meta: Meta) -> torch.Tensor:
    """``meta`` as an ``int64`` tensor of :data:`HEADER_LEN` words.

    Raises:
        ValueError: a dtype that cannot be sent, or a message too large to describe (too many tensors/dims).
    """
    container, parts, layouts, shares = meta
    words = [int(container), len(parts)]
    for (shape, dtype, requires_grad), layout, share in zip(parts, layouts, shares):
        if dtype not in DTYPE_CODE:
            raise ValueError(unsendable(dtype))
        gapped = isinstance(layout, Gapped)
        flags = int(requires_grad) | (share + 1) << 1  # bit 0: requires_grad; above: 1 + the shared element, or 0
        words += [DTYPE_CODE[dtype], flags, len(shape) | (_GAPPED if gapped else 0), *shape,
                  *((*layout.strides, layout.offset) if gapped else layout)]
    if len(words) > HEADER_LEN:
        raise ValueError(f"a stage output with {len(parts)} tensors is too large to describe "
                         f"({len(words)} > {HEADER_LEN} header words)")
    return torch.tensor(words + [0] * (HEADER_LEN - len(words)), dtype=torch.int64)


def decode_meta(header: torch.Tensor) -> Meta:
    """Inverse of :func:`encode_meta`."""
    words = header.tolist()
    container, count, pos, parts, layouts, shares = words[0], words[1], 2, [], [], []
    for _ in range(count):
        code, requires_grad, ndim = words[pos:pos + 3]
        requires_grad, share = requires_grad & 1, (requires_grad >> 1) - 1
        gapped, ndim = bool(ndim & _GAPPED), ndim & ~_GAPPED
        shape = tuple(words[pos + 3:pos + 3 + ndim])
        layout = tuple(words[pos + 3 + ndim:pos + 3 + 2 * ndim])
        layouts.append(Gapped(layout, words[pos + 3 + 2 * ndim]) if gapped else layout)
        if not 0 <= code < len(DTYPES) or DTYPES[code] is None:
            name = DTYPE_NAMES[code] if 0 <= code < len(DTYPE_NAMES) else f"code {code}"
            raise ValueError(f"a peer sent a tensor of dtype {name}, which this torch ({torch.__version__}) lacks: "
                             f"run the same torch version on every rank")
        parts.append((shape, DTYPES[code], bool(requires_grad)))
        shares.append(share)
        pos += 3 + 2 * ndim + gapped
    return (container, tuple(parts), tuple(layouts), tuple(shares))


# ---- packing ---------------------------------------------------------------------------------------

def _nbytes(shape, dtype) -> int:
    count = 1
    for d in shape:
        count *= d
    return count * (torch.empty((), dtype=dtype).element_size())


def _offsets(specs) -> tuple[list[int], int]:
    offsets, total = [], 0
    for shape, dtype in specs:
        offsets.append(total)
        total += -(-_nbytes(shape, dtype) // _ALIGN) * _ALIGN
    return offsets, total


#: dtypes every backend sends as themselves (NCCL has no int16 or complex): others travel as bytes
NATIVE_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                           torch.int8, torch.uint8, torch.bool})


def _as_itself(specs) -> bool:
    return len(specs) == 1 and specs[0][1] in NATIVE_DTYPES


#: an integer dtype of each element size: a same-size view of any tensor (any strides, 0-dim too) that torch copies
SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s values, in row-major order: a flat contiguous ``uint8`` tensor. A conjugate or negative
    view is resolved first (its storage does not hold its values); a non-contiguous tensor is copied as a
    same-size integer view, since torch has no copy for some dtypes (float8 on some builds, int1..uint7)."""
    t = t.detach().resolve_conj().resolve_neg()
    size = t.element_size()
    if size in SAME_SIZE_INT and t.dtype != SAME_SIZE_INT[size]:
        t = t.view(SAME_SIZE_INT[size])
    return t.contiguous().reshape(-1).view(torch.uint8)  # reshape first: a 0-dim tensor cannot change element size


def pack(tensors) -> torch.Tensor:
    """One tensor of a native dtype (:data:`NATIVE_DTYPES`): itself (contiguous). Otherwise (several tensors,
    or one tensor of another dtype: int16, uint16/32/64, complex, float8...): one ``uint8`` buffer holding the bytes
    of each, 16-byte aligned."""
    if _as_itself([(t.shape, t.dtype) for t in tensors]):
        return tensors[0].detach().resolve_neg().contiguous()  # a real tensor can be a negative view (x.conj().imag)
    offsets, total = _offsets([(t.shape, t.dtype) for t in tensors])
    buf = torch.empty(total, dtype=torch.uint8, device=tensors[0].device)
    for t, off in zip(tensors, offsets):
        flat = as_bytes(t)  # (nbytes,)
        buf[off:off + flat.numel()].copy_(flat)
    return buf


def empty_for(specs, device) -> torch.Tensor:
    """The receive buffer for a message of ``specs`` ((shape, dtype) per tensor), see :func:`pack`."""
    if _as_itself(specs):
        shape, dtype = specs[0]
        return torch.empty(shape, dtype=dtype, device=device)
    _, total = _offsets(specs)
    return torch.empty(total, dtype=torch.uint8, device=device)


def unpack(buf: torch.Tensor, specs) -> tuple[torch.Tensor, ...]:
    """Inverse of :func:`pack`: views into ``buf``, one per (shape, dtype)."""
    if _as_itself(specs):
        return (buf,)
    offsets, _ = _offsets(specs)
    out = []
    for (shape, dtype), off in zip(specs, offsets):
        n = _nbytes(shape, dtype)
        out.append(buf[off:off + n].view(dtype).view(shape))
    return tuple(out)
