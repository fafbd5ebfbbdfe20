"""Per-kind rules for forward ops: output shapes and FLOPs, one table each, keyed by op kind.

The builder uses both tables to make an op; the verifier re-runs SHAPE_RULES to check a graph.
FLOP counts per element for the cheap ops are conventions, written beside each rule; the plate's
figures are dominated by the matrix multiplies, whose counts are exact (2 FLOPs per multiply-add).
"""

from __future__ import annotations

from collections.abc import Callable

import sympy

from .ir import Tensor

Shape = tuple[sympy.Expr, ...]


class ShapeError(ValueError):
    """Shapes that do not fit the op: `matmul of [B, S, D] and [F, D]: inner dims D and F`."""


def same(a, b) -> bool:
    """Symbolic equality of two dimensions."""
    return a == b or sympy.expand(a - b) == 0


def _fmt(shape: Shape) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ShapeError(message)


# --- shape rules: (inputs, params) -> output shapes -----------------------------------------------

def _same_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """Element-wise ops: every floating input has the first input's shape."""
    for t in ins[1:]:
        _require(all(same(a, b) for a, b in zip(ins[0].shape, t.shape))
                 and len(t.shape) == len(ins[0].shape),
                 f"{t.name} {_fmt(t.shape)} does not match {ins[0].name} {_fmt(ins[0].shape)}")
    return [ins[0].shape]


def _norm_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    x, *affine = ins
    for w in affine:
        _require(len(w.shape) == 1 and same(w.shape[0], x.shape[-1]),
                 f"norm weight {w.name} {_fmt(w.shape)} does not match width {x.shape[-1]}")
    return [x.shape]


def _embedding_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    ids, table = ins
    _require(len(table.shape) == 2, f"embedding table {table.name} must be 2-D")
    return [(*ids.shape, table.shape[1])]


def _matmul_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """Three forms: `x[..., K] @ w[K, N]` (a weight; `transpose_b` for `w[N, K]`),
    `a[..., M, K] @ b[..., K, N]` (batched), and per-head `p[B, H, M, K] @ v[B, K, G*d]`
    -> `[B, M, H*d]` with `heads=H, kv_heads=G` (grouped-query attention's P.V)."""
    a, b, *bias = ins
    heads = params.get("heads")
    if heads is not None:
        groups = params["kv_heads"]
        _require(len(a.shape) == 4 and len(b.shape) == 3,
                 f"per-head matmul takes a[B, H, M, K] and b[B, K, G*d], got "
                 f"{_fmt(a.shape)} and {_fmt(b.shape)}")
        _require(same(a.shape[1], heads), f"{a.name} has {a.shape[1]} heads, not {heads}")
        _require(same(a.shape[-1], b.shape[1]),
                 f"matmul inner dims {a.shape[-1]} and {b.shape[1]} differ")
        return [(a.shape[0], a.shape[2], heads * b.shape[2] / groups)]
    if len(b.shape) == 2:
        k, n = (b.shape[1], b.shape[0]) if params.get("transpose_b") else b.shape
        _require(same(a.shape[-1], k),
                 f"matmul of {a.name} {_fmt(a.shape)} and {b.name} {_fmt(b.shape)}: "
                 f"inner dims {a.shape[-1]} and {k} differ")
        out = (*a.shape[:-1], n)
    else:
        _require(len(a.shape) == len(b.shape)
                 and all(same(x, y) for x, y in zip(a.shape[:-2], b.shape[:-2])),
                 f"batched matmul batch dims differ: {_fmt(a.shape)} and {_fmt(b.shape)}")
        _require(same(a.shape[-1], b.shape[-2]),
                 f"matmul inner dims {a.shape[-1]} and {b.shape[-2]} differ")
        out = (*a.shape[:-1], b.shape[-1])
    for t in bias:
        _require(len(t.shape) == 1 and same(t.shape[0], out[-1]),
                 f"bias {t.name} {_fmt(t.shape)} does not match {out[-1]} outputs")
    return [out]


def _scores_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """q[B, S, H*d], k[B, S, G*d] -> scores[B, H, S, S]."""
    q, k = ins
    heads, groups = params["heads"], params["kv_heads"]
    _require(len(q.shape) == 3 and len(k.shape) == 3, "attention takes q, k as [B, S, heads*d]")
    _require(same(q.shape[-1] / heads, k.shape[-1] / groups),
             f"q {_fmt(q.shape)} over {heads} heads and k {_fmt(k.shape)} over {groups} heads "
             "have different head dims")
    return [(q.shape[0], heads, q.shape[1], k.shape[1])]


def _flash_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    q, k, v = ins
    _scores_shape([q, k], params)
    _require(same(k.shape[-1], v.shape[-1]), f"k {_fmt(k.shape)} and v {_fmt(v.shape)} differ")
    return [q.shape]


def _topk_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """Router logits `[..., E]` -> the top-`k` gates `[..., K]` and their expert ids `[..., K]`."""
    (logits,) = ins
    lead = logits.shape[:-1]
    return [(*lead, params["k"]), (*lead, params["k"])]


def _expert_matmul_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """Each token through the K experts it is routed to, with expert weights `w[E, K_in, N]`
    and the routing `experts[..., K]`: `x[..., K_in]` -> `[..., K, N]` (the token is sent to
    each of its K experts), or `h[..., K, K_in]` -> `[..., K, N]` (each of the token's K
    slots through its own expert)."""
    a, w, experts = ins
    _require(len(w.shape) == 3, f"expert weights {w.name} {_fmt(w.shape)} must be [E, in, out]")
    route = experts.shape
    lead = a.shape[:-1] if len(a.shape) == len(route) + 1 else (*a.shape[:-1], route[-1])
    _require(len(lead) == len(route) and all(same(x, y) for x, y in zip(lead, route)),
             f"{a.name} {_fmt(a.shape)} does not fit the routing {experts.name} {_fmt(route)}")
    _require(same(a.shape[-1], w.shape[1]),
             f"expert matmul of {a.name} {_fmt(a.shape)} and {w.name} {_fmt(w.shape)}: "
             f"inner dims {a.shape[-1]} and {w.shape[1]} differ")
    return [(*route, w.shape[2])]


def _combine_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """Expert outputs `[..., K, D]` weighted by the gates `[..., K]` and summed -> `[..., D]`."""
    y, gates = ins
    _require(len(y.shape) == len(gates.shape) + 1
             and all(same(a, b) for a, b in zip(y.shape[:-1], gates.shape)),
             f"expert outputs {y.name} {_fmt(y.shape)} do not match gates "
             f"{gates.name} {_fmt(gates.shape)}")
    return [(*y.shape[:-2], y.shape[-1])]


def _loss_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    logits, targets = ins
    _require(all(same(a, b) for a, b in zip(logits.shape[:-1], targets.shape)),
             f"targets {_fmt(targets.shape)} do not match logits {_fmt(logits.shape)}")
    return [()]


# --- FLOP rules: (inputs, outputs, params) -> FLOPs of one instance -------------------------------

def per_element(n: int) -> Callable:
    """A rule of `n` FLOPs per output element (element-wise ops, norms)."""
    def _per_element(ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
        return n * outs[0].numel
    _per_element.__name__ = f"_per_element_{n}"
    return _per_element


def _no_flops(ins, outs, params) -> sympy.Expr:
    return sympy.Integer(0)


def _density(params: dict) -> sympy.Expr:
    """A causal mask leaves the lower triangle: half the products are done."""
    return sympy.Rational(1, 2) if params.get("causal") else sympy.Integer(1)


def _matmul_flops(ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
    """2 FLOPs per multiply-add: 2 x outputs x contraction; a bias adds one per output."""
    out = outs[0].numel
    flops = 2 * out * ins[0].shape[-1] * _density(params)
    return flops + (out if len(ins) > 2 else 0)


def _scores_flops(ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
    """QK^T only: 2 x S x S x d per head (halved when causal). Scale, mask and softmax are a few
    FLOPs per score against 2d for the product; like the plate, they are not counted."""
    q = ins[0]
    head_dim = q.shape[-1] / params["heads"]
    return 2 * outs[0].numel * head_dim * _density(params)


def _flash_flops(ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
    """QK^T and P.V together, each as in `_scores_flops`."""
    q, k, _ = ins
    batch, seq = q.shape[0], q.shape[1]
    scores = batch * params["heads"] * seq * k.shape[1]
    return 2 * 2 * scores * (q.shape[-1] / params["heads"]) * _density(params)


def _loss_flops(ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
    """Cross-entropy: max, subtract, exp, sum over each logit: 4 per logit."""
    return 4 * ins[0].numel


def _topk_flops(ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
    """Softmax over each router logit (max, subtract, exp, sum, divide: 5), then the chosen
    gates renormalised (sum, divide: 2 each); picking the top k is comparisons, not FLOPs."""
    return 5 * ins[0].numel + 2 * outs[0].numel


def _expert_matmul_flops(ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
    """Only the routed experts compute: 2 x (tokens x K x out) x contraction."""
    return 2 * outs[0].numel * ins[0].shape[-1]


def _combine_flops(ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
    """Each expert output element times its gate, then added into the token's sum: 2 each."""
    return 2 * ins[0].numel


SHAPE_RULES: dict[str, Callable] = {
    "embedding": _embedding_shape,
    "matmul": _matmul_shape,
    "rmsnorm": _norm_shape,
    "layernorm": _norm_shape,
    "rope": _same_shape,
    "attention_scores": _scores_shape,
    "flash_attention": _flash_shape,
    "swiglu": _same_shape,
    "gelu": _same_shape,
    "add": _same_shape,
    "cross_entropy": _loss_shape,
    "topk": _topk_shape,
    "expert_matmul": _expert_matmul_shape,
    "moe_combine": _combine_shape,
}

FLOP_RULES: dict[str, Callable] = {
    "embedding": _no_flops,  # a gather: bytes only
    "matmul": _matmul_flops,
    "rmsnorm": per_element(4),  # square, mean, scale by 1/rms, scale by weight
    "layernorm": per_element(7),  # mean, subtract, square, mean, scale, weight, bias
    "rope": per_element(3),  # x*cos + rotate(x)*sin
    "attention_scores": _scores_flops,
    "flash_attention": _flash_flops,
    "swiglu": per_element(5),  # silu(g) = g*sigmoid(g): ~4; times up: 1
    "gelu": per_element(8),  # tanh approximation
    "add": per_element(1),
    "cross_entropy": _loss_flops,
    "topk": _topk_flops,
    "expert_matmul": _expert_matmul_flops,
    "moe_combine": _combine_flops,
}

FORWARD_KINDS = tuple(SHAPE_RULES)


def infer_shapes(kind: str, ins: list[Tensor], params: dict) -> list[Shape]:
    return SHAPE_RULES[kind](ins, params)


def count_flops(kind: str, ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
    return FLOP_RULES[kind](ins, outs, params)


__all__ = ["FLOP_RULES", "FORWARD_KINDS", "SHAPE_RULES", "ShapeError", "count_flops",
           "infer_shapes", "per_element", "same"]
