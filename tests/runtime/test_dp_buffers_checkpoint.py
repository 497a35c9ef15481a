"""DP=2 x PP=2 with BatchNorm: each replica's running statistics are its own data's; a checkpoint holds replica 0's,
mean and variance together (DCP writes a name several ranks save once, from any of them: before, a mean of one
replica could be saved next to a variance of the other)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline, launch, load_into, save_checkpoint

NAMES = ["1.running_mean", "1.running_var", "4.running_mean", "4.running_var"]


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8), nn.BatchNorm1d(8),
                         nn.Linear(8, 2))


def body(rank, path):
    torch.set_num_threads(1)
    pipe = Pipeline(model(), schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, dp_size=2, balance=[3, 3])
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(pipe.grid.dp_rank)  # each replica its own data
    x, y = torch.randn(8, 4, generator=g) * (1 + pipe.grid.dp_rank), torch.randn(8, 2, generator=g)
    pipe.step(x, target=y)
    opt.step()
    save_checkpoint(path, pipe, opt, step=1)
    out = {"dp_rank": pipe.grid.dp_rank,
           "buffers": {k: v.clone() for k, v in pipe.state_dict().items() if "running" in k}}
    pipe.close()
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt") / "s")
    results = launch(body, 4, path, timeout=300)
    reference = model()
    load_into(reference, path)
    return results, reference.state_dict()


def test_replicas_keep_their_own_statistics_and_the_checkpoint_holds_replica_0s(saved):
    results, stored = saved
    for name in NAMES:
        holders = [r for r in results if name in r["buffers"]]
        assert sorted(r["dp_rank"] for r in holders) == [0, 1]
        first = next(r for r in holders if r["dp_rank"] == 0)["buffers"][name]
        second = next(r for r in holders if r["dp_rank"] == 1)["buffers"][name]
        assert not torch.equal(first, second)  # different data, different statistics
        assert torch.equal(stored[name], first)  # replica 0's, for every buffer: mean and variance together
