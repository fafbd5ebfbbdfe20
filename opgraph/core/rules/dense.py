"""The dense family: a matrix multiply (by a weight, batched, per head, a weight's gradient) and
the embedding's gather. Their traits: how tensor parallelism splits them, their GEMM grid for wave
quantisation, their FP8 operands, what recomputation keeps."""

from __future__ import annotations

import sympy

from ..ir import Op, Tensor
from ..symbols import B, D, F, S, V
from .attention import _density, _head_dim, _per_head_shape, _score_pairs
from .base import (Example, Shape, _fmt, _no_flops, _require, ids_, kind, same, sums_gradient,
                   w_, x_)


def _embedding_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    ids, table = ins
    _require(len(table.shape) == 2, lambda: f"embedding table {table.name} must be 2-D")
    return [(*ids.shape, table.shape[1])]


def _matmul_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """The forms of a matrix multiply, by parameters:

    - `x[..., K] @ w[K, N]` -> `[..., N]` (a weight; `transpose_b` for `w[N, K]`), an optional
      bias `[N]` third;
    - `a[..., M, K] @ b[..., K, N]` (batched; `transpose_a` for `a[..., K, M]`, `transpose_b`
      for `b[..., N, K]`, `transpose_out` for the result `[..., N, M]`: dB = A^T dY);
    - `contract="leading"`: `a[..., M]^T @ b[..., N]` summed over the leading (token) dims ->
      `[M, N]` (`transpose_out`: `[N, M]`), a weight's gradient dW = X^T dY; with `bias` also
      the bias's gradient `[N]`, dY summed over the tokens;
    - per head, `heads=H, kv_heads=G` (grouped-query attention): P.V, `p[B, H, M, K] @
      v[B, K, G*d]` -> `[B, M, H*d]`; its backward `grad="a"`, dP = dO V^T, `do[B, M, H*d]`,
      `v[B, K, G*d]` -> `[B, H, M, K]`; and `grad="b"`, dV = P^T dO, `p[B, H, M, K]`,
      `do[B, M, H*d]` -> `[B, K, G*d]`."""
    a, b, *bias = ins
    if params.get("heads") is not None:
        return [_per_head_shape(a, b, params)]
    if params.get("contract") == "leading":
        _require(len(a.shape) == len(b.shape)
                 and all(same(x, y) for x, y in zip(a.shape[:-1], b.shape[:-1])),
                 lambda: f"weight-gradient matmul of {a.name} {_fmt(a.shape)} and {b.name} "
                         f"{_fmt(b.shape)}: leading dims differ")
        m, n = a.shape[-1], b.shape[-1]
        out = [(n, m) if params.get("transpose_out") else (m, n)]
        return out + ([(n,)] if params.get("bias") else [])
    if len(b.shape) == 2:
        k, n = (b.shape[1], b.shape[0]) if params.get("transpose_b") else b.shape
        _require(same(a.shape[-1], k),
                 lambda: f"matmul of {a.name} {_fmt(a.shape)} and {b.name} {_fmt(b.shape)}: "
                         f"inner dims {a.shape[-1]} and {k} differ")
        out = (*a.shape[:-1], n)
    else:
        m, k_a = (a.shape[-1], a.shape[-2]) if params.get("transpose_a") else a.shape[-2:]
        k, n = (b.shape[-1], b.shape[-2]) if params.get("transpose_b") else b.shape[-2:]
        _require(len(a.shape) == len(b.shape)
                 and all(same(x, y) for x, y in zip(a.shape[:-2], b.shape[:-2])),
                 lambda: f"batched matmul batch dims differ: {_fmt(a.shape)} and {_fmt(b.shape)}")
        _require(same(k_a, k), lambda: f"matmul inner dims {k_a} and {k} differ")
        out = (*a.shape[:-2], *((n, m) if params.get("transpose_out") else (m, n)))
    for t in bias:
        _require(len(t.shape) == 1 and same(t.shape[0], out[-1]),
                 lambda: f"bias {t.name} {_fmt(t.shape)} does not match {out[-1]} outputs")
    return [out]


def _matmul_flops(ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
    """2 FLOPs per multiply-add: 2 x outputs x contraction; a bias adds one per output (and its
    gradient one per summed element)."""
    a, b, *bias = ins
    heads = params.get("heads")
    if heads is not None:  # every form does B x H x M x K x d multiply-adds
        grad = params.get("grad")
        d = _head_dim(a, heads) if grad == "a" else (
            b.shape[-1] / heads if grad == "b" else b.shape[-1] / params["kv_heads"])
        m, k = (a.shape[1], b.shape[1]) if grad == "a" else (a.shape[-2], a.shape[-1])
        return 2 * a.shape[0] * heads * _score_pairs(m, k, params) * d
    if params.get("contract") == "leading":
        lead = sympy.Mul(*a.shape[:-1])
        return 2 * outs[0].numel * lead + (b.numel if params.get("bias") else 0)
    out = outs[0].numel
    contraction = a.shape[-2] if params.get("transpose_a") else a.shape[-1]
    flops = 2 * out * contraction * _density(params)
    return flops + (out if bias else 0)


def _matmul_grid(ins: list[Tensor], outs: list[Tensor], params: dict) -> tuple:
    """Each form of `_matmul_shape` as independent GEMMs of an M x N output: the weight form
    one GEMM over every token; the batched form one per batch element; a weight gradient one;
    per head (`heads`) one per batch element and head, its N a head's width."""
    a, b = ins[0], ins[1]
    out = outs[0].shape
    heads = params.get("heads")
    if heads is not None:
        grad = params.get("grad")
        if grad == "a":  # dP[B, H, M, K] = dO V^T, per head
            return (out[0] * out[1], out[2], out[3])
        if grad == "b":  # dV = P^T dO, per head: K x d
            return (a.shape[0] * heads, a.shape[3], b.shape[2] / heads)
        return (a.shape[0] * heads, a.shape[2], b.shape[2] / params["kv_heads"])
    if params.get("contract") == "leading":
        return (sympy.Integer(1), *out)
    if len(b.shape) == 2:
        return (sympy.Integer(1), sympy.Mul(*out[:-1]), out[-1])
    return (sympy.Mul(*out[:-2]), out[-2], out[-1])


def _matmul_vjp(ctx, op: Op) -> list[Op]:
    """dA = dY B^T and dB = A^T dY (and a bias's gradient with dB): two matmuls. Per head
    (attention's P.V) they are dP = dO V^T and dV = P^T dO, per-head matmuls too."""
    a, b, *bias = op.inputs
    dy = ctx.grad(op.outputs[0])
    if op.param("heads") is not None:
        kernels = [ctx.emit(op, "dA", "matmul", [dy, b], [a], grad="a"),
                   ctx.emit(op, "dB", "matmul", [a, dy], [b], grad="b")]
    else:  # None drops a parameter
        transposed = bool(op.param("transpose_b"))
        # dB sums the token dims for a weight b[K, N]; a batched b[..., K, N] keeps them
        weight = len(ctx.graph.tensor(b).shape) == 2
        db = ({"contract": "leading", "bias": bool(bias) or None} if weight
              else {"transpose_a": True})
        kernels = [ctx.emit(op, "dA", "matmul", [dy, b], [a], transpose_b=not transposed or None),
                   ctx.emit(op, "dB", "matmul", [a, dy], [b, *bias], transpose_b=None,
                            transpose_out=transposed or None, **db)]
    return [k for k in kernels if k is not None]


KINDS = (
    kind("embedding", shape=_embedding_shape, flops=_no_flops,  # a gather: bytes only
         vjp="inputs",  # scatter-add of dY rows into the table's gradient
         backward_flops=sums_gradient, shards=("contracting",),
         category="embedding", example=Example((ids_((B, S)), w_((V, D), "table")))),
    kind("matmul", shape=_matmul_shape, flops=_matmul_flops, vjp=_matmul_vjp,
         grid=_matmul_grid, shards=("column", "contracting"), fusion_class="matmul", kept=True,
         operands=2, fp8_weight_dims=2, category="matmul",
         example=Example((x_((B, S, D)), w_((D, F))))),
)
