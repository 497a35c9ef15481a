"""The runtime: run compiled pipeline programs over torch.distributed (the only part that imports torch)."""
from .accounting import stage_activation_bytes
from .failure import PipelineError
from .launch import ChildTraceback, launch
from .pipeline import Pipeline

__all__ = ["ChildTraceback", "Pipeline", "PipelineError", "launch", "stage_activation_bytes"]
