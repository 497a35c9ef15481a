"""What a ``Pipeline`` decides on its own rank before any communication: the checked arguments, the program, the
stages and the device. A bad argument fails here, on this rank, before the job's ranks meet."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..api import StepPrograms, step_programs
from ..checks import check_positive
from ..ir import Op, Program
from ..user_programs import dp_size_for, program_for, program_with_ties
from .comm import MAX_TIMEOUT_S, backend_for, make_grid, timeout_ok, warn_if_unlaunched, world_and_rank
from .devices import checked_device
from .measured_costs import plan_for, safe_program
from .recompute import refuse_forward_hooks
from .stage import build_stages, layer_names, layer_starts, layers_of, resolve_balance
from .state import state_spec
from .shared_buffers import checked_on, refuse_running_stats, shared_buffers
from .ties import find_ties, program_ties



@dataclass
class LocalSetup:
    """The result of :func:`local_setup` (each field becomes the ``Pipeline`` attribute of the same name).

    Attributes:
        layers: the model's layers, in order. state_spec: unsplit-model name -> shape (state_dict, checkpoints).
        grid: this process's place (world rank, pipeline rank, data-parallel rank).
        plan: for ``zb-auto`` without ``costs``, what its first step measures and compiles
            (:mod:`~pipesched.runtime.measured_costs`); else ``None``.
        program: ``programs.train``; programs: the validated programs the backend's steps run.
        costs: what ``zb-auto`` was built for (``None``: not given, or measured later).
        balance: layers per stage. ties: parameters used by two stages or more. first_layers: per stage, the
            index of its first layer, then the layer count.
        stages: ``{stage: nn.Sequential}`` of this rank. device: where they run.
        shared_buffers: the buffers stages on two ranks or more use that this rank holds a use of
            (:mod:`~pipesched.runtime.shared_buffers`: checked unchanged around each step).
        layer_names: each layer's key in the model (:func:`~pipesched.runtime.stage.layer_names`), on every rank:
            the first part of its tensors' names (state_dict, checkpoints, ties).
    """

    layers: list
    state_spec: dict
    grid: object
    plan: object
    program: Program
    programs: StepPrograms
    costs: object
    balance: tuple
    ties: list
    first_layers: list
    stages: dict
    device: torch.device
    shared_buffers: list
    layer_names: tuple = ()


def local_setup(model, schedule, num_microbatches, loss_fn, virtual_stages, balance, dp_size, recompute,
                split_backward, device, timeout, early_receives, costs=None, memory_limit=None,
                profile=None) -> LocalSetup:
    """Check the arguments and build this rank's part of the pipeline (arguments as ``Pipeline``'s).

    Raises:
        ValueError, TypeError: as ``Pipeline`` documents, naming the argument.
    """
    num_microbatches = check_positive("num_microbatches", num_microbatches, 1)  # plain ints from here on
    dp_size = check_positive("dp_size", dp_size, 1)
    if virtual_stages is not None:
        virtual_stages = check_positive("virtual_stages", virtual_stages, 1)
    if not timeout_ok(timeout):
        raise ValueError(f"timeout must be a number of seconds > 0 and at most {MAX_TIMEOUT_S:g} (about 31 years: "
                         f"the store and the process groups take no longer), got {timeout!r}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    layers, names = layers_of(model), tuple(layer_names(model))
    refuse_lazy(layers, names)
    world, rank = world_and_rank()
    dp_size = dp_size_for(schedule, dp_size)  # a Program's own dp_size (pipesched.user_programs)
    grid = make_grid(rank, world, dp_size)
    # zb-auto without costs: a safe program now, zb-auto from what its first step measures (measured_costs.py)
    plan = plan_for(schedule, costs, grid.pp_size, num_microbatches, dp_size, recompute, split_backward,
                    memory_limit, early_receives)
    program = safe_program(plan, virtual_stages) if plan else program_for(
        schedule, grid.pp_size, num_microbatches, virtual_stages, dp_size, recompute, split_backward, costs=costs,
        memory_limit=memory_limit)
    balance = resolve_balance(layers, program.num_stages, balance, profile, program.stage_to_rank)
    ties = find_ties(layers, balance, program.stage_to_rank, names)  # parameters used by 2+ stages
    shared = shared_buffers(layers, balance, program.stage_to_rank, names)  # buffers: nothing sums them
    refuse_running_stats(shared)  # a norm layer's running statistics in two stages: refused now
    # a TIE_REDUCE per rank of a tie that spans ranks; a user's program with ties: checked against the model's
    program = program_with_ties(program, program_ties(ties))
    stages = build_stages(layers, balance, program.stages_of(grid.pp_rank))
    first_layers = layer_starts(balance)
    recomputed = program.stages_with(Op.R)  # their forward runs twice: no forward hooks there
    refuse_forward_hooks(stages, [s in recomputed for s in range(program.num_stages)], first_layers)
    device = checked_device(stages, device)  # ValueError naming device and both devices
    # the programs the backend's steps run (early receives on gloo), each proven with its step protocol
    programs = step_programs(program, backend_for(device), early_receives)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL and all_gather_object use the current device
    warn_if_unlaunched()  # plain `python train.py`: one rank, nothing split (SingleProcessWarning)
    return LocalSetup(layers, state_spec(layers, names), grid, plan, programs.train, programs, costs, balance, ties,
                      first_layers, stages, device, checked_on(shared, grid.pp_rank, num_microbatches), names)


def refuse_lazy(layers, names) -> None:
    """Raises ValueError: a layer holds a lazy module's parameter or buffer that has no shape yet (``nn.LazyLinear``
    before its first forward): the split, the ties and the checkpoint's model description need every shape; names
    the first one and what to do."""
    for key, layer in zip(names, layers):
        for kind, named in (("parameter", layer.named_parameters()), ("buffer", layer.named_buffers())):
            for name, tensor in named:
                if isinstance(tensor, torch.nn.parameter.UninitializedTensorMixin):
                    raise ValueError(f"{kind} '{key}.{name}' is uninitialized (a lazy module such as "
                                     f"{type(layer.get_submodule(name.rpartition('.')[0])).__name__} before its first "
                                     f"forward): run the model once on a sample batch (model(x)) before building the "
                                     f"Pipeline, so that it takes its shapes")
