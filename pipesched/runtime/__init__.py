"""The runtime: run compiled pipeline programs over torch.distributed (the only part that imports torch)."""
from .failure import PipelineError
from .launch import launch
from .pipeline import Pipeline

__all__ = ["Pipeline", "PipelineError", "launch"]
