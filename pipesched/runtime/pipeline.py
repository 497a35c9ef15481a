"""``Pipeline``: an ``nn.Sequential`` trained with a compiled pipeline schedule over torch.distributed."""
from __future__ import annotations

import time
from collections import OrderedDict

import torch
import torch.distributed as dist

from ..checks import check_flag
from .comm import init_default_group, make_groups, world_and_rank
from .amp import autocast_context, checked_autocast, loss_scaling
from .built import Built
from .collective import peer_loss_as_comm_error
from .agreement import agree, connected, describe, groups_failed, model_shapes, refuse_construction
from .construction import local_setup
from .replica_init import COPY_WHAT, COPY_WHERE, copy_replica_zero
from .executor import Executor
from .step_state import Links, RankWork
from .handshake import Handshake, StepKey
from .norm_parts import NormParts
from .heap import keep_freed_memory
from .failure import FailureChannel, PipelineError
from .departure import announce_close, watch
from .measured import StepRecord
from .measured_costs import costs_field, memory_limit_field
from .microbatch import merge
from .misfit import refused_on_misfit
from .pipeline_calls import PipelineCalls
from .pipeline_collectives import PipelineCollectives
from .pipeline_failure import teardown
from .pipeline_measured import PipelineMeasured
from .sealed import Sealed
from .stage import layers_of
from .state import load_rank_state_dict, rank_state_dict
from .step_run import run
from .ties import counted_parameters, start_ties
from .transport import Transport


class Pipeline(PipelineCalls, PipelineCollectives, PipelineMeasured, Sealed):
    """Train an ``nn.Sequential`` with a pipeline schedule; construct it on every rank of the job.

    Rank layout: world size = pipeline ranks ``p`` x ``dp_size``; world rank ``g`` is pipeline rank
    ``g % p`` of replica ``g // p`` (see :mod:`pipesched.runtime.comm`). The model is cut into
    ``p * virtual_stages`` stages in order; stage ``s`` runs on pipeline rank ``program.stage_to_rank[s]``, as the
    schedule places it: ``s`` (one stage per rank), ``s % p`` (interleaved), or a V (``zbv``: rank ``r`` holds
    stages ``r`` and ``2p - 1 - r``, so the first and the last stage are both on rank 0).

    Args:
        model: ``nn.Sequential`` or list of modules, identical on every rank (this rank keeps its stages'
            layers, which stay shared with ``model``). A stage passes a tensor or a tuple of tensors
            (any dtype) to the next, as ``nn.Sequential`` passes them from layer to layer. The stages' device
            (``device``) decides the rest: on CUDA, point-to-point messages use NCCL, the timeline
            uses CUDA events, and that device is made current (``torch.cuda.set_device``); else gloo and
            ``time.perf_counter``.
        schedule: a schedule name (``pipesched.SCHEDULES`` or registered: ``pipesched.register_schedule``), or a
            lowered ``pipesched.Program`` of world size / ``dp_size`` ranks, validated here; its ``dp_size`` and
            ``num_microbatches`` are used (the arguments must be left at 1 or equal them) and its R/I/W stand
            (``recompute``/``split_backward`` must be False); its ties, if any, must be the model's cross-rank
            ties (else ``ValueError`` naming both): see :mod:`pipesched.user_programs`.
        num_microbatches: microbatches per step ``m`` >= 1.
        loss_fn: ``loss_fn(output, target) -> scalar tensor`` (``loss_fn(output)`` when ``target`` is None).
        virtual_stages: stages per rank ``v``; ``None`` takes the schedule's default (interleaved: 2; zbv: 2, its only value).
        balance: ``None`` (even by layer count), ``"params"``, ``"time"`` (needs ``profile``: the cut that minimises
            the slowest rank's measured seconds, :func:`pipesched.partition.balance_by_time`) or a list of layers
            per stage.
        dp_size: data-parallel replicas of the pipeline. As DDP, replica 0's values are copied to every replica
            at construction: each rank's stage parameters and buffers, in place, one broadcast per dtype over its
            data-parallel group (:mod:`~pipesched.runtime.replica_init`), so replicas built with other initial
            weights (each process seeded by its rank) train replica 0's model.
        recompute: ``False``, ``True`` or one bool per stage: keep only the stage input for backward and
            re-run the forward right before it, with the RNG state and the buffer values its first run saw,
            leaving the buffers as they were (:mod:`pipesched.runtime.recompute`); forward hooks on a recomputed
            stage are refused (they would run twice).
        split_backward: run the backward of a stage as ``I`` (input gradient), then the send of that
            gradient, then ``W`` (weight gradients), so the previous stage's rank does not wait for this
            one's weight gradients (see :mod:`pipesched.runtime.split`; gradients are bitwise the same). A tensor
            hook registered inside a split stage (``y.register_hook``) runs at both ``I`` and ``W`` (gradients
            stay right: ``W`` uses what ``I`` recorded after the hook), so its side effects happen twice, and
            ``retain_grad()`` gives ``y.grad`` twice the gradient.
            ``False`` (default): a fused ``B``; ``True``: every stage whose input gradient goes to another
            rank; or one bool per stage. It pays off when a message's latency is large next to the
            weight-gradient half; on small layers its bookkeeping costs more (README, Benchmarks).
        device: the device this rank's stages run on; ``None``: that of their first parameter or buffer (CPU
            if they have neither). Pass it for a rank whose stages hold no tensors but run on a GPU. It must be the
            CPU or an available CUDA device holding all of this rank's stage tensors, else a ``ValueError`` naming
            both devices (:func:`~pipesched.runtime.devices.checked_device`); ``x`` and ``target`` are moved there.
        timeout: seconds any rank waits for a message or collective before failing the step; the same on every
            rank (compared at construction, as the device type is: ``cpu`` or ``cuda``, whose backend the groups use).
        early_receives: ``None`` (default): as the backend allows (:func:`pipesched.api.passes_for`): on gloo,
            once a step's message shapes are known, receives are posted up to 16 instructions early
            (:func:`pipesched.lower.post_receives_early`); on NCCL every message stays at its program
            position. ``False``: program order on gloo too. ``True``: early receives (gloo only).
        costs, memory_limit: for ``schedule="zb-auto"`` only: the :class:`~pipesched.CostModel` (seconds, bytes) and
            the in-flight limit per rank (int or list) it is built for (:func:`pipesched.compile_program`; identical
            on every rank, else construction fails naming the differing program). ``costs=None``: measured. The
            first training ``step()`` runs a safe program with I and W split (``zb-h1``, or ``zb-auto`` for the
            default costs where ``zb-h1`` exceeds ``memory_limit``) and measures per stage the median F, I, W
            (and R) seconds and, by a ping between neighbouring ranks, the one-way time of an activation message and
            the median seconds of a send call;
            at its end every rank of the job agrees on one ``CostModel`` (each stage's numbers from the rank that
            owns it, the maximum over data-parallel replicas) and compiles ``zb-auto`` from it, which every later
            step runs (:mod:`pipesched.runtime.measured_costs`). A ``forward()`` before that runs the safe program.
        profile: for ``balance="time"``: the model's :class:`~pipesched.profile.LayerProfile`
            (:func:`~pipesched.runtime.profile_layers`); a profile of another model is a ``ValueError``.
        autocast: ``None`` (default; the caller's autocast state applies), ``torch.bfloat16`` or ``torch.float16``:
            each stage's forward, its recompute and ``loss_fn`` run under ``torch.autocast(device.type, autocast)``
            (as torch advises: the forward including the loss; backward outside); parameters, gradients and
            optimizer state stay as they are (float32), and activations cross ranks in the dtype the stage
            produced (bfloat16 halves the bytes). Every rank must pass the same. float16 wants a
            :class:`~pipesched.runtime.GradScaler` (``step(..., scaler=)``). See :mod:`pipesched.runtime.amp`.
        gradient_accumulation_fusion: ``False`` (default) or ``True``: ``W`` adds an ``nn.Linear``'s weight gradient
            into its existing ``.grad`` with one GEMM (``addmm_``, ``beta = 1``), as Megatron-Core's option of that
            name; a ``B`` then runs as ``I`` then ``W`` (:mod:`pipesched.runtime.wgrad_fusion`: where it applies,
            what it costs). **Not bitwise** (float rounding), so the bitwise guarantees hold with it off. A
            ``TypeError`` for anything but a bool. Per rank (not compared across ranks).
        pair_weight_grads: ``False`` (default) or ``True`` (with ``gradient_accumulation_fusion=True`` only, else a
            ``ValueError``; a ``TypeError`` for anything but a bool): a fused ``W`` whose stage has a later ``W`` (or
            ``B``) in this rank's stream of the step keeps its GEMM for that one, which runs one ``addmm_`` over
            both microbatches' rows (the GEMM is bound by writing the weight's gradient: at a few dozen rows, two
            cost far more than one over twice the rows). A stage's last ``W`` of the step never waits, so every
            ``.grad`` is complete before ALL_REDUCE, TIE_REDUCE and the step's end. Memory: each ``Linear`` keeps
            one microbatch's input and output gradient alive until its stage's next ``W``. Not bitwise (as fusion).
            Per rank (not compared across ranks).
    Attributes:
        programs: the validated programs this pipeline runs (:class:`pipesched.api.StepPrograms`): ``step()``
            and ``forward()``, once the message shapes are known and while learning them; the executor runs
            this rank's stream of the one that fits each step, as it is.
        program: ``programs.train``, what ``step()`` runs once the shapes are known. ``zb-auto`` without ``costs``:
            the safe program (``program.schedule`` says which) until the first training step ends, then the
            ``zb-auto`` program compiled from the measured costs (``programs`` alike). The first step's
            :meth:`timeline` then carries the new program's name and in-flight counts in its metadata.
        costs: the :class:`~pipesched.CostModel` ``zb-auto`` was compiled from: the given ``costs``, or, measured,
            ``None`` until the first training step ends, then the agreed costs (per-stage ``forward``,
            ``input_grad``, ``weight_grad``, ``backward = I + W``, ``recompute`` (``None`` without recompute) and
            ``latency`` and ``send_overhead``, in seconds; identical on every rank of the job). ``None`` for other schedules.
        autocast: the checked ``autocast`` argument (``None``, ``torch.bfloat16`` or ``torch.float16``); read only.
        ties: the parameters used by two stages or more, frozen ones too
            (:class:`~pipesched.runtime.ties.TiedParameter`: names in the unsplit model, stages, ranks, owning
            stage). Each rank holding a use keeps its copy; a tie across ranks gets a ``TIE_REDUCE`` that sums the
            copies' gradients after the step's last backward of its stages (:mod:`pipesched.ties`), so the copies
            stay identical under any optimizer.
        layer_names: each layer's key in the model, in order, on every rank (``("0", "1", ...)`` for a plain
            ``nn.Sequential`` or a list; ``("embed", "block0", ...)`` for one built from an ``OrderedDict``): layer
            ``i``'s tensors are named ``f"{layer_names[i]}.<name>"``, as the unsplit model's ``state_dict()``.
    Raises:
        TypeError, ValueError (incl. ``ScheduleArgumentError``), UnknownScheduleError: a bad argument,
            before any communication; the message names the argument, its value and what is valid.
        ScheduleError (``DeadlockError``, ``PairingError``, ...): ``schedule`` is a Program that fails validation
            (the validator's error), before any communication, on every rank.
        ValueError: another rank of the job built its Pipeline with other arguments (names the first that
            differs, both ranks and both values; ``model``: other tensor names or shapes, e.g. other widths, shown
            as a digest), or refused its own (quotes its error); checked on every rank
            through the default group's store before any pipeline group exists, so no rank waits for the others.
        ValueError: a layer of a recomputed stage on this rank has a forward hook or pre-hook, or a global module
            forward hook is registered (names the layer, its class and the hook; see
            :func:`~pipesched.runtime.recompute.check_no_forward_hooks`); the other ranks raise it too, as above.
        ValueError: a parameter shares memory with another tensor of the model that is not the same ``Parameter``
            (a view or slice of another layer's weight, a buffer over a weight) and their uses span two pipeline
            ranks (names both, their stages and ranks; :mod:`~pipesched.runtime.shared_buffers`), before any
            communication, on every rank.
        ValueError: the copies of a tied parameter differ between ranks of one replica at construction (names the
            parameter's names in the unsplit model and two ranks whose copies differ), on every rank
            (:func:`~pipesched.runtime.ties.check_copies`).
        TimeoutError: a rank did not construct its Pipeline within ``timeout`` seconds, or this rank reached the
            construction agreement after the others had timed out on it (names them); or, launched through
            ``env://`` (torchrun), the other ``WORLD_SIZE - 1`` ranks did not join within it (says how to start them).
    """

    _SETTABLE = ("loss_fn", "anticipate_clip")  # what a user may set after construction (runtime/sealed.py)

    @refused_on_misfit(lambda _pipe, error: refuse_construction(error))
    def __init__(self, model, schedule: str = "1f1b", num_microbatches: int = 1, loss_fn=None,
                 virtual_stages: int | None = None, balance=None, dp_size: int = 1, recompute=False,
                 split_backward=False, device=None, timeout: float = 300.0,
                 early_receives: bool | None = None, autocast: torch.dtype | None = None, costs=None,
                 memory_limit=None, profile=None, gradient_accumulation_fusion: bool = False,
                 pair_weight_grads: bool = False) -> None:
        try:
            setup = local_setup(model, schedule, num_microbatches, loss_fn, virtual_stages, balance, dp_size,
                                recompute, split_backward, device, timeout, early_receives, costs, memory_limit,
                                profile)  # checks, program, stages, device: nothing communicated yet
            layers, self._plan, self.loss_fn, self.timeout = setup.layers, setup.plan, loss_fn, float(timeout)
            self._shared_buffers = setup.shared_buffers  # checked unchanged around each step (shared_buffers.py)
            for name in ("state_spec", "grid", "program", "programs", "costs", "balance", "ties", "first_layers",
                         "stages", "device", "layer_names"):
                setattr(self, name, getattr(setup, name))
            self.autocast = checked_autocast(autocast, self.device)  # ValueError naming autocast and valid values
            self._fuse_wgrad = check_flag(gradient_accumulation_fusion, "gradient_accumulation_fusion", "Pipeline: ")
            self._pair_wgrad = check_flag(pair_weight_grads, "pair_weight_grads", "Pipeline: ")
            if self._pair_wgrad and not self._fuse_wgrad:
                raise ValueError(f"Pipeline: pair_weight_grads=True needs gradient_accumulation_fusion=True (it pairs "
                                 f"the fused weight-gradient GEMMs), got gradient_accumulation_fusion="
                                 f"{self._fuse_wgrad}: pass both True, or pair_weight_grads=False")
            self._built = Built(model, self.stages, self.first_layers, self.layer_names)  # checked at each step
        except Exception as exc:
            refuse_construction(exc, timeout)  # the other ranks must not wait for this one
            raise
        init_default_group(self.device, self.timeout)  # communication starts here
        self._construction = agree(  # which of the job's Pipelines this is, the same on every rank (checkpoint.py)
            dist.distributed_c10d._get_default_store(), self.grid.world_rank, self.grid.world_size,
              dict(costs=costs_field(self._plan, self.costs),  # first: a measured safe program has another name
                   memory_limit=memory_limit_field(memory_limit, self._plan is not None or
                                                   self.program.schedule == "zb-auto", self.program.num_ranks,
                                                   self.program.num_microbatches),
                   device=self.device.type,  # the groups' backend (gloo or NCCL) follows it; its index may differ
                   **describe(self.program, self.balance, len(layers), self.grid.world_size,
                              self.programs.early_receives),
                   autocast=str(self.autocast), model=model_shapes(self.state_spec),
                   timeout=self.timeout), self.timeout, self.state_spec)  # one timeout: the roll call assumes it
        grid = self.grid
        self._tie_groups, ties = start_ties(layers, self.ties, self.program, grid, self.timeout, self.device,
                                            self.layer_names)
        try:
            self._pp_group, self._dp_group = make_groups(grid, self.timeout, self.device)
        except Exception as exc:  # file its connected entry all the same: the ranks' rounds stay in step
            groups_failed(dist.distributed_c10d._get_default_store(), grid.world_rank, grid.world_size,
                          self.timeout, exc)  # and leave the failed construction with the other ranks
            raise
        connected(dist.distributed_c10d._get_default_store(), grid.world_rank, grid.world_size, self.timeout)
        names = [self._pp_group.group_name] + ([self._dp_group.group_name] if self._dp_group else [])
        names += [group.group_name for group in self._tie_groups.values()]
        self._failures = FailureChannel(dist.distributed_c10d._get_default_store(), names,
                                        f"pipesched/pipeline-{self._construction}")
        work = RankWork(self.stages, self.loss_fn, self.device, self.first_layers,
                        autocast_context(self.device, self.autocast), self._fuse_wgrad, self._pair_wgrad)
        links = Links(Transport(self._pp_group, self.program.num_stages, self.device), self._dp_group, ties)
        keep_freed_memory()  # no page faults for the weight-gradient blocks each backward frees (heap.py)
        self._executor = Executor(self.programs, grid.pp_rank, work, links)
        self._handshake = Handshake(self._executor.transport, self.program, grid.pp_rank, self.device,
                                    self._dp_group, self.autocast)
        self._norm_parts = NormParts(self._executor.transport, self.program.num_ranks, grid.pp_rank, self.device,
                                     self.owned_parameters)  # anticipated clip_grad_norm_ (runtime/norm_parts.py)
        self._metas: OrderedDict[StepKey, dict] = OrderedDict()  # -> {(kind, stage, mb): meta}
        self._learned = 0  # steps and forwards that learned their message metas
        self._records: dict[str, StepRecord | None] = {"step": None, "forward": None}  # the last step()'s, forward()'s
        self._broken: PipelineError | None = None
        self._closed = False
        self._running = 0  # calls (step, forward, collectives) in progress on this Pipeline
        self._idle_since, self._away_s = time.monotonic(), 0.0  # the last call's end; the pause before this call
        self._departure = watch(self, self._failures, self.grid)  # said to peers still waiting if it goes unclosed
        if self._dp_group is not None:  # as DDP: every replica starts from replica 0's values (replica_init.py)
            self._guarded(lambda: peer_loss_as_comm_error(
                lambda: copy_replica_zero(self.stages, self._dp_group, grid, self.device), COPY_WHAT), where=COPY_WHERE)
        self._seal(strict=type(self) is Pipeline)  # public attributes are fixed from here on (runtime/sealed.py)

    @classmethod
    def from_plan(cls, model, plan, loss_fn=None, **kwargs) -> "Pipeline":
        """The pipeline a plan chose (:func:`pipesched.plan`: its winner, or one :class:`~pipesched.Candidate`):
        its schedule, m, v, balance, recompute, split backward and dp size; ``kwargs`` are the other arguments.

        Raises:
            ValueError: the model's layer count (or layer classes) differs from the plan's, the job's world size
                is not pp x dp, or ``kwargs`` sets what the plan decides (:func:`pipesched.planner.pipeline_kwargs`);
                on every rank, before any communication. TypeError: ``plan`` is neither.
        """
        from ..planner import pipeline_kwargs

        layers = layers_of(model)
        kwargs = pipeline_kwargs(plan, len(layers), world_and_rank()[0], [type(l).__name__ for l in layers], kwargs)
        return cls(model, loss_fn=loss_fn, **kwargs)

    # ---- public ----------------------------------------------------------------------------------------

    @property
    def pp_rank(self) -> int:
        """This process's pipeline rank."""
        return self.grid.pp_rank

    @property
    def dp_rank(self) -> int:
        """This process's data-parallel replica (0 .. ``dp_size - 1``): the shard of the data it should pass."""
        return self.grid.dp_rank

    @property
    def gradient_accumulation_fusion(self) -> bool:
        """Whether ``W`` fuses a ``Linear``'s weight-gradient accumulation (the constructor's argument; fixed)."""
        return self._fuse_wgrad

    @property
    def pair_weight_grads(self) -> bool:
        """Whether fused ``W`` GEMMs of a stage run two microbatches at a time (the constructor's argument; fixed)."""
        return self._pair_wgrad

    @property
    def stage_ids(self) -> tuple[int, ...]:
        """The global stages this rank runs."""
        return tuple(self.stages)

    def parameters(self):
        """This rank's parameters (those of its stages), each once even if two of its stages share it, for an
        optimizer; a parameter tied to a stage on another rank (:attr:`ties`) is this rank's copy."""
        seen = set()
        for module in self.stages.values():
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def owned_parameters(self):
        """The parameters this rank owns: :meth:`parameters` less the copies of tied parameters (:attr:`ties`) whose
        owning stage is on another rank, so that every parameter of the unsplit model is owned by exactly one
        pipeline rank (of each replica). What a global norm or a parameter count sums over."""
        return counted_parameters(self.stages, self.first_layers, self.ties, self.program.stage_to_rank,
                                  self.pp_rank, self.layer_names)

    def state_dict(self) -> dict:
        """Every parameter and buffer of this rank under the unsplit model's names (its own keys: ``"3.attn.weight"``,
        ``"embed.weight"`` for a layer keyed ``"embed"``: :attr:`layer_names`), detached,
        sharing storage, a tied copy under the tie's first name; independent of ranks, balance and schedule
        (:func:`~pipesched.runtime.state.saved_state`); ``load_state_dict(state_dict())`` round-trips."""
        return rank_state_dict(self)

    def load_state_dict(self, state_dict, strict: bool = True):
        """Copy this rank's entries of an unsplit-model-named ``state_dict`` in, all checked first; see
        :func:`~pipesched.runtime.state.load_rank_state_dict` (returns missing/unexpected keys; raises on a bad one)."""
        return load_rank_state_dict(self, state_dict, strict)

    @refused_on_misfit(lambda pipe, error: pipe._refuse_call(error, train=True))
    def step(self, x=None, target=None, scaler=None) -> torch.Tensor:
        """One training step: forward and backward of every microbatch; gradients accumulate into ``.grad``.

        ``loss_fn`` gets the last stage's output as the stage returns it (a tensor, or a tuple, list or dict that
        may hold non-tensors: only outputs of the other stages cross the wire and must be tensors or tuples of
        tensors) and must return a floating tensor of one element, shape ``()``, ``(1,)``, ``(1, 1)``, ... (anything
        else fails the step: ``PipelineError`` caused by a ``ValueError`` on the last stage's rank).

        Args:
            x: the batch, a tensor or tuple of tensors with batch dim 0, ``(N, ...)``. Needed on the rank of
                stage 0 (which checks it and tells the others its shapes); other ranks ignore it (may pass None).
            target: ``(N, ...)`` tensor or tuple, needed on the rank of the last stage; others may pass None.
            scaler: ``None``, or this pipeline's :class:`~pipesched.runtime.GradScaler` (on every rank): the last
                stage backpropagates each microbatch's ``loss * scaler.get_scale()``; the returned loss is unscaled.
                Else a ``TypeError`` (``ValueError``: one built for another Pipeline), ruled on in the opening (see
                Raises).
        Returns:
            The loss, the same on every rank of this pipeline: a 0-dim tensor (shape ``()`` whatever shape of one
            element ``loss_fn`` returns) of the dtype ``loss_fn`` returns, on this rank's device, not requiring
            grad; ``sum_i loss_fn(out_i, target_i) * n_i / N`` over microbatches ``i`` of ``n_i`` samples, summed
            in microbatch order in that dtype (the full-batch mean loss for a mean ``loss_fn``). With
            ``dp_size > 1`` it is this replica's loss.
        Raises:
            ValueError, TypeError: this rank's own checks, before the opening: no ``loss_fn`` (``ValueError``), a bad
                ``scaler`` (above). The error travels in this rank's row of the opening all-gather: where every rank
                failed alike, each raises its own error; else every rank raises the first failing rank's type with
                ``pipeline rank R refused its step: <its message>``, at once (no rank waits for the others); the
                pipeline stays usable. So is a call whose arguments do not fit (``step(x, targets=y)``: the
                ``TypeError`` Python gives, :mod:`~pipesched.runtime.misfit`), so a rank that catches it and goes
                on stays in step with the others.
            ValueError: the first stage's rank rejects ``x`` (``N < num_microbatches``, tensors
                of different batch sizes, not tensors, missing); or the last stage's rank rejects ``target``
                (missing while ``loss_fn`` takes ``(output, target)``, batch size other than ``N``). A plain
                ``ValueError`` raised on every rank, carrying the checking rank's message; the pipeline stays usable.
                Also when some ranks call ``step()`` and others ``forward()`` (names each rank's call).
            PipelineError: any rank failed during the step (names the rank, the instruction and the cause);
                the pipeline is unusable afterwards. The rank that failed first, and world rank 0 (which hosts
                the store carrying the failure record), keep their processes up at exit until every rank has
                read the record (at most 30 s), so a rank that is still computing learns the true origin.
        """
        self._check_local(x, target)
        scale = refusal = None
        try:  # this rank's own checks: a failure is ruled on in the opening, so no rank waits for this one
            if self.loss_fn is None:
                raise ValueError("step() needs a loss_fn; pass loss_fn= to Pipeline (forward() needs none)")
            self._check_built()
            scale = loss_scaling(scaler, self)  # None, or the scaler's scale()
        except (TypeError, ValueError) as exc:
            refusal = exc
        return self._guarded(lambda: run(self, x, target, train=True, scale=scale, scaler=scaler, refusal=refusal))

    @refused_on_misfit(lambda pipe, error: pipe._refuse_call(error, train=False))
    def forward(self, x=None):
        """Forward only (no autograd graph, no loss): the model's output on the rank of the last stage,
        merged over microbatches; ``None`` on other ranks.

        The last stage's output may be a tensor or any ``torch.utils._pytree`` container (tuple, list, dict,
        namedtuple) of tensors and other values; it keeps its structure, merged element by element
        (:func:`~pipesched.runtime.microbatch.merge`): a tensor is concatenated along dim 0, ``(N, ...)``; a
        non-tensor equal (same type, ``==``) on every microbatch is kept once, else it becomes the list of the
        ``m`` per-microbatch values. E.g. ``{"logits": (n_i, C), "tag": "x"}`` -> ``{"logits": (N, C), "tag": "x"}``.

        Raises:
            ValueError, PipelineError: as :meth:`step`.
            ValueError: on the last stage's rank only, after the step (the pipeline stays usable): the output
                cannot be merged (a 0-dim tensor, a structure or shape that differs between microbatches); the
                message names the element of the last stage's output.
        """
        self._check_local(x, None)
        try:  # this rank's own check, ruled on in the opening as step()'s
            self._check_built()
            refusal = None
        except ValueError as exc:
            refusal = exc
        outputs = self._guarded(lambda: run(self, x, None, train=False, refusal=refusal))
        if not outputs:
            return None
        m = self.program.num_microbatches  # merged after the step: a merge error leaves the pipeline usable
        return merge([outputs[i] for i in range(m)])

    def __call__(self, *args, **kwargs):
        """``pipe(x)`` is ``pipe.forward(x)``, a subclass's own ``forward`` included (any misfit in the
        arguments is ``forward``'s to refuse, on every rank)."""
        return self.forward(*args, **kwargs)

    def close(self) -> None:
        """Destroy this pipeline's process groups (collective: call it on every rank); the Pipeline is
        unusable afterwards. The default process group is left alone. A peer still waiting on this rank in a step or
        collective raises a ``PipelineError`` saying this rank closed its Pipeline (``runtime/departure.py``).

        Raises:
            RuntimeError: a ``step()``, ``forward()`` or collective call of this Pipeline is running (close() from a
                layer's forward, a hook or another thread); nothing is closed."""
        if self._running:
            raise RuntimeError("close() was called while this Pipeline's step(), forward() or collective call is "
                               "running (from a layer's forward, a hook, or another thread); call it after the "
                               "call returns, on every rank")
        announce_close(self._departure)  # before the teardown closes the connections the peers may be blocked on
        teardown(self)
        self._closed = True
