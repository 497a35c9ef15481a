"""Per-rank bodies of tests/runtime/test_tie_frozen.py (2 ranks): a weight tied across ranks (embedding = LM head)
whose copies' ``.grad`` differ in presence at the step's end (frozen at construction then unfrozen, frozen
throughout, one use not reached), against the unsplit model; and ``Pipeline.state_dict()`` of a rank whose only
parameter is a tied copy."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline
from pipesched.runtime.ties import digest

from rt_cases import reference_step

V, D, M = 16, 8, 4  # vocabulary, width, microbatches
BALANCE = [4, 2]  # rank 0: Embedding, Detach/Identity, Linear, Tanh; rank 1: Identity, Head (only the tie)
RTOL, ATOL = 1e-5, 1e-6  # tied sums: the same terms in another order than the unsplit model's


class Detach(nn.Module):
    def forward(self, x):
        return x.detach()


class DetachedHead(nn.Module):
    """An LM head that uses its weight without a gradient (``weight.detach()``): this use produces none."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(V, D))

    def forward(self, x):
        return F.linear(x, self.weight.detach())


def tie_model(kind: str) -> nn.Sequential:
    """Embedding(16, 8), X, Linear, Tanh, Identity, Head(8 -> 16) with Head.weight = Embedding.weight (names
    ``0.weight`` = ``5.weight``). ``kind`` "detach_emb": X detaches (the embedding's use gets no gradient);
    "detach_head": the head uses the weight detached; "detach_both": both (trainable, but no use produces a
    gradient); otherwise X is an Identity."""
    torch.manual_seed(0)
    emb = nn.Embedding(V, D)
    head = DetachedHead() if kind in ("detach_head", "detach_both") else nn.Linear(D, V, bias=False)
    head.weight = emb.weight
    first = Detach() if kind in ("detach_emb", "detach_both") else nn.Identity()
    return nn.Sequential(emb, first, nn.Linear(D, D), nn.Tanh(), nn.Identity(), head)


def ce(out, y):
    return F.cross_entropy(out.reshape(-1, V), y.reshape(-1))


def compare(mine, ref) -> tuple[bool, bool, bool]:
    """(this copy's .grad is None, the unsplit model's is None, equal to it within RTOL/ATOL or both None)."""
    if mine is None or ref is None:
        return mine is None, ref is None, mine is None and ref is None
    return False, False, torch.allclose(mine, ref, rtol=RTOL, atol=ATOL)


def tie_case(rank, kind, steps=3, **options):
    """AdamW (weight decay 0.5) for ``steps`` steps on the pipeline and the unsplit model. "unfreeze": the tie is
    frozen at construction and for step 1, unfrozen from step 2; "frozen": frozen throughout."""
    model = tie_model(kind)
    if kind in ("unfreeze", "frozen"):
        model[0].weight.requires_grad_(False)
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=M, loss_fn=ce, balance=BALANCE, **options)
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.1, weight_decay=0.5)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.5)
    mine = model[0].weight if rank == 0 else model[5].weight  # this rank's copy
    g = torch.Generator().manual_seed(7)
    out = {"steps": [], "grad_digests": []}
    for step in range(steps):
        if kind == "unfreeze" and step == 1:
            model[0].weight.requires_grad_(True)
            ref[0].weight.requires_grad_(True)
        x, y = torch.randint(0, V, (8, 3), generator=g), torch.randint(0, V, (8, 3), generator=g)
        pipe.step(x, target=y)
        reference_step(ref, x, y, M, ce)
        out["steps"].append(compare(mine.grad, ref[0].weight.grad))
        out["grad_digests"].append(None if mine.grad is None else digest(mine.grad))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    out["weight_digest"] = digest(mine)
    out["weight_close"] = torch.allclose(mine, ref[0].weight, rtol=RTOL, atol=ATOL)
    out["weight_bitwise"] = torch.equal(mine, ref[0].weight)
    pipe.close()
    return out


def frozen_copies_differ(rank):
    """A frozen tie whose copy differs on rank 1 at construction: refused on every rank (its message)."""
    model = tie_model("plain")
    model[0].weight.requires_grad_(False)
    if rank == 1:
        with torch.no_grad():
            model[5].weight[3, 2] += 1.0
    try:
        Pipeline(model, schedule="1f1b", num_microbatches=M, loss_fn=ce, balance=BALANCE)
    except ValueError as exc:
        return str(exc)
    return "no error"


def state_case(rank):
    """state_dict() keys and storage, load of changed values, round trip, and the message for a missing entry."""
    model = tie_model("plain")
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=M, loss_fn=ce, balance=BALANCE)
    sd = pipe.state_dict()
    mine = model[0].weight if rank == 0 else model[5].weight
    out = {"keys": list(sd), "shares": "0.weight" in sd and sd["0.weight"].data_ptr() == mine.data_ptr()}
    changed = {name: t + 1.0 for name, t in sd.items()}
    try:  # values changed, then the round trip: both must load (the bug this guards: rank 1's dict was empty)
        pipe.load_state_dict(changed)
        out["loaded"] = all(torch.equal(pipe.state_dict()[n], t) for n, t in changed.items())
        out["round_trip"] = tuple(pipe.load_state_dict(pipe.state_dict()))
    except ValueError as exc:
        out["loaded"] = out["round_trip"] = str(exc)
    try:
        pipe.load_state_dict({"2.weight": torch.zeros(D, D), "2.bias": torch.zeros(D)})
        out["missing"] = "no error"
    except ValueError as exc:
        out["missing"] = str(exc)
    pipe.close()
    return out


KINDS = ("unfreeze", "frozen", "detach_head", "detach_emb", "detach_both")
OPTIONS = {"plain": {}, "split": {"split_backward": True}}


def suite(rank):
    torch.set_num_threads(1)
    results = {(kind, label): tie_case(rank, kind, **options) for kind in KINDS for label, options in OPTIONS.items()}
    results["state"] = state_case(rank)
    results["differ"] = frozen_copies_differ(rank)
    return results
