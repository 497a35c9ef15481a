"""Gradient-accumulation fusion for ``W``: a ``Linear``'s weight gradient added into ``.grad`` by the GEMM itself.

Autograd computes a ``Linear``'s weight gradient ``dW = dY^T X`` into a new tensor, then its accumulate node adds
that into ``.grad``: a GEMM writing ``out x in`` values, then a pass that reads them, reads ``.grad`` and writes it
back. With ``.grad`` already holding earlier microbatches' sum, one GEMM with ``beta = 1``
(``weight.grad.addmm_(dY^T, X)``) does both: Megatron-Core's ``gradient_accumulation_fusion`` (its fused
``wgrad`` kernels), here for ``W`` instructions (and ``B``, which the executor then runs as ``I`` then ``W``) on
any device through ``torch.addmm``. On this machine's CPU it takes 6.3 ms where autograd takes 9.0-10.0 (one
``Linear(2048, 2048)``, 64 rows, one thread). A ``B`` run so pays the split's bookkeeping (about 0.24 ms per stage
and microbatch on 4 x Linear(512): it pays on wide layers only), and tensor hooks inside the stage run twice, as
with ``split_backward``. Only where ``.grad`` already exists: not the first microbatch after ``zero_grad()``.

**Not bitwise.** The GEMM adds its products into the old ``.grad`` as it goes, in K-blocks (rows of the
microbatch; MKL here: blocks of 256 rows), where autograd rounds the whole product first, then adds: the sums
agree to float rounding (max difference 3e-5 on values of order 1 at 2048 rows, fp32), equal bitwise only while
the rows fit one block. So it is off by default and the Pipeline's bitwise guarantees hold only with it off.

What it fuses: a group of :func:`~pipesched.runtime.split.backward_weight` that restarts at one ``addmm``/``mm``
node (``nn.Linear``, ``F.linear``, ``x @ w.t()``) whose ``mat2`` is ``weight.t()`` of a leaf, when that weight's
``.grad`` is already a plain contiguous tensor of the product's dtype and device, no gradient hooks are on the
weight (``register_hook``, ``register_post_accumulate_grad_hook``) and the tensors are plain ``torch.Tensor``.
Anything else (the first microbatch after ``zero_grad(set_to_none=True)``, an autocast cast between the weight
and the GEMM, a weight used twice, also as the GEMM's other operand as in ``torch.addmm(h, tanh(w), w.t())``, a
GEMM whose ``self`` is not a leaf bias, a root that does not depend on the stage input, a convolution) runs
autograd's path unchanged. The bias, if any, gets its gradient from autograd as before (bitwise).

Hooks a fused ``W`` does not run (torch cannot list them, so they do not make it decline): those registered on
the weight's accumulate node itself (``w.view_as(w).grad_fn.next_functions[0][0].register_hook``, as Megatron's
and DeepSpeed's data parallelism do), and, for a ``Linear`` without a bias, the second run of a tensor hook on its
output that the split's ``W`` restart would make (the unsplit model's count, where unfused ``W`` runs it twice).

**Pairs** (``Pipeline(pair_weight_grads=True)``, with fusion only): the GEMM writes the whole ``out x in`` gradient
for ``K`` = a microbatch's rows, and at a few dozen rows its time goes to that output traffic, not to the
products: one ``addmm_`` over two microbatches' rows (``K`` doubled) costs far less than two (9.0 ms against 13.4
for ``Linear(2048, 2048)`` at 64 rows on this machine's CPU). So a fused ``W`` whose stage has a later ``W`` (or
``B``) in this rank's stream of the step keeps its operands pending (:class:`Pairing`) instead of running its GEMM,
and the next fused ``W`` of that weight runs one ``addmm_`` over both (rows concatenated); where ``.grad`` is None
(the first microbatch after ``zero_grad()``, which fusion alone leaves to autograd) the pair's product becomes
``.grad`` (``torch.mm``, as autograd's first accumulation stores its product). The last ``W`` of a stage
in the step never defers and runs whatever is still pending for the stage, so nothing is pending when a
``.grad`` is read (ALL_REDUCE, TIE_REDUCE, the step's end). Memory: a pending pair keeps one microbatch's
``Linear`` input and output gradient per ``Linear`` alive until the stage's next ``W``. Not bitwise either: the
sums agree with fusion alone to float rounding.
"""
from __future__ import annotations

import torch
from torch.autograd.graph import GradientEdge

_GEMMS = {"AddmmBackward0": "_saved_mat1", "MmBackward0": "_saved_self"}  # node type -> its saved left operand
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  #: classes whose autograd needs no __torch_function__ dispatch


def fused_linear_weight(starts, params, accumulate, pairing=None) -> bool:
    """Run one ``W`` group as a fused accumulation if it is a ``Linear``'s (see the module docstring); False
    (nothing done) if it is not.

    Args:
        starts: the group's ``[(boundary node, recorded gradients)]`` (:class:`~pipesched.runtime.split.
            WeightGrad`).
        params: the group's parameters (the weight, and the bias if any).
        accumulate: ``accumulate(edges, values, params)``, autograd's path, for the parameters other than the
            weight (the bias).
        pairing: ``None`` (the GEMM runs now), or the :class:`Pairing` of this ``W``: the GEMM may be kept for the
            stage's next ``W``, or run over this and a pending one's rows.
    """
    if len(starts) != 1:
        return False
    node, grads = starts[0]
    saved = _GEMMS.get(type(node).__name__)
    if saved is None or len(grads) != 1 or grads[0] is None or getattr(node, "_saved_alpha", 1) != 1:
        return False
    weight = _transposed_leaf(node.next_functions[-1][0])
    if weight is None or not any(p is weight for p in params) or not _only_through_mat2(node, grads, weight, params):
        return False
    grad_out = grads[0]
    fresh = pairing is not None and weight.grad is None  # a pair may make .grad, as autograd's first accumulation
    if not _fusable(weight, grad_out, fresh):
        return False
    left = getattr(node, saved)  # after the checks: under a non-reentrant checkpoint, reading it recomputes
    if not _fits(weight if fresh else weight.grad, left):
        return False
    rest = [p for p in params if p is not weight]
    if rest:
        accumulate([GradientEdge(node, 0)], [grad_out], rest)
    with torch.no_grad():
        if pairing is None:
            weight.grad.addmm_(grad_out.t(), left)
        else:
            pairing.gemm(weight, grad_out, left)
    return True


class PairStats:
    """What pairing did on one executor, summed over its steps (for tests and benchmarks): GEMMs ``deferred``
    (operands kept), ``paired`` (one ``addmm_`` over two microbatches), ``apart`` (a pending pair whose operands
    did not match in dtype, device or contiguity: two ``addmm_``), ``alone`` (nothing pending, none deferred: one
    ``addmm_``, the fusion's), ``leftover`` (pending pairs the stage's last ``W`` ran because no later ``W`` of
    that weight took them: a ``W`` that declined fusion or reached no gradient) and ``flushed`` (pending pairs
    the step's end ran: never, by the stream rule; a safety net)."""

    __slots__ = ("deferred", "paired", "apart", "alone", "leftover", "flushed")

    def __init__(self) -> None:
        self.deferred = self.paired = self.apart = self.alone = self.leftover = self.flushed = 0

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}


class Pairing:
    """One ``W``'s pairing: ``pending``, this step's ``{id(weight): (weight, grad_out, left)}`` of its stage (the
    executor's per-step state); ``defer``, whether the stage has a later ``W`` (or ``B``) in this rank's stream of
    the step (then a GEMM with nothing pending is kept); ``stats``, the executor's :class:`PairStats`."""

    __slots__ = ("pending", "defer", "stats")

    def __init__(self, pending: dict, defer: bool, stats: PairStats) -> None:
        self.pending, self.defer, self.stats = pending, defer, stats

    def gemm(self, weight, grad_out, left) -> None:
        """``weight.grad += grad_out^T left``, now, paired with the pending one, or later (under ``no_grad``)."""
        held = self.pending.pop(id(weight), None)
        if held is None:
            if self.defer:
                self.pending[id(weight)] = (weight, grad_out, left)
                self.stats.deferred += 1
            else:
                _add_product(weight, grad_out, left)
                self.stats.alone += 1
            return
        _, before_out, before_left = held
        if _same_kind(before_out, grad_out) and _same_kind(before_left, left):
            _add_product(weight, torch.cat([before_out, grad_out]), torch.cat([before_left, left]))
            self.stats.paired += 1
        else:
            _add_product(weight, before_out, before_left)
            _add_product(weight, grad_out, left)
            self.stats.apart += 1


def run_pending(pending: dict) -> int:
    """Run and clear the GEMMs kept in ``pending`` (a :class:`Pairing`'s); returns how many ran."""
    count = len(pending)
    with torch.no_grad():
        for weight, grad_out, left in pending.values():
            _add_product(weight, grad_out, left)
    pending.clear()
    return count


def _add_product(weight, grad_out, left) -> None:
    """``weight.grad += grad_out^T left`` in one GEMM; where ``.grad`` is None (the first microbatch after
    ``zero_grad()``: only a pair's GEMM gets here so) the product becomes ``.grad``, as autograd's first accumulation
    stores it."""
    if weight.grad is None:
        weight.grad = torch.mm(grad_out.t(), left)
    else:
        weight.grad.addmm_(grad_out.t(), left)


def _same_kind(a, b) -> bool:
    """Whether ``a`` and ``b`` can be concatenated along rows for one GEMM: same dtype, device and contiguity
    (their columns: one per feature, already checked against ``.grad``)."""
    return a.dtype == b.dtype and a.device == b.device and a.is_contiguous() == b.is_contiguous()


def _transposed_leaf(node):
    """The leaf tensor ``w`` when ``node`` is the ``t()`` of ``w`` (``TBackward0`` over ``w``'s accumulate
    node), else None."""
    if node is None or type(node).__name__ != "TBackward0":
        return None
    below = node.next_functions[0][0]
    return getattr(below, "variable", None) if type(below).__name__ == "AccumulateGrad" else None


def _only_through_mat2(node, grads, weight, params) -> bool:
    """Whether the weight's gradient can reach ``node`` only through ``mat2`` (``weight.t()``), so the ``addmm_``
    is all of it. Another use of the weight below ``mat1`` passes a node that depends on the stage input (its own
    restart point: the group then has two) when the input comes in through ``mat1``; not when ``node`` is a root
    outside the input closure (``grads`` a dict) or the input comes in through ``addmm``'s ``self``
    (``torch.addmm(h, tanh(w), w.t())``: ``mat1`` may then hang on the weight alone, and its share would be lost).
    So ``self`` must be absent or a leaf parameter of the group other than the weight (a ``Linear``'s bias)."""
    if isinstance(grads, dict):
        return False
    if type(node).__name__ != "AddmmBackward0":
        return True
    bias = node.next_functions[0][0]
    if bias is None:
        return True
    leaf = getattr(bias, "variable", None) if type(bias).__name__ == "AccumulateGrad" else None
    return leaf is not None and leaf is not weight and any(p is leaf for p in params)


def _fusable(weight, grad_out, fresh: bool = False) -> bool:
    """Whether ``weight.grad += grad_out^T @ left`` in one ``addmm_`` can do what the accumulate node would (bar
    rounding), as far as the weight and ``grad_out`` say: ``.grad`` there to add into, contiguous, not itself
    requiring grad, of ``grad_out``'s dtype and device, one row per output feature; no hooks on the weight; plain
    tensors (``left``: :func:`_fits`). ``fresh`` (pairs only): ``.grad`` is None and the GEMM makes it (``torch.mm``,
    as autograd's first accumulation stores its product): the weight itself must be so (contiguous, of
    ``grad_out``'s dtype and device), as autograd gives a new ``.grad`` the weight's layout."""
    grad = weight if fresh else weight.grad
    if grad is None or not all(type(t) in PLAIN_TENSORS for t in (weight, grad, grad_out)):
        return False
    if weight._backward_hooks or getattr(weight, "_post_accumulate_grad_hooks", None):
        return False
    if grad_out.dim() != 2 or grad.dim() != 2 or grad.layout != torch.strided or (grad.requires_grad and not fresh):
        return False
    return (grad.is_contiguous() and grad.dtype == grad_out.dtype and grad.device == grad_out.device
            and grad.shape[0] == grad_out.shape[1])


def _fits(grad, left) -> bool:
    """Whether the GEMM's saved left operand fits ``grad`` (checked by :func:`_fusable`): a plain 2-D tensor of its
    dtype and device, one column per input feature."""
    return (type(left) in PLAIN_TENSORS and left.dim() == 2 and left.dtype == grad.dtype and left.device == grad.device
            and left.shape[1] == grad.shape[1])
