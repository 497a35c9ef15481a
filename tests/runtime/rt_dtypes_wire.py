"""Per-rank bodies of tests/runtime/test_dtypes_wire.py: stage outputs of dtypes gloo/NCCL cannot send (uint16/32/64,
float8, complex32, sub-byte and bits dtypes...) cross the boundary as bytes. Plain results, asserted in the parent.

Stage 0 outputs a tuple ``(h, used, bits, scalar)``: ``h`` float32; ``used`` a non-contiguous tensor of the dtype cast
from an activation (float dtypes: it requires grad, so its gradient, of the same dtype, comes back); ``bits`` a
non-contiguous tensor of the dtype holding the raw bytes of ``x`` (any bit pattern: NaNs, invalid codes), passed
through unused; ``scalar`` a 0-dim tensor of the dtype (an element of ``bits``). Stage 1 records what it received
(dtype, shape, the values as a same-size integer view) and uses ``used`` through a cast. Dtypes torch cannot cast
to (float4, bits, int1..uint7) have no ``used``: ``(h, bits, scalar)``.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline, PipelineError

from rt_cases import reference_forward, reference_step

#: dtypes cast to and used by stage 1 (float ones carry a gradient back), with the schedules each runs
USED = {"uint16": ("1f1b",), "uint32": ("1f1b",), "uint64": ("1f1b",),
        "float8_e4m3fn": ("1f1b", "zb-h1"), "float8_e5m2": ("1f1b", "zb-h1"),
        "float8_e4m3fnuz": ("1f1b",), "float8_e5m2fnuz": ("1f1b",), "float8_e8m0fnu": ("1f1b",),
        "complex32": ("1f1b",), "int16": ("1f1b",), "complex64": ("1f1b",)}
#: dtypes only passed through (torch has no cast to them)
PASSED = ("float4_e2m1fn_x2", "bits8", "bits16", "bits1x8", "int4", "uint4")
#: dtypes also run with stage 0 outputting ``used`` alone: one tensor of a dtype the backend cannot send (each way)
SINGLE = ("float8_e5m2", "uint32")
CASES = ([(dt, sched, "tuple") for dt, scheds in USED.items() for sched in scheds]
         + [(dt, "1f1b", "tuple") for dt in PASSED] + [(dt, "1f1b", "single") for dt in SINGLE])
STEPS = 2  # the first learns the metas (headers, the gradient mask), the second runs without
N, M = 7, 3  # samples, microbatches (3, 2, 2)
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as a same-size integer view, copied (torch.equal on it is a bitwise comparison)."""
    if t.element_size() == 16:  # complex128: no 16-byte integer
        return torch.view_as_real(t.detach()).view(torch.int64).clone()
    return t.detach().view(_INT[t.element_size()]).clone()


class Make(nn.Module):
    def __init__(self, dt: torch.dtype, used: bool, single: bool = False):
        super().__init__()
        self.dt, self.used, self.single = dt, used, single
        self.lin0, self.lin1 = nn.Linear(4, 8), nn.Linear(4, 8)

    def forward(self, x):
        h = self.lin0(x)
        bits = x.detach().contiguous().view(torch.uint8).view(self.dt).t()  # (16 / size, B), non-contiguous
        scalar = bits[-1, -1]  # 0-dim, with a storage offset
        if not self.used:
            return h, bits, scalar
        y = torch.tanh(self.lin1(x)) * 3
        if not (self.dt.is_floating_point or self.dt.is_complex):
            y = (y + 3) * 20  # non-negative: a defined cast to unsigned types
        used = y.to(self.dt)[:, ::2]  # (B, 4), non-contiguous
        if self.single:
            return used
        return h, used, bits, scalar


class Use(nn.Module):
    def __init__(self, used: bool, single: bool = False):
        super().__init__()
        self.used, self.single = used, single
        self.lin = nn.Linear(4, 2)
        self.seen = []  # per call: ((dtype, shape, bits_of(t)) per received tensor but h)

    def forward(self, inp):
        if self.single:
            self.seen.append(((inp.dtype, tuple(inp.shape), bits_of(inp)),))
            return self.lin(inp.float())
        h, *rest = inp
        self.seen.append(tuple((t.dtype, tuple(t.shape), bits_of(t)) for t in rest))
        out = h[:, :4] + h[:, 4:]
        if self.used:
            u = rest[0]
            out = out * (u.real if u.is_complex() else u).float()
        return self.lin(out)


def model(dt_name: str, kind: str = "tuple"):
    dt = getattr(torch, dt_name)
    torch.manual_seed(0)
    single = kind == "single"
    return nn.Sequential(Make(dt, dt_name in USED, single), Use(dt_name in USED, single))


def data(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, 4, generator=g), torch.randn(N, 2, generator=g)


def grads(pipe, net, ref) -> dict:
    """{name: "equal" / "none" (both None) / "differ"} for this rank's parameters against the unsplit model's."""
    mine, theirs = {id(p) for p in pipe.parameters()}, dict(ref.named_parameters())
    out = {}
    for name, p in net.named_parameters():
        if id(p) in mine:
            a, b = p.grad, theirs[name].grad
            out[name] = "none" if a is None and b is None else \
                "equal" if a is not None and b is not None and torch.equal(a, b) else "differ"
    return out


def one_case(rank: int, dt_name: str, schedule: str, kind: str) -> dict:
    """``STEPS`` steps and 2 forwards on one pipeline and on the unsplit model: per step the losses (returned, and the
    reference), this rank's grads bitwise; what stage 1 received (on rank 1) and what it saw unsplit; forward()."""
    net = model(dt_name, kind)
    ref = copy.deepcopy(net)
    pipe = Pipeline(net, schedule=schedule, num_microbatches=M, loss_fn=F.mse_loss, timeout=60)
    out = {"steps": [], "forwards": []}
    for k in range(STEPS):
        x, y = data(k)
        loss = pipe.step(x, target=y)
        ref_loss = reference_step(ref, x, y, M)
        out["steps"].append({"loss": loss, "ref": ref_loss, "grads": grads(pipe, net, ref)})
        for m in (net, ref):
            m.zero_grad(set_to_none=True)
    for k in range(2):
        x, _ = data(10 + k)
        got = pipe.forward(x)
        out["forwards"].append({"got": got, "ref": reference_forward(ref, x, M)})
    out["seen"] = net[1].seen if rank == 1 else None
    out["ref_seen"] = ref[1].seen
    pipe.close()
    return out


class Quantized(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 8)

    def forward(self, x):
        h = self.lin(x)
        return h, torch.quantize_per_tensor(h.detach(), 0.1, 0, torch.qint8)


def quantized(rank: int) -> str:
    """A stage output holding a quantized tensor: the error each rank gets at the first step."""
    torch.manual_seed(0)
    net = nn.Sequential(Quantized(), nn.Linear(8, 2))  # stage 1 would take a tuple: it never runs
    pipe = Pipeline(net, num_microbatches=2, loss_fn=F.mse_loss, timeout=60)
    x, y = data(0)
    try:
        pipe.step(x, target=y)
    except PipelineError as exc:
        return str(exc)
    return "no error"


def suite(rank: int) -> dict:
    torch.set_num_threads(1)
    results = {case: one_case(rank, *case) for case in CASES}
    results["quantized"] = quantized(rank)
    return results
