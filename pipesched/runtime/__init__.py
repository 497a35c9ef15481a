"""The runtime: run compiled pipeline programs over torch.distributed (the only part that imports torch).

Example (``torchrun --nproc_per_node 2 --master_addr 127.0.0.1 --master_port 29500 train.py``)::

    import torch, torch.nn as nn, torch.nn.functional as F
    from pipesched.runtime import Pipeline

    torch.manual_seed(0)  # the same model on every rank
    model = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.Tanh()) for _ in range(8)])
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=8, loss_fn=F.mse_loss)
    opt = torch.optim.AdamW(pipe.parameters())            # this rank's parameters only
    x, y = torch.randn(128, 512), torch.randn(128, 512)
    loss = pipe.step(x, target=y)                          # the same loss on every rank
    opt.step(); opt.zero_grad()
    out = pipe.forward(x)                                  # (128, 512) on the last stage's rank, else None
    timeline = pipe.gather_timeline()                      # measured Timeline of the last step, all ranks
    torch.distributed.destroy_process_group()              # before exit, as with any torch.distributed job

Without torchrun, ``launch(fn, world_size, *args)`` runs ``fn(rank, *args)`` on local processes.
"""
from .accounting import stage_activation_bytes
from .checkpoint import CheckpointInfo, latest_checkpoint, load_checkpoint, load_into, save_checkpoint
from .amp import GradScaler
from .comm import SingleProcessWarning
from .failure import PipelineError
from .launch import ChildTraceback, launch
from .pipeline import Pipeline
from .profiling import profile_layers, profile_link
from .ties import TiedParameter

__all__ = ["CheckpointInfo", "ChildTraceback", "GradScaler", "Pipeline", "PipelineError", "SingleProcessWarning", "latest_checkpoint", "launch", "load_checkpoint", "load_into", "save_checkpoint", "stage_activation_bytes", "TiedParameter", "profile_layers", "profile_link"]
