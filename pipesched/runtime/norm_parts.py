"""Anticipated gradient clipping: each rank's part of the gradient norm travels at the step's end, so that
``Pipeline.clip_grad_norm_`` right after ``step()`` needs no collective.

A collective over 4 gloo processes on shared cores costs milliseconds of latency however little it carries; at a
1F1B step's end the ranks idle anyway (the last stage's rank finishes first, stage 0's last). So once a pipeline
has seen a ``clip_grad_norm_`` call, its training steps *anticipate* the next one:

1. The step's opening all-gather (:mod:`~pipesched.runtime.handshake`) carries each rank's ``max_norm`` and
   ``norm_type`` of its last ``clip_grad_norm_`` call, and its count of calls. The step anticipates when every
   rank carries the same non-zero pair (and :attr:`NormParts.enabled`); different counts are an error on every
   rank (some rank clipped and another did not), before any work.
2. After its stream's last instruction, once its gradients are final (data-parallel all-reduces and tied sums
   waited for), each rank computes its row (:func:`~pipesched.runtime.clipping.local_part` over
   ``Pipeline.owned_parameters()``: tied parameters once, replicas not twice) and sends it to every other
   pipeline rank, point to point (where receives are posted early, a rank owning no tied copy sends before the
   tied sums end: :meth:`NormParts.send_early`); each rank waits for the others' rows (the messages of
   :func:`pipesched.protocol.step_posts` with ``norm_parts``, proven by :func:`~pipesched.protocol.check_step`).
   After the last rank's stream ends, one message hop stands between it and every rank knowing every part.
3. ``clip_grad_norm_`` (:meth:`NormParts.take`) uses the rows when this rank's row, computed again now with the
   call's arguments, is bitwise the one it sent — the same ``max_norm`` and ``norm_type`` (the anticipated ones)
   and gradients that give the same part — so the total is exactly what the collective would combine. If
   ``pipesched.runtime.GradScaler.unscale_`` ran since the step (collective: every rank knows), every row's norm
   is first multiplied by the scaler's inverse scale when it is a power of two (exact: the gradients were
   multiplied by it), else every rank takes the collective. A step without anticipation, a second clip after
   one step, or a call whose row differs on EVERY rank (all switched ``norm_type``) take the collective path,
   which then anticipates the new arguments. A call whose row differs on SOME ranks only (they passed other
   arguments, or changed their gradients since the step, e.g. ``p.grad.mul_``) takes the collective there and
   the anticipated path elsewhere: the two meet at the next collective over the pipeline group, where every rank
   raises a ``PipelineError`` saying so
   (:func:`~pipesched.runtime.handshake.check_rows_meet`), instead of hanging or clipping differently
   unseen. Set ``pipe.anticipate_clip = False`` on every rank for such loops.
4. Rows whose total is not finite are not used: every rank holds the same rows, so every rank takes the collective,
   which compares ``error_if_nonfinite`` (a rank raising while another scales by nan otherwise).
5. Data parallelism: each replica's ranks anticipate and use their own pipeline's rows (no collective), and the
   replicas hold the same gradients, so they agree when every rank calls alike. A replica whose call differs from
   the anticipated one (another ``max_norm`` there, ``anticipate_clip`` set there only, gradients changed there
   only) takes the collective, whose agreement of the replicas (``clipping.agree_replicas``) then meets the other
   replicas' next step over the data-parallel groups: it raises a ``PipelineError`` there, and they a
   ``ValueError`` from the step's agreement of the replicas ("replica R refused its step: it is in clip_grad_norm_'s
   agreement ...") — after they clipped by their own rows, as in 3.
"""
from __future__ import annotations

import math

import torch
from torch.amp.grad_scaler import OptState

from ..protocol import norm_end_posts, norm_post_position
from .clipping import local_part, total_norm
from .transport import wait

TAG_NORM = 4  #: the control tag of the norm-part messages (0..15 control tags; 2: loss)
ROW = 8  #: float64 values of a rank's row (clipping.local_part): norm, nan, 4 dtype flags, max_norm, norm_type


def float_word(value: float) -> int:
    """The int64 word holding ``value``'s float64 bits (0.0 is word 0)."""
    return int(torch.tensor([value], dtype=torch.float64).view(torch.int64)[0])


def word_float(word: int) -> float:
    return float(torch.tensor([word], dtype=torch.int64).view(torch.float64)[0])


class NormParts:
    """One rank's side of anticipated clipping (module docstring).

    Args:
        transport: the pipeline group's :class:`~pipesched.runtime.transport.Transport`.
        num_ranks: pipeline ranks ``p``. pp_rank: this rank's.
        device: where the rows live (the model's device).
        owned: ``() -> iterable of parameters`` this rank counts in the norm (``Pipeline.owned_parameters``).
    Attributes:
        enabled: anticipate (default False: opt in with ``Pipeline.anticipate_clip = True``); False on any rank:
            no step anticipates.
        wanted: ``(max_norm, norm_type)`` of this rank's last ``clip_grad_norm_`` call (``None`` before one).
        calls: this rank's ``clip_grad_norm_`` calls that got past the local argument checks.
        used: how many of them combined the anticipated rows (no collective).
        fell_back: the last call had the step's rows but could not use them (its row differed here), so it takes
            the collective where the other ranks may not: its wait names that (clipping.gather_parts).
        scaler: the ``GradScaler`` the last ``step()`` got (``None``).
        rows: after a step that anticipated, every rank's row (lists of floats, by pipeline rank) until a clip
            call uses them or the next step starts; else ``None``.
    """

    def __init__(self, transport, num_ranks: int, pp_rank: int, device, owned) -> None:
        self.transport, self.num_ranks, self.pp_rank, self.device, self.owned = (transport, num_ranks, pp_rank,
                                                                                 device, owned)
        self.enabled, self.wanted, self.calls, self.used, self.scaler = False, None, 0, 0, None
        self.fell_back = False
        self.rows, self.agreed = None, None
        self._sent = None  # this rank's row of the last step (float64 tensor), to compare with a clip call's
        self._params = []  # the owned parameters that row is over (listed once per step: 0.1-0.3 ms)
        self._at, self._recvs, self._sends, self._early = {}, {}, [], False

    # ---- the step's opening -----------------------------------------------------------------------------

    def opening_words(self) -> list[int]:
        """``[calls, max_norm, norm_type]`` (floats as their bits; zeros when nothing is to be anticipated)."""
        if not self.enabled or self.wanted is None:
            return [self.calls, 0, 0]
        return [self.calls, float_word(self.wanted[0]), float_word(self.wanted[1])]

    def agree(self, words: list[list[int]], train: bool) -> None:
        """From every rank's :meth:`opening_words` (the step's all-gather, by pipeline rank): this step
        anticipates ``(max_norm, norm_type)`` when every rank wants the same (same on every rank). The last
        step's rows are dropped: the gradients are about to change."""
        self.rows = self._sent = None
        pairs = {tuple(w[1:]) for w in words}
        (pair,) = pairs if len(pairs) == 1 else ((0, 0),)
        self.agreed = (word_float(pair[0]), word_float(pair[1])) if train and pair[1] != 0 else None

    # ---- the step: posted by the executor ---------------------------------------------------------------

    def begin(self, stream, early: bool) -> None:
        """Before the step's first instruction: where each part receive is posted (:func:`norm_post_position`)."""
        self._early, self._recvs, self._sends, self._sent, self._params = early, {}, [], None, []
        peers = [q for q in range(self.num_ranks) if q != self.pp_rank]
        self._at = {q: norm_post_position(stream, q, early) for q in peers}
        self.post_at(-1)

    def post_at(self, at: int) -> None:
        """Post the part receives due after the instruction at ``at`` (-1: before the first)."""
        for peer, where in self._at.items():
            if where == at:
                self._post(peer)

    def _post(self, peer: int) -> None:
        self._recvs[peer] = self.transport.post([((ROW,), torch.float64)], peer, TAG_NORM,
                                                f"the norm part of pipeline rank {peer}")

    def send_early(self, ties) -> None:
        """Where the receives were posted early (gloo) and none of this rank's owned parameters is a tied copy
        (``ties``: the executor's :class:`~pipesched.runtime.tie_reduce.TieReducer` or ``None``), its gradients are
        final before the tied sums end: send the parts now, before waiting for those (the last stage's rank of a
        tied GPT would otherwise wait for stage 0's rank's sum first). Call it after the data-parallel sums."""
        self._params = list(self.owned())
        tied = ties.tied if ties is not None else set()
        if self._early and not any(id(p) in tied for p in self._params):
            self._send_all()

    def _send_all(self) -> None:
        max_norm, norm_type = self.agreed
        self._sent = local_part(self._params, max_norm, norm_type, None, self.device)
        for kind, peer in norm_end_posts(self.pp_rank, self.num_ranks, self._early):
            if kind == "send":
                self._sends.append(self.transport.send((self._sent,), peer, TAG_NORM))
            else:
                self._post(peer)

    def exchange(self) -> None:
        """At the step's end (gradients final): send this rank's row to every other rank and post the remaining
        receives (:func:`norm_end_posts`) unless :meth:`send_early` did, then wait for everything; :attr:`rows`
        holds every rank's row."""
        if self._sent is None:
            self._send_all()
        mine = self._sent
        rows = [None] * self.num_ranks
        rows[self.pp_rank] = mine
        for peer, pending in self._recvs.items():
            (rows[peer],), _ = self.transport.wait(pending)
        for work, _ in self._sends:
            wait(work, "a norm-part send")
        self._recvs, self._sends = {}, []
        self.rows = torch.stack(rows).tolist()

    # ---- the clip call ----------------------------------------------------------------------------------

    def take(self, max_norm: float, norm_type: float, foreach) -> list | None:
        """The rows ``clip_grad_norm_`` combines without a collective, or ``None`` (take the collective): see the
        module docstring. Counts the call; the rows are used once."""
        self.calls += 1
        rows, sent, self.rows, self._sent = self.rows, self._sent, None, None
        self.fell_back = False
        if rows is None:
            return None
        inv = _inverse_scale(self.scaler)
        if inv is False:  # unscaled by a scale that is not a power of two: every rank takes the collective
            return None
        now = local_part(self._params, max_norm, norm_type, foreach, self.device)  # the step's parameters
        if inv is not None:
            sent, rows = sent.clone(), [[row[0] * inv, *row[1:]] for row in rows]
            sent[0] *= inv
        if not torch.equal(now.view(torch.int64), sent.view(torch.int64)):  # bitwise: nan too
            self.fell_back = True
            return None  # differs here: the collective (on every rank when every rank differs)
        if not bool(total_norm(rows, norm_type, torch.device("cpu")).isfinite()):
            return None  # every rank holds these rows: all take the collective, which compares error_if_nonfinite
        self.used += 1
        return rows

    def refused(self) -> None:
        """Count a call whose arguments this rank refused (it joins the collective with a refusal row,
        :func:`~pipesched.runtime.clipping.refuse`), as the other ranks' :meth:`take` counts theirs; the step's
        rows are dropped, as theirs are."""
        self.calls += 1
        self.rows = self._sent = None
        self.fell_back = False


def _inverse_scale(scaler):
    """``None``: the gradients are as the step left them (no ``GradScaler``, or ``unscale_`` not called since);
    the inverse scale ``unscale_`` multiplied them by, when a power of two; ``False`` when another number."""
    if scaler is None or not any(state["stage"] is OptState.UNSCALED
                                 for state in scaler._per_optimizer_states.values()):
        return None
    scale = float(scaler._scale)
    mantissa, _ = math.frexp(scale)
    return 1.0 / scale if mantissa == 0.5 else False
