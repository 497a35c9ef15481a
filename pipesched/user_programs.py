"""A program of your own as a pipeline's schedule: ``Pipeline(model, schedule=program)`` with a lowered
:class:`~pipesched.ir.Program` (``pipesched.load("my_schedule.txt")``, or built and lowered in Python).

What the program decides and what the ``Pipeline`` arguments may still say:

- **Validated once**, before any communication: :func:`~pipesched.validate.validate`'s error as it is (a
  ``ScheduleError``: ``DeadlockError``, ``PairingError``, ...), raised on every rank (each rank checks the same
  program). The step programs (early receives, forward-only, learning steps) are then derived from it and
  proven as from a compiled one (:func:`pipesched.api.step_programs`).
- **It must be a lowered training program**: SEND/RECV present when it has more than one rank (lower a
  compute-only one with :func:`~pipesched.lower.add_send_recv`), not forward-only.
- **Ties**: the ``Pipeline`` finds the parameters the model's stages share (:func:`pipesched.runtime.ties.find_ties`).
  A program without ties gets their ``TIE_REDUCE`` as lowering adds it (:func:`~pipesched.lower.add_tie_reduce`);
  a program with ties (``compile_program(..., ties=...)``, or a file's ``ties:`` line) is run as it is if its
  ties are the model's cross-rank ones, in any order (its ``TIE_REDUCE`` instructions proven by the validator),
  and refused otherwise, naming both (:func:`program_with_ties`).
- **Ranks**: ``program.num_ranks`` must equal the pipeline's ranks, world size / ``dp_size``.
- **num_microbatches and dp_size come from the program**: the argument must be left at its default (1) or
  equal the program's, else a ``ValueError`` naming both.
- **virtual_stages**: ``None`` or the program's stages per rank (``num_stages / num_ranks``); placement is the
  program's ``stage_to_rank``.
- **recompute and split_backward** must be ``False``: what is recomputed (``R``) and which backwards are split
  (``I``/``W``) is the program's own; apply :func:`~pipesched.lower.add_recompute` /
  :func:`~pipesched.lower.split_backward` before lowering it.
"""
from __future__ import annotations

from .api import BACKENDS, StepPrograms, compile_program, step_programs
from .engine import has_comm
from .ir import Op, Program
from .lower import add_tie_reduce
from .validate import validate


def dp_size_for(schedule, dp_size: int) -> int:
    """The data-parallel size of a pipeline built with ``schedule``: a program's own ``dp_size`` (the argument
    must be 1, its default, or equal), else ``dp_size``.

    Raises:
        ValueError: ``dp_size`` differs from the program's (names both).
    """
    if not isinstance(schedule, Program):
        return dp_size
    if schedule.dp_size == 1 and dp_size != 1:  # a program without the replicas' all-reduce: say how to add it
        raise ValueError(f"dp_size={dp_size!r}, but the program runs 1 data-parallel replica (program.dp_size, no "
                         f"ALL_REDUCE); add the replicas' all-reduce to it: pipesched.add_all_reduce(program, "
                         f"{dp_size!r}) (a torch CSV: pipesched.interop.from_torch_csv(..., dp_size={dp_size!r})), "
                         f"or leave dp_size at its default")
    _agree("dp_size", dp_size, schedule.dp_size, "data-parallel replicas")
    return schedule.dp_size


def program_for(schedule, num_ranks: int, num_microbatches: int, virtual_stages, dp_size: int, recompute=False,
                split_backward=False, costs=None, memory_limit=None) -> Program:
    """The validated training program of a pipeline: :func:`~pipesched.api.compile_program` of a schedule name,
    or a user ``Program`` checked against the arguments (see the module docstring).

    Args:
        schedule: a schedule name (``str``) or a lowered :class:`~pipesched.ir.Program`.
        num_ranks: pipeline ranks (world size / ``dp_size``).
    Raises:
        TypeError: ``schedule`` is neither a ``str`` nor a ``Program``.
        ValueError: a program the pipeline cannot run as given (names the argument or the property, its value
            and what is valid); ``ScheduleError`` (a ``ValueError`` or not): the validator's verdict.
    """
    if isinstance(schedule, str):
        return compile_program(schedule, num_ranks, num_microbatches, virtual_stages, dp_size, recompute,
                               split_backward, costs=costs, memory_limit=memory_limit)
    if not isinstance(schedule, Program):
        raise TypeError(f"schedule must be a schedule name (str, see pipesched.get_schedule) or a lowered "
                        f"pipesched.Program, got {type(schedule).__name__}")
    for name, value in (("costs", costs), ("memory_limit", memory_limit)):
        if value is not None:
            raise ValueError(f"{name}={value!r} builds a schedule from costs (schedule='zb-auto'); a given Program is "
                             f"run as it is: drop {name}")
    return check_user_program(schedule, num_ranks, num_microbatches, virtual_stages, dp_size, recompute,
                              split_backward)


def check_user_program(program: Program, num_ranks: int, num_microbatches: int, virtual_stages, dp_size: int,
                       recompute=False, split_backward=False) -> Program:
    """``program`` validated, if a pipeline of ``num_ranks`` ranks can run it with these arguments.

    Raises:
        ValueError: see :func:`program_for`.
        ScheduleError: ``program`` fails validation (the validator's error, unchanged).
    """
    _check_shape(program, num_ranks, dp_size)
    _agree("num_microbatches", num_microbatches, program.num_microbatches, "microbatches")
    per_rank, uneven = divmod(program.num_stages, program.num_ranks)
    if virtual_stages is not None and (uneven or virtual_stages != per_rank):
        holds = [len(program.stages_of(r)) for r in range(program.num_ranks)]
        raise ValueError(f"virtual_stages={virtual_stages!r}, but the program places its {program.num_stages} stages "
                         f"on its ranks as its stage_to_rank says ({holds} per rank); leave virtual_stages=None")
    for name, value, op, pass_ in (("recompute", recompute, Op.R, "add_recompute"),
                                   ("split_backward", split_backward, Op.I, "split_backward")):
        if value is not False:
            raise ValueError(f"{name}={value!r} with a Program: the program's own {op.value} instructions decide it "
                             f"(stages {sorted(program.stages_with(op))}); pass {name}=False, or apply "
                             f"pipesched.{pass_} to the compute-only program before lowering it")
    return validate(program)


def _check_shape(program: Program, num_ranks: int, dp_size: int) -> None:
    """A lowered training program without ties, for ``num_ranks`` pipeline ranks."""
    if program.num_ranks != num_ranks:
        world, replicas = num_ranks * dp_size, divmod(num_ranks * dp_size, program.num_ranks)
        data_parallel = (f", or run {replicas[0]} data-parallel replicas of it: pipesched.add_all_reduce(program, "
                         f"{replicas[0]}) (a torch CSV: from_torch_csv(..., dp_size={replicas[0]}))"
                         if program.dp_size == 1 and replicas[0] > 1 and not replicas[1] else "")
        raise ValueError(f"the program has {program.num_ranks} ranks (num_ranks) but the pipeline has {num_ranks} "
                         f"(world size {world} / dp_size {dp_size}); launch {program.num_ranks} x dp_size "
                         f"processes, or use a program for {num_ranks} ranks{data_parallel}")
    check_pipeline_program(program)


def check_pipeline_program(program: Program) -> None:
    """``program`` is one a ``Pipeline`` runs (whatever its ranks): a lowered training program.

    Raises:
        ValueError: ``program`` is forward-only, or compute-only with stages on more than one rank (says what to
            do; stages all on one rank need no message, the other ranks idle).
    """
    if program.forward_only:
        raise ValueError("the program is forward-only (forward_only=True); a Pipeline needs the training program "
                         "and derives the forward-only one itself")
    if len(set(program.stage_to_rank)) > 1 and not has_comm(program):
        raise ValueError("the program is compute-only (no SEND/RECV); lower it first: "
                         "pipesched.add_send_recv(program), or register its builder (pipesched.register_schedule)")


def backend_programs(program: Program, backend: str) -> StepPrograms:
    """What ``Pipeline(model, schedule=program)`` proves of a validated ``program`` on ``backend`` (``"gloo"``, its
    CPU backend, or ``"nccl"``, its CUDA one; :data:`~pipesched.api.BACKENDS`) before any communication, with the
    very functions it calls there: :func:`check_pipeline_program`, then :func:`~pipesched.api.step_programs` with
    ``early_receives=None`` (the Pipeline's default): gloo proves the step that learns the message shapes (each
    RECV_F waits until its SEND_F is issued), nccl also one message order per pair of ranks. What depends on the
    launch and the model is not checked: the ranks (world size / dp_size) and the model's ties (a program without
    ties gets the model's cross-rank ones added first). ``pipesched validate FILE --backend`` runs it.

    Raises:
        ValueError: as :func:`check_pipeline_program`, or an unknown ``backend`` (names the known ones).
        ScheduleError: the Pipeline's refusal on ``backend``, its message unchanged (``PairingError`` on nccl, a
            ``ScheduleError`` chained to a ``DeadlockError`` for a learning step that would hang).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    check_pipeline_program(program)
    return step_programs(program, backend)


def program_with_ties(program: Program, ties) -> Program:
    """The program a pipeline runs for a model whose cross-rank tie groups are ``ties`` (sorted tuples of stages,
    :func:`pipesched.runtime.ties.program_ties`): ``program`` with ``TIE_REDUCE`` added by
    :func:`~pipesched.lower.add_tie_reduce` and validated when it has no ties (a compiled program, or a user's
    without them); ``program`` itself when its ties are ``ties`` (in any order; validated already, which proves
    its TIE_REDUCE instructions).

    Raises:
        ValueError: ``program`` has ties (or TIE_REDUCE instructions) other than ``ties``: names both, with the
            stages of each and what to do.
    """
    if not program.ties and not program.stages_with(Op.TIE_REDUCE):
        return validate(add_tie_reduce(program, ties)) if ties else program
    if sorted(program.ties) != sorted(ties):
        model = ", ".join(map(str, ties)) or "none"
        raise ValueError(f"the program's ties ({', '.join(map(str, program.ties)) or 'none, but it has TIE_REDUCE'}) "
                         f"differ from the model's (stages sharing a parameter on two ranks or more: {model}); give "
                         f"the program without ties and TIE_REDUCE (the Pipeline adds them for the model), or compile "
                         + (f"it with ties={list(ties)}" if ties else "it without ties"))
    return program


def _agree(name: str, given: int, own: int, what: str) -> None:
    if given != 1 and given != own:
        raise ValueError(f"{name}={given!r}, but the program runs {own} {what} (program.{name}); leave {name} "
                         f"at its default or pass {own}")
