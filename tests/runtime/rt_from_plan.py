"""Per-rank body of tests/runtime/test_from_plan.py: ``Pipeline.from_plan`` builds what the candidate says, its
gradients equal the unsplit model's bitwise, and a plan for another model or job is refused on every rank."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from pipesched import Op, plan
from pipesched.profile import LayerProfile
from pipesched.runtime import Pipeline

from rt_cases import reference_step

MiB = 2**20
LAYERS = 6


def make_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(LAYERS)])


def skewed_profile() -> LayerProfile:
    """Layers 1 and 4 four times the others; parameters large enough that one rank cannot hold them all."""
    w = [1, 4, 1, 1, 4, 1]
    return LayerProfile(forward=[x * 1e-3 for x in w], input_grad=[x * 1e-3 for x in w],
                        weight_grad=[x * 1e-3 for x in w], activation_bytes=[x * MiB for x in w],
                        output_bytes=[MiB] * LAYERS, param_bytes=[x * 16 * MiB for x in w], microbatch_size=1,
                        layer_names=["Sequential"] * LAYERS)


def candidates():
    """Planned for 2 ranks and a global batch of 8: the winner of a roomy budget, one of a budget that makes it
    recompute, and zbv's (a V placement)."""
    profile = skewed_profile()
    roomy = plan(profile, 2, 600 * MiB, 8, top=1)  # one rank holding all parameters needs 768 MiB
    need = max(plan(profile, 2, 600 * MiB, 8, schedules=["1f1b"], top=1).best.peak_memory)
    tight = plan(profile, 2, need - MiB, 8, schedules=["1f1b"], top=1)
    vee = plan(profile, 2, 600 * MiB, 8, schedules=["zbv"], top=1)
    return {"roomy": roomy, "tight": tight, "zbv": vee}


def case(plan_or_candidate, candidate) -> dict:
    model = make_model()
    ref = copy.deepcopy(model)
    pipe = Pipeline.from_plan(model, plan_or_candidate, loss_fn=F.mse_loss, timeout=60)
    torch.manual_seed(1)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    loss = pipe.step(x, target=y)
    ref_loss = reference_step(ref, x, y, candidate.num_microbatches)
    ref_params = dict(ref.named_parameters())
    mine = {id(p) for p in pipe.parameters()}
    grads_equal = all(torch.equal(p.grad, ref_params[n].grad) for n, p in model.named_parameters() if id(p) in mine)
    program = pipe.program
    built = {"schedule": program.schedule, "pp": program.num_ranks, "dp": program.dp_size,
             "m": program.num_microbatches, "v": program.num_stages // program.num_ranks,
             "balance": tuple(pipe.balance), "recompute": tuple(s in program.stages_with(Op.R)
                                                              for s in range(program.num_stages)),
             "split": bool(program.stages_with(Op.I))}
    pipe.close()
    return {"built": built, "loss_equal": torch.equal(loss, ref_loss), "grads_equal": grads_equal,
            "count": len(mine)}


def refused(work) -> str | None:
    try:
        work()
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def suite(rank: int) -> dict:
    torch.set_num_threads(1)
    out = {}
    plans = candidates()
    for name, planned in plans.items():
        out[name] = {"candidate": planned.best.to_json() | {"split_backward": planned.best.split_backward},
                     **case(planned, planned.best)}
    profile = skewed_profile()
    for_four = plan(profile, 4, 2**31, 8, top=1)
    out["world"] = refused(lambda: Pipeline.from_plan(make_model(), for_four, loss_fn=F.mse_loss))
    short = nn.Sequential(*list(make_model())[:5])
    out["layers"] = refused(lambda: Pipeline.from_plan(short, plans["roomy"], loss_fn=F.mse_loss))
    out["clash"] = refused(lambda: Pipeline.from_plan(make_model(), plans["roomy"], loss_fn=F.mse_loss,
                                                      schedule="gpipe"))
    out["type"] = refused(lambda: Pipeline.from_plan(make_model(), {"schedule": "1f1b"}, loss_fn=F.mse_loss))
    return out
