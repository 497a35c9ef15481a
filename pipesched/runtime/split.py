"""Split backward: the input gradient now (``I``), the weight gradient later (``W``), each matmul run once.

The split is the zero-bubble one (Qi et al., "Zero Bubble Pipeline Parallelism", arXiv:2401.10241): the
previous stage waits only for the gradient of this stage's input, so computing that first and sending it
before the weight gradients shortens the pipeline's critical path.

How, without doing the backward twice: ``I`` runs autograd towards the stage inputs only. The autograd
nodes on a path to an input that also lead to parameters (a ``Linear``'s addmm node: input and weight)
are the *boundary*; a pre-hook on each records the gradient flowing into it. ``W`` restarts autograd at the
boundary with those gradients, asking for the parameters only, so every node computes just the outputs
it was skipped for: ``dX = dY W`` ran in ``I``, ``dW = dY^T X`` runs in ``W``. Gradients accumulate into
``.grad`` through the same accumulate nodes, in the same order, as a fused backward: results are bitwise
those of ``torch.autograd.backward``. One exception to "once": a parameter used at two points of a stage
(a weight applied twice) restarts ``W`` from both, and the part of the graph between them runs again
(its result is pinned to the recorded gradient, so nothing is counted twice).

``W`` accumulates into every leaf of the graph that requires grad, as the fused backward does, not only the
stage's parameters: a loss function's own parameters (a learnable temperature) and tensors created with
``requires_grad=True`` that are not registered parameters; only the stage inputs are left to ``I``. Tensor hooks
(``y.register_hook``) on a boundary node's tensor run at ``I`` and again at ``W``: the gradient ``W`` uses is
pinned to the one ``I`` recorded (after the hooks), so values are right, but a hook's side effects (calls
counted, ``retain_grad``'s ``.grad``, which gets the gradient twice) happen twice.

``I`` calls ``torch.autograd.grad``, which the reentrant form of ``torch.utils.checkpoint`` does not
support; use ``use_reentrant=False`` in stages that are split.
"""
from __future__ import annotations

from collections import deque

import torch
from torch.autograd.graph import GradientEdge

from .wgrad_fusion import PLAIN_TENSORS, fused_linear_weight


class WeightGrad:
    """The deferred half of a split backward: for each group of parameters, the boundary edges to restart
    from, their recorded gradients, and the parameters to accumulate into. Holds the autograd graph (and
    so the stage's saved activations) until :func:`backward_weight` runs."""

    __slots__ = ("groups", "whole")

    def __init__(self, groups, whole=None) -> None:
        self.groups = groups  # [([(boundary node, its gradients)], params)]
        self.whole = whole  # (roots, grads): no input needs a gradient, W is the whole backward


class SplitPlans:
    """The graph analysis of a stage's last split backward, reused while the graph keeps its shape.

    Every microbatch builds a new autograd graph, but a stage's graph has the same shape each time (same
    nodes in the same breadth-first order, same edges, the inputs and parameters at the same places). Which
    nodes ``I`` hooks and how ``W`` groups the parameters depend only on that shape, so :func:`backward_input`
    keeps the last analysis here with the shape it was made for, and redoes it only when the shape differs.
    One per stage (the executor keeps one for each of its stages); holds integers, no tensors or nodes."""

    __slots__ = ("key", "plan", "hits")

    def __init__(self) -> None:
        self.key = self.plan = None
        self.hits = 0  # analyses reused (for tests and benchmarks)


def backward_input(roots, grads, inputs, params, plans: SplitPlans | None = None):
    """Input-gradient half of the backward of ``roots`` (a stage's outputs, or its loss) with output gradients
    ``grads`` (``None``: ``roots`` are scalars, gradient 1).

    Args:
        roots: tensors that require grad (a leaf among them, a parameter returned as an output, gets its gradient
            at ``W``); one that does not fails with torch's own error, as the fused backward does.
        grads: one gradient per root (same shape and dtype), or ``None``.
        inputs: the stage's input tensors (leaves); those that require grad get a gradient (from ``I``, not in
            their ``.grad``).
        params: the stage's parameters that require grad. ``W`` also accumulates into every other leaf of the
            graph that requires grad (a loss function's parameters, an unregistered tensor created with
            ``requires_grad=True``), except ``inputs``, as the fused backward does.
        plans: where this stage's graph analysis is kept between calls (:class:`SplitPlans`); ``None``: none is
            kept (each call analyses its graph). Results are the same either way.
    Returns:
        ``(input_grads, weight_grad)``: one gradient per input that requires grad (``None`` where no root
        depends on it, as ``.grad`` after a fused backward), and the :class:`WeightGrad` to pass to
        :func:`backward_weight`.
    """
    _refuse_roots_without_grad(roots, grads)
    need = [t for t in inputs if t.requires_grad]
    if not need or not roots:
        return (None,) * len(need), WeightGrad([], (roots, grads) if roots else None)
    tops = [_node(r) for r in roots]
    nodes, index, kids = _walk(tops)
    leaf = _leaves(nodes, kids)
    key = (kids, len({index[n] for n in tops}),  # the shape: edges and how many tops (they come first), then where
           # the inputs and the parameters are (None: not in the graph), then every leaf's accumulate node
           tuple(index.get(t.grad_fn) if t.grad_fn is not None else leaf.get(id(t)) for t in need),
           tuple(leaf.get(id(p)) for p in params), tuple(leaf.values()))
    if plans is not None and plans.key == key:
        plans.hits += 1
        closure, boundary, groups, others = plans.plan
    else:
        closure, boundary, groups, others = _plan(*key)
        if plans is not None:
            plans.key, plans.plan = key, (closure, boundary, groups, others)
    if others:  # leaves that are neither parameters nor inputs (a loss function's parameters): the tensors now
        params = [*params, *(nodes[i].variable for i in others)]
    records: dict = {}
    recording = [True]  # the boundary hooks record during I, then pin what they recorded (they go with the graph)
    for i in boundary:
        nodes[i].register_prehook(_record_then_pin(records, i, recording))
    try:
        got = torch.autograd.grad(roots, need, grads, retain_graph=True, allow_unused=True)
    finally:
        recording[0] = False
    records.update(_root_seeds(roots, grads, closure, index))
    work = []
    for starts, positions in groups:
        found = [(nodes[i], records[i]) for i in starts if i in records]
        if found:
            work.append((found, [params[k] for k in positions]))
    return tuple(got), WeightGrad(work)


def backward_weight(work: WeightGrad, fuse: bool = False, pairing=None) -> None:
    """Weight-gradient half: accumulate every parameter's gradient into its ``.grad`` (as
    ``torch.autograd.backward`` does), then let the graph go. ``fuse``: a ``Linear``'s weight gradient is added
    into an existing ``.grad`` by the GEMM itself (:mod:`pipesched.runtime.wgrad_fusion`: faster, not bitwise);
    ``pairing`` (with ``fuse``): that GEMM may be kept for, or run together with, another microbatch's
    (:class:`~pipesched.runtime.wgrad_fusion.Pairing`); ``None``: it runs now.

    Each boundary node's incoming gradient is pinned to the one ``I`` recorded (by the pre-hook that recorded
    it): for a group restarting at several boundary nodes, one below another (a parameter used twice), so the
    part that flows down again is not added twice; and for a tensor hook on the node's tensor
    (``y.register_hook(lambda g: g * 0.5)``), which runs again when ``W`` restarts there (node pre-hooks run
    after tensor hooks), so it is not applied twice."""
    if work.whole is not None:
        torch.autograd.backward(*work.whole)
    for starts, params in work.groups:
        if fuse and fused_linear_weight(starts, params, _accumulate, pairing):
            continue
        edges = [GradientEdge(node, i) for node, grads in starts for i, g in _given(grads)]
        values = [g for _, grads in starts for _, g in _given(grads)]
        _accumulate(edges, values, params)
    work.groups, work.whole = [], None


def _accumulate(edges, values, params) -> None:
    """``torch.autograd.backward(edges, values, inputs=params, retain_graph=True)`` without its argument
    checks: the values are the gradients autograd itself recorded at those edges (their shapes and dtypes are
    right by construction), and re-checking them cost about as much as the small matmuls they feed. The public
    call is kept where torch lacks the engine entry point it uses, and for tensor subclasses (which it may
    dispatch through ``__torch_function__``)."""
    run = getattr(torch.autograd.graph, "_engine_run_backward", None)
    if run is None or not all(type(t) in PLAIN_TENSORS for t in (*values, *params)):
        torch.autograd.backward(edges, values, inputs=params, retain_graph=True)
        return
    run(tuple(edges), tuple(values), True, False, tuple(params), allow_unreachable=True, accumulate_grad=True)


# ---- the autograd graph ----------------------------------------------------------------------------

def _refuse_roots_without_grad(roots, grads) -> None:
    """Fail as ``torch.autograd.backward(roots, grads)`` does when a root does not require grad (a detached loss
    or output): torch itself raises its ``RuntimeError`` ("element 0 of tensors does not require grad and does not
    have a grad_fn"), from its check of every root before the engine runs, so no gradient is computed."""
    if all(r.requires_grad for r in roots):
        return
    torch.autograd.backward(roots, grads)
    raise RuntimeError("a root of the split backward does not require grad and does not have a grad_fn")  # (torch
    # raised above on every version checked; this keeps the refusal if one did not)


_gradient_edge = getattr(torch.autograd.graph, "get_gradient_edge", None)


def _edge(t: torch.Tensor):
    """``(node, output index)`` where ``t``'s gradient enters the graph: its ``grad_fn``, or a leaf's accumulate
    node (index 0). ``t`` requires grad."""
    if t.grad_fn is not None:
        return t.grad_fn, t.output_nr
    if _gradient_edge is not None:  # also under no_grad
        edge = _gradient_edge(t)
        return edge.node, edge.output_nr
    return t.view_as(t).grad_fn.next_functions[0]


def _node(t: torch.Tensor):
    """The autograd node that receives ``t``'s gradient: its ``grad_fn``, or a leaf's accumulate node."""
    return _edge(t)[0]


def _walk(tops):
    """Breadth-first over the graph below ``tops``: ``(nodes, {node: index}, kids)``, ``kids[i]`` the indices
    of the nodes ``nodes[i]`` passes gradient to (one per edge). ``tops`` come first, duplicates once."""
    index: dict = {}
    for node in tops:
        index.setdefault(node, len(index))
    nodes, kids = list(index), []
    for node in nodes:  # grows while walking
        row = []
        for child, _ in node.next_functions:
            if child is None:
                continue
            k = index.get(child)
            if k is None:
                k = index[child] = len(nodes)
                nodes.append(child)
            row.append(k)
        kids.append(tuple(row))
    return nodes, index, tuple(kids)


def _leaves(nodes, kids) -> dict:
    """{id(leaf tensor): index of its accumulate node} over the graph's accumulate nodes."""
    return {id(node.variable): i for i, node in enumerate(nodes)
            if not kids[i] and type(node).__name__ == "AccumulateGrad"}


def _plan(kids, tops, need, params, leaves):
    """The analysis of a graph's shape: ``(closure, boundary, groups, others)``. ``closure``: the node indices on a
    path from a top to an input that needs a gradient (``tops``: how many nodes are roots' nodes, indices 0 to
    ``tops - 1``; ``need``: indices, None for an input not in the graph);
    ``boundary``: the closure's nodes that parameters' gradients pass through (``I`` records what flows into
    them); ``groups``: ``[(boundary node indices, parameter positions)]`` (``params``: per parameter the index
    of its accumulate node, None when the graph does not reach it), a group's ``W`` restarting at its nodes;
    ``others``: the accumulate nodes of ``leaves`` (every leaf's) that are neither a parameter's nor an input's,
    whose tensors ``W`` accumulates into too, as positions ``len(params)`` on in ``groups``."""
    parents: list = [[] for _ in kids]
    for i, row in enumerate(kids):
        for k in row:
            parents[k].append(i)
    closure = frozenset(_upward({i for i in need if i is not None}, parents, stop=()))
    known = {*params, *need}
    others = tuple(i for i in leaves if i not in known)
    groups = _groups((*params, *others), parents, closure, range(tops))
    boundary = sorted({i for nodes, _ in groups for i in nodes if i in closure})
    return closure, tuple(boundary), tuple(groups), others


def _upward(starts, parents, stop) -> set:
    """Nodes reachable upward (towards the roots) from ``starts``, not walking past nodes in ``stop``."""
    seen, queue = set(starts), deque(starts)
    while queue:
        for parent in parents[queue.popleft()]:
            if parent not in seen:
                seen.add(parent)
                if parent not in stop:
                    queue.append(parent)
    return seen


def _groups(params, parents, closure, tops) -> list:
    """Parameters grouped by the boundary nodes their gradient passes through: ``[(node indices, parameter
    positions)]``; groups that share a node merge. A boundary node is in the input closure, or is a top
    outside it (a root that does not depend on the inputs: ``W`` seeds it with the root's gradient, also where
    another root's graph passes through it, or where it is a parameter's accumulate node). Parameters the graph
    does not reach are left out."""
    groups: list = []
    for position, node in enumerate(params):
        if node is None:
            continue
        above = _upward({node}, parents, stop=closure)
        nodes = {n for n in above if n in closure or n in tops}
        group = [nodes, [position]]
        for other in [g for g in groups if not g[0].isdisjoint(nodes)]:
            group = [group[0] | other[0], other[1] + group[1]]
        groups = [g for g in groups if g[0].isdisjoint(nodes)] + [group]
    return [(tuple(sorted(nodes)), tuple(positions)) for nodes, positions in groups]


def _record_then_pin(records: dict, key, recording: list):
    """A boundary node's pre-hook: while ``recording[0]`` (``I``) it records the node's incoming gradients in
    ``records[key]``; after, it replaces them with those (``None``: none recorded, left as they are)."""
    def hook(grad_outputs):
        if recording[0]:
            records[key] = tuple(grad_outputs)
            return None
        return records.get(key)
    return hook


def _given(grads):
    """(output index, gradient) of the gradients given: a recorded tuple (``None`` where no gradient
    flowed) or a root's ``{output index: gradient}``."""
    pairs = grads.items() if isinstance(grads, dict) else enumerate(grads)
    return [(i, g) for i, g in pairs if g is not None]


def _root_seeds(roots, grads, closure, index) -> dict:
    """{root node index: {output index: gradient}}, for roots outside the input closure (``W`` restarts there);
    a leaf root's node is its accumulate node. A tensor given twice as a root gets the sum of its gradients, in
    order, as autograd's input buffer adds them."""
    seeds: dict = {}
    for k, r in enumerate(roots):
        node, nr = _edge(r)
        if index[node] not in closure:
            grad = torch.ones_like(r) if grads is None else grads[k]
            given = seeds.setdefault(index[node], {})
            given[nr] = given[nr] + grad if nr in given else grad
    return seeds
