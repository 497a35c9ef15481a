"""The shortest complete pipesched program: a 4-layer MLP on 2 pipeline ranks, 1F1B, 4 microbatches.

    python examples/quickstart.py                              # spawns 2 local ranks (CPU, gloo)
    torchrun --nproc-per-node 2 examples/quickstart.py         # the same under torchrun
"""
import os

import torch
from torch import nn

from pipesched.runtime import Pipeline, launch


def main(rank: int) -> float:
    torch.manual_seed(0)  # the same model and data on every rank
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=4, loss_fn=nn.functional.mse_loss)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.05)
    x, y = torch.randn(64, 16), torch.randn(64, 1)
    losses = []
    for step in range(20):
        loss = pipe.step(x, target=y)  # forward + backward of all 4 microbatches, pipelined
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())  # the same value on every rank
    if rank == 0:
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in 20 steps; bubble of the last step: "
              f"{pipe.gather_timeline().bubble_fraction:.2f}")
    else:
        pipe.gather_timeline()  # collective: every pipeline rank takes part
    return losses[-1]


if __name__ == "__main__":
    if "RANK" in os.environ:  # under torchrun
        main(int(os.environ["RANK"]))
    else:
        launch(main, 2)
