"""Per-rank bodies of tests/runtime/test_checkpoint_agreement.py (2 ranks): arguments of save/load_checkpoint that
must agree across ranks, a rank whose stages hold no parameters (optimizer=None there), and a GradScaler's state
kept in ``extra`` (fp16 autocast) for an exact resume."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import GradScaler, Pipeline, load_checkpoint, save_checkpoint

from rt_checkpoint import error_of, unchanged

HYPER = {"lr": 0.01, "weight_decay": 0.1}


def model(seed: int) -> nn.Sequential:
    """Linear(4, 4), Tanh, Linear(4, 4), Tanh: with balance [3, 1] rank 1's only stage is a Tanh (no parameters)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh())


def batch(step: int):
    g = torch.Generator().manual_seed(500 + step)
    x, y = torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g)
    return x, y


def make_pipe(seed: int, balance=(2, 2), autocast=None) -> Pipeline:
    return Pipeline(model(seed), schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, balance=list(balance),
                    autocast=autocast, timeout=60.0)


def optimizer(pipe):
    """AdamW over this rank's parameters, or None where the rank holds none (torch refuses an empty list)."""
    return torch.optim.AdamW(pipe.parameters(), **HYPER) if any(True for _ in pipe.parameters()) else None


def train(pipe, opt, steps, scaler=None) -> list[str]:
    """The losses (hex: bitwise comparable), plus the scale after each step when ``scaler`` is given."""
    out = []
    for step in steps:
        x, y = batch(step)
        loss = pipe.step(x, target=y, scaler=scaler)
        if scaler is None:
            if opt is not None:
                opt.step()
                opt.zero_grad()
            out.append(loss.item().hex())
        else:
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            out.append((loss.item().hex(), scaler.get_scale()))
    return out


def state(pipe) -> dict:
    return {name: t.clone() for name, t in pipe.state_dict().items()}


def mismatches(rank: int, root: str) -> dict:
    """Checkpoints at steps 1 and 2, then loads and saves whose ranks disagree: the error on each rank, and the
    weights (and AdamW state) unchanged after."""
    out = {}
    pipe = make_pipe(0)
    opt = optimizer(pipe)
    for step in (1, 2):
        train(pipe, opt, [step])
        save_checkpoint(os.path.join(root, f"step-{step}"), pipe, opt, step=step)
    fresh = make_pipe(9)
    fresh_opt = optimizer(fresh)
    before = state(fresh)
    path = os.path.join(root, "step-1" if rank == 0 else "step-2")
    out["load_path"] = error_of(lambda: load_checkpoint(path, fresh, fresh_opt))
    out["load_opt_one_rank"] = error_of(lambda: load_checkpoint(os.path.join(root, "step-2"), fresh,
                                                              fresh_opt if rank == 0 else None))
    out["save_opt_one_rank"] = error_of(lambda: save_checkpoint(os.path.join(root, "half"), fresh,
                                                              fresh_opt if rank == 1 else None, step=3))
    out["save_step"] = error_of(lambda: save_checkpoint(os.path.join(root, "steps"), fresh, fresh_opt, step=3 + rank))
    out["unchanged"] = unchanged(fresh, before) and fresh_opt.state_dict()["state"] == {}
    torch.distributed.barrier()  # rank 0 has cleaned up after the refusals
    out["saved"] = sorted(os.listdir(root))
    same = os.path.join(root, "step-2")  # usable after; a relative path on one rank is the same absolute path
    info = load_checkpoint(os.path.relpath(same) if rank == 0 else same, fresh, fresh_opt)
    out["loaded"] = (info.step, all(torch.equal(t, state(pipe)[n]) for n, t in fresh.state_dict().items()))
    pipe.close()
    fresh.close()
    return out


def no_parameters(rank: int, root: str) -> dict:
    """Balance [3, 1]: rank 1 holds only a Tanh and passes optimizer=None. 4 steps straight == 2 steps, save,
    a new pipeline (other init), load, 2 steps."""
    out = {}
    straight = make_pipe(0, balance=(3, 1))
    out["straight"] = train(straight, optimizer(straight), range(4))
    out["straight_state"] = state(straight)
    straight.close()
    half = make_pipe(0, balance=(3, 1))
    opt = optimizer(half)
    out["opt_is_none"] = opt is None
    out["half"] = train(half, opt, range(2))
    out["save"] = error_of(lambda: save_checkpoint(os.path.join(root, "noparams"), half, opt, step=2))
    half.close()
    resumed = make_pipe(7, balance=(3, 1))
    opt = optimizer(resumed)
    info = load_checkpoint(os.path.join(root, "noparams"), resumed, opt)
    out["info"] = (info.step, info.rng_restored)
    out["resumed"] = train(resumed, opt, range(2, 4))
    out["resumed_state"] = state(resumed)
    resumed.close()
    return out


def scaler_resume(rank: int, root: str) -> dict:
    """fp16 autocast + GradScaler (init scale 2^18: overflows, halves; growth_interval 2): 6 steps straight == 2
    steps, save with extra={"scaler": scaler.state_dict()}, a new pipeline and scaler (other init and scale), load,
    4 steps."""
    def run(seed, init_scale):
        pipe = make_pipe(seed, autocast=torch.float16)
        return pipe, torch.optim.AdamW(pipe.parameters(), **HYPER), GradScaler(pipe, init_scale=init_scale,
                                                                               growth_interval=2)
    out = {}
    pipe, opt, scaler = run(0, 2.0 ** 18)
    out["straight"] = train(pipe, opt, range(6), scaler)
    out["straight_state"] = state(pipe)
    out["straight_scaler"] = scaler.state_dict()
    pipe.close()
    pipe, opt, scaler = run(0, 2.0 ** 18)
    out["half"] = train(pipe, opt, range(2), scaler)
    out["saved_scaler"] = scaler.state_dict()
    save_checkpoint(os.path.join(root, "scaler"), pipe, opt, step=2, extra={"scaler": scaler.state_dict()})
    pipe.close()
    pipe, opt, scaler = run(7, 2.0 ** 16)
    info = load_checkpoint(os.path.join(root, "scaler"), pipe, opt)
    out["extra"] = info.extra
    scaler.load_state_dict(info.extra["scaler"])
    out["resumed"] = train(pipe, opt, range(2, 6), scaler)
    out["resumed_state"] = state(pipe)
    out["resumed_scaler"] = scaler.state_dict()
    pipe.close()
    return out


def everything(rank: int, root: str) -> dict:
    torch.set_num_threads(1)
    out = {}
    for name, body in (("mismatches", mismatches), ("no_parameters", no_parameters), ("scaler", scaler_resume)):
        folder = os.path.join(root, name)
        if rank == 0:
            os.makedirs(folder, exist_ok=True)
        torch.distributed.barrier()
        try:  # a part that raises (the same error on every rank: they vote) fails its own tests only
            out[name] = body(rank, folder)
        except Exception as exc:  # noqa: BLE001
            out[name] = {"raised": f"{type(exc).__name__}: {exc}"}
    return out
