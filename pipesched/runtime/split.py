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

``I`` calls ``torch.autograd.grad``, which the reentrant form of ``torch.utils.checkpoint`` does not
support; use ``use_reentrant=False`` in stages that are split.
"""
from __future__ import annotations

from collections import deque

import torch
from torch.autograd.graph import GradientEdge


class WeightGrad:
    """The deferred half of a split backward: for each group of parameters, the boundary edges to restart
    from, their recorded gradients, and the parameters to accumulate into. Holds the autograd graph (and
    so the stage's saved activations) until :func:`backward_weight` runs."""

    __slots__ = ("groups", "whole")

    def __init__(self, groups, whole=None) -> None:
        self.groups = groups  # [([(boundary node, its gradients)], params)]
        self.whole = whole  # (roots, grads): no input needs a gradient, W is the whole backward


def backward_input(roots, grads, inputs, params):
    """Input-gradient half of the backward of ``roots`` (a stage's outputs, or its loss) with output gradients
    ``grads`` (``None``: ``roots`` are scalars, gradient 1).

    Args:
        roots: tensors that require grad.
        grads: one gradient per root (same shape and dtype), or ``None``.
        inputs: the stage's input tensors (leaves); those that require grad get a gradient.
        params: the stage's parameters that require grad.
    Returns:
        ``(input_grads, weight_grad)``: one gradient per input that requires grad (``None`` where no root
        depends on it, as ``.grad`` after a fused backward), and the :class:`WeightGrad` to pass to
        :func:`backward_weight`.
    """
    need = [t for t in inputs if t.requires_grad]
    if not need or not roots:
        return (None,) * len(need), WeightGrad([], (roots, grads) if roots else None)
    parents = _parents([_node(r) for r in roots])
    closure = _upward({_node(t) for t in need}, parents, stop=())
    groups = _groups(params, parents, closure)
    records: dict = {}
    boundary = [node for nodes, _ in groups for node in nodes if node in closure]
    handles = [node.register_prehook(_recorder(records, node)) for node in boundary]
    try:
        got = torch.autograd.grad(roots, need, grads, retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    records.update(_root_seeds(roots, grads, closure))
    work = []
    for nodes, group_params in groups:
        starts = [(node, records[node]) for node in nodes if node in records]
        if starts:
            work.append((starts, group_params))
    return tuple(got), WeightGrad(work)


def backward_weight(work: WeightGrad) -> None:
    """Weight-gradient half: accumulate every parameter's gradient into its ``.grad`` (as
    ``torch.autograd.backward`` does), then let the graph go.

    A group restarting at several boundary nodes, one below another (a parameter used twice), pins each
    node's incoming gradient to the recorded one, so the part that flows down again is not added twice."""
    if work.whole is not None:
        torch.autograd.backward(*work.whole)
    for starts, params in work.groups:
        edges = [GradientEdge(node, i) for node, grads in starts for i, g in _given(grads)]
        values = [g for _, grads in starts for _, g in _given(grads)]
        pins = [node.register_prehook(_pin(grads)) for node, grads in starts
                if isinstance(grads, tuple)] if len(starts) > 1 else []
        try:
            torch.autograd.backward(edges, values, inputs=params, retain_graph=True)
        finally:
            for handle in pins:
                handle.remove()
    work.groups, work.whole = [], None


# ---- the autograd graph ----------------------------------------------------------------------------

def _node(t: torch.Tensor):
    """The autograd node that receives ``t``'s gradient: its ``grad_fn``, or a leaf's accumulate node."""
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]


def _parents(tops) -> dict:
    """{node: the nodes that pass gradient to it} over the graph below ``tops``; tops map to []."""
    parents = {node: [] for node in tops}
    queue = deque(parents)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                queue.append(child)
            parents[child].append(node)
    return parents


def _upward(starts, parents, stop) -> set:
    """Nodes reachable upward (towards the roots) from ``starts``, not walking past nodes in ``stop``."""
    seen, queue = set(starts), deque(starts)
    while queue:
        for parent in parents.get(queue.popleft(), ()):
            if parent not in seen:
                seen.add(parent)
                if parent not in stop:
                    queue.append(parent)
    return seen


def _groups(params, parents, closure) -> list:
    """Parameters grouped by the boundary nodes their gradient passes through: ``[(nodes, params)]``; groups
    that share a node merge. A boundary node is in the input closure, or is a root outside it (a root
    that does not depend on the inputs). Parameters the graph does not reach are left out."""
    groups: list = []
    for p in params:
        node = _node(p)
        if node not in parents:
            continue
        above = _upward({node}, parents, stop=closure)
        nodes = {n for n in above if n in closure or not parents[n]}
        group = [nodes, [p]]
        for other in [g for g in groups if not g[0].isdisjoint(nodes)]:
            group = [group[0] | other[0], other[1] + group[1]]
        groups = [g for g in groups if g[0].isdisjoint(nodes)] + [group]
    return [(list(nodes), ps) for nodes, ps in groups]


def _recorder(records: dict, node):
    def record(grad_outputs):
        records[node] = tuple(grad_outputs)
    return record


def _pin(grads):
    def pin(grad_outputs):
        return grads
    return pin


def _given(grads):
    """(output index, gradient) of the gradients given: a recorded tuple (``None`` where no gradient
    flowed) or a root's ``{output index: gradient}``."""
    pairs = grads.items() if isinstance(grads, dict) else enumerate(grads)
    return [(i, g) for i, g in pairs if g is not None]


def _root_seeds(roots, grads, closure) -> dict:
    """{root node: {output index: gradient}}, for roots outside the input closure (``W`` restarts there)."""
    seeds: dict = {}
    for k, r in enumerate(roots):
        node = r.grad_fn
        if node is not None and node not in closure:
            seeds.setdefault(node, {})[r.output_nr] = torch.ones_like(r) if grads is None else grads[k]
    return seeds
