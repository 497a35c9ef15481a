"""Per-rank body of tests/runtime/test_one_rank_and_user_ties.py (2 ranks, one launch): a tie whose stages are all on
one rank (ZB-V's and DualPipe-V's V put stage 0 and the last stage on rank 0: the embedding tied to the head needs no
TIE_REDUCE), and ties in a user's Program (``Pipeline(model, schedule=program)``), against the unsplit model."""
from __future__ import annotations

import copy

import torch

import pipesched as ps

from rt_cases import reference_step
from rt_tied import D, M, V, batches, ce, tied_case, tied_model
from pipesched.runtime import Pipeline

#: the tied model (rt_tied.tied_model) cut into 4 stages [emb, La], [Tanh, Lb], [Tanh, Lc], [Head]: the embedding
#: and head on stages 0 and 3, the shared Linear weight on stages 0, 1 and 2
BALANCE4 = [2, 2, 2, 1]


def v_shape_cases(rank):
    """zbv and dualpipev on 2 ranks (placement 0 1 1 0): tie (0, 3) on rank 0 only, tie (0, 1, 2) across ranks."""
    out = {name: tied_case(rank, name, 2, BALANCE4, "sgd", steps=2) for name in ("zbv", "dualpipev")}
    out.update({f"{name}-embedding-head": embedding_head_only(rank, name) for name in ("zbv", "dualpipev")})
    return out


def embedding_head_only(rank, schedule):
    """The embedding tied to the head only (no other tie) on stages 0 and 3, both on rank 0 in the V: no TIE_REDUCE
    anywhere. One step against the unsplit model: per parameter of this rank, bitwise equal or not, and the largest
    absolute difference (the tied weight sums its two uses in another order than the unsplit model)."""
    torch.manual_seed(0)
    emb, head = torch.nn.Embedding(V, D), torch.nn.Linear(D, V, bias=False)
    head.weight = emb.weight
    model = torch.nn.Sequential(emb, torch.nn.Linear(D, D), torch.nn.Tanh(), torch.nn.Linear(D, D), torch.nn.Tanh(),
                                torch.nn.Linear(D, D), head)
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, schedule=schedule, num_microbatches=M, loss_fn=ce, balance=BALANCE4)
    (x, y), = batches(1)[0]
    loss = pipe.step(x, target=y)
    ref_loss = reference_step(ref, x, y, M, ce)
    refs, mine = dict(ref.named_parameters()), {id(p) for p in pipe.parameters()}
    grads = {n: (torch.equal(p.grad, refs[n].grad), float((p.grad - refs[n].grad).abs().max()))
             for n, p in model.named_parameters() if id(p) in mine}
    out = {"grads": grads, "ties": [tuple(t) for t in pipe.ties], "program_ties": pipe.program.ties,
           "tie_reduce": sum(i.op.name == "TIE_REDUCE" for s in pipe.program.ranks for i in s),
           "loss_equal": bool(torch.equal(loss, ref_loss)), "scale": float(refs["0.weight"].grad.abs().max())}
    pipe.close()
    return out


def user_program_cases(rank):
    """Programs of the user's: without ties (the Pipeline adds TIE_REDUCE), with the model's ties (run as they are;
    in another order than the model lists them, too)."""
    plain = ps.loads(ps.to_text(ps.compile_program("1f1b", 2, M)))  # as a user has it: from its text form
    tied = ps.loads(ps.to_text(ps.compile_program("1f1b", 2, M, ties=[(0, 1)])))
    reordered = ps.compile_program("interleaved-1f1b", 2, M, 2, ties=[(0, 1, 2), (0, 3)])  # the model: (0, 3) first
    out = {"plain": tied_case(rank, plain, None, [4, 3], "sgd", steps=2),
           "tied": tied_case(rank, tied, None, [4, 3], "sgd", steps=2),
           "reordered": tied_case(rank, reordered, None, BALANCE4, "sgd", steps=2)}
    out["tied"]["given_tie_reduce"] = [str(i) for i in tied.ranks[rank] if i.op.name == "TIE_REDUCE"]
    out["reordered"]["given_ties"] = reordered.ties
    return out


def disagreeing(rank):
    """A program whose ties are not the model's: refused on every rank, naming both."""
    out = {}
    for label, program in (("missing", ps.compile_program("interleaved-1f1b", 2, M, 2, ties=[(0, 3)])),
                           ("extra", ps.compile_program("1f1b", 2, M, ties=[(0, 1)]))):
        model = tied_model() if label == "missing" else torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])
        try:
            Pipeline(model, schedule=program, num_microbatches=M, loss_fn=ce,
                     balance=BALANCE4 if label == "missing" else [2, 2])
            out[label] = "no error"
        except ValueError as exc:
            out[label] = str(exc)
    return out


def suite(rank):
    torch.set_num_threads(1)
    return {"v": v_shape_cases(rank), "user": user_program_cases(rank), "refused": disagreeing(rank)}
