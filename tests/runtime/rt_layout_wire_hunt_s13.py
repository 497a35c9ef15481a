"""Per-rank bodies of tests/runtime/test_layout_wire_hunt_s13.py: a hunt for configurations where a stage output or
gradient crossing a rank boundary in its own dim order makes a Pipeline differ from the unsplit model run one
microbatch at a time. Each case builds a model with two :class:`~rt_layout_wire.Probe` layers at a rank boundary,
runs ``steps`` training steps (and optionally ``forward()`` twice) on a Pipeline and on the unsplit model, and
returns per step: the losses both ways, the names of this rank's parameters whose gradients are not bitwise equal,
the probe records both ways (strides of the activation and of the gradient reaching each probe)."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline

from rt_cases import reference_step
from rt_layout_wire import Probe


# ---- layers -----------------------------------------------------------------------------------------------------

class Perm(nn.Module):
    def __init__(self, *dims):
        super().__init__()
        self.dims = dims

    def forward(self, x):
        return x.permute(*self.dims)


class Fmt(nn.Module):
    """``x.contiguous(memory_format=fmt)`` (copies into that layout)."""

    def __init__(self, fmt):
        super().__init__()
        self.fmt = fmt

    def forward(self, x):
        return x.contiguous(memory_format=self.fmt)


class Tanh(nn.Module):
    def forward(self, x):
        return torch.tanh(x)


class Expand(nn.Module):
    """(B, 8) -> (B, 8): column 0 repeated (stride 0), a tensor with repeats."""

    def forward(self, x):
        return x[:, :1].expand(-1, 8)


class UseExpand(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x)


class MixFan(nn.Module):
    """(B, 12) -> a tuple mixing layouts and dtypes (bytes path): transposed float, 0-dim float that requires grad,
    an empty (0, B) float, a transposed complex64 that requires grad, a transposed int16, a transposed bool,
    a transposed float16 and a permuted bfloat16 (both require grad)."""

    def forward(self, x):
        b = x.shape[0]
        cplx = torch.complex(x, x * 0.5).t()
        return (x.t(), x.sum() * 0.1, x.new_zeros(0, b).t().t(), cplx, (x * 100).to(torch.int16).t(), (x > 0).t(),
                x.half().t(), x.bfloat16().reshape(b, 3, 4).permute(2, 0, 1))


class MixGather(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(12, 12)

    def forward(self, parts):
        t, s, empty, cplx, ints, mask, half, bf = parts
        h = t.t() * s + empty.sum() + cplx.t().real * cplx.t().imag + ints.t().float() / 100 * mask.t()
        h = h + half.t().float() + bf.permute(1, 2, 0).reshape(h.shape).float()
        return self.lin(h)


class EmptyFan(nn.Module):
    """(B, 12) -> (transposed, an empty (12, 0) transposed slice that requires grad, a 0-dim, a conj view of a
    transposed complex): all require grad."""

    def forward(self, x):
        return x.t(), x[:0].t(), x.sum() * 0.1, torch.complex(x, -x).t().conj()


class EmptyGather(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(12, 12)

    def forward(self, parts):
        t, e, s, c = parts
        return self.lin(t.t() * s + e.sum() + (c.t() * c.t()).real)


class Complex1(nn.Module):
    """A single transposed complex output (the bytes path for one tensor)."""

    def forward(self, x):
        return torch.complex(x, x * 0.5).t()


class UseComplex1(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(12, 12)

    def forward(self, c):
        return self.lin((c.t() * c.t().conj()).real + c.t().imag)


class GradToggle(nn.Module):
    """``x @ W.T + b`` computed so that the gradient reaching ``x`` is row-major on odd calls, column-major on even
    ones (a gradient layout that changes between microbatches and steps)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls % 2:
            return self.lin(x)
        return (self.lin.weight @ x.t()).t() + self.lin.bias


class Dup(nn.Module):
    """(B, 6) -> (y, y), the same transposed tensor twice."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        y = self.lin(x).t()
        return y, y


class UseDup(nn.Module):
    """A Linear over one (a row-major gradient), an elementwise product on the other (a transposed one)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, parts):
        a, b = parts
        return self.lin(a.t()) * torch.tanh(b).t()


class ViewOfParam(nn.Module):
    """(B, 6) -> (h, w.t()): a tuple whose second element is a view of a parameter (transposed)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.w = nn.Parameter(torch.randn(5, 6))

    def forward(self, x):
        return self.lin(x), self.w.t()


class UseViewOfParam(nn.Module):
    def forward(self, parts):
        h, wt = parts
        return torch.tanh(h @ wt)  # (B, 5)


class InputView(nn.Module):
    """Returns a transposed view of its input (the stage input when first in a stage)."""

    def forward(self, x):
        return x.transpose(-1, -2)


class HookInput(nn.Module):
    """Registers ``g * 2`` on its input (the stage input when first in a stage), then a Linear over a transposed
    3-D view: a gradient laid out otherwise than the input, changed by a user hook."""

    def __init__(self, inner=16, out=7, hook=True):
        super().__init__()
        self.lin, self.hook = nn.Linear(inner, out), hook

    def forward(self, x):
        if self.hook and x.requires_grad:
            x.register_hook(lambda g: g * 2)
        return self.lin(x.transpose(-1, -2))


class Toggle(nn.Module):
    """``x * 2``, laid out row-major or transposed-dense on alternate calls (a layout that changes between
    microbatches and between steps; the values do not)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x.t().contiguous().t() * 2 if self.calls % 2 else x * 2


class Pool1(nn.Module):
    def forward(self, x):
        return F.adaptive_avg_pool2d(x, 1)


class Up(nn.Module):
    def forward(self, x):
        return F.interpolate(x, scale_factor=4, mode="nearest")


class Unsqueezed(nn.Module):
    """(B, 16, 37) Linear(37, 1) then transpose: (B, 1, 16) with strides (16, 1, 1), contiguous but for its size-1
    dim's stride."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(37, 1)

    def forward(self, x):
        return self.lin(x).transpose(1, 2)


class SumIn(nn.Module):
    """Starts with a sum over the last dim: the gradient flowing to its input is an expand (stride 0)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(1, 4)

    def forward(self, x):
        return self.lin(x.sum(-1, keepdim=True))


class ManyOut(nn.Module):
    """(B, 8) -> a tuple of ``count`` 2-D tensors."""

    def __init__(self, count):
        super().__init__()
        self.count = count

    def forward(self, x):
        return tuple(x * (k + 1) for k in range(self.count))


class ManyIn(nn.Module):
    def forward(self, parts):
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        return total


# ---- models -----------------------------------------------------------------------------------------------------

def model(name):
    """(layers, balance per virtual layout {1: [..], 2: [..]}, input shape per row)."""
    torch.manual_seed(0)
    pp = [Probe(), Probe()]
    if name == "cl4":
        return ([nn.Conv2d(3, 8, 3, padding=1), Fmt(torch.channels_last), nn.ReLU(), *pp, nn.Conv2d(8, 8, 3, padding=1),
                 nn.ReLU(), nn.Conv2d(8, 2, 3), nn.Flatten()], [4, 5], (3, 6, 6))
    if name == "cl3d":
        return ([nn.Conv3d(2, 4, 3, padding=1), Fmt(torch.channels_last_3d), *pp, nn.Conv3d(4, 4, 3, padding=1),
                 nn.Conv3d(4, 2, 3), nn.Flatten()], [3, 4], (2, 4, 4, 4))
    if name == "perm3":  # (B,16,37) -> (B,16,53) -> (53,B,16) | -> (B,16,53) -> (B,16,7)
        return [nn.Linear(37, 53), Perm(2, 0, 1), *pp, Perm(1, 2, 0), nn.Linear(53, 7)], [3, 3], (16, 37)
    if name == "perm4":  # (B,3,4,5) -> (B,3,4,6) -> (6,3,B,4) | -> (B,3,4,6)
        return [nn.Linear(5, 6), Perm(3, 1, 0, 2), *pp, Perm(2, 1, 3, 0), nn.Linear(6, 3)], [3, 3], (3, 4, 5)
    if name == "expand":
        return [nn.Linear(8, 8), Expand(), *pp, UseExpand()], [3, 2], (8,)
    if name == "mix":
        return [nn.Linear(12, 12), MixFan(), *pp, MixGather()], [3, 2], (12,)
    if name == "param_view":
        return [ViewOfParam(), *pp, UseViewOfParam()], [2, 2], (6,)
    if name == "input_view":  # interleaved: stage 1 (rank 1) returns a view of its input, handed over / sent
        return ([nn.Linear(16, 9), Tanh(), Probe(), Probe(), InputView(), Probe(), Probe(), nn.Linear(16, 16), Tanh(),
                 nn.Linear(16, 5)], [3, 3, 2, 2], (16, 16))
    if name == "hook":  # (B,16,37) -> (B,16,53) transposed (B,53,16) | hook x2, Linear over x.T
        return [nn.Linear(37, 53), Perm(0, 2, 1), *pp, HookInput(53, 7)], [3, 2], (16, 37)
    if name in ("chain4", "chain4_hook"):  # 4 stages, every boundary a permuted 3-D tensor
        return ([nn.Linear(37, 53), Perm(0, 2, 1), Probe(), Probe(), HookInput(53, 20, name == "chain4_hook"),
                 Perm(2, 0, 1), Probe(), Probe(), Perm(1, 2, 0), nn.Linear(20, 12), Perm(0, 2, 1), Probe(), Probe(),
                 nn.Linear(16, 5)], [3, 4, 5, 2], (16, 37))
    if name == "cl4_chain4":  # 4 stages: channels_last, then channels_last_3d-free 4-D boundaries
        return ([nn.Conv2d(3, 6, 3, padding=1), Fmt(torch.channels_last), Probe(), Probe(), nn.Conv2d(6, 6, 3, padding=1),
                 nn.ReLU(), Probe(), Probe(), nn.Conv2d(6, 4, 3, padding=1), Perm(0, 2, 3, 1), Probe(), Probe(),
                 Perm(0, 3, 1, 2), nn.Conv2d(4, 2, 3), nn.Flatten()], [3, 5, 4, 3], (3, 5, 5))
    if name == "empty":
        return [nn.Linear(12, 12), EmptyFan(), *pp, EmptyGather()], [3, 2], (12,)
    if name == "complex1":
        return [nn.Linear(12, 12), Complex1(), *pp, UseComplex1()], [3, 2], (12,)
    if name == "grad_toggle":
        return [nn.Linear(6, 6), *pp, GradToggle(), nn.Tanh()], [2, 3], (6,)
    if name == "dup":
        return [nn.Linear(6, 6), Dup(), *pp, UseDup()], [3, 2], (6,)
    if name == "inplace_cl":  # the receiving stage starts with ReLU(inplace=True): it runs on a clone of its input
        return ([nn.Conv2d(3, 8, 3, padding=1), Fmt(torch.channels_last), Probe(), nn.ReLU(inplace=True), Probe(),
                 nn.Conv2d(8, 2, 3), nn.Flatten()], [3, 4], (3, 6, 6))
    if name == "toggle":
        return [nn.Linear(6, 6), Toggle(), *pp, nn.Tanh(), nn.Linear(6, 6)], [3, 3], (6,)
    if name == "pool":  # channels_last (B, 8, 1, 1): contiguous, but its size-1 dims' strides are channels_last's
        return ([nn.Conv2d(3, 8, 3, padding=1), Fmt(torch.channels_last), Pool1(), *pp, nn.Conv2d(8, 8, 1), Up(),
                 nn.Conv2d(8, 2, 3), nn.Flatten()], [4, 5], (3, 6, 6))
    if name == "unsqueezed":
        return [Unsqueezed(), *pp, nn.Linear(16, 4)], [2, 2], (16, 37)
    if name == "sum_in":
        return [nn.Linear(8, 8), *pp, SumIn()], [2, 2], (8,)
    if name.startswith("many"):
        return [nn.Linear(8, 8), ManyOut(int(name[4:])), *pp, ManyIn()], [3, 2], (8,)
    raise ValueError(name)


# ---- one case ---------------------------------------------------------------------------------------------------

def _records(layers, keep):
    return {i: sorted(set(layer.seen)) for i, layer in enumerate(layers) if isinstance(layer, Probe) and i in keep}


def _clear(layers):
    for layer in layers:
        if isinstance(layer, Probe):
            layer.seen.clear()


def _local_probes(layers, pipe):
    return {i for i, layer in enumerate(layers) if isinstance(layer, Probe) and any(
        layer is m for stage in pipe.stages.values() for m in stage.modules())}


def _out(y):
    return y[0] if isinstance(y, tuple) else y


def run_case(rank, name, schedule="1f1b", recompute=False, n=10, nmb=4, steps=2, forward=False, autocast=None,
             dp=1, balance=None):
    """Per step: {"loss": (pipe, ref) as floats, "eq": loss bitwise, "unequal": names of this rank's parameters
    whose gradient differs (or is None on one side only), "worst": largest |difference| / largest |unsplit value| of
    a gradient, "probes": (ours, ref) for the probes on this rank}; "forward": per forward() call (learning, then
    learned), (output bitwise equal, None on a rank without the last stage; probes both ways)."""
    layers, bal, shape = model(name)
    v = 2 if schedule in ("zbv", "interleaved-1f1b") else None
    if balance is not None:
        bal = balance
    elif v and len(bal) == 2:
        raise ValueError(f"{name}: needs a 4-stage balance for {schedule}")
    seq = nn.Sequential(*layers)
    ref = copy.deepcopy(seq)
    pipe = Pipeline(seq, schedule=schedule, virtual_stages=v, num_microbatches=nmb, loss_fn=F.mse_loss,
                    balance=bal, recompute=recompute, dp_size=dp, autocast=autocast, timeout=60.0)
    local = _local_probes(list(seq), pipe)
    mine = {id(p) for p in pipe.parameters()}
    out = {"steps": [], "forward": []}
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        xs = [torch.randn(n, *shape, generator=g) for _ in range(dp)]
        with torch.no_grad():
            probe_model = copy.deepcopy(ref)
            _clear(probe_model)
            ys = [torch.randn(_out(probe_model(x)).shape, generator=g) for x in xs]
        for p in (*seq.parameters(), *ref.parameters()):
            p.grad = None
        _clear(seq)
        _clear(ref)
        me = pipe.grid.dp_rank if dp > 1 else 0
        loss = pipe.step(xs[me], ys[me])
        ours = _records(list(seq), local)
        ctx = torch.autocast("cpu", autocast) if autocast else _null()
        if dp == 1:
            with ctx:
                ref_loss = reference_step(ref, xs[0], ys[0], nmb)
            refrec = _records(list(ref), local)
            named = dict(ref.named_parameters())
            want = {k: named[k].grad for k in named}
        else:  # each replica's unsplit steps, then the all-reduce's average: (a + b) / 2, exact for two replicas
            grads = []
            for x, y in zip(xs, ys):
                r = copy.deepcopy(ref)
                with ctx:
                    l = reference_step(r, x, y, nmb)
                grads.append({k: p.grad for k, p in r.named_parameters()})
                if x is xs[me]:
                    ref_loss, refrec = l, _records(list(r), local)
            want = {k: (None if grads[0][k] is None else (grads[0][k] + grads[1][k]) / 2) for k in grads[0]}
        unequal = [k for k, p in seq.named_parameters() if id(p) in mine and not (
            (p.grad is None and want[k] is None) or (p.grad is not None and want[k] is not None
                                                     and torch.equal(p.grad, want[k])))]
        worst = max((float((p.grad - want[k]).abs().max() / want[k].abs().max().clamp_min(1e-30))
                     for k, p in seq.named_parameters() if id(p) in mine and p.grad is not None
                     and want[k] is not None), default=0.0)
        out["steps"].append({"loss": (float(loss), float(ref_loss)), "eq": bool(torch.equal(loss, ref_loss)),
                             "unequal": unequal, "worst": worst, "probes": (ours, refrec)})
    if forward:
        g = torch.Generator().manual_seed(7)
        x = torch.randn(n, *shape, generator=g)
        for _ in range(2):
            _clear(seq)
            _clear(ref)
            got = pipe.forward(x)
            ctx = torch.autocast("cpu", autocast) if autocast else _null()
            with torch.no_grad(), ctx:
                want = torch.cat([_out(ref(xm)) for xm in x.split(_sizes(n, nmb))])
            same = None if got is None else bool(torch.equal(torch.cat([_out(o) for o in got]) if isinstance(
                got, (list, tuple)) else _out(got), want))
            out["forward"].append((same, (_records(list(seq), local), _records(list(ref), local))))
    return out


def _sizes(n, nmb):
    base, extra = divmod(n, nmb)
    return [base + 1 if i < extra else base for i in range(nmb)]


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def safe(rank, *args, **kw):
    """:func:`run_case`, or ``{"error": text}`` if it raised (every rank raises: the Pipeline reports a failure to
    all of them), so one failing case does not end the suite."""
    try:
        return run_case(rank, *args, **kw)
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"}


#: name -> (model, options of run_case), on 2 ranks. n=5 over 4 microbatches: sizes 2, 1, 1, 1 (a batch of 1 in
#: the uneven last microbatches, so microbatches of two shapes); n=8: 2 rows each
TWO = {
    "cl4": ("cl4", dict(n=8, forward=True)),
    "cl4_b1_zbh2": ("cl4", dict(n=5, schedule="zb-h2")),
    "cl3d": ("cl3d", dict(n=5, forward=True)),
    "perm3_zbh2_rc": ("perm3", dict(n=8, schedule="zb-h2", recompute=True)),
    "perm3_b1_gpipe": ("perm3", dict(n=5, schedule="gpipe", forward=True)),
    "perm4_zbh1": ("perm4", dict(n=5, schedule="zb-h1")),
    "chain4_interleaved_rc": ("chain4", dict(n=8, schedule="interleaved-1f1b", recompute=True, steps=3,
                                             forward=True)),
    "chain4_zbv": ("chain4", dict(n=5, schedule="zbv")),
    "hook4_interleaved": ("chain4_hook", dict(n=8, schedule="interleaved-1f1b")),
    "hook4_zbv": ("chain4_hook", dict(n=5, schedule="zbv")),
    "hook_zbh1": ("hook", dict(n=5, schedule="zb-h1")),
    "mix_zbh1": ("mix", dict(n=8, schedule="zb-h1", steps=3, forward=True)),
    "empty_gpipe_rc": ("empty", dict(n=8, schedule="gpipe", recompute=True, forward=True)),
    "complex1": ("complex1", dict(n=8)),
    "param_view_zbh2_rc": ("param_view", dict(n=5, schedule="zb-h2", recompute=True)),
    "input_view_interleaved": ("input_view", dict(n=8, schedule="interleaved-1f1b", forward=True)),
    "input_view_zbv_rc": ("input_view", dict(n=8, schedule="zbv", recompute=True)),
    "dup": ("dup", dict(n=8)),
    "inplace_cl_zbh1_rc": ("inplace_cl", dict(n=5, schedule="zb-h1", recompute=True)),
    "grad_toggle": ("grad_toggle", dict(n=6, nmb=3, steps=3)),
    "toggle": ("toggle", dict(n=6, nmb=3, steps=3)),
    "expand": ("expand", dict(n=8)),
    "sum_in": ("sum_in", dict(n=8, schedule="zb-h1")),
    "perm3_bf16": ("perm3", dict(n=5, autocast=torch.bfloat16, forward=True)),
    "cl4_bf16_rc": ("cl4", dict(n=5, autocast=torch.bfloat16, recompute=True)),
    # found here (see the test file): size-1 dims' strides, recompute + a hook on the input, the header's size
    "pool": ("pool", dict(n=8)),
    "mix_b1": ("mix", dict(n=5, steps=1)),
    "input_view_b1": ("input_view", dict(n=5, schedule="interleaved-1f1b", steps=1)),
    "hook_rc": ("hook", dict(n=5, recompute=True, steps=1)),
    "many30": ("many30", dict(n=4, steps=1)),
    "many40": ("many40", dict(n=4, steps=1)),  # last: it fails at the first send
}

#: on 4 ranks, 2 pipeline ranks x dp_size=2: each replica steps on its own batch; gradients must be the average of
#: the replicas' unsplit gradients, (a + b) / 2, bitwise
FOUR = {
    "dp_perm3": ("perm3", dict(n=5, dp=2)),
    "dp_cl4_zbh1": ("cl4", dict(n=5, dp=2, schedule="zb-h1")),
    "dp_hook": ("hook", dict(n=8, dp=2)),
    "dp_mix_zbh1": ("mix", dict(n=8, dp=2, schedule="zb-h1")),
    "dp_perm3_gpipe_rc": ("perm3", dict(n=8, dp=2, schedule="gpipe", recompute=True, forward=True)),
}


def suite(rank, cases):
    torch.set_num_threads(1)
    return {key: safe(rank, name, **options) for key, (name, options) in cases.items()}


def two_rank_suite(rank):
    return suite(rank, TWO)


def four_rank_suite(rank):
    return suite(rank, FOUR)
