"""The compiler's front door: a schedule name and sizes in, a lowered and proven program out; and, decided once
here, which passes the program of each ``torch.distributed`` backend gets (:func:`passes_for`)."""
from __future__ import annotations

from typing import NamedTuple

from .checks import as_int, check_callable, check_positive, check_program, check_program_size, described
from .cost import CostModel
from .errors import DependencyError, PairingError, ScheduleArgumentError, ScheduleError
from .gcpause import paused_gc
from .ir import Program
from .protocol import check_step
from .ties import tie_tuples
from . import lower, progress
from .registry import get_schedule  # built-in or registered
from .validate import validate


@paused_gc()
def build(schedule: str, num_ranks: int, num_microbatches: int, virtual_stages: int | None = None,
          costs=None, memory_limit=None, *, score=None) -> Program:
    """The compute-only program (F, B, ... per rank, no communication) of a registered schedule.

    Args:
        schedule: a registered name (``pipesched list``).
        num_ranks: pipeline ranks ``p`` >= 1.
        num_microbatches: microbatches per step ``m`` >= 1.
        virtual_stages: stages per rank ``v``; ``None`` takes the schedule's default.
        costs, memory_limit: for a schedule built from costs (``ScheduleInfo.takes_costs``: ``zb-auto``) only, the
            :class:`~pipesched.cost.CostModel` and the in-flight limit per rank it is built for (``None``: its
            defaults).
        score: for such a schedule, ``score(program, costs) -> seconds`` that ranks its candidates (``None``:
            :func:`simulated_makespan`; :func:`compile_program` passes one that applies its own passes first).
    Raises:
        UnknownScheduleError: ``schedule`` is not registered (lists the valid names).
        ScheduleArgumentError: a size the schedule cannot run (names the argument and what is valid); a program
            too big (``num_ranks * num_microbatches * virtual_stages`` above
            :data:`~pipesched.checks.MAX_PROGRAM_SIZE`, refused before building); ``costs``, ``memory_limit`` or
            ``score`` given for a schedule that does not take them.
        TypeError: ``score`` is neither callable nor None.
    """
    info = get_schedule(schedule)
    check_callable(score, "score", where="build: ", none="the default: simulated_makespan")
    if virtual_stages is not None and not isinstance(virtual_stages, bool) and as_int(virtual_stages) is None:
        raise ScheduleArgumentError(  # a bool goes on to the schedule's own check ("a bool is not a count")
            f"virtual_stages must be an integer >= 1 or None (the schedule's default: "
            f"{info.default_virtual_stages} for {schedule!r}), got {virtual_stages!r}", argument="virtual_stages")
    v = info.default_virtual_stages if virtual_stages is None else virtual_stages
    sizes = [as_int(value) for value in (num_ranks, num_microbatches, v)]
    if all(size is not None and size >= 1 for size in sizes):  # else the schedule's own checks name the fault
        check_program_size(*sizes)  # before building: m=10**30 would never finish
    if costs is not None and not isinstance(costs, CostModel):
        raise ScheduleArgumentError(f"costs must be a pipesched.CostModel (seconds, bytes per stage), got "
                                    f"{type(costs).__name__} {costs!r}", argument="costs")
    if getattr(info, "takes_costs", False):
        return info.build(num_ranks, num_microbatches, v, costs=costs, memory_limit=memory_limit,
                          score=simulated_makespan if score is None else score)
    for name, value in (("costs", costs), ("memory_limit", memory_limit), ("score", score)):
        if value is not None:  # a score would rank nothing here: told, as costs are, not ignored
            raise ScheduleArgumentError(f"{name}={value!r}: schedule {schedule!r} does not take {name}; only "
                                        f"schedules built from costs do (zb-auto)", argument=name)
    return info.build(num_ranks, num_microbatches, v)


def simulated_makespan(program: Program, costs) -> float:
    """Seconds :func:`pipesched.simulate` gives the compute-only ``program`` lowered by
    :func:`~pipesched.lower.add_send_recv` under ``costs`` (``None``: ``CostModel()``): how ``zb-auto`` ranks its
    candidates."""
    from .sim import makespan

    return makespan(lower.add_send_recv(program, check=False), costs, check=False)  # simulate()'s, no Timeline


def _flags(name: str, value, num_stages: int):
    """``True``/``False`` as given, else the checked list of per-stage bools.

    Raises:
        ScheduleArgumentError: see :func:`pipesched.lower.stage_flags` (names ``name``).
    """
    if isinstance(value, bool):
        return value
    try:
        return lower.stage_flags(value, num_stages, name)
    except ValueError as exc:
        raise ScheduleArgumentError(str(exc), argument=name) from None


def compile_program(
    schedule: str,
    num_ranks: int,
    num_microbatches: int,
    virtual_stages: int | None = None,
    dp_size: int = 1,
    recompute=False,
    split_backward=False,
    forward_only: bool = False,
    early_receives: int = 0,
    ties=(),
    costs=None,
    memory_limit=None,
) -> Program:
    """Build, lower and validate: the program an executor runs.

    Passes, in order: :func:`~pipesched.lower.split_backward` (if ``split_backward``),
    :func:`~pipesched.lower.add_recompute` (if ``recompute``),
    :func:`~pipesched.lower.add_send_recv` (``check=False``: the builder's program is not validated on
    its own, the lowered one is), :func:`~pipesched.lower.add_all_reduce` (if ``dp_size > 1``),
    :func:`~pipesched.lower.add_tie_reduce` (if ``ties``),
    :func:`~pipesched.lower.forward_only` (if ``forward_only``),
    :func:`~pipesched.lower.post_receives_early` (if ``early_receives``),
    then :func:`~pipesched.validate.validate` of the result, whichever passes ran.

    Args:
        recompute: ``False``, ``True`` (every stage) or one bool per stage (``p * v`` of them).
        dp_size: data-parallel replicas >= 1.
        split_backward: split the backward of stages into ``I`` and ``W`` so the input gradient is sent before the
            weight gradient is computed: ``False`` (none), ``True`` (every stage whose input gradient goes
            to another rank) or one bool per stage. A schedule whose builder emits ``I``/``W`` itself (``zb-h1``,
            ``zb-h2``) has no ``B`` to split: any value leaves the builder's split as it is.
        forward_only: the program of a forward-only run (``Pipeline.forward()``): the training program's F,
            SEND_F and RECV_F, proven as a forward-only program.
        early_receives: post each receive up to this many instructions earlier (0: where
            :func:`~pipesched.lower.add_send_recv` put it); :func:`passes_for` says which backend may.
        ties: groups of stages that use one parameter, e.g. ``[(0, 7)]`` (a GPT's embedding and head): their
            gradients are summed by a ``TIE_REDUCE`` per rank (:mod:`pipesched.ties`); a tie whose stages are all
            on one rank needs none and is left out of ``program.ties``. Any sequence of sequences of integers
            (numpy arrays and integers too, e.g. ``np.array([[0, 7]])``); ``None`` or empty: no ties.
        costs, memory_limit: the :class:`~pipesched.cost.CostModel` and the in-flight limit per rank (an int or one
            per rank) that ``zb-auto`` is built for; refused for other schedules (see :func:`build`).
    Raises:
        UnknownScheduleError, ScheduleArgumentError: as :func:`build`; ``early_receives`` not an integer >= 0;
            ``forward_only`` not a bool; ill-formed ``ties`` (``argument="ties"``).
        ScheduleError: the compiled program fails validation (a bug in a schedule or a pass; please report it).
    """
    dp_size = check_positive("dp_size", dp_size)  # plain ints from here on (a numpy integer is accepted)
    early_receives = check_positive("early_receives", early_receives, 0)
    try:  # a tuple of tuples: a numpy array has no truth value, and a generator is read once (zb-auto scores many)
        ties = () if ties is None else tie_tuples(ties)
    except ValueError as exc:
        raise ScheduleArgumentError(str(exc), argument="ties") from None
    if not isinstance(forward_only, bool):  # a truthy "no" or nan would compile the forward-only program
        raise ScheduleArgumentError(f"forward_only must be True or False, got {described(forward_only)}",
                                    argument="forward_only")
    progress.note(f"building {schedule}")

    def passes(program: Program) -> Program:  # the passes of the step, the same for zb-auto's candidates
        if split_backward is not False:
            program = lower.split_backward(program, _flags("split_backward", split_backward, program.num_stages))
        if recompute is not False:
            program = lower.add_recompute(program, _flags("recompute", recompute, program.num_stages))
        program = lower.add_all_reduce(_lowered(program), dp_size)  # validated as a whole below
        if ties:
            try:
                program = lower.add_tie_reduce(program, ties)
            except ValueError as exc:
                raise ScheduleArgumentError(str(exc), argument="ties") from None
        return program

    def score(candidate: Program, candidate_costs) -> float:  # zb-auto: candidates ranked as they will run
        from .sim import makespan

        return makespan(passes(candidate), candidate_costs, check=False)

    program = build(schedule, num_ranks, num_microbatches, virtual_stages, costs=costs, memory_limit=memory_limit,
                    score=score if getattr(get_schedule(schedule), "takes_costs", False) else None)
    progress.note(f"lowering {schedule}: {len(program)} instructions")
    program = passes(program)
    if forward_only:
        program = lower.forward_only(program)
    progress.note(f"validating {schedule}: {len(program)} instructions")
    return validate(lower.post_receives_early(program, early_receives))


def _lowered(program: Program) -> Program:
    """:func:`~pipesched.lower.add_send_recv` without validating first (the lowered program is validated); when it
    fails, the builder's program is validated to name its own fault (a missing or misordered instruction of a
    user's schedule), not the deadlock the timing ran into, nor the IndexError a stage or rank that does not exist
    raised in the lowering."""
    try:
        return lower.add_send_recv(program, check=False)
    except (ScheduleError, IndexError):
        validate(program)
        raise


class Backend(NamedTuple):
    """What the runtime's programs get on one ``torch.distributed`` backend (see :data:`BACKENDS`)."""

    early_receives: int  #: :func:`compile_program`'s ``early_receives`` once the message shapes are known
    same_pair_order: bool  #: the pair's messages run in issue order: both ranks must post them in one order


#: Per ``torch.distributed`` backend, the passes its executor's programs get on top of :func:`compile_program`'s
#: and what :func:`~pipesched.protocol.check_step` proves for them; :func:`passes_for` and :func:`step_programs`
#: read this table, and nothing else decides it.
#:
#: - ``gloo`` matches messages by tag and a posted receive holds nothing up: receives are posted
#:   :data:`~pipesched.lower.EARLY_RECEIVE_WINDOW` instructions early, so transfers overlap compute.
#: - ``nccl`` runs the messages between two ranks in issue order on one stream, where a posted receive holds up
#:   every later message of the pair: every message stays at its program position, and both ranks of each
#:   pair are proven to post their messages to each other in one order.
BACKENDS = {"gloo": Backend(early_receives=lower.EARLY_RECEIVE_WINDOW, same_pair_order=False),
            "nccl": Backend(early_receives=0, same_pair_order=True)}


def passes_for(backend: str, learning: bool = False) -> dict:
    """The :func:`compile_program` options of the program the executor runs on ``backend``.

    Args:
        backend: a ``torch.distributed`` backend name, ``"gloo"`` or ``"nccl"`` (:data:`BACKENDS`).
        learning: for a step that learns the message shapes: each receive of an activation then waits for
            its shape header when posted, so receives stay at their program positions on every backend.
    Raises:
        ValueError: an unknown backend (names the known ones).
    """
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"no passes are defined for backend {backend!r}; known: {', '.join(BACKENDS)}")
    return {"early_receives": 0 if learning else BACKENDS[backend].early_receives}


class StepPrograms(NamedTuple):
    """The proven programs one pipeline runs, one per kind of step (:func:`step_programs`)."""

    train: Program  #: ``step()`` once the message shapes are known
    forward: Program  #: ``forward()`` once they are known (forward-only)
    learn_train: Program  #: a ``step()`` that learns the message shapes
    learn_forward: Program  #: a ``forward()`` that learns them (forward-only)
    early_receives: int = 0  #: how many instructions early ``train`` and ``forward`` post receives (0: program order)

    def pick(self, train: bool, learning: bool) -> Program:
        """The program of a training step (``train``) or a forward, learning the message shapes or not."""
        if train:
            return self.learn_train if learning else self.train
        return self.learn_forward if learning else self.forward


#: the advice every refusal of an early-posted user program ends with
IN_PROGRAM_ORDER = "pass it in program order, without early_receives"
EARLY_ITSELF = "; the pipeline posts receives early itself once the shapes are known (gloo)"


def step_programs(program: Program, backend: str = "gloo", early_receives: bool | None = None) -> StepPrograms:
    """The four programs a pipeline on ``backend`` runs, made from ``program`` by the passes :func:`passes_for`
    names and proven: each validated (:func:`~pipesched.validate.validate`) and its whole step protocol checked
    (:func:`~pipesched.protocol.check_step`: the shape headers of a learning step, the loss, and on NCCL one
    message order per pair). Each equals :func:`compile_program` with ``program``'s arguments,
    ``forward_only`` for the forwards, and the options of ``passes_for(backend, learning)`` (``early_receives``
    overriding them).

    Args:
        program: a training program in program order, as :func:`compile_program` returns it (no early receives).
        backend: ``"gloo"`` or ``"nccl"`` (:data:`BACKENDS`).
        early_receives: ``None``: as :func:`passes_for` says for ``backend``; ``True``/``False``: receives
            posted :data:`~pipesched.lower.EARLY_RECEIVE_WINDOW` instructions early or not, once the shapes are
            known (a step that learns them never posts early).
    Raises:
        ValueError: an unknown backend; ``early_receives`` not None or a bool, or ``True`` on a backend that keeps
            program order (``nccl``); ``program`` is forward-only.
        ScheduleError: a program or its step protocol fails its proof (a bug in a schedule or a pass; please
            report it); a program whose learning step would block says which receive or send to move (gloo; a
            program given with early receives: pass it in program order instead), one whose pairs post their
            messages in other orders is a ``PairingError`` (nccl), a ``RECV_B`` before its own ``F`` a
            ``DependencyError`` (the learning step sizes it from that forward's output).
    """
    check_program(program)
    window = passes_for(backend)["early_receives"]
    if not isinstance(early_receives, (bool, type(None))):
        raise ValueError(f"early_receives must be None (the backend's choice), True or False, got {early_receives!r}")
    if early_receives is True and not window:
        raise ValueError(f"early_receives=True: backend {backend!r} runs the messages between two ranks in issue "
                         f"order, where an early receive holds up the pair's later messages (pass None or False)")
    if early_receives is not None:
        window = lower.EARLY_RECEIVE_WINDOW if early_receives else 0
    if program.forward_only:
        raise ValueError("step_programs takes a training program; it makes the forward-only ones itself")
    learn_window = passes_for(backend, learning=True)["early_receives"]
    pair_order = BACKENDS[backend].same_pair_order
    train, forward = program, lower.forward_only(program)

    def proven(part: Program, window: int, learning: bool) -> Program:
        done = validate(lower.post_receives_early(part, window))
        return check_step(done, learning=learning, early=window > 0, same_pair_order=pair_order)

    try:
        steady = proven(train, window, False), proven(forward, window, False)
    except PairingError as exc:
        if not pair_order:
            raise
        # on a backend that keeps program order, a receive posted early meets its peer's messages in another order
        raise type(exc)(
            f"{exc.reason}. On backend {backend!r} both ranks of a pair post their messages to each other in one "
            f"order, and this program posts a receive ahead of a message its peer sends first (e.g. compiled with "
            f"compile_program(..., early_receives=N)): {IN_PROGRAM_ORDER}; {backend!r} keeps every message at its "
            f"program position", exc.rank, exc.instr, exc.grid) from exc
    try:  # only the learning step's receives block (on their shape headers): a failure here is about them
        learning = proven(train, learn_window, True), proven(forward, learn_window, True)
    except DependencyError as exc:  # a RECV_B before its F: the error says what to move
        raise DependencyError(
            f"{exc.reason} (a program compiled with compile_program(..., early_receives=N) does this: "
            f"{IN_PROGRAM_ORDER}{EARLY_ITSELF})", exc.rank, exc.instr, exc.grid) from None
    except ScheduleError as exc:
        raise ScheduleError(
            f"{exc}. The program is valid, but a step that learns the message shapes (a Pipeline's first step, and "
            f"the first after a change of input signature or settings) waits for each activation's shape header "
            f"where its RECV_F is posted, so a RECV_F posted before a send its peer needs first blocks both ranks. "
            f"Post each RECV_F right before the F that uses it, or issue each SEND_F before its rank's next receive "
            f"(right after its F, as compile_program does); a program compiled with compile_program(..., "
            f"early_receives=N): {IN_PROGRAM_ORDER}{EARLY_ITSELF}") from exc
    return StepPrograms(*steady, *learning, early_receives=window)
