"""pipesched: pipeline-parallel schedules as data — compiled, proven deadlock-free, simulated, executed.

This package (everything outside ``pipesched.runtime``) is torch-free and imports in milliseconds.
"""
from .api import StepPrograms, build, compile_program, passes_for, step_programs
from .cost import CostError, CostModel
from .errors import (
    BuilderError,
    DeadlockError,
    DependencyError,
    InvalidProgramError,
    PairingError,
    ProgramFormatError,
    ScheduleArgumentError,
    ScheduleError,
    UnknownScheduleError,
)
from .ir import Instr, Op, Program
from .lower import add_all_reduce, add_recompute, add_send_recv, forward_only, post_receives_early, split_backward
from .lower import add_tie_reduce
from .program_io import load, loads, to_json, to_text
from .schedules import SCHEDULES
from .registry import REGISTRY, Registry, get_schedule, register_schedule, unregister_schedule
from .sim import simulate
from .timeline import Event, Timeline
from .validate import validate
from .planner import Candidate, Plan, PlanError, plan  # the planner (issue 14)
from .partition import balance_by_time, rank_loads
from .profile import LayerProfile

__version__ = "0.1.0"

__all__ = [
    "BuilderError", "CostError", "CostModel", "DeadlockError", "DependencyError", "Event", "Instr", "InvalidProgramError", "Op",
    "PairingError", "Program", "ProgramFormatError", "SCHEDULES", "ScheduleArgumentError", "ScheduleError",
    "StepPrograms", "Timeline", "UnknownScheduleError", "add_all_reduce", "add_recompute", "add_send_recv",
    "add_tie_reduce", "build", "REGISTRY", "Registry", "register_schedule", "unregister_schedule",
    "compile_program", "forward_only", "get_schedule", "load", "loads", "passes_for", "post_receives_early",
    "simulate", "split_backward", "step_programs", "to_json", "to_text", "validate",
    "Candidate", "Plan", "PlanError", "plan",
    "LayerProfile", "balance_by_time", "rank_loads",
]
