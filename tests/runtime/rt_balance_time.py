"""Per-rank bodies of tests/runtime/test_balance_time.py: Pipeline(balance="time", profile=...) and profile_link
on 2 ranks, against the partitioner and the unsplit model."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.partition import balance_by_time
from pipesched.profile import LayerProfile
from pipesched.runtime import Pipeline, profile_link

from rt_cases import grad_report, reference_step
from rt_workers import _data

SECONDS = (1.0, 1.0, 2.0, 1.0, 8.0, 3.0)  # a skewed model: the wide Linear is slow
CASES = (("1f1b", None), ("interleaved-1f1b", 2), ("zbv", None))


def skewed(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64),
                         nn.Linear(64, 8))


def hand_profile(num_layers: int = 6, names=None) -> LayerProfile:
    seconds = (SECONDS * 2)[:num_layers]
    return LayerProfile(forward=seconds, input_grad=(0.0,) * num_layers, weight_grad=(0.0,) * num_layers,
                        activation_bytes=(100.0,) * num_layers, output_bytes=(32.0,) * num_layers,
                        param_bytes=(0.0,) * num_layers, microbatch_size=2,
                        layer_names=names or tuple(type(layer).__name__ for layer in skewed())[:num_layers])


def time_case(schedule, v, m=4):
    model = skewed()
    ref = copy.deepcopy(model)
    prof = hand_profile()
    pipe = Pipeline(model, schedule=schedule, num_microbatches=m, loss_fn=F.mse_loss, virtual_stages=v,
                    balance="time", profile=prof)
    expected = balance_by_time(prof.layer_seconds(), pipe.program.num_stages, pipe.program.stage_to_rank,
                               memory=prof.activation_bytes)
    x, y = _data(0)
    loss = pipe.step(x, target=y)
    ref_loss = reference_step(ref, x, y, m)
    count, equal, _ = grad_report(pipe, model, ref)
    pipe.close()
    return {"balance": pipe.balance, "expected": expected, "stage_to_rank": pipe.program.stage_to_rank,
            "loss_equal": loss is None or bool(torch.equal(loss, ref_loss)), "grads": (count > 0, equal)}


def refused(**kwargs):
    try:
        Pipeline(skewed(), schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, balance="time", **kwargs)
    except (ValueError, TypeError) as exc:
        return type(exc).__name__, str(exc)
    return None


def suite(rank):
    torch.set_num_threads(1)
    out = {"link": profile_link(nbytes=(1 << 8, 1 << 14, 1 << 18), repeat=3)}
    for schedule, v in CASES:
        out[schedule] = time_case(schedule, v)
    out["no profile"] = refused()
    out["other model"] = refused(profile=hand_profile(5))
    out["other classes"] = refused(profile=hand_profile(names=("Linear",) * 6))
    return out
