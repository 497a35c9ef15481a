"""One ``step()`` or ``forward()`` of a :class:`~pipesched.runtime.Pipeline` on this rank, once its own checks
passed: the opening (:class:`~pipesched.runtime.handshake.Handshake`: every rank rules alike on the input, the
target and the call), the message metas of the step's key (learned, or remembered from an earlier step with the
same input signature and settings), the executor's run of this rank's stream, and the step's record (its
timeline's events, peak activation bytes). A ``zb-auto`` pipeline without ``costs=`` then adopts the costs its
first training step measured."""
from __future__ import annotations

from .accounting import cuda_memory_base, cuda_peak_since
from .comm import backend_for
from .devices import move_to
from .handshake import StepKey
from .refusals import TargetVerdict, check_target, target_microbatches
from .loss import needs_target
from .measured import StepRecord
from .measured_costs import measure_and_compile
from .microbatch import split_sizes
from .sealed import update
from .settings import fingerprint
from .shared_buffers import check_unchanged, snapshot
from .step_state import StepInputs

CACHE_SIZE = 32  # input signatures whose message metas are remembered


def run(pipe, x, target, train: bool, scale=None, scaler=None, refusal=None):
    """Run one step (``train``) or forward of ``pipe`` on this rank; returns the loss (``train``) or the last
    stage's per-microbatch outputs (``{microbatch: output}``; empty on other ranks). ``scale``: the loss scale
    (``None``: none); ``refusal``: this rank's own check's exception, ruled on in the opening."""
    verdict = targets_verdict(pipe, target) if train and pipe.pp_rank == pipe.program.stage_to_rank[-1] else None
    key, micro, container = pipe._handshake.signature(x, train, lambda batch: move_to(batch, pipe.device, "x"),
                                                     fingerprint(pipe.stages, pipe.device, pipe.autocast),
                                                     pipe._norm_parts.opening_words(), verdict, refusal)
    if train:  # the step is accepted on every rank: it counts on the scaler (the same count everywhere)
        pipe._norm_parts.scaler = scaler  # its unscale_ rescales the anticipated norm parts
        if scaler is not None:
            scaler.scaled_steps += 1
    pipe._norm_parts.agree(pipe._handshake.clip_words, train)  # does this step send its norm parts?
    m, total = pipe.program.num_microbatches, key.batch_size
    sizes = split_sizes(total, m)
    metas = pipe._metas.get(key)  # metas follow from the input and every rank's settings
    learning = metas is None
    inputs = StepInputs(train, micro, container, target_microbatches(verdict, m),  # the opening proved its size x's
                        [n / total for n in sizes], {} if learning else metas, learning, scale,
                        pipe._norm_parts if pipe._norm_parts.agreed else None,
                        loss_weights(sizes, replica_batches(pipe._handshake, total)))
    base = cuda_memory_base(pipe.device)
    before = snapshot(pipe._shared_buffers) if pipe._shared_buffers else None
    pipe._executor.loss_fn = pipe.loss_fn  # a loss_fn assigned since the last step is the one this step uses
    loss, outputs, peak = pipe._executor.run(inputs)
    if before is not None:  # a buffer that stages on two ranks use must not change (shared_buffers.py)
        check_unchanged(pipe._shared_buffers, before)
    remember(pipe._metas, key, inputs.metas)
    pipe._learned += learning
    ex = pipe._executor
    pipe._records["step" if train else "forward"] = StepRecord(
        events=ex.events, origin=ex.origin, clock=ex.clock, wall0=ex.wall0, peak=peak,
        allocated=cuda_peak_since(pipe.device, base), train=train, dp_rank=pipe.grid.dp_rank, sent=ex.sent)
    if train and pipe._plan is not None:  # zb-auto without costs=: this first step measured them
        adopt_measured_costs(pipe)
    return loss if train else outputs


def replica_batches(handshake, total: int) -> list[int]:
    """Every replica's batch size in this step (the replicas' agreement's); ``[total]`` without data parallelism."""
    return handshake.replica_batches if handshake.dp_group is not None else [total]


def loss_weights(sizes: list[int], replicas: list[int]) -> list[float]:
    """The weight of each microbatch's loss in backward: ``n * dp / N_all`` for microbatch sizes ``sizes`` and the
    replicas' batch sizes ``replicas`` (``dp`` of them, ``N_all`` in all), so that the data-parallel all-reduce's
    average over replicas, ``(1/dp) sum_r``, is the gradient of ``sum over every replica's microbatches of
    loss_fn * n / N_all``: the whole batch's. Computed from exact integers in one division, so where every replica
    got the same batch size ``N`` it is the very float ``n / N`` (the weight of the returned loss)."""
    dp, whole = len(replicas), sum(replicas)
    return [(n * dp) / whole for n in sizes]


def adopt_measured_costs(pipe) -> None:
    """Agree on the costs the first step measured, compile zb-auto from them and run it from now on
    (collective; :func:`~pipesched.runtime.measured_costs.measure_and_compile`)."""
    costs, programs, pipe._executor = measure_and_compile(
        pipe._plan, pipe._records["step"], pipe._executor, (pipe._pp_group, pipe._dp_group), pipe.ties,
        backend_for(pipe.device))
    update(pipe, costs=costs, programs=programs, program=programs.train)  # fixed for users (runtime/sealed.py)
    pipe._plan = None


def targets_verdict(pipe, target) -> TargetVerdict:
    """The last stage's rank's verdict on ``target`` before the step's opening (:func:`check_target`)."""
    missing = (f"step() needs target on the rank of the last stage (pipeline rank {pipe.pp_rank}): loss_fn "
               f"takes (output, target)") if target is None and needs_target(pipe.loss_fn) else ""
    return check_target(target, missing, lambda batch: move_to(batch, pipe.device, "target"))


def remember(cache, key: StepKey, metas: dict) -> None:
    """Keep ``metas`` under ``key`` in ``cache`` (an ``OrderedDict``), the most recent last, at most
    :data:`CACHE_SIZE` keys."""
    cache[key] = metas
    cache.move_to_end(key)
    while len(cache) > CACHE_SIZE:
        cache.popitem(last=False)
