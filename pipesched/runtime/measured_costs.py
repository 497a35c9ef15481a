"""``Pipeline(schedule="zb-auto")`` without ``costs=``: the costs are measured during the first training step.

1. Construction compiles a **safe program** for the same ``p``, ``m``, placement (contiguous, one stage per rank),
   ``dp_size``, ``recompute`` and ``memory_limit`` (:func:`safe_program`): ``zb-h1`` when its peak in-flight count
   fits the limit on every rank (it does for the default limit, ``min(p, m)``), else ``zb-auto`` built for the
   default :class:`~pipesched.cost.CostModel` (which never exceeds the limit). Both split every backward into ``I``
   and ``W``, so the two are measured apart. ``step()`` and ``forward()`` run it until the first training step ends.
2. After that step each rank takes, for each of its stages, the **median** duration of its ``F``, ``I``, ``W`` (and
   ``R`` under recompute) instructions in the step's :class:`~pipesched.runtime.measured.StepRecord`
   (:func:`stage_seconds`; a duration starts once the instruction's input has arrived, so it is compute time; the
   median keeps a first-call warm-up or a preempted microbatch out), and measures the **message latency** with a
   ping (:func:`ping_latency`): each rank ``r`` sends rank ``r + 1`` a message the size of the largest activation
   it sent it in the step and gets one of that size back, 3 times; half the fastest round trip is the one-way time
   of an activation message. A ping rather than matched ``SEND``/``RECV`` times of the step: a round trip needs no
   clock shared by two ranks (across hosts ``time.time()`` is only as good as their synchronisation), and inside a
   step a receive completes only when its rank gets to wait for it, so its time mixes transfer and compute. The
   ping runs after every message of the step was delivered, pair by pair (ranks ``(0, 1), (2, 3), ...``, then
   ``(1, 2), (3, 4), ...``) on control tags no step message uses, so it meets no message of a step. It also takes
   the **send overhead**: the median time the ping's send calls took on this rank (on gloo the send call blocks its
   rank while it copies and hands the message over, ~0.1 ms here), which the simulator charges to the sending rank;
   the latency is the ping's one-way time less that overhead (at least 0). Not the first step's own ``SEND`` calls:
   that step learns the message shapes (a header before each activation, each receive blocking) and runs cold, so
   its sends took 10-50 times as long as a later step's.
3. **Agreement** (:func:`agree_costs`): an all-gather over the pipeline group gives every rank each stage's numbers
   from the rank that owns it, and the latency and send overhead of every rank (the largest of each is kept); with ``dp_size > 1`` an
   all-gather over the data-parallel group then gives every rank every replica's vector, and the element-wise
   **maximum** over replicas is kept (exact, so every rank of the world computes the same floats: the whole job
   plans for its slowest replica). The result is one :class:`~pipesched.cost.CostModel`: per-stage ``forward``,
   ``input_grad``, ``weight_grad``, ``backward = I + W``, ``recompute`` (``R``'s median; ``None`` without
   recompute) in seconds, ``send_overhead``, and ``latency`` (seconds: with the overhead, the whole one-way time
   of an activation message, so ``bandwidth`` stays infinite and ``activation_bytes`` 0). A measured 0 s is raised to 1 ns (a timer tick).
4. Every rank compiles ``zb-auto`` from those costs and the memory limit (:func:`measured_programs`: the same passes
   and proofs as at construction, :func:`~pipesched.api.step_programs`), and an all-gather of the program's
   fingerprint over both groups checks that every rank compiled the same one. From the second step on the
   pipeline runs it.

Everything here is collective over the pipeline's groups and runs inside the first ``step()``: a failure on any
rank ends every rank with a ``PipelineError``, as a failure of the step itself does.
"""
from __future__ import annotations

import statistics
import time
from typing import NamedTuple

import torch

from ..api import StepPrograms, compile_program, step_programs
from ..cost import CostModel
from ..ir import Op
from ..schedules.zb_auto import check_memory_limit
from ..program_io import fingerprint
from ..timeline import peak_inflight
from ..user_programs import program_for
from .executor import Executor
from .step_state import Links
from .ties import with_ties
from .transport import gather_rows, wait

KINDS = (Op.F, Op.I, Op.W, Op.R)  #: the instructions whose per-stage medians make the costs, in vector order
_TAG_HEADER, _TAG_PING, _TAG_PONG = 13, 14, 15  # control tags (0..15) that no step message uses
_REPEATS = 3  # round trips per pair; the fastest counts
_TICK = 1e-9  # seconds: the least a measured duration is taken to be


class MeasurePlan(NamedTuple):
    """How to compile ``zb-auto`` once its costs are measured: the ``Pipeline`` arguments it depends on."""

    num_ranks: int
    num_microbatches: int
    dp_size: int
    recompute: object  #: ``Pipeline``'s ``recompute`` argument, as given
    split_backward: object
    memory_limit: object  #: ``None``, an int or one int per rank, as given
    early_receives: bool | None


def plan_for(schedule, costs, num_ranks, num_microbatches, dp_size, recompute, split_backward, memory_limit,
             early_receives) -> MeasurePlan | None:
    """The plan when the pipeline must measure its costs (``schedule == "zb-auto"`` and no ``costs``), else ``None``."""
    if schedule != "zb-auto" or costs is not None:
        return None
    return MeasurePlan(num_ranks, num_microbatches, dp_size, recompute, split_backward, memory_limit, early_receives)


def costs_field(plan: MeasurePlan | None, costs) -> str:
    """What the construction agreement (:mod:`~pipesched.runtime.agreement`) compares for ``costs``: every rank
    must give the same costs, or none (then all measure them)."""
    return "None (measured in the first step)" if plan is not None else repr(costs)


def memory_limit_field(memory_limit, zb_auto: bool, num_ranks: int, num_microbatches: int) -> list | None:
    """What the construction agreement compares for ``memory_limit``: for ``zb-auto`` (``zb_auto``), the per-rank
    in-flight limit it stands for (:func:`~pipesched.schedules.zb_auto.check_memory_limit`: ``3`` and ``[3, 3]``
    agree, ``None`` stands for its default, ``min(p, m)`` per rank); ``None`` for other schedules (which refuse a
    limit). Compared before any group exists, so a rank with another limit is named at construction: with measured
    costs every rank starts from the same safe program, and the difference would only show when they compile
    zb-auto after the first step."""
    return list(check_memory_limit(memory_limit, num_ranks, num_microbatches)) if zb_auto else None


def safe_program(plan: MeasurePlan, virtual_stages=None):
    """The program the first step runs (see the module docstring): ``zb-h1`` if its peak in-flight count is within
    the memory limit on every rank, else ``zb-auto`` for the default ``CostModel()``; lowered and validated
    (:func:`~pipesched.api.compile_program`).

    Raises:
        ScheduleArgumentError: what ``zb-auto`` refuses (``virtual_stages != 1``, a bad ``memory_limit``, ...),
            before any communication; the message names the argument.
    """
    args = (plan.num_ranks, plan.num_microbatches, virtual_stages, plan.dp_size, plan.recompute, plan.split_backward)
    fallback = program_for("zb-auto", *args, costs=CostModel(), memory_limit=plan.memory_limit)  # checks every argument
    limit = fallback.meta["zb_auto"]["memory_limit"]
    h1 = compile_program("zb-h1", *args)
    fits = all(peak <= cap for peak, cap in zip(peak_inflight(h1.ranks), limit))
    return h1 if fits else fallback


def stage_seconds(events, stages) -> dict:
    """Per stage of ``stages``, the median seconds of each kind of :data:`KINDS` it ran (a kind it did not run is
    left out).

    Args:
        events: ``(instr, start, end)`` per instruction, seconds (:meth:`StepRecord.seconds`).
        stages: the stages to report (this rank's).
    Returns:
        ``{stage: {Op: seconds}}``, each at least 1 ns.
    """
    durations = {s: {kind: [] for kind in KINDS} for s in stages}
    for instr, start, end in events:
        if instr.op in KINDS and instr.stage in durations:
            durations[instr.stage][instr.op].append(end - start)
    return {s: {kind: max(statistics.median(times), _TICK) for kind, times in kinds.items() if times}
            for s, kinds in durations.items()}


def cost_vector(medians: dict, num_stages: int, latency: float, send_overhead: float = 0.0) -> list:
    """``[F of each stage, I ..., W ..., R ..., latency, send overhead]`` (seconds), 0 where this rank has no
    number."""
    per_stage = [medians.get(s, {}).get(kind, 0.0) for kind in KINDS for s in range(num_stages)]
    return per_stage + [float(latency), float(send_overhead)]



def combine(rows, stage_to_rank) -> list:
    """One vector from the pipeline ranks' :func:`cost_vector` rows (by pipeline rank): each stage's numbers from
    the rank that owns it, the largest latency and the largest send overhead."""
    n = len(stage_to_rank)
    out = [rows[stage_to_rank[k % n]][k] for k in range(len(KINDS) * n)]
    return out + [max(row[-2] for row in rows), max(row[-1] for row in rows)]


def replicas_max(vectors) -> list:
    """The element-wise maximum of the replicas' vectors: exact, so the same floats on every rank."""
    return [max(column) for column in zip(*vectors)]


def cost_model(vector, num_stages: int) -> CostModel:
    """The :class:`CostModel` of a combined vector (see the module docstring).

    Raises:
        ValueError: a stage has no ``F``, ``I`` or ``W`` time (the safe program ran none: a bug).
    """
    per = {kind: tuple(vector[i * num_stages:(i + 1) * num_stages]) for i, kind in enumerate(KINDS)}
    for kind in (Op.F, Op.I, Op.W):
        missing = [s for s, t in enumerate(per[kind]) if not t > 0]
        if missing:
            raise ValueError(f"no measured {kind.value} time for stages {missing}; the first step's program must run "
                             f"F, I and W of every stage")
    recompute = per[Op.R] if all(t > 0 for t in per[Op.R]) else None
    backward = tuple(i + w for i, w in zip(per[Op.I], per[Op.W]))
    return CostModel(forward=per[Op.F], backward=backward, input_grad=per[Op.I], weight_grad=per[Op.W],
                     recompute=recompute, latency=vector[-2], send_overhead=vector[-1])


def activation_bytes(sent: dict, peer: int) -> int:
    """The largest activation message (bytes) this rank's step sent to ``peer`` (``StepRecord.sent``); 8 if none."""
    return max([n for instr, n in sent.items() if instr.op is Op.SEND_F and instr.peer == peer], default=8)


def ping_latency(transport, pp_rank: int, num_ranks: int, nbytes: int) -> tuple[float, float]:
    """This rank's measured one-way time (seconds) of a message of ``nbytes`` to pipeline rank ``pp_rank + 1``
    (0.0 on the last rank), and the median time its send calls of the ping took (the send overhead: the rank's own
    time per message, measured warm, apart from any step); collective over the pipeline group (see the module
    docstring).

    Raises:
        CommError: a peer is gone or a wait timed out.
    """
    latency, calls = 0.0, []
    for phase in (0, 1):
        if pp_rank % 2 == phase and pp_rank + 1 < num_ranks:
            latency = _initiate(transport, pp_rank + 1, nbytes, calls)
        elif pp_rank % 2 != phase and pp_rank >= 1:
            _serve(transport, pp_rank - 1, calls)
    return latency, statistics.median(calls) if calls else 0.0


def _initiate(transport, peer: int, nbytes: int, calls: list) -> float:
    """Round trips to ``peer`` (one untimed first). On gloo every pong's receive is posted before any ping is sent,
    as the steps post receives early, so a send call's time is this rank's own (a send to a peer that has not posted
    its receive waits for it on gloo); on NCCL each receive is posted after its ping (:func:`_ahead`)."""
    device = transport.device
    _settled(transport.send((torch.tensor([nbytes], dtype=torch.int64, device=device),), peer, _TAG_HEADER))
    payload = torch.zeros(nbytes, dtype=torch.uint8, device=device)

    def post():
        return transport.post([((nbytes,), torch.uint8)], peer, _TAG_PONG, f"the latency ping of {peer}")

    pongs = [post() for _ in range(_REPEATS + 1)] if _ahead(transport) else None
    best = float("inf")
    for k in range(_REPEATS + 1):
        start = time.perf_counter()
        sent = transport.send((payload,), peer, _TAG_PING)
        call = time.perf_counter() - start
        transport.wait(pongs[k] if pongs else post())
        _settled(sent)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if k:  # the first round trip warms up (and the peer posts its receives meanwhile)
            calls.append(call)
            best = min(best, time.perf_counter() - start)
    return best / 2


def _serve(transport, peer: int, calls: list) -> None:
    what = f"the latency ping from pipeline rank {peer}"
    (header,), _ = transport.wait(transport.post([((1,), torch.int64)], peer, _TAG_HEADER, what))
    nbytes = int(header.item())

    def post():
        return transport.post([((nbytes,), torch.uint8)], peer, _TAG_PING, what)

    pings = [post() for _ in range(_REPEATS + 1)] if _ahead(transport) else None
    for k in range(_REPEATS + 1):
        (payload,), _ = transport.wait(pings[k] if pings else post())
        start = time.perf_counter()
        sent = transport.send((payload,), peer, _TAG_PONG)
        if k:
            calls.append(time.perf_counter() - start)
        _settled(sent)


def _ahead(transport) -> bool:
    """Whether the ping's receives are posted ahead: on gloo, yes; not on NCCL (a CUDA device), whose messages
    between two ranks run in issue order on one stream, so a receive posted before a send to the same peer would
    hold that send up, and both ranks would wait for ever."""
    return transport.device.type != "cuda"


def _settled(sent) -> None:
    work, _ = sent
    wait(work, "a latency ping send")


def agree_costs(vector, stage_to_rank, groups, sizes, device) -> CostModel:
    """The one :class:`CostModel` of the job from every rank's :func:`cost_vector` (see the module docstring).

    Args:
        groups: ``(pipeline group, data-parallel group or None)``; ``sizes``: their sizes.
    Raises:
        CommError: an all-gather failed.
    """
    pp_group, dp_group = groups
    rows = gather_rows(vector, pp_group, sizes[0], torch.float64, device, "the all-gather of the measured costs")
    combined = combine(rows, stage_to_rank)
    if dp_group is not None:
        combined = replicas_max(gather_rows(combined, dp_group, sizes[1], torch.float64, device,
                                           "the all-gather of the replicas' measured costs"))
    return cost_model(combined, len(stage_to_rank))


def measured_programs(plan: MeasurePlan, costs: CostModel, ties, backend: str) -> StepPrograms:
    """``zb-auto`` for ``costs`` and the plan's memory limit, with the ties' ``TIE_REDUCE``, as the step programs of
    ``backend`` (proven: :func:`~pipesched.api.step_programs`)."""
    program = program_for("zb-auto", plan.num_ranks, plan.num_microbatches, None, plan.dp_size, plan.recompute,
                          plan.split_backward, costs=costs, memory_limit=plan.memory_limit)
    return step_programs(with_ties(program, ties), backend, plan.early_receives)


def check_same_program(program, groups, sizes, device) -> None:
    """Every rank compiled the same ``program`` (its fingerprint all-gathered over both groups).

    Raises:
        RuntimeError: some rank compiled another program (a bug: they were built from the same costs).
        CommError: an all-gather failed.
    """
    mine = fingerprint(program)
    for group, size in zip(groups, sizes):
        if group is None:
            continue
        prints = [row[0] for row in gather_rows([mine], group, size, torch.int64, device,
                                              "the all-gather of the zb-auto program's fingerprint")]
        if any(p != mine for p in prints):
            raise RuntimeError(f"the ranks compiled different zb-auto programs from the same measured costs "
                               f"(fingerprints {[f'{p:014x}' for p in prints]}); please report it")


def rebuilt_executor(executor: Executor, programs: StepPrograms) -> Executor:
    """A new :class:`Executor` of ``programs`` on ``executor``'s stages, loss, device, transport, groups and ties."""
    links = Links(executor.transport, executor.dp_group, executor.ties)
    return Executor(programs, executor.pp_rank, executor.work, links)


def measure_and_compile(plan: MeasurePlan, record, executor: Executor, groups, ties, backend: str):
    """Steps 2 to 4 of the module docstring, after the first training step on this rank.

    Args:
        record: the first step's :class:`~pipesched.runtime.measured.StepRecord`.
        executor: the executor that ran it (its program, rank, transport, device).
        groups: ``(pipeline group, data-parallel group or None)``.
        ties: ``Pipeline.ties``; ``backend``: ``"gloo"`` or ``"nccl"``.
    Returns:
        ``(costs, programs, executor)``: the agreed :class:`CostModel`, the proven ``zb-auto`` step programs and an
        executor that runs them.
    Raises:
        CommError: a peer is gone or a wait timed out.
    """
    program, pp_rank, device = executor.program, executor.pp_rank, executor.device
    medians = stage_seconds(record.seconds(), program.stages_of(pp_rank))
    nbytes = activation_bytes(record.sent, pp_rank + 1)
    one_way, overhead = ping_latency(executor.transport, pp_rank, program.num_ranks, nbytes)
    latency = max(0.0, one_way - overhead)
    sizes = (program.num_ranks, plan.dp_size)
    costs = agree_costs(cost_vector(medians, program.num_stages, latency, overhead), program.stage_to_rank, groups,
                        sizes, device)
    programs = measured_programs(plan, costs, ties, backend)
    check_same_program(programs.train, groups, sizes, device)
    return costs, programs, rebuilt_executor(executor, programs)
