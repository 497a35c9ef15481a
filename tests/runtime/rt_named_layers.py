"""Per-rank bodies of tests/runtime/test_named_layers.py: an ``nn.Sequential(OrderedDict(...))`` whose layers have
names ("embed", "block0", "norm", "block1", "head"), its embedding tied to its head, a BatchNorm's buffers on
rank 0. Each body returns plain values (tensors cloned) for the test to compare."""
from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline, load_checkpoint, save_checkpoint


def model(seed: int, shared_norm: bool = False) -> nn.Sequential:
    """5 layers; 2 ranks cut them 3 + 2: rank 0 embed, block0, norm; rank 1 block1, head (head.weight = embed's).
    ``shared_norm``: one BatchNorm object at "norm" and "block1" instead (its uses on two ranks: refused)."""
    torch.manual_seed(seed)
    norm = nn.BatchNorm1d(8)
    m = nn.Sequential(OrderedDict(
        embed=nn.Embedding(16, 8),
        block0=nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
        norm=norm,
        block1=norm if shared_norm else nn.Linear(8, 8),
        head=nn.Linear(8, 16),
    ))
    m.head.weight = m.embed.weight  # tied across the two ranks
    return m


def batch():
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, 16, (8,), generator=g), torch.randint(0, 16, (8,), generator=g)


def _pipe(m) -> Pipeline:
    return Pipeline(m, num_microbatches=2, loss_fn=F.cross_entropy, timeout=60)


def _error(fn) -> str | None:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return None


def _values(pipe) -> dict:
    return {k: v.detach().clone() for k, v in pipe.state_dict().items()}


def names_and_loads(rank: int) -> dict:
    """The names this rank uses (state_dict, ties, layer_names), the unsplit model's state dict loaded strict and
    not, and the errors a state dict with a missing and with a foreign name give."""
    out: dict = {"refused": _error(lambda: _pipe(model(0, shared_norm=True)))}  # before any communication
    reference = model(0).state_dict()
    pipe = _pipe(model(1))
    out["layer_names"] = pipe.layer_names
    out["keys"] = list(pipe.state_dict())
    out["ties"] = [t.names for t in pipe.ties]
    out["initial"] = _values(pipe)
    result = pipe.load_state_dict(reference)
    out["strict"] = (list(result.missing_keys), list(result.unexpected_keys), _values(pipe))
    other = model(2).state_dict()
    result = pipe.load_state_dict(other, strict=False)
    out["loose"] = (list(result.missing_keys), list(result.unexpected_keys), _values(pipe))
    missing = {k: v for k, v in reference.items() if k != "embed.weight"}
    out["missing"] = _error(lambda: pipe.load_state_dict(missing))
    out["foreign"] = _error(lambda: pipe.load_state_dict({**reference, "0.weight": reference["embed.weight"]}))
    pipe.close()
    return out


def checkpoint(rank: int, path: str) -> dict:
    """Train a step, save (model and SGD momentum), then load into a Pipeline of another initialisation."""
    pipe = _pipe(model(0))
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    x, y = batch()
    pipe.step(x, target=y)
    opt.step()
    opt.zero_grad()
    save_checkpoint(path, pipe, opt, step=1)
    saved = _values(pipe)
    momenta = [opt.state[p]["momentum_buffer"].clone() for p in pipe.parameters()]
    pipe.close()
    pipe = _pipe(model(1))
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    info = load_checkpoint(path, pipe, opt)
    loaded_momenta = [opt.state[p]["momentum_buffer"].clone() for p in pipe.parameters()]
    same_momenta = len(momenta) == len(loaded_momenta) and all(map(torch.equal, momenta, loaded_momenta))
    out = {"step": info.step, "saved": saved, "loaded": _values(pipe), "momenta": same_momenta}
    pipe.close()
    return out
