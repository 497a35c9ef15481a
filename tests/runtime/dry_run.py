"""A dry run of a whole pipeline in one process: every rank's real step-opening ``Handshake`` and ``Executor``
in its own thread, over an in-memory process group that logs every post in call order and matches the
point-to-point messages between two ranks first in, first out whatever their tag (as NCCL does; the checker's
model), failing on a message whose tag or size is not the one the receive was posted for, on a receive
nothing comes for, or on a rank entering the step-opening all-gather while a message it posted is not yet
waited for (on NCCL that collective would queue behind it). With ``dp_size > 1`` each rank's data-parallel group
is a fake of identical replicas (:class:`_FakeDP`): the real handshake's agreement all-gather over it is logged
among the rank's posts, and each all-reduce's place among them in ``Network.reduces``."""
from __future__ import annotations

import threading
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.api import StepPrograms
from pipesched.runtime.executor import Executor
from pipesched.runtime.step_state import Links, RankWork, StepInputs
from pipesched.runtime.handshake import Handshake
from pipesched.runtime.refusals import TargetVerdict, target_microbatches
from pipesched.runtime.norm_parts import NormParts
from pipesched.runtime.transport import Transport

WAIT_S = 20.0  # a receive that gets nothing in this time fails (a hang, in a real run)


class _Done:
    """A finished work (sends are buffered; a fake all-reduce does nothing); ``waited`` once waited for."""

    waited = False
    what = "a send"

    def wait(self):
        self.waited = True
        return True


class _Receive:
    """The ``index``-th receive posted from ``src`` on ``dst``: it gets the ``index``-th message ``src`` sent
    ``dst``, which must carry ``tag`` and fit ``buf``."""

    waited = False

    def __init__(self, net, src, dst, index, tag, buf):
        self.net, self.src, self.dst, self.index, self.tag, self.buf = net, src, dst, index, tag, buf
        self.what = f"the receive of tag {tag} from rank {src}"

    def wait(self):
        self.waited = True
        net, channel = self.net, (self.src, self.dst)
        with net.cond:
            if not net.cond.wait_for(lambda: net.failed or len(net.sent[channel]) > self.index, WAIT_S):
                raise RuntimeError(f"rank {self.dst}: receive {self.index} from rank {self.src} (tag {self.tag}) got "
                                   f"nothing in {WAIT_S} s")
            if len(net.sent[channel]) <= self.index:
                raise RuntimeError(f"rank {self.dst}: stopped, another rank failed")
            tag, data = net.sent[channel][self.index]
        if tag != self.tag or data.shape != self.buf.shape:
            raise RuntimeError(f"rank {self.dst}: receive {self.index} from rank {self.src} was posted for tag "
                               f"{self.tag} {tuple(self.buf.shape)}, the message sent is tag {tag} {tuple(data.shape)}")
        self.buf.copy_(data)
        return True


class Network:
    """The messages between ``num_ranks`` in-process ranks, and each rank's log of posts:
    ``("send" | "recv", peer, tag)`` in call order."""

    def __init__(self, num_ranks: int) -> None:
        self.cond = threading.Condition()
        self.sent = defaultdict(list)  # (src, dst) -> [(tag, tensor)] in send order
        self.posted = defaultdict(int)  # (src, dst) -> receives posted so far
        self.failed = False  # a rank failed: every wait stops
        self.num_ranks = num_ranks
        self.gathers = defaultdict(dict)  # all-gather number -> {rank: its tensor}
        self.gathered = [0] * num_ranks  # per rank, the all-gathers it joined
        self.log = [[] for _ in range(num_ranks)]
        self.works = [[] for _ in range(num_ranks)]  # per rank, its point-to-point works not yet seen waited
        self.reduces = [[] for _ in range(num_ranks)]  # per rank, for each data-parallel all-reduce: len(log) then

    def group(self, rank: int) -> "FakeGroup":
        return FakeGroup(self, rank)


class FakeGroup:
    """The pipeline group as one rank sees it: ``send``/``recv`` of one packed tensor, as ``Transport`` calls them."""

    def __init__(self, net: Network, rank: int) -> None:
        self.net, self.rank = net, rank

    def send(self, tensors, dst, tag):
        net = self.net
        net.log[self.rank].append(("send", dst, tag))
        with net.cond:
            net.sent[(self.rank, dst)].append((tag, tensors[0].clone()))
            net.cond.notify_all()
        return self._track(_Done())

    def _track(self, work):
        self.net.works[self.rank].append(work)
        return work

    def allgather(self, outputs, inputs):
        net = self.net
        unfinished = [work.what for work in net.works[self.rank] if not work.waited]
        if unfinished:
            raise RuntimeError(f"rank {self.rank} enters the step-opening all-gather with {unfinished} not waited for")
        net.works[self.rank] = []
        net.log[self.rank].append(("all_gather", None, None))
        with net.cond:
            number = net.gathered[self.rank]
            net.gathered[self.rank] += 1
            net.gathers[number][self.rank] = inputs[0].clone()
            net.cond.notify_all()
        return _Gather(net, number, outputs[0])

    def recv(self, tensors, src, tag):
        net = self.net
        net.log[self.rank].append(("recv", src, tag))
        with net.cond:
            index = net.posted[(src, self.rank)]
            net.posted[(src, self.rank)] += 1
        return self._track(_Receive(net, src, self.rank, index, tag, tensors[0]))


class _Gather:
    """One rank's side of all-gather number ``number``: done when every rank has joined."""

    def __init__(self, net, number, rows):
        self.net, self.number, self.rows = net, number, rows

    def wait(self):
        net = self.net
        with net.cond:
            if not net.cond.wait_for(lambda: net.failed or len(net.gathers[self.number]) == net.num_ranks, WAIT_S):
                raise RuntimeError(f"all-gather {self.number}: only ranks {sorted(net.gathers[self.number])} came")
            if len(net.gathers[self.number]) < net.num_ranks:
                raise RuntimeError("stopped, another rank failed")
            parts = net.gathers[self.number]
        for rank, row in enumerate(self.rows):
            row.copy_(parts[rank])
        return True


class CountingTransport(Transport):
    """The real :class:`Transport`, adding to each post it logs the number of tensors the message carries:
    ``("send" | "recv", peer, tag, tensors)``."""

    def __init__(self, net: Network, rank: int, num_stages: int, device) -> None:
        super().__init__(net.group(rank), num_stages, device)
        self.log = net.log[rank]

    def send(self, tensors, peer: int, tag: int):
        sent = super().send(tensors, peer, tag)
        self.log[-1] += (len(tensors),)
        return sent

    def post(self, specs, peer: int, tag: int, what: str):
        pending = super().post(specs, peer, tag, what)
        self.log[-1] += (len(specs),)
        return pending


class Boundary(nn.Module):
    """A stage whose input and output may be a pair of tensors, for masked gradients: ``y = tanh(lin(h))``
    from the input's first tensor ``h`` (``detach``: ``h.detach()``, so ``h`` gets no gradient), plus its
    second tensor if ``use_aux`` (otherwise that one gets none); returns ``(y, 2 * y)`` if ``pair_out``, else
    ``y``."""

    def __init__(self, width: int, detach: bool, use_aux: bool, pair_out: bool) -> None:
        super().__init__()
        self.lin, self.detach, self.use_aux, self.pair_out = nn.Linear(width, width), detach, use_aux, pair_out

    def forward(self, x):
        h, aux = x if isinstance(x, tuple) else (x, None)
        y = torch.tanh(self.lin(h.detach() if self.detach else h))
        if self.use_aux and aux is not None:
            y = y + aux
        return (y, 2 * y) if self.pair_out else y


class _FakeDP:
    """One rank's data-parallel group, its other replicas identical to it (same step, same data): an all-gather
    (the handshake's agreement) gives ``size`` copies of this rank's row and is logged among the rank's posts as
    ``("all_gather", None, "replicas")``; an all-reduce does nothing but note its place (``net.reduces``), and
    the agreement fails while one of the previous step's all-reduces is not waited for."""

    def __init__(self, net: Network, rank: int) -> None:
        self.net, self.rank, self.works = net, rank, []

    def allgather(self, outputs, inputs):
        if not all(work.waited for work in self.works):
            raise RuntimeError(f"rank {self.rank} enters the replicas' agreement with an all-reduce not waited for")
        self.works = []
        self.net.log[self.rank].append(("all_gather", None, "replicas"))
        for row in outputs[0]:
            row.copy_(inputs[0])
        return _Done()

    def allreduce(self, tensors):
        self.net.reduces[self.rank].append(len(self.net.log[self.rank]))
        self.works.append(_Done())
        return self.works[-1]


class DryPipeline:
    """``programs`` run by one real :class:`Executor` per pipeline rank on a stage of ``nn.Linear(4, 4)`` each,
    or on ``layers`` (one module per stage taking and giving tensors of width 4, e.g. :class:`Boundary`).
    ``norm_parts``: ``(max_norm, norm_type)`` every rank anticipates a ``clip_grad_norm_`` with (its training
    steps send the norm parts, runtime/norm_parts.py; ``self.parts[rank].rows`` after a step), or ``None``."""

    def __init__(self, programs: StepPrograms, width: int = 4, layers=None, norm_parts=None) -> None:
        torch.manual_seed(0)
        program = programs.train
        self.programs, self.p, self.m = programs, program.num_ranks, program.num_microbatches
        self.layers = layers or [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(program.num_stages)]
        self.net = Network(self.p)
        cpu = torch.device("cpu")
        transports = [CountingTransport(self.net, r, program.num_stages, cpu) for r in range(self.p)]
        dp = [_FakeDP(self.net, r) if program.dp_size > 1 else None for r in range(self.p)]
        self.executors = [
            Executor(programs, r, RankWork({s: self.layers[s] for s in program.stages_of(r)}, F.mse_loss, cpu),
                     Links(transports[r], dp[r]))
            for r in range(self.p)]
        self.handshakes = [Handshake(transports[r], program, r, cpu, dp[r]) for r in range(self.p)]
        self.parts = [NormParts(transports[r], self.p, r, cpu,
                                lambda r=r: [q for s in program.stages_of(r) for q in self.layers[s].parameters()])
                      for r in range(self.p)]
        for parts in self.parts:
            parts.wanted, parts.enabled = norm_parts, True
        self.metas = {True: [None] * self.p, False: [None] * self.p}  # per kind of step, per rank, once learned
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(2 * self.m, width, generator=g), torch.randn(2 * self.m, width, generator=g)

    def run(self, train: bool) -> list[list]:
        """One step (``train``) or forward on every rank, as ``Pipeline`` runs it (the handshake, then the
        executor); returns each rank's posts ``(kind, peer, tag, tensors)``, the all-gather as
        ``("all_gather", None, None)``, the replicas' agreement (``dp_size > 1``) as ``("all_gather", None,
        "replicas")``.

        Raises:
            RuntimeError: a rank failed (the first failure, naming the rank).
        """
        start = [len(log) for log in self.net.log]
        errors, threads = [], []
        for r in range(self.p):
            threads.append(threading.Thread(target=self._body, args=(r, train, errors)))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            rank, exc = errors[0]  # the first to fail
            raise RuntimeError(f"rank {rank} failed: {type(exc).__name__}: {exc}") from exc
        return [log[n:] for log, n in zip(self.net.log, start)]

    def _body(self, rank, train, errors):
        program, handshake = self.programs.train, self.handshakes[rank]
        first, last = program.stage_to_rank[0], program.stage_to_rank[-1]
        try:
            parts = self.parts[rank]
            verdict = TargetVerdict(len(self.y), "", self.y) if train and rank == last else None
            _, micro, is_tuple = handshake.signature(self.x if rank == first else None, train, lambda x: x, 0,
                                                     parts.opening_words(), verdict)
            parts.agree(handshake.clip_words, train)
            targets = target_microbatches(verdict, self.m)
            metas = self.metas[train][rank]
            inputs = StepInputs(train, micro, is_tuple, targets, [1 / self.m] * self.m,
                                {} if metas is None else metas, metas is None, None,
                                parts if parts.agreed else None)
            self.executors[rank].run(inputs)
            self.metas[train][rank] = inputs.metas
        except BaseException as exc:  # noqa: BLE001 - reported by run()
            errors.append((rank, exc))
            with self.net.cond:
                self.net.failed = True
                self.net.cond.notify_all()
