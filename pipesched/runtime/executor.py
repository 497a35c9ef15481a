"""The executor: one rank's instruction stream run through a dispatch table (kind -> handler).

There is no per-schedule code here and no reordering: each step runs, in order, this rank's stream of one
of the proven programs it is given (:class:`~pipesched.api.StepPrograms`). Each handler does one
instruction; the executor records when each started and ended (a measured
:class:`~pipesched.timeline.Timeline`) and the bytes of activations held for backward.
"""
from __future__ import annotations

import torch

from ..ir import Op
from .accounting import SavedBytes, tensor_bytes
from .grad_sum import finish_sum
from .input_grads import input_gradients
from .loss import checked_loss, step_total, weighted
from .wire import DTYPE_CODE, DTYPES, TAG_LOSS, meta_of, unsendable
from .messages import MessageHandlers
from .microbatch import as_tuple, as_value, stage_output
from .received import loss_input_text, stage_input_text
from .shared_inputs import check_shared_writes, shared_versions
from .recompute import check_no_forward_hooks, keep_nothing, replay_rng, rng_state, scratch_buffers
from .split import SplitPlans, backward_input, backward_weight
from .wgrad_fusion import Pairing, PairStats, run_pending
from .stage import call_stage
from .clock import clock_for
from ..api import StepPrograms
from ..protocol import loss_post_position
from .reduction import reduced_params
from .step_state import Links, RankWork, StepInputs, StepState
from .transport import wait


class Executor(MessageHandlers):
    """Runs pipeline rank ``pp_rank``'s stream of one of ``programs`` per step on its stages.

    Args:
        programs: the validated programs of each kind of step (:func:`~pipesched.api.step_programs`):
            a step runs ``programs.pick(train, learning)``, this rank's stream of it exactly as it is; a stage
            with an ``R`` in them is recomputed.
        work: the rank's stages, loss, device, names of layers for errors and autocast (:class:`RankWork`;
            ``first_layers`` None: each stage counts its layers from 0).
        links: its transport, data-parallel group and tie reducer (:class:`Links`); ``TIE_REDUCE`` starts the
            tie reducer and the step's end waits for it, and the data-parallel ALL_REDUCE leaves tied parameters out.
    """

    def __init__(self, programs: StepPrograms, pp_rank: int, work: RankWork, links: Links):
        program = programs.train  # the four share placement and sizes
        self.programs, self.program, self.pp_rank, self.stages = programs, program, pp_rank, work.stages
        self.work = work  # kept whole: an executor rebuilt for other programs (measured_costs) runs the same work
        self.transport, self.dp_group, self.loss_fn = links.transport, links.dp_group, work.loss_fn
        recomputed = program.stages_with(Op.R)
        self.recompute = [s in recomputed for s in range(program.num_stages)]  # stages with an R: no forward hooks
        self.device, self.autocast, self.fuse_wgrad = work.device, work.autocast, work.fuse_wgrad
        self.pair_wgrad = work.fuse_wgrad and work.pair_wgrad
        self.pair_stats = PairStats()  # what pairing did, over all steps (runtime.wgrad_fusion; for tests)
        self.first_layers = work.first_layers if work.first_layers is not None else [0] * program.num_stages
        self.last = program.num_stages - 1
        self.local = set(work.stages)
        # every parameter, frozen too: requires_grad is read at each step (one frozen now may be unfrozen later)
        self.params = {s: list(m.parameters()) for s, m in work.stages.items()}
        self.counter = SavedBytes(p for ps in self.params.values() for p in ps)
        self.split_plans = {s: SplitPlans() for s in work.stages}  # each stage's I/W graph analysis, reused
        self.modules = {s: list(m.modules()) for s, m in work.stages.items()}  # (their buffers are read at each W)
        self.ties = ties = links.ties  # the TieReducer of TIE_REDUCE (runtime.tie_reduce), None without ties here
        self.reduced = reduced_params(self.params if ties is None else ties.untied(self.params), program.ranks[pp_rank])
        b = self._i_then_w if self.fuse_wgrad else self._b  # fusion needs the weight half apart (chosen once)
        table = {Op.F: self._f, Op.B: b, Op.I: self._i, Op.W: self._w, Op.R: self._r,
                 Op.SEND_F: self._send_f, Op.RECV_F: self._recv_f, Op.SEND_B: self._send_b,
                 Op.RECV_B: self._recv_b, Op.ALL_REDUCE: self._all_reduce, Op.TIE_REDUCE: self._tie_reduce}
        #: per (train, learning): this rank's stream of that program, each instruction with its handler
        self.streams, self.loss_post, self.redone, self.defers = {}, {}, {}, {}
        for key in ((True, False), (True, True), (False, False), (False, True)):
            stream = programs.pick(*key).ranks[pp_rank]
            #: the (stage, microbatch) pairs whose F keeps only its input, an R rebuilding the graph (a program may
            #: recompute some microbatches of a stage and not others)
            self.redone[key] = programs.pick(*key).recomputed()
            self.streams[key] = [(table[i.op], i) for i in stream]
            #: the (stage, microbatch) of the W (and B) after which this stream has another of the same stage: a
            #: paired GEMM may wait for that one; the stage's last never waits (see runtime.wgrad_fusion.Pairing)
            self.defers[key] = later_weight_grads(stream)
            #: the position after which the loss receive is posted (see :func:`loss_post_position`)
            early = programs.early_receives > 0 and not key[1]
            self.loss_post[key] = loss_post_position(stream, program.stage_to_rank[-1], early)
        self.ran = None  # the program of the last step run
        self.defer_now = frozenset()  # self.defers of the step running
        self.current = None  # the instruction running now (for error reports)
        #: (instr, text): what the stage whose forward (or loss_fn) raised received, for the error; set only then
        self.failed_input = None
        self.clock = clock_for(work.device)
        self.events: list = []  # [instr, start mark, end mark] per instruction run, see pipesched.runtime.clock
        self.sent: dict = {}  # {SEND instr: bytes its messages put on the wire} of the last step
        self.origin = None  # the mark of the step's start
        self.wall0 = None  # time.time() at the step's start (aligns the ranks' timelines)
        self.step = None
        self.waited = None

    # ---- the loop ---------------------------------------------------------------------------------

    def run(self, inputs: StepInputs):
        """Run one step. Returns ``(total loss or None, last-stage outputs {mb: output}, peak bytes)``;
        ``self.events`` then holds the step's marks: ``self.clock.seconds(self.origin, marks)`` gives seconds.

        Raises whatever a handler raises; ``self.current`` names the instruction.
        """
        self.step = st = StepState(inputs)
        self.events = events = []
        self.sent = {}
        mark = self.clock.mark
        self.origin, self.wall0 = self.clock.origin()  # one instant: a preemption between them is retried
        key = (inputs.train, inputs.learning)
        self.ran = self.programs.pick(*key)  # the program this step runs (its stream is self.streams[key])
        self.defer_now = self.defers[key]
        loss_post = self.loss_post[key] if inputs.train and self.last not in self.local else None
        if loss_post == -1:
            self._post_loss()
        if inputs.train and self.ties is not None:
            self.ties.begin()  # earlier steps' tied gradient counted once per replica (TieReducer.begin)
        parts = inputs.parts if inputs.train else None
        if parts is not None:  # the receives of the other ranks' norm parts, where the protocol puts them
            parts.begin(self.ran.ranks[self.pp_rank], self.programs.early_receives > 0 and not inputs.learning)
        for at, (handler, instr) in enumerate(self.streams[key]):
            self.current = instr
            self.waited = mark()
            handler(instr)
            events.append([instr, self.waited, mark()])  # a handler that waits for data moves its start past it
            if at == loss_post:
                self._post_loss()
            if parts is not None:
                parts.post_at(at)
        self.current = None
        loss = self._finish()
        self.step = None
        return loss, st.outputs, st.peak

    def _post_loss(self):
        self.step.loss_recv = self.transport.post([((2,), torch.float64)], self.program.stage_to_rank[-1], TAG_LOSS,
                                                  "the step loss")

    def _finish(self):
        """End of the stream: the last stage's rank sends the loss (its last message to every rank in a step;
        the others posted its receive after their last receive from it), then every send and all-reduce is
        waited for."""
        st = self.step
        if any(st.wpairs.values()):  # never, by the stream rule (each stage's last W runs what is pending): a net
            self.pair_stats.flushed += sum(run_pending(pending) for pending in st.wpairs.values())
        if st.io.train and self.last in self.local:
            self._send_loss()
        for pending in list(st.act_sends.values()) + [st.other_sends]:
            for work, _ in pending:
                wait(work, "a send")
        for at, started in st.reductions:
            finish_sum(started, self.program.dp_size)  # the average over replicas; None where no replica had one
            self.events[at][2] = self.clock.mark()  # the ALL_REDUCE event spans start call to result awaited
        if st.io.train and st.io.parts is not None:
            st.io.parts.send_early(self.ties)  # the norm parts, if this rank's owned gradients are final already
        if self.ties is not None:
            self.ties.finish()  # the tied-gradient sums TIE_REDUCE started
            if st.tie_event is not None:
                self.events[st.tie_event][2] = self.clock.mark()  # TIE_REDUCE too: until its sums are in
        if st.io.train and st.io.parts is not None:
            st.io.parts.exchange()  # the gradients are final: this rank's norm part to every rank, theirs here
        if not st.io.train:
            return None
        if self.last in self.local:
            return step_total(st.losses, self.program.num_microbatches)
        tensors, _ = self.transport.wait(st.loss_recv)
        value, code = tensors[0].tolist()
        return torch.tensor(value, dtype=DTYPES[int(code)], device=self.device)

    # ---- forward ------------------------------------------------------------------------------------

    def _stage_input(self, s, mb):
        st = self.step
        if s == 0:
            return st.io.microbatches[mb], st.io.container
        if s - 1 in self.local:
            outs, container = st.fwd_out.pop((s - 1, mb))
            return tuple(o.detach().requires_grad_(o.requires_grad) for o in outs), container
        tensors, meta = self.transport.wait(st.pending.pop(("act", s, mb)))
        self.waited = self.clock.mark()
        self.events[st.recv_event.pop(("act", s, mb))][2] = self.waited
        if meta is not None:
            st.io.metas[("in", s, mb)] = meta
        meta = st.io.metas[("in", s, mb)]
        out = tuple(t.detach().requires_grad_(True) if rg else t
                    for t, (_, _, rg) in zip(tensors, meta[1]))
        return out, meta[0]

    def _f(self, instr):
        s, mb, st = instr.stage, instr.microbatch, self.step
        inputs, container = self._stage_input(s, mb)
        module, arg = self.stages[s], as_value(inputs, container)
        shared = self._shared_before(s, mb, inputs)
        if not st.io.train:
            with torch.no_grad(), self.autocast():
                try:
                    out = module(arg)
                except Exception:
                    self.failed_input = (instr, self._input_text(s, mb, inputs, container))
                    raise
            if shared:
                check_shared_writes(s, mb, *shared, inputs)
            if s == self.last:
                st.outputs[mb] = out
            else:
                self._stash(s, mb, out)
            return
        redo = (s, mb) in self.redone[(st.io.train, st.io.learning)]
        if redo:  # what R must replay: the RNG, the buffers; and the input's versions, to check them
            st.rng[(s, mb)] = (rng_state(self.device, module), [t._version for t in inputs], st.buffers.snapshot(module))
            # F's graph is thrown away: it runs on aliases (same data and version counters), so a hook its forward
            # registers on its input goes with it, and only R's (whose graph the backward runs) acts, once
            aliases = tuple(t.detach().requires_grad_(t.requires_grad) for t in inputs)
            arg = as_value(aliases, container)
        with (keep_nothing() if redo else self.counter.track()), self.autocast():
            try:
                out = call_stage(module, arg, s)
            except Exception:
                self.failed_input = (instr, self._input_text(s, mb, inputs, container))
                raise
            loss = self._loss(out, mb) if s == self.last else None
        if shared:
            check_shared_writes(s, mb, *shared, inputs)
        saved = self.counter.take()
        st.inputs[(s, mb)] = (inputs, container)
        if loss is not None:
            st.losses[mb] = loss[0].detach()  # the replica's own loss; loss[1] the backward's (_loss)
            roots = (st.io.scale(loss[1]),)
        else:
            roots = self._stash(s, mb, out)
        if not redo:
            st.roots[(s, mb)] = roots
        self._hold((s, mb), tensor_bytes(inputs) if redo else saved)

    def _shared_before(self, s, mb, inputs):
        """``(meta, versions)`` of a received input whose elements shared memory on the sending rank, for
        :func:`~pipesched.runtime.shared_inputs.check_shared_writes` after the forward; else ``None``."""
        if s == 0 or s - 1 in self.local:  # the microbatch itself, or outputs handed over on this rank: one memory
            return None
        meta = self.step.io.metas[("in", s, mb)]
        versions = shared_versions(meta, inputs)
        return None if versions is None else (meta, versions)

    def _input_text(self, s, mb, inputs, container):
        """What stage ``s`` received for microbatch ``mb`` (:func:`~pipesched.runtime.received.stage_input_text`)."""
        return stage_input_text(s, mb, inputs, container, None if s == 0 else self.program.stage_to_rank[s - 1])

    def _loss(self, out, mb):
        io = self.step.io
        target = io.targets[mb] if io.targets is not None else None
        try:
            value = self.loss_fn(out) if target is None else self.loss_fn(out, target)
        except Exception:
            self.failed_input = (self.current, loss_input_text(out, target))
            raise
        return weighted(checked_loss(value), io.weights[mb], io.grad_weights[mb])

    def _stash(self, s, mb, out):
        outs, container = stage_output(out, s)
        st = self.step
        st.fwd_out[(s, mb)] = (outs, container)
        if st.io.learning:
            for k, t in enumerate(outs):  # on every placement, before any message: not only where it is sent
                if unsendable(t.dtype):
                    raise TypeError(f"element {k} of the output of stage {s}: {unsendable(t.dtype)}")
            st.io.metas[("out", s, mb)] = meta_of(outs, container)
        return outs

    def _send_loss(self):
        total = step_total(self.step.losses, self.program.num_microbatches)
        msg = torch.tensor([float(total), float(DTYPE_CODE[total.dtype])], dtype=torch.float64, device=self.device)
        for peer in range(self.program.num_ranks):
            if peer != self.pp_rank:
                self.step.other_sends.append(self.transport.send((msg,), peer, TAG_LOSS))

    def _r(self, instr):
        s, mb, st = instr.stage, instr.microbatch, self.step
        inputs, container = st.inputs[(s, mb)]
        state, versions, buffers = st.rng.pop((s, mb))
        if [t._version for t in inputs] != versions:  # autograd's count of in-place writes to each tensor
            raise ValueError(f"stage {s} modified its input in place during its forward (e.g. an in-place "
                             f"Dropout or x.mul_(...) on a tensor that needs no gradient), so recomputing it "
                             f"from that input would give other gradients: make the operation out-of-place, "
                             f"or turn recompute off for stage {s}")
        check_no_forward_hooks(self.stages[s], s, self.first_layers[s], self.recompute)  # one added since
        # the stage input is already held (counted at F): count only what the recompute adds. Copies of F's
        # buffer values are swapped in for the forward and the module's own put back after it
        with replay_rng(state, self.device), buffers.replayed(), torch.enable_grad(), self.counter.track(inputs), \
                self.autocast():
            out = call_stage(self.stages[s], as_value(inputs, container), s)
            loss = self._loss(out, mb) if s == self.last else None
        st.roots[(s, mb)] = (st.io.scale(loss[1]),) if loss is not None else as_tuple(out)[0]
        self._hold((s, mb), self.counter.take())

    def _hold(self, key, nbytes):
        st = self.step
        st.held[key] = st.held.get(key, 0) + nbytes
        st.live += nbytes
        st.peak = max(st.peak, st.live)

    # ---- backward -----------------------------------------------------------------------------------

    def _output_grads(self, s, mb):
        st = self.step
        if s == self.last:
            return None
        if s + 1 in self.local:
            return st.input_grads.pop((s + 1, mb))
        pending = st.pending.pop(("grad", s, mb), None)
        if pending is None:  # no output needs a gradient, or (learned) none gets one
            return (None,) * len(st.io.metas.get(("out_grad", s, mb), ()))
        grads, mask, orders = self.transport.wait_grads(pending)
        self.waited = self.clock.mark()
        self.events[st.recv_event.pop(("grad", s, mb))][2] = self.waited
        if st.io.learning:
            st.io.metas[("out_grad", s, mb)], st.io.metas[("out_grad_order", s, mb)] = mask, orders
        return grads

    def _backward_roots(self, s, mb):
        """The outputs to run the backward of (s, mb) from, and their gradients: only outputs that got one,
        so an output the next stage does not use (or detaches) gets none, as in the unsplit model."""
        roots = self.step.roots.pop((s, mb))
        if s == self.last:
            return list(roots), None
        pairs = [(r, g) for r, g in zip([o for o in roots if o.requires_grad], self._output_grads(s, mb))
                 if g is not None]
        return [r for r, _ in pairs], [g for _, g in pairs]

    def _b(self, instr):
        s, mb = instr.stage, instr.microbatch
        roots, grads = self._backward_roots(s, mb)
        inputs, _ = self.step.inputs.pop((s, mb))
        # an input's gradient as it flows on in the unsplit model (after the forward's hooks on it, in the layout
        # the backward made), not its .grad, which autograd lays out as the input. None where none reached it
        with input_gradients(inputs if s > 0 else ()) as got:
            if roots:
                torch.autograd.backward(roots, grads)
        if s > 0:
            self.step.input_grads[(s, mb)] = tuple(got)
        self._release(s, mb)

    def _i(self, instr):
        s, mb = instr.stage, instr.microbatch
        roots, grads = self._backward_roots(s, mb)
        inputs, _ = self.step.inputs.pop((s, mb))
        trainable = [p for p in self.params[s] if p.requires_grad]  # now, not at construction
        # stage 0's input gradient goes to no rank: its W runs the whole backward, as B, which fills the .grad of
        # a caller's input that requires grad (x.requires_grad_()); I does nothing there
        got, self.step.wgrad[(s, mb)] = backward_input(roots, grads, inputs if s > 0 else (), trainable,
                                                       self.split_plans[s])
        if s > 0:
            self.step.input_grads[(s, mb)] = got

    def _i_then_w(self, instr):  # a B under gradient-accumulation fusion
        self._i(instr)
        self._w(instr)

    def _w(self, instr):
        s, mb = instr.stage, instr.microbatch
        work = self.step.wgrad.pop((s, mb))
        pairing = None
        if self.pair_wgrad:  # the GEMM may wait for the stage's next W, or take the one waiting (wgrad_fusion)
            pairing = Pairing(self.step.wpairs.setdefault(s, {}), (s, mb) in self.defer_now, self.pair_stats)
        if work.groups and any(m._buffers for m in self.modules[s]):  # W restarts inside the graph I ran: a
            # torch.utils.checkpoint region recomputes its forward again there (I, as the fused backward, already
            # did once), so what it writes to buffers (BatchNorm's running statistics) goes to scratch copies
            with scratch_buffers(self.stages[s]):
                backward_weight(work, self.fuse_wgrad, pairing)
        else:
            backward_weight(work, self.fuse_wgrad, pairing)
        if pairing is not None and not pairing.defer and pairing.pending:  # the stage's last W of the step: what
            # waits for a W that did not take it (one that declined fusion, or got no gradient) runs now
            self.pair_stats.leftover += run_pending(pairing.pending)
        self._release(s, mb)

    def _release(self, s, mb):
        st = self.step
        st.live -= st.held.pop((s, mb), 0)
        for work, _ in st.act_sends.pop((s, mb), ()):  # landed: its gradient has come back
            wait(work, f"the send of the output of stage {s}, microbatch {mb}")


def later_weight_grads(stream) -> frozenset:
    """The ``(stage, microbatch)`` of the ``W`` and ``B`` instructions of ``stream`` (one rank's, in order) that
    another ``W`` or ``B`` of the same stage follows: those whose weight GEMM may wait to be paired
    (:class:`~pipesched.runtime.wgrad_fusion.Pairing`). A stage's last is not in it, so nothing waits past it."""
    later, seen = set(), set()
    for instr in reversed(stream):
        if instr.op in (Op.W, Op.B):
            if instr.stage in seen:
                later.add((instr.stage, instr.microbatch))
            seen.add(instr.stage)
    return frozenset(later)
