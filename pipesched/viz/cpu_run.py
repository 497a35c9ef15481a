"""A real measured timeline for the gallery: a small MLP trained on local CPU ranks (gloo) by the runtime.

Imports torch (through :mod:`pipesched.runtime`) only when :func:`measure_cpu_run` is called.
"""
from __future__ import annotations


def measure_cpu_run(schedule: str = "1f1b", num_ranks: int = 4, num_microbatches: int = 8,
                    virtual_stages: int | None = None, steps: int = 3, width: int = 512, batch: int = 256,
                    timeout: float = 240.0):
    """Train an MLP for ``steps`` steps on ``num_ranks`` spawned CPU processes; return the last step's timeline.

    The model is ``num_ranks * v`` stages of two ``Linear(width, width)`` + ReLU each; every step runs
    ``batch`` samples in ``num_microbatches`` microbatches. The first steps warm up (allocations, learned
    message shapes); the returned :class:`~pipesched.timeline.Timeline` is the last step's, gathered on
    rank 0 with clocks aligned at the step start (``source="measured"``, seconds).

    Raises:
        ImportError: torch or :mod:`pipesched.runtime` is not available.
        TimeoutError, RuntimeError, PipelineError: as :func:`pipesched.runtime.launch`.
    """
    from ..runtime import launch

    results = launch(_rank_main, num_ranks, schedule, num_microbatches, virtual_stages, steps, width, batch,
                     timeout=timeout)
    return results[0]


def _rank_main(rank: int, schedule: str, m: int, v, steps: int, width: int, batch: int):
    import torch
    from torch import nn

    from ..runtime import Pipeline
    from ..schedules import get_schedule

    torch.manual_seed(0)
    world = torch.distributed.get_world_size()
    stages = world * (v or get_schedule(schedule).default_virtual_stages)
    layers = []
    for _ in range(stages):
        layers += [nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers)
    pipe = Pipeline(model, schedule=schedule, num_microbatches=m, virtual_stages=v,
                    loss_fn=lambda out, target: ((out - target) ** 2).mean(), balance=[4] * stages)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(batch, width, generator=generator)  # (N, width)
        y = torch.randn(batch, width, generator=generator)  # (N, width)
        pipe.step(x, target=y)
    timeline = pipe.gather_timeline()
    return timeline if rank == 0 else None
