"""The one message round that opens every step: an all-gather in which stage 0's rank describes the input (or
rejects it), the last stage's rank gives its verdict on the target (checked on its own before the gather: all but
the batch size x must match), and every rank gives its settings fingerprint and its anticipated clipping
(:mod:`~pipesched.runtime.norm_parts`); every rank then decides alike, so a bad batch is the same ``ValueError``
on every rank before any work, and a changed setting on any rank makes every rank re-learn the step's message metas.
With data parallelism a second all-gather, over each data-parallel group, lets the replicas agree
(:meth:`Handshake.signature`): a step one replica refuses is refused on all.

Each rank's row of the all-gather is ``ROW_LEN`` int64 words: ``[OPENING_MARK, settings, train, no_grad, clip calls,
clip max_norm, clip norm_type, autocast, *signature, *verdict]`` (``autocast``: the caller's,
:func:`~pipesched.runtime.settings.caller_autocast`, the same on every rank or the step is refused; ``signature``:
stage 0's rank's description of x or its refusal, zeros on the other ranks, or, on any rank whose own checks of its
call failed before the opening (a bad ``scaler=``, no ``loss_fn``), ``[OWN_REFUSAL, kind, 0, *text]`` instead: every
rank then raises that error, :func:`~pipesched.runtime.refusals.judge_own_checks`, so none waits for a rank that
raised alone; ``verdict``: ``VERDICT_LEN`` words, :func:`~pipesched.runtime.refusals.verdict_words`, zeros but on the
last stage's rank in a training step). ``clip_grad_norm_``'s all-gather on the same group (``runtime/clipping.py``)
has rows of the same shape opening with ``CLIP_MARK`` and the count of clip calls, so where ranks are out of step
(some in a step's opening, some in a clip's collective, or with different counts of clip calls) every rank that meets
them raises the same clear error
(:func:`check_rows_meet`) instead of misreading the rows."""
from __future__ import annotations

from typing import NamedTuple

import torch

from .wire import DTYPE_CODE, unsendable
from .microbatch import TENSOR, TooFewSamples, split
from .settings import caller_autocast, describe_autocast
from .refusals import (OWN_REFUSAL, REFUSAL_KINDS, SIG_LEN, VERDICT_LEN, Rejected, TargetVerdict, decode_text,
                       encode_text, judge_own_checks, judge_target, kind_code, verdict_words)
from .transport import gather_rows

REQUIRES_GRAD = 1 << 16  # added to an input tensor's dtype code in the signature where it requires grad
HEAD = 8  # int64 words of a row before the signature
ROW_LEN = HEAD + SIG_LEN + VERDICT_LEN  # int64 words of each rank's row in the opening all-gather (and clip's)
OPENING_MARK, CLIP_MARK = 0x5354_4550, 0x434C_4950  # the first word of a step's row, of a clip's row
TIMELINE_MARK = 0x5449_4D45  # the first word of gather_timeline()'s row (its all-gather of rows before the events)
REPLICA_MARK = 0x5245_504C  # the first word of a replica's row in a step's agreement over the data-parallel group
COLLECTIVE_MARK = 0x434F_4C4C  # the first word of a row run_collective() meets the other ranks with
SCALER_MARK = 0x5343_4C52  # the first word of a GradScaler's row in its overflow vote (runtime/scaler_vote.py)
#: added to a forward()'s refusal of a batch smaller than m: what to do with an evaluation set's last batch
EVAL_TAIL = ("; for the last, smaller batch of an evaluation set: pad it to num_microbatches samples (repeat a "
             "row) and drop the padded rows' outputs")
#: the call each mark stands for, in errors about ranks in different calls
CALLS = {OPENING_MARK: "opened the next step (step() or forward())", CLIP_MARK: "are in clip_grad_norm_'s collective",
         TIMELINE_MARK: "are in gather_timeline()",
         SCALER_MARK: "are in the GradScaler's overflow vote (scaler.unscale_ or scaler.step)",
         COLLECTIVE_MARK: "are in run_collective()"}


def check_rows_meet(heads: list[list[int]], mark: int) -> None:
    """``heads``: every pipeline rank's first two words of its row in an all-gather (its mark, its count of
    ``clip_grad_norm_`` calls). Every rank must be in the same operation (``mark``) with the same count of
    clip calls.

    Raises:
        RuntimeError: naming the ranks in a step's opening and those in a clip's collective, or the counts of
            calls by rank; every rank that took part sees the same rows, so each raises the same error (the
            Pipeline ends every rank with a ``PipelineError``: some ranks may have clipped their gradients).
    """
    kinds = list(dict.fromkeys(head[0] for head in heads))  # the calls, in the order of their first rank
    if len(kinds) > 1 and set(kinds) != {OPENING_MARK, CLIP_MARK}:
        by = "; ".join(f"pipeline ranks {[r for r, h in enumerate(heads) if h[0] == k]} "
                       f"{CALLS.get(k, 'are in another collective call')}" for k in kinds)
        raise RuntimeError(f"the pipeline ranks made different collective calls: {by}; every rank of a pipeline "
                           f"must make the same calls (step, forward, clip_grad_norm_, gather_timeline, the GradScaler's "
                           f"unscale_/step, run_collective, checkpoints) "
                           f"in the same order")
    opening = [r for r, head in enumerate(heads) if head[0] == OPENING_MARK]
    clipping = [r for r, head in enumerate(heads) if head[0] == CLIP_MARK]
    if len(opening) not in (0, len(heads)):
        raise RuntimeError(
            f"clip_grad_norm_: pipeline ranks {clipping} are in clip_grad_norm_'s collective while ranks {opening} "
            f"opened the next step: the ranks' clip_grad_norm_ calls differed. Call it on every rank alike, after "
            f"the same step, with the same max_norm and norm_type. With pipe.anticipate_clip = True, a rank whose "
            f"call differed from the one its last step anticipated (another max_norm or norm_type, or gradients "
            f"changed since the step on that rank only) also takes the collective while the others do not: change "
            f"gradients between step() and clip_grad_norm_() on every rank alike, or set "
            f"pipe.anticipate_clip = False")
    counts = [head[1] for head in heads]
    if len(set(counts)) > 1:
        raise RuntimeError(f"clip_grad_norm_: the pipeline ranks made different numbers of clip_grad_norm_ calls "
                           f"(by pipeline rank: {counts}); call it on every rank alike")


def meet(group, size: int, device, mark: int, what: str, words: list | None = None) -> list:
    """A row shaped as the step opening's and clip's (``ROW_LEN`` int64 words, ``mark`` first), so that a rank that
    is in another pipeline collective meanwhile meets it in an all-gather of the same size and every rank raises one
    error naming the calls (:func:`check_rows_meet`), instead of gloo aborting on two gathers of different sizes or
    waiting for the timeout. ``what``: the all-gather, for a ``CommError``. ``words``: the row after ``mark``
    (``ROW_LEN - 1`` words, the first 0; default zeros), e.g. the call's arguments (``runtime/call_args.py``).
    Returns every rank's row, by rank."""
    row = [mark] + (list(words) if words is not None else [0] * (ROW_LEN - 1))
    rows = gather_rows(row, group, size, torch.int64, device, what)
    check_rows_meet([row[:2] for row in rows], mark)
    return rows


def replica_rows(words: list, mark: int, dp_group, grid, device, what: str, mismatch) -> list:
    """All-gather this replica's row ``words`` (opening with ``mark``) over the data-parallel group; every replica's
    row, by replica. ``mismatch(in_call, others, doing)`` words the error where some replicas' rows open with another
    mark (``others``: those replicas; ``doing``: what they are in, e.g. their next step's agreement).

    Raises:
        RuntimeError: ``mismatch``'s text, on every rank of the job alike. CommError: the all-gather failed.
    """
    replicas = gather_rows(words, dp_group, grid.dp_size, torch.int64, device, what)
    others = [k for k, row in enumerate(replicas) if row[0] != mark]
    if others:
        opened = [k for k in others if replicas[k][0] == REPLICA_MARK]
        doing = "opened the next step (step() or forward())" if opened == others else "are in another collective"
        raise RuntimeError(mismatch([k for k in range(grid.dp_size) if k not in others], others, doing))
    return replicas


class StepKey(NamedTuple):
    """What a step's message metas follow from, and so the key they are cached under: the input's description
    and every pipeline rank's settings. Two steps with equal keys send messages of the same shapes, dtypes,
    ``requires_grad`` and gradient presence."""

    signature: tuple[int, ...]  # :func:`encode_signature`'s words after the rejection flag: train, m, batch, ...
    settings: tuple[int, ...]  # every pipeline rank's settings fingerprint, by pipeline rank

    @property
    def batch_size(self) -> int:
        """``N``, the size of the step's batch along dim 0."""
        return self.signature[2]


class Handshake:
    """One rank's side of the step-opening messages over the pipeline group.

    Args:
        transport: the pipeline group's :class:`~pipesched.runtime.transport.Transport`.
        program: the compiled program (for the first and last stages' ranks and ``m``).
        pp_rank: this rank's pipeline rank.
        device: where the control tensors live (the model's device).
        dp_group: the data-parallel group of this pipeline rank (``None`` with ``dp_size == 1``): the replicas agree
            on each step over it.
    """

    def __init__(self, transport, program, pp_rank: int, device, dp_group=None, autocast=None) -> None:
        self.transport, self.program, self.pp_rank, self.device = transport, program, pp_rank, device
        self.autocast = autocast  # the Pipeline's own autocast dtype (None: the caller's autocast, compared)
        self.dp_group = dp_group  # the replicas of this pipeline rank (None: dp_size 1)
        self.clip_words: list = []  # the last opening's clip words, by pipeline rank (see :meth:`signature`)
        self.replica_batches: list = []  # the last agreement's batch size of each replica (:meth:`_agree_replicas`)

    def signature(self, x, train: bool, to_device, settings: int, clip=(0, 0, 0),
                  verdict: TargetVerdict | None = None, refusal: Exception | None = None):
        """Every rank learns the step's input (stage 0's rank describes ``x`` or rejects it), the last stage's
        rank's ``verdict`` on the step's target (a training step; ``None`` on the other ranks and in a
        ``forward()``), every rank's ``refusal`` of its own call (the ``ValueError`` or ``TypeError`` its own
        checks raised before the opening, e.g. a bad ``scaler=``; ``None``), every rank's settings fingerprint
        (:func:`~pipesched.runtime.settings.fingerprint`) and its three words of anticipated clipping
        (``clip``: :meth:`NormParts.opening_words <pipesched.runtime.norm_parts.NormParts.opening_words>`, by
        pipeline rank in :attr:`clip_words` afterwards), in one all-gather over the pipeline group: the step's only
        message before its program.

        Returns:
            ``(key, microbatches, container)``: the :class:`StepKey` (the input's description and every pipeline
            rank's fingerprint); ``microbatches`` is ``None`` on the other ranks.
        Raises:
            Rejected: on every rank, with the same message, checked in this order: some rank refused its own call
                (:func:`judge_own_checks`: that rank's exception type, naming it); stage 0's rank refused ``x``;
                ranks disagree on ``step()`` versus ``forward()``; a training step with gradients disabled; ranks
                under different autocast (the caller's, where the Pipeline has no ``autocast=``); the target's
                batch size is not x's; the last stage's rank refused the target (:func:`judge_target`).
            RuntimeError: some ranks are in ``clip_grad_norm_``'s collective, or made other numbers of clip calls
                (:func:`check_rows_meet`), on every rank.

        With data parallelism the replicas then agree (:meth:`_agree_replicas`), so a step refused on one replica
        is refused on every one (else the others would run it and their data-parallel all-reduce would meet the
        refusing replica's next step): ``Rejected`` also where another replica refused or made another call.
        """
        amp = caller_autocast(self.device, self.autocast)
        try:
            decided, rejected = self._decide(x, train, to_device, settings, clip, verdict, refusal, amp), None
        except Rejected as exc:
            decided, rejected = None, exc
        if self.dp_group is not None:  # decided[0]: the StepKey, whose batch size every pipeline rank learned
            self._agree_replicas(train, rejected, amp, 0 if decided is None else decided[0].batch_size)
        if rejected is not None:
            raise rejected
        return decided

    def _agree_replicas(self, train: bool, refusal: Rejected | None, amp: int, batch: int = 0) -> None:
        """One all-gather over the data-parallel group of ``[REPLICA_MARK, train, refused, *its text, autocast,
        batch]`` (``refused``: 0, or the :data:`REFUSAL_KINDS` code of the exception it raises; ``autocast``: the
        caller's, :func:`~pipesched.runtime.settings.caller_autocast` word ``amp``, which every pipeline rank of
        the replica shares once its opening passed; ``batch``, the last word: this replica's batch size, 0 where
        refused). The replicas' batch sizes, by replica, are kept in :attr:`replica_batches`: the step weights its
        loss in backward by them (``step_run.loss_weights``), so that the data-parallel average is the whole batch's
        gradient where replicas got different batch sizes.

        Raises:
            Rejected: replicas made different calls (names each replica's); or another replica refused its step
                (its message, prefixed by ``replica R refused its step:``, of its kind); a replica that refused
                raises its own; replicas under different autocast (their gradients would be averaged across two
                precisions).
        """
        mine = encode_text([REPLICA_MARK, int(train), 0 if refusal is None else kind_code(refusal.kind)],
                           str(refusal or ""), SIG_LEN - 2) + [amp, batch]
        rows = gather_rows(mine, self.dp_group, self.program.dp_size, torch.int64, self.device,
                           "the replicas' agreement on the step")
        calls = ("forward()", "step()")
        if len({row[1] for row in rows}) > 1:
            p = self.program.num_ranks  # replica k's rank at this pipeline position: world rank k * p + pp_rank
            raise Rejected("every replica must make the same call; " + ", ".join(
                f"replica {k} (world rank {k * p + self.pp_rank}) called {calls[row[1]]}" for k, row in enumerate(rows)))
        refused = [k for k, row in enumerate(rows) if row[2]]
        if refused and refusal is None:
            row = rows[refused[0]]
            raise Rejected(f"replica {refused[0]} refused its step: {decode_text(row)}",
                           REFUSAL_KINDS.get(row[2], ValueError))
        if not refused and len({row[-2] for row in rows}) > 1:
            raise autocast_differs(calls[train], {f"replica {k}": row[-2] for k, row in enumerate(rows)},
                                   self.device.type)
        self.replica_batches = [row[-1] for row in rows]

    def _decide(self, x, train: bool, to_device, settings: int, clip, verdict: TargetVerdict | None,
                refusal: Exception | None, amp: int):
        """What every rank of the pipeline decides alike from the opening's all-gather (see :meth:`signature`)."""
        first = self.program.stage_to_rank[0]
        m = self.program.num_microbatches
        words, micro, container = [0] * SIG_LEN, None, TENSOR
        if refusal is not None:  # in its signature block (stage 0's rank: in place of x's description)
            words = encode_text([OWN_REFUSAL, kind_code(type(refusal)), 0], str(refusal))
        elif self.pp_rank == first:
            try:
                if x is None:
                    raise ValueError(f"the rank of stage 0 (pipeline rank {first}) got no input x; pass the batch "
                                     f"as x there")
                micro, container = split(to_device(x), m, "x")
                words = encode_signature(train, m, micro, container)
            except (TypeError, ValueError) as exc:
                text = str(exc) + (EVAL_TAIL if isinstance(exc, TooFewSamples) and not train else "")
                words = encode_text([1, int(train), m], text)
        rows = self._gather([OPENING_MARK, settings, int(train), int(train and not torch.is_grad_enabled()),
                             *clip, amp]
                            + words + verdict_words(verdict if train else None))
        check_rows_meet([row[:1] + row[4:5] for row in rows], OPENING_MARK)
        self.clip_words = [row[4:7] for row in rows]
        amp = [row[7] for row in rows]
        judge_own_checks([row[HEAD:HEAD + SIG_LEN] for row in rows], self.pp_rank, refusal,
                         "step" if train else "forward()")
        last_verdict = rows[self.program.stage_to_rank[-1]][HEAD + SIG_LEN:]
        rows = [row[1:4] + row[HEAD:HEAD + SIG_LEN] for row in rows]  # settings, train, no_grad, signature
        words = rows[first][3:]
        if words[0]:
            raise Rejected(decode_text(words) if self.pp_rank == first else
                           f"the rank of stage 0 (pipeline rank {first}) rejected the "
                           f"{'step' if train else 'forward()'} input: {decode_text(words)}")
        calls = ("forward()", "step()")
        made = [row[1] for row in rows]
        if len(set(made)) > 1:
            raise Rejected("every rank of a pipeline must make the same call; "
                           + ", ".join(f"pipeline rank {r} called {calls[c]}" for r, c in enumerate(made)))
        no_grad = [r for r, row in enumerate(rows) if row[2]]
        if no_grad:  # a training step needs autograd: refuse it on every rank before any work
            raise Rejected(f"step() trains, but pipeline ranks {no_grad} called it with gradients disabled "
                           f"(inside torch.no_grad() or torch.inference_mode()); call step() outside it, or use "
                           f"forward() for evaluation")
        if len(set(amp)) > 1:  # stages at different precisions: neither the fp32 nor the autocast model's values
            raise autocast_differs(calls[train], {f"pipeline rank {r}": a for r, a in enumerate(amp)},
                                   self.device.type)
        if train:
            judge_target(last_verdict, words[3], self.program.stage_to_rank[-1], self.pp_rank, verdict)
        return StepKey(tuple(words[1:]), tuple(row[0] for row in rows)), micro, container

    def _gather(self, words: list[int]) -> list[list[int]]:
        """All-gather one row of int64 ``words`` from every pipeline rank; returns the rows by rank."""
        return gather_rows(words, self.transport.group, self.program.num_ranks, torch.int64, self.device,
                           "the step signature")


def encode_signature(train, m, micro, container) -> list[int]:
    """The input's description: ``[0, train, m, batch, container, tensors, (dtype, dims, *shape[1:]) ...]``, each
    ``dtype`` word its :data:`DTYPE_CODE` plus :data:`REQUIRES_GRAD` where the tensor requires grad (a stage's
    outputs require grad where its input does, so the message metas follow from that too).

    Raises:
        TypeError: a dtype that cannot cross a stage boundary.
        ValueError: too many tensors or dimensions for ``SIG_LEN`` words.
    """
    first = micro[0]
    total = sum(mb[0].shape[0] for mb in micro)
    words = [0, int(train), m, total, int(container), len(first)]
    for t in first:
        if t.dtype not in DTYPE_CODE:
            raise TypeError(f"x: {unsendable(t.dtype)}")
        words += [DTYPE_CODE[t.dtype] + REQUIRES_GRAD * t.requires_grad, t.dim() - 1, *t.shape[1:]]
    if len(words) > SIG_LEN:
        raise ValueError(f"x has too many tensors or dimensions to describe ({len(words)} > {SIG_LEN} words)")
    return words + [0] * (SIG_LEN - len(words))


def autocast_differs(call: str, words: dict, kind: str) -> Rejected:
    """The refusal of a ``call`` made under different autocast settings: ``words`` maps who (``pipeline rank 1``,
    ``replica 0``) to its :func:`~pipesched.runtime.settings.caller_autocast` word on device type ``kind``."""
    return Rejected(f"{call} was called under different autocast settings: " + ", ".join(
        f"{who} {describe_autocast(a, kind)}" for who, a in words.items()) + "; enter the same torch.autocast on "
        "every rank, or pass autocast= to Pipeline (then the caller's is ignored)")
