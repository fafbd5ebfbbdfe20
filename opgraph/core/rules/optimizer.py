"""The optimizer's update: AdamW on one parameter (`opgraph.passes.attach_adamw`)."""

from __future__ import annotations

import sympy

from ..ir import Tensor
from .base import Shape, _fmt, _require, kind, same


def _adamw_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """The gradient, then the weight (or its FP32 master) and the moments, all of one shape ->
    each of them updated, then the low-precision copy (`copy`) and the zeroed gradient
    buffer (`zero_grad`)."""
    grad, *state = ins
    for t in state:
        _require(len(t.shape) == len(grad.shape)
                 and all(same(a, b) for a, b in zip(t.shape, grad.shape)),
                 lambda: f"optimizer state {t.name} {_fmt(t.shape)} does not match the gradient "
                         f"{grad.name} {_fmt(grad.shape)}")
    writes = len(state) + bool(params.get("copy")) + bool(params.get("zero_grad"))
    return [grad.shape] * writes


def _adamw_flops(ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
    """`flops_per_param` (attach_adamw's AdamW record: 12) per element of the gradient."""
    return params["flops_per_param"] * ins[0].numel


KINDS = (kind("adamw", shape=_adamw_shape, flops=_adamw_flops, vjp=None, group="optimizer"),)
