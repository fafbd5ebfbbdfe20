"""Norms: RMSNorm and LayerNorm, row-wise reductions over one token's width, and the kernels
eager PyTorch runs one as (torchtitan's Python RMSNorm)."""

from __future__ import annotations

import sympy

from ..ir import Tensor
from ..symbols import B, D, S
from .base import _F32, Example, Shape, _fmt, _require, kind, per_element, per_input, same, w_, x_

# Eager PyTorch: under a framework that runs a kind eagerly (`frameworks.Traits.eager`, marked by
# `passes.decompose`), one op is several kernels, each reading and writing a whole tensor, often
# upcast to FP32: `eager` gives their HBM bytes from the op's own tensors (x the op's first input,
# b its bytes per element, N its elements), `eager_saved` what their autograd keeps more than one
# fused kernel does. FLOPs are unchanged: the same arithmetic over more kernels.


def _norm_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    x, *affine = ins
    for w in affine:
        _require(len(w.shape) == 1 and same(w.shape[0], x.shape[-1]),
                 lambda: f"norm weight {w.name} {_fmt(w.shape)} does not match width {x.shape[-1]}")
    return [x.shape]


def _eager_rmsnorm(ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
    """torchtitan's `RMSNorm` (`torchtitan/models/norms.py`, norm_type "rmsnorm", the default of
    its Llama configs): `(x.float() * rsqrt(x.float().pow(2).mean(-1) + eps)).type_as(x) * w`:
    the upcast (N x (b + 4)), the square (8N), the row mean (4N), the scale by each row's
    1/rms (8N), the cast back (N x (4 + b)) and the weight's product (2Nb), six full-tensor
    kernels, beside a fused kernel's 2Nb; plus the rows' statistics (mean, + eps, rsqrt: 4 bytes
    each, read and written) and the weight."""
    x, w = ins[0], ins[1:]
    n, b, rows = x.numel, x.dtype.itemsize, x.numel / x.shape[-1]
    full = n * (b + _F32) + 2 * _F32 * n + _F32 * n + 2 * _F32 * n + n * (_F32 + b) + 2 * n * b
    return full + 7 * _F32 * rows + sympy.Add(*(t.nbytes for t in w))


def _eager_rmsnorm_saved(ins: list[Tensor], outs: list[Tensor], params: dict) -> tuple:
    """torchtitan's `RMSNorm` (`_eager_rmsnorm`): `pow` and the product with the rsqrt keep the
    FP32 copy of the input, and the product with the weight keeps the normalized BF16 tensor
    (standing where a fused norm keeps its input): the FP32 copy more."""
    x = ins[0]
    return (("fp32_input", x.shape, "fp32"),)


KINDS = (
    kind("rmsnorm", shape=_norm_shape,
         flops=per_element(4),  # square, mean, scale by 1/rms, scale by weight
         # x-hat recomputed (2), dY*w (1), the two row means (4), dX (3), dW's sum of dY*x-hat (2)
         backward_flops=per_input(12), fusion_class="reduction", eager=_eager_rmsnorm,
         eager_saved=_eager_rmsnorm_saved, category="norm",
         example=Example((x_((B, S, D)), w_((D,))))),
    kind("layernorm", shape=_norm_shape,
         flops=per_element(7),  # mean, subtract, square, mean, scale, weight, bias
         backward_flops=per_input(16),  # as RMSNorm's, with the mean and the bias's sum
         fusion_class="reduction", category="norm",
         example=Example((x_((B, S, D)), w_((D,)), w_((D,), "b")))),
)
