"""What one step of the executor (:mod:`pipesched.runtime.executor`) is given and holds: its inputs
(:class:`StepInputs`), its tensors and pending messages (:class:`StepState`), and what a rank computes and how it talks
to the others (:class:`RankWork`, :class:`Links`)."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from .recompute import BufferLedger
from .transport import Transport


class StepInputs:
    """What one step needs: microbatches (tuples of tensors) for the first stage, targets and loss
    weights for the last, whether it trains, and the metas of its input signature and settings (filled while
    learning): ``("in" | "out", stage, mb)``: the meta of that stage's input / output message;
    ``("in_grad" | "out_grad", stage, mb)``: which of the gradients of that stage's input / output come (a
    bool per tensor that requires grad)."""

    def __init__(self, train, microbatches, container, targets, weights, metas, learning, scale=None, parts=None,
                 grad_weights=None):
        self.train, self.microbatches, self.container = train, microbatches, container
        self.targets, self.weights, self.metas, self.learning = targets, weights, metas, learning
        # the loss weights in backward (step_run.loss_weights: n * dp / N_all, the whole batch's over replicas of
        # other batch sizes); ``weights`` (n / N) weigh the returned loss, the replica's own. Equal by default
        self.grad_weights = weights if grad_weights is None else grad_weights
        self.scale = scale or (lambda loss: loss)  # the loss a backward starts from (a GradScaler's scale())
        self.parts = parts  # None, or the NormParts whose norm parts this training step sends (runtime/norm_parts.py)


class StepState:
    """Per-step tensors and pending messages, keyed by (stage, microbatch)."""

    def __init__(self, inputs: StepInputs):
        self.io = inputs
        self.inputs, self.fwd_out, self.roots, self.input_grads = {}, {}, {}, {}
        self.pending, self.recv_event, self.rng, self.held, self.wgrad = {}, {}, {}, {}, {}
        self.act_sends, self.other_sends, self.reductions = {}, [], []  # reductions: (event index, PendingSum)
        self.tie_event = None  # the index in the executor's events of this step's TIE_REDUCE
        self.losses, self.outputs, self.loss_recv = {}, {}, None
        self.buffers = BufferLedger()  # the buffers of recomputed stages at each F, for their R
        self.live = self.peak = 0
        #: {stage: {id(weight): (weight, grad_out, left)}}: fused W GEMMs kept for the stage's next W (pairs,
        #: runtime.wgrad_fusion.Pairing); empty again after each stage's last W of the step
        self.wpairs: dict = {}


class RankWork(NamedTuple):
    """What one rank computes (see :class:`Executor`)."""

    stages: dict  #: {stage: nn.Module} this rank runs
    loss_fn: Callable | None  #: ``loss_fn(output, target) -> scalar tensor`` on the last stage
    device: torch.device
    first_layers: Sequence[int] | None = None  #: per stage, its first layer's index in the model (for errors)
    autocast: Callable = contextlib.nullcontext  #: () -> the context F, R and the loss run in (runtime.amp)
    fuse_wgrad: bool = False  #: W adds a Linear's weight gradient into ``.grad`` in its GEMM (runtime.wgrad_fusion)
    pair_wgrad: bool = False  #: with fuse_wgrad: two W's GEMMs of a weight run as one (runtime.wgrad_fusion.Pairing)


class Links(NamedTuple):
    """How one rank talks to the others (see :class:`Executor`)."""

    transport: Transport  #: point-to-point messages within this pipeline
    dp_group: object = None  #: the data-parallel group (``None`` when ``dp_size == 1``)
    ties: object = None  #: the :class:`~pipesched.runtime.tie_reduce.TieReducer` of TIE_REDUCE, None without ties
