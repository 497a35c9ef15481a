"""The executor's message instructions (``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B``, the data-parallel
``ALL_REDUCE`` and ``TIE_REDUCE``): each posts its transfer or reduction and returns; the step's state
(:class:`~pipesched.runtime.step_state.StepState`) keeps what is in flight until a compute instruction or the
step's end waits for it. A step that learns the wire format records each message's layout; a later step checks
its tensors against it (a stage's outputs must follow from its input signature and the settings)."""
from __future__ import annotations

from .accounting import tensor_bytes
from .wire import describe_change, grad_specs, meta_of, tag_of
from .grad_sum import start_sum
from .settings import SETTINGS


class MessageHandlers:
    """Mixed into :class:`~pipesched.runtime.executor.Executor`, whose attributes these handlers use
    (``step``, ``transport``, ``program``, ``sent``, ``events``, ``reduced``, ``dp_group``, ``ties``)."""

    def _send_f(self, instr):
        s, mb, st = instr.stage, instr.microbatch, self.step
        outs, container = st.fwd_out.pop((s, mb))
        meta = meta_of(outs, container)
        learned = None if st.io.learning else st.io.metas[("out", s, mb)]
        if learned is not None and meta != learned:
            change = describe_change(f"the output of stage {s}", meta, learned)
            if change:
                raise RuntimeError(f"microbatch {mb}: {change}, with the same input signature and settings "
                                   f"({SETTINGS}); a stage's output shapes, dtypes and requires_grad must follow "
                                   f"from those (data-dependent ones are not supported)")
            meta = learned  # only the layout differs: sent in the learned dim order, which the receiver expects
        sends = self.transport.send_act(outs, meta, instr.peer, s, mb, st.io.learning)
        self.sent[instr] = tensor_bytes(buf for _, buf in sends)
        if st.io.train:
            st.act_sends[(s, mb)] = sends
        else:
            st.other_sends.extend(sends)

    def _recv_f(self, instr):
        s, mb, st = instr.stage, instr.microbatch, self.step
        meta = None if st.io.learning else st.io.metas[("in", s, mb)]
        what = f"RECV_F{s}.{mb} from pipeline rank {instr.peer}"
        st.pending[("act", s, mb)] = self.transport.post_act(meta, instr.peer, s - 1, mb, what)
        st.recv_event[("act", s, mb)] = len(self.events)

    def _send_b(self, instr):
        s, mb, st = instr.stage, instr.microbatch, self.step
        grads = st.input_grads.pop((s, mb))
        if not grads:
            return
        mask = tuple(g is not None for g in grads)
        if st.io.learning:
            st.io.metas[("in_grad", s, mb)] = mask
        elif mask != st.io.metas[("in_grad", s, mb)]:
            raise RuntimeError(f"microbatch {mb}: the input gradients of stage {s} present "
                               f"{list(mask)} (True: a gradient, False: none), "
                               f"{list(st.io.metas[('in_grad', s, mb)])} before, with the same input signature "
                               f"and settings ({SETTINGS}); which inputs get a gradient must follow from those")
        tag = tag_of("grad", s, mb, self.program.num_stages)
        specs, key = grad_specs(st.io.metas[("in", s, mb)]), ("in_grad_order", s, mb)
        orders = None if st.io.learning else st.io.metas[key]  # None: learn each gradient's layout, send it along
        sends, st.io.metas[key] = self.transport.send_grads(grads, specs, instr.peer, tag, orders)
        st.other_sends.extend(sends)
        self.sent[instr] = tensor_bytes(buf for _, buf in sends)

    def _recv_b(self, instr):
        s, mb, st = instr.stage, instr.microbatch, self.step
        specs = grad_specs(st.io.metas[("out", s, mb)])
        if not specs:
            return
        mask = None if st.io.learning else st.io.metas[("out_grad", s, mb)]
        orders = None if st.io.learning else st.io.metas[("out_grad_order", s, mb)]
        what = f"RECV_B{s}.{mb} from pipeline rank {instr.peer}"
        tag = tag_of("grad", s + 1, mb, self.program.num_stages)
        pending = self.transport.post_grads(specs, mask, instr.peer, tag, what, orders)
        if pending is not None:
            st.pending[("grad", s, mb)] = pending
            st.recv_event[("grad", s, mb)] = len(self.events)

    def _all_reduce(self, instr):
        # every trainable parameter, with or without a gradient on this replica (grad_sum: presence flags), so the
        # replicas sum the same elements even when one replica's data left a parameter unused
        params = [p for p in self.reduced[instr.stage] if p.requires_grad or p.grad is not None]
        if params and self.dp_group is not None:
            self.step.reductions.append((len(self.events),  # this instruction's event: its end set in _finish
                                         start_sum(self.dp_group, params,
                                                   f"the data-parallel all-reduce of stage {instr.stage}")))

    def _tie_reduce(self, _instr):
        self.ties.start()
        self.step.tie_event = len(self.events)  # this instruction's event: its end set in _finish
