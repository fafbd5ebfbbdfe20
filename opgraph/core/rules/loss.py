"""The loss: cross-entropy over the vocabulary, fused, or as eager PyTorch's kernels on FP32
logits (nanotron's and torchtitan's) with the FP32 tensors those hold."""

from __future__ import annotations

import sympy

from ..ir import Tensor
from ..symbols import B, S, V
from .base import _F32, Example, Shape, _fmt, _require, _saved, ids_, kind, same, x_


def _loss_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    logits, targets = ins
    _require(all(same(a, b) for a, b in zip(logits.shape[:-1], targets.shape)),
             lambda: f"targets {_fmt(targets.shape)} do not match logits {_fmt(logits.shape)}")
    return [()]


def _loss_flops(ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
    """Cross-entropy: max, subtract, exp, sum over each logit: 4 per logit."""
    return 4 * ins[0].numel


def _loss_backward_flops(ins, outs, params) -> sympy.Expr:
    """softmax(logits) - onehot(targets), scaled by dLoss / tokens: the softmax recomputed from
    the saved logits (max, subtract, exp, sum, divide: 5) and the scale, 6 per logit."""
    _, (logits, _), _ = _saved(ins, params)
    return 6 * logits.numel


def _eager_loss(ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
    """Cross-entropy over FP32 logits as Megatron-LM's `_VocabParallelCrossEntropy` runs it
    (`megatron/core/tensor_parallel/cross_entropy.py`; nanotron's `_ShardedCrossEntropy`,
    `src/nanotron/parallel/tensor_parallel/functional.py`, is the same, called with
    `dtype=torch.float`): the upcast (N x (b + 4)), the row max (4N), the max subtracted in
    place (8N), exp in place (8N), the row sum (4N), the division in place (8N), the softmax
    kept for the backward; the targets and each row's statistics beside them."""
    logits, targets = ins
    n, b = logits.numel, logits.dtype.itemsize
    return n * (b + _F32) + _F32 * n + 3 * 2 * _F32 * n + _F32 * n + targets.nbytes


def _eager_loss_backward(ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
    """Its backward from the kept softmax: the one-hot subtracted (a gather), the product with
    the loss's gradient in place (8N), then the upcast's backward, FP32 back to the logits'
    dtype (N x (4 + b)). torchtitan's `F.cross_entropy(pred.float())` splits its kernels
    otherwise (log_softmax forward, nll_loss and log_softmax backward) but moves the same
    N x (2b + 44) in all."""
    logits = ins[0]
    n, b = logits.numel, logits.dtype.itemsize
    return 2 * _F32 * n + n * (_F32 + b)


# The tensors an eager op's kernels hold beside its inputs and outputs while they run, by kind:
# `(name, shape, dtype)` each, live for the op alone (`memory.Liveness`: a fused kernel keeps
# them in registers). The loss's are the ones that matter: a vocabulary's worth per token.
def _eager_loss_workspace(ins: list[Tensor], outs: list[Tensor], params: dict) -> tuple:
    """`_eager_loss`'s FP32 tensors: the upcast copy of the logits (none where they are FP32
    already; nanotron's `cast_to_fp32` block, torchtitan's `pred.float()`) and the max-shifted
    copy that exp and the division overwrite in place and the backward keeps as the softmax
    (Megatron-LM's and nanotron's `_VocabParallelCrossEntropy.forward`; torchtitan's
    `log_softmax` output in its stead). Both live at the division, beside the logits."""
    logits = ins[0]
    upcast = (("fp32_logits", logits.shape),) if logits.dtype.itemsize < _F32 else ()
    return tuple((name, shape, "fp32") for name, shape in (*upcast, ("softmax", logits.shape)))


def _eager_loss_backward_workspace(ins: list[Tensor], outs: list[Tensor],
                                   params: dict) -> tuple:
    """The FP32 gradient of the logits, made from the kept softmax in place, before the
    upcast's backward casts it to the logits' dtype (the output opgraph counts).
    torchtitan's `log_softmax` backward writes a second FP32 tensor beside it (not held here)."""
    return (("fp32_grad", ins[0].shape, "fp32"),)


KINDS = (
    kind("cross_entropy", shape=_loss_shape, flops=_loss_flops,
         vjp="inputs",  # softmax(logits) - onehot(targets)
         backward_flops=_loss_backward_flops, fusion_class="reduction", eager=_eager_loss,
         eager_backward=_eager_loss_backward, eager_workspace=_eager_loss_workspace,
         eager_backward_workspace=_eager_loss_backward_workspace, category="output_head",
         example=Example((x_((B, S, V), "logits"), ids_((B, S), "targets")))),
)
