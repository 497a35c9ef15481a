"""Per-rank bodies of tests/runtime/test_checkpoint.py: save, exact resume in new processes, resharding 4 -> 2
ranks, bad checkpoints and arguments, and a rank killed during a save."""
from __future__ import annotations

import os
import signal

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline, latest_checkpoint, load_checkpoint, save_checkpoint

STEPS = 2  # k: the resumed run does k steps, saves, and k more in new processes
HYPER = {"lr": 0.01, "weight_decay": 0.1}


def dropout_model(seed: int) -> nn.Sequential:
    """8 x (Linear(8, 8) + Tanh + Dropout(0.2)): enough layers for 4 ranks x 2 virtual stages."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Dropout(0.2)) for _ in range(8)])


def buffered_model(seed: int, layers: int = 8, odd_layer: int | None = None) -> nn.Sequential:
    """Linear, Tanh, BatchNorm1d, Linear, Tanh, Linear, Tanh, Linear (8 layers, buffers in layer 2). ``layers`` cuts
    or extends it (extra layers: Linear(8, 8)); ``odd_layer``: that Linear takes 4 features instead of 8."""
    torch.manual_seed(seed)
    made = [nn.Linear(8, 8), nn.Tanh(), nn.BatchNorm1d(8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
            nn.Linear(8, 8)] + [nn.Linear(8, 8) for _ in range(max(0, layers - 8))]
    if odd_layer is not None:
        made[odd_layer] = nn.Linear(4, 8)
    return nn.Sequential(*made[:layers])


def batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)


def train(pipe, opt, steps) -> list[str]:
    """Steps ``steps`` (their indices choose the data); the losses as hex floats (bitwise comparable)."""
    losses = []
    for step in steps:
        x, y = batch(step)
        losses.append(pipe.step(x, target=y).item().hex())
        opt.step()
        opt.zero_grad()
    return losses


def snapshot(pipe) -> dict:
    return {name: t.clone() for name, t in pipe.state_dict().items()}


def make_pipe(model, schedule="1f1b", **options):
    v = 2 if schedule == "interleaved-1f1b" else 1
    return Pipeline(model, schedule=schedule, num_microbatches=4, loss_fn=F.mse_loss, virtual_stages=v, **options)


def first_run(rank: int, root: str) -> dict:
    """4 ranks: 2k steps straight and k steps + save, for 1f1b and interleaved-1f1b (dropout, AdamW); and a
    dropout-free model saved after k steps, with its next loss and weights (the resharding reference); and that
    model on 2 pipeline ranks x 2 data-parallel replicas, saved after k steps."""
    out = {}
    for schedule in ("1f1b", "interleaved-1f1b"):
        straight = make_pipe(dropout_model(0), schedule)
        torch.manual_seed(100 + rank)  # each rank its own dropout masks
        opt = torch.optim.AdamW(straight.parameters(), **HYPER)
        out[("straight", schedule)] = {"losses": train(straight, opt, range(2 * STEPS)), "state": snapshot(straight)}
        straight.close()
        half = make_pipe(dropout_model(0), schedule)
        torch.manual_seed(100 + rank)
        opt = torch.optim.AdamW(half.parameters(), **HYPER)
        losses = train(half, opt, range(STEPS))
        save_checkpoint(os.path.join(root, f"resume-{schedule}"), half, opt, step=STEPS,
                        extra={"schedule": schedule, "pair": (1, 2), "t": torch.arange(3)})
        out[("half", schedule)] = losses
        half.close()
    pipe = make_pipe(buffered_model(0))
    opt = torch.optim.AdamW(pipe.parameters(), **HYPER)
    train(pipe, opt, range(STEPS))
    save_checkpoint(os.path.join(root, "reshard"), pipe, opt, step=STEPS)
    out["names"] = list(pipe.state_dict())
    out["at_save"] = snapshot(pipe)
    out["next_loss"] = train(pipe, opt, [STEPS])
    out["after_next"] = snapshot(pipe)
    pipe.close()
    replicated = make_pipe(buffered_model(0), dp_size=2)  # 2 ranks x 2 replicas: equal names written once
    opt = torch.optim.AdamW(replicated.parameters(), **HYPER)
    train(replicated, opt, range(STEPS))
    save_checkpoint(os.path.join(root, "dp"), replicated, opt, step=STEPS)
    out["dp_saved"] = snapshot(replicated)
    replicated.close()
    return out


def resumed_run(rank: int, root: str) -> dict:
    """4 new processes: another initialisation and seed, load, k more steps; and the 2 x 2 (pipeline x data
    parallel) checkpoint loaded on 4 pipeline ranks."""
    out = {}
    for schedule in ("1f1b", "interleaved-1f1b"):
        pipe = make_pipe(dropout_model(7), schedule)
        torch.manual_seed(12345)  # the checkpoint's RNG state must replace this
        opt = torch.optim.AdamW(pipe.parameters(), **HYPER)
        info = load_checkpoint(os.path.join(root, f"resume-{schedule}"), pipe, opt)
        extra = dict(info.extra)
        extra["t"] = extra["t"].tolist()
        out[schedule] = {"losses": train(pipe, opt, range(STEPS, 2 * STEPS)), "state": snapshot(pipe),
                         "info": (info.step, extra, info.rng_restored)}
        pipe.close()
    pipe = make_pipe(buffered_model(7))
    opt = torch.optim.AdamW(pipe.parameters(), **HYPER)
    info = load_checkpoint(os.path.join(root, "dp"), pipe, opt)
    out["from_dp"] = {"loaded": snapshot(pipe), "rng_restored": info.rng_restored}
    pipe.close()
    return out


def error_of(fn) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test compares type and message
        return type(exc).__name__, str(exc)
    return None


def unchanged(pipe, before) -> bool:
    return all(torch.equal(t, before[n]) for n, t in pipe.state_dict().items())


def two_rank_run(rank: int, root: str) -> dict:
    """2 ranks: load the 4-rank checkpoint with another balance and step once; then bad checkpoints and arguments,
    each with the weights unchanged after; Pipeline.load_state_dict of a full unsplit state dict."""
    out = {}
    pipe = make_pipe(buffered_model(5), balance=[5, 3])
    opt = torch.optim.AdamW(pipe.parameters(), **HYPER)
    info = load_checkpoint(os.path.join(root, "reshard"), pipe, opt)
    out["reshard"] = {"loaded": snapshot(pipe), "info": (info.step, info.extra, info.rng_restored)}
    out["reshard"]["next_loss"] = train(pipe, opt, [STEPS])
    out["reshard"]["after_next"] = snapshot(pipe)
    pipe.close()
    ckpt = os.path.join(root, "reshard")
    bad_models = {"missing": buffered_model(1, layers=9), "extra": buffered_model(1, layers=7),
                  "shape": buffered_model(1, odd_layer=5)}
    for case, model in bad_models.items():
        pipe = make_pipe(model)
        before = snapshot(pipe)
        out[case] = (error_of(lambda: load_checkpoint(ckpt, pipe)), unchanged(pipe, before))
        pipe.close()
    pipe = make_pipe(buffered_model(1))
    before = snapshot(pipe)
    sgd = torch.optim.SGD(pipe.parameters(), lr=0.1)
    loads = {"nope": os.path.join(root, "nope"), "foreign": os.path.join(root, "foreign"),
             "incomplete": os.path.join(root, "incomplete")}
    for case, path in loads.items():
        out[case] = (error_of(lambda: load_checkpoint(path, pipe)), unchanged(pipe, before))
    out["sgd"] = (error_of(lambda: load_checkpoint(ckpt, pipe, sgd)), unchanged(pipe, before))
    saves = {"bad_step": dict(path=os.path.join(root, "s1"), step=-1),
             "bad_extra": dict(path=os.path.join(root, "s2"), extra={"a": {1, 2}}),
             "paths_differ": dict(path=os.path.join(root, f"s3-rank{rank}")),
             "not_a_checkpoint": dict(path=os.path.join(root, "foreign"))}
    for case, args in saves.items():
        out[case] = error_of(lambda: save_checkpoint(args.pop("path"), pipe, **args))
    out["write_fails"] = error_of(lambda: _save_failing_on_rank_1(rank, os.path.join(root, "s4"), pipe))
    out["saved_nothing"] = sorted(n for n in os.listdir(root) if n.startswith("s"))
    full = buffered_model(11).state_dict()
    keys = pipe.load_state_dict(full)
    out["load_state_dict"] = (keys, all(torch.equal(t, full[n]) for n, t in pipe.state_dict().items()))
    partial = {n: t for n, t in full.items() if n != "0.bias"}
    out["strict"] = error_of(lambda: pipe.load_state_dict(partial))
    pipe.close()
    out["tied"] = tied_case(root)
    return out


def _uses(pipe, model) -> dict:
    """This rank's copies of the tied weights, by each use's name (rt_tied.tied_model: 0 = 6, 1 = 3 = 5)."""
    held = {id(layer) for stage in pipe.stages.values() for layer in stage}
    return {f"{i}.weight": model[i].weight.detach().clone() for i in (0, 1, 3, 5, 6) if id(model[i]) in held}


def tied_case(root: str) -> dict:
    """A model whose embedding is tied to its head and three Linears share a weight, across 2 ranks: one step,
    save; a new pipeline (another init) loads it; the next step of both, each copy of each tie compared."""
    from rt_tied import batches, ce, tied_model

    data = [pair for (pair,) in batches(2)]
    out = {}
    for phase, seed in (("saved", 0), ("loaded", 3)):
        model = tied_model(seed)
        pipe = Pipeline(model, schedule="1f1b", num_microbatches=4, loss_fn=ce)
        opt = torch.optim.AdamW(pipe.parameters(), **HYPER)
        path = os.path.join(root, "tied")
        if phase == "saved":
            pipe.step(data[0][0], target=data[0][1])
            opt.step()
            opt.zero_grad()
            save_checkpoint(path, pipe, opt, step=1)
        else:
            load_checkpoint(path, pipe, opt)
        out[phase] = {"names": list(pipe.state_dict()), "uses": _uses(pipe, model)}
        out[phase]["next_loss"] = pipe.step(data[1][0], target=data[1][1]).item().hex()
        opt.step()
        out[phase]["after_next"] = _uses(pipe, model)
        pipe.close()
    return out


def _save_failing_on_rank_1(rank: int, path: str, pipe) -> None:
    """A save whose shard write raises OSError on rank 1 (a full disk)."""
    from torch.distributed.checkpoint import FileSystemWriter

    original = FileSystemWriter.write_data

    def disk_full(self, plan, planner):
        raise OSError("No space left on device (simulated)")

    if rank == 1:
        FileSystemWriter.write_data = disk_full
    try:
        save_checkpoint(path, pipe)
    finally:
        FileSystemWriter.write_data = original


def crash_run(rank: int, root: str) -> None:
    """2 ranks: save step 1 (twice: the second replaces the first), then rank 1 is killed (SIGKILL) while writing
    its shard of step 2."""
    folder = os.path.join(root, "crash")
    pipe = make_pipe(buffered_model(0))
    opt = torch.optim.AdamW(pipe.parameters(), **HYPER)
    train(pipe, opt, [0])
    save_checkpoint(os.path.join(folder, "step-000001"), pipe, opt, step=1)
    save_checkpoint(os.path.join(folder, "step-000001"), pipe, opt, step=1, extra="replaced")
    train(pipe, opt, [1])
    if rank == 1:
        from torch.distributed.checkpoint import FileSystemWriter

        original = FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            original(self, plan, planner).wait()
            os.kill(os.getpid(), signal.SIGKILL)

        FileSystemWriter.write_data = write_then_die
    save_checkpoint(os.path.join(folder, "step-000002"), pipe, opt, step=2)
    assert latest_checkpoint(folder) is not None  # not reached: the save above fails on every rank
