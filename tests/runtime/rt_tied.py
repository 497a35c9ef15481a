"""Per-rank bodies of tests/runtime/test_tied.py and test_tied_dp.py: parameters tied across pipeline ranks (a
token embedding tied to the LM head, and one Linear weight used by three layers), against the unsplit model."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline
from pipesched.runtime.ties import digest
from pipesched.viz.compare import predict_for

from rt_cases import reference_step

V, D, M = 16, 8, 4  # vocabulary, width, microbatches
#: the tolerance for tied gradients and the weights they update (float32): the unsplit model adds the two uses per
#: microbatch, the pipeline sums each use over the microbatches, then the uses: the same terms in another order
RTOL, ATOL = 1e-5, 1e-6


def tied_model(seed: int = 0) -> nn.Sequential:
    """Embedding(16, 8), La, Tanh, Lb, Tanh, Lc, Head(8 -> 16): Head.weight is Embedding.weight, and La, Lb, Lc share
    one weight (their biases are their own). Names in the unsplit model: 0.weight = 6.weight, 1.weight = 3.weight =
    5.weight."""
    torch.manual_seed(seed)
    emb, la, lb, lc = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
    head = nn.Linear(D, V, bias=False)
    head.weight = emb.weight
    lb.weight = la.weight
    lc.weight = la.weight
    return nn.Sequential(emb, la, nn.Tanh(), lb, nn.Tanh(), lc, head)


def ce(out, y):
    return F.cross_entropy(out.reshape(-1, V), y.reshape(-1))


def batches(steps: int, replicas: int = 1, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randint(0, V, (8, 3), generator=g), torch.randint(0, V, (8, 3), generator=g))
             for _ in range(replicas)] for _ in range(steps)]


def _reference_grads(ref, replicas):
    """The unsplit model's gradients averaged over the replicas' batches (data parallelism), left in ``.grad``."""
    total = {}
    for x, y in replicas:
        ref.zero_grad(set_to_none=True)
        reference_step(ref, x, y, M, ce)
        for name, p in ref.named_parameters():
            total[name] = p.grad.clone() if name not in total else total[name] + p.grad
    for name, p in ref.named_parameters():
        p.grad = total[name] / len(replicas) if len(replicas) > 1 else total[name]


def _names(model, pipe):
    mine = {id(p) for p in pipe.parameters()}
    return {n: p for n, p in model.named_parameters() if id(p) in mine}  # tied: listed once, under the first name


def tied_case(rank, schedule, v, balance, optim, dp=1, steps=3, **options):
    """``steps`` steps with ``optim``; per step: tied grads close to the unsplit model's, untied bitwise (dp=1), and
    the digests of this rank's copies after the optimizer step; at the end: weights close to the unsplit model's."""
    model = tied_model()
    ref = copy.deepcopy(model)  # keeps the ties
    pipe = Pipeline(model, schedule=schedule, num_microbatches=M, loss_fn=ce, virtual_stages=v, balance=balance,
                    dp_size=dp, **options)
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.5),
            "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1)}[optim]
    opt, ref_opt = make(pipe.parameters()), make(ref.parameters())
    mine, refs = _names(model, pipe), dict(ref.named_parameters())
    tied = {t.names[0] for t in pipe.ties}
    out = {"steps": []}
    for replicas in batches(steps, dp):
        x, y = replicas[pipe.grid.dp_rank]
        loss = pipe.step(x, target=y)
        _reference_grads(ref, replicas)
        close = all(torch.allclose(p.grad, refs[n].grad, rtol=RTOL, atol=ATOL) for n, p in mine.items())
        exact = all(torch.equal(p.grad, refs[n].grad) for n, p in mine.items() if n not in tied)
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        out["steps"].append({"close": close, "untied_exact": exact, "loss": float(loss),
                             "copies": {n: digest(p) for n, p in mine.items() if n in tied}})
    out["weights_close"] = all(torch.allclose(p, refs[n], rtol=RTOL, atol=ATOL) for n, p in mine.items())
    out["ties"] = [tuple(t) for t in pipe.ties]
    out["counted"] = sorted(n for n, p in mine.items() if any(p is q for q in pipe.owned_parameters()))
    out["tie_reduce"] = [str(i) for i in pipe.program.ranks[pipe.pp_rank] if i.op.name == "TIE_REDUCE"]
    out["program_ties"] = pipe.program.ties
    out["measured"] = [str(e.instr) for e in pipe.timeline().events if e.instr.op.name == "TIE_REDUCE"]
    predicted = predict_for(pipe.gather_timeline())  # the program recompiled from the measured timeline's meta
    out["predicted"] = sorted(str(e.instr) for e in predicted.events if e.instr.op.name == "TIE_REDUCE")
    pipe.close()
    return out


def differing_copies(rank):
    """Rank 1 perturbs its copy of the tied embedding before Pipeline(...): refused on every rank."""
    model = tied_model()
    if rank == 1:
        with torch.no_grad():
            model[6].weight[3, 2] += 1.0
    try:
        Pipeline(model, schedule="1f1b", num_microbatches=M, loss_fn=ce, balance=[4, 3])
    except ValueError as exc:
        return str(exc)
    return "no error"


CASES = [("1f1b", 1, [4, 3]), ("gpipe", 1, [4, 3]), ("interleaved-1f1b", 2, [2, 2, 2, 1])]
OPTIONS = {"plain": {}, "split": {"split_backward": True}, "recompute": {"recompute": True}}


def suite(rank):
    torch.set_num_threads(1)
    results = {}
    for schedule, v, balance in CASES:
        for label, options in OPTIONS.items():
            for optim in (("sgd", "adamw") if label == "plain" else ("adamw",)):
                results[(schedule, label, optim)] = tied_case(rank, schedule, v, balance, optim, **options)
    results["differ"] = differing_copies(rank)
    return results


def dp_suite(rank):
    """DP=2 x PP=2 on 4 ranks."""
    torch.set_num_threads(1)
    return {("1f1b", "plain", "adamw"): tied_case(rank, "1f1b", 1, [4, 3], "adamw", dp=2),
            ("interleaved-1f1b", "split", "sgd"): tied_case(rank, "interleaved-1f1b", 2, [2, 2, 2, 1], "sgd", dp=2,
                                                            split_backward=True, recompute=True)}
