"""Attention: the unfused scores kernel (QK^T and softmax, its P.V a per-head matmul) and
FlashAttention's one kernel, with causal masks, sliding windows, logit soft-capping and ALiBi;
what context parallelism gathers; the exponentials and query rows the calibrated model times."""

from __future__ import annotations

import sympy

from ..ir import Op, Tensor
from ..symbols import B, H, H_kv, S, d_h, dim
from .base import (
    Example,
    Shape,
    _fmt,
    _no_flops,
    _require,
    _saved,
    kind,
    same,
    scaled_flops,
    sums_gradient,
    x_,
)


def _per_head_shape(a: Tensor, b: Tensor, params: dict) -> Shape:
    heads, groups, grad = params["heads"], params["kv_heads"], params.get("grad")
    if grad == "a":  # dP = dO V^T
        _require(len(a.shape) == 3 and len(b.shape) == 3,
                 lambda: f"per-head dP takes do[B, M, H*d] and v[B, K, G*d], got "
                         f"{_fmt(a.shape)} and {_fmt(b.shape)}")
        _require(same(a.shape[-1] / heads, b.shape[-1] / groups),
                 lambda: f"{a.name} {_fmt(a.shape)} over {heads} heads and {b.name} "
                         f"{_fmt(b.shape)} over {groups} heads have different head dims")
        return (a.shape[0], heads, a.shape[1], b.shape[1])
    if grad == "b":  # dV = P^T dO
        _require(len(a.shape) == 4 and len(b.shape) == 3,
                 lambda: f"per-head dV takes p[B, H, M, K] and do[B, M, H*d], got "
                         f"{_fmt(a.shape)} and {_fmt(b.shape)}")
        _require(same(a.shape[1], heads), lambda: f"{a.name} has {a.shape[1]} heads, not {heads}")
        _require(same(a.shape[2], b.shape[1]),
                 lambda: f"matmul inner dims {a.shape[2]} and {b.shape[1]} differ")
        return (a.shape[0], a.shape[3], groups * b.shape[2] / heads)
    _require(len(a.shape) == 4 and len(b.shape) == 3,
             lambda: f"per-head matmul takes a[B, H, M, K] and b[B, K, G*d], got "
                     f"{_fmt(a.shape)} and {_fmt(b.shape)}")
    _require(same(a.shape[1], heads), lambda: f"{a.name} has {a.shape[1]} heads, not {heads}")
    _require(same(a.shape[-1], b.shape[1]),
             lambda: f"matmul inner dims {a.shape[-1]} and {b.shape[1]} differ")
    return (a.shape[0], a.shape[2], heads * b.shape[2] / groups)


def _head_dim(t: Tensor, heads) -> sympy.Expr:
    """The per-head width of `t[B, S, heads*d]`."""
    return t.shape[-1] / heads


def _scores_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """q[B, S, H*d], k[B, S_k, G*d] -> scores[B, H, S, S_k]."""
    q, k = ins
    heads, groups = params["heads"], params["kv_heads"]
    _require(len(q.shape) == 3 and len(k.shape) == 3, "attention takes q, k as [B, S, heads*d]")
    _require(same(_head_dim(q, heads), _head_dim(k, groups)),
             lambda: f"q {_fmt(q.shape)} over {heads} heads and k {_fmt(k.shape)} over "
                     f"{groups} heads have different head dims")
    return [(q.shape[0], heads, q.shape[1], k.shape[1])]


def _flash_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """q[B, S, H*d], k[B, S_k, G*d], v[B, S_k, G*d_v] -> o[B, S, H*d_v]: the values' head
    dimension may differ from the queries' and keys' (DeepSeek's MLA: 192 and 128)."""
    q, k, v = ins
    _scores_shape([q, k], params)
    heads, groups = params["heads"], params["kv_heads"]
    _require(len(v.shape) == 3 and same(v.shape[1], k.shape[1]) and same(v.shape[0], k.shape[0]),
             lambda: f"k {_fmt(k.shape)} and v {_fmt(v.shape)} differ in batch or length")
    return [(q.shape[0], q.shape[1], heads * _head_dim(v, groups))]


def _density(params: dict) -> sympy.Expr:
    """A causal mask leaves the lower triangle: half the products are done."""
    return sympy.Rational(1, 2) if params.get("causal") else sympy.Integer(1)


def _band_rows(t, window) -> sympy.Expr:
    """Causal (query, key) pairs inside a sliding window of W keys over the first t queries of
    a sequence: query x sees min(x, W) keys, so the area under min(x, W) from 0 to t, which is
    m t - m^2 / 2 with m = min(t, W) (t^2 / 2 while the window covers them all)."""
    m = sympy.Min(t, window)
    return m * t - m**2 / 2


def _score_pairs(s_q, s_k, params: dict) -> sympy.Expr:
    """(query, key) pairs one head scores in one sequence: all S x S_k; causal, the lower
    triangle (half, the plate's convention). With a sliding `window` W each query sees at most
    w = min(S_k, W) keys: S x w, and causal the band below the diagonal, S x w - w^2 / 2 (the
    first w queries see fewer), which is S^2 / 2 again when the window covers the sequence.

    Fewer queries than keys (s_q < s_k) is context parallelism: the GPU holds s_q = S/cp of the
    sequence's queries and sees all S keys. Ring attention splits the sequence into 2 cp chunks
    and gives rank r chunks r and 2 cp - 1 - r (Megatron-LM, `get_batch_on_this_cp_rank` in
    megatron/training/utils.py), which balances plain causal work exactly: s_q x s_k / 2 on
    every rank. A window breaks the balance: the early chunks see fewer keys. The rank whose
    work the step waits for holds the middle two chunks (queries (s_k - s_q)/2 to (s_k + s_q)/2;
    the band's per-query width min(x, W) grows and is concave, so the pair of chunks closest
    to each other has the most), and its pairs are the band's area over those rows."""
    window = params.get("window")
    if window is None:
        return s_q * s_k * _density(params)
    w = sympy.Min(s_k, window)
    if not params.get("causal"):
        return s_q * w
    first = (s_k - s_q) / 2  # 0 unless context parallel
    if first == 0:
        return s_q * w - w**2 / 2
    return _band_rows(first + s_q, window) - _band_rows(first, window)


# Logit soft-capping, cap x tanh(s / cap) on each score (Gemma 2): divide, tanh, multiply
# forward; its backward recomputes them and multiplies by 1 - tanh^2 (2 more).
SOFTCAP_FLOPS, SOFTCAP_BACKWARD_FLOPS = 3, 5


def _softcap_scores(q: Tensor, k: Tensor, params: dict, per_score: int) -> sympy.Expr:
    """`per_score` FLOPs on each score when the logits are soft-capped (`softcap`), else 0.
    Scale, mask and softmax are not counted (the plate's convention); capping is, being what
    the parameter adds."""
    if params.get("softcap") is None:
        return sympy.Integer(0)
    return per_score * q.shape[0] * params["heads"] * _score_pairs(q.shape[1], k.shape[1], params)


# ALiBi (Press et al. 2022, arXiv:2108.12409; BLOOM): a per-head linear bias, slope x key
# position, added to each score: one add per score forward (inside the scores kernel, or
# inside FlashAttention's); the gradient passes through it unchanged, and the slopes are fixed,
# so its backward does no arithmetic. Its bias is made from the head's slope and the key's
# index, so it reads no score-sized tensor.
ALIBI_FLOPS = 1


def _alibi_scores(q: Tensor, k: Tensor, params: dict) -> sympy.Expr:
    """ALIBI_FLOPS on each score when the scores carry ALiBi's bias (`alibi=True`), else 0."""
    if not params.get("alibi"):
        return sympy.Integer(0)
    return ALIBI_FLOPS * q.shape[0] * params["heads"] * _score_pairs(q.shape[1], k.shape[1],
                                                                     params)


def _scores_flops(ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
    """QK^T only: 2 x S x S x d per head (halved when causal). Scale, mask and softmax are a few
    FLOPs per score against 2d for the product; like the plate, they are not counted."""
    q, k = ins
    return (2 * q.shape[0] * params["heads"] * _score_pairs(q.shape[1], k.shape[1], params)
            * _head_dim(q, params["heads"]) + _softcap_scores(q, k, params, SOFTCAP_FLOPS)
            + _alibi_scores(q, k, params))


def _attention_products(q: Tensor, k: Tensor, params: dict) -> sympy.Expr:
    """Scores computed per step: B x H x S x S_k, halved when causal, fewer with a window."""
    return q.shape[0] * params["heads"] * _score_pairs(q.shape[1], k.shape[1], params)


def _flash_flops(ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
    """QK^T (2 d_qk per score) and P.V (2 d_v per score) together, as in `_scores_flops` and
    the per-head matmul: the same FLOPs as the unfused pair, whatever the head sizes."""
    q, k, v = ins
    d_qk, d_v = _head_dim(q, params["heads"]), _head_dim(v, params["kv_heads"])
    return (2 * _attention_products(q, k, params) * (d_qk + d_v)
            + _softcap_scores(q, k, params, SOFTCAP_FLOPS) + _alibi_scores(q, k, params))


def _scores_backward_flops(ins, outs, params) -> sympy.Expr:
    """dQ = dS K and dK = dS^T Q: each the forward's QK^T product (softmax's backward, a few
    FLOPs per score, is not counted, like its forward)."""
    _, (q, k), (p,) = _saved(ins, params)
    products = (_scores_flops([q, k], [p], params) - _softcap_scores(q, k, params, SOFTCAP_FLOPS)
                - _alibi_scores(q, k, params))
    return (len(params.get("wrt", (0, 1))) * products
            + _softcap_scores(q, k, params, SOFTCAP_BACKWARD_FLOPS))


def _flash_backward_flops(ins, outs, params) -> sympy.Expr:
    """FlashAttention's backward as it runs: it recomputes QK^T (2 d_qk per score), then
    dV = P^T dO and dP = dO V^T (2 d_v each), dQ = dS K and dK = dS^T Q (2 d_qk each): 2.5x the
    forward when the head sizes agree. ALiBi's bias is added again as the scores are
    recomputed."""
    _, (q, k, v), _ = _saved(ins, params)
    d_qk, d_v = _head_dim(q, params["heads"]), _head_dim(v, params["kv_heads"])
    return (2 * _attention_products(q, k, params) * (3 * d_qk + 2 * d_v)
            + _softcap_scores(q, k, params, SOFTCAP_BACKWARD_FLOPS) + _alibi_scores(q, k, params))


def _ring_passes(s_q, s_k, params: dict) -> sympy.Expr:
    """How many kernels each query row runs in, on average: 1, or under ring attention (s_q =
    S/cp queries against all S keys) one per ring step it takes part in. Load-balanced causal
    ring attention (Transformer Engine's `AttnFuncWithCPAndKVP2P`, torch's
    `_templated_ring_attention`) runs the local causal block first, then on each of the cp - 1
    steps either every local query against half a block of keys or half the queries against
    a whole block, each half of the time: 1 + 3/4 (cp - 1). Without the mask, every step runs
    every row: cp. A sliding window (its steps depend on the window) is left at 1."""
    if s_q == s_k or params.get("window") is not None:
        return sympy.Integer(1)
    cp = s_k / s_q
    return 1 + sympy.Rational(3, 4) * (cp - 1) if params.get("causal") else cp


def _flash_scores(ins: list[Tensor], outs: list[Tensor], params: dict) -> tuple:
    """FlashAttention's forward: (scores computed, d_qk + d_v, query rows): one exponential
    per score beside its tensor-core FLOPs, and B x H rows of queries, each of which runs its
    own loop over the keys it sees, once in each kernel it is part of (`_ring_passes`)."""
    q, k, v = ins
    return (_attention_products(q, k, params),
            _head_dim(q, params["heads"]) + _head_dim(v, params["kv_heads"]),
            q.shape[0] * params["heads"] * q.shape[1] * _ring_passes(q.shape[1], k.shape[1],
                                                                      params))


def _flash_backward_scores(ins: list[Tensor], outs: list[Tensor], params: dict) -> tuple:
    """FlashAttention's backward: the forward's scores, their exponentials recomputed."""
    _, saved, _ = _saved(ins, params)
    return _flash_scores(list(saved), outs, params)


def flash_attention_backward(ctx, op: Op) -> list[Op]:
    """FlashAttention's backward: one kernel reading dO, Q, K, V and O, writing dQ, dK, dV."""
    q, k, v = op.inputs
    do = ctx.grad(op.outputs[0])
    kernel = ctx.emit(op, "grad", "flash_attention_backward", [do, q, k, v, *op.outputs],
                      [q, k, v], dys=1, saved_inputs=3, saved_outputs=1,
                      wrt=ctx.wrt(op, [q, k, v]))
    return [kernel] if kernel else []


def _repeat_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """Keys or values `x[B, S, G*d]` over `kv_heads` G, each head copied to the `heads` H / G
    query heads of its group: `[B, S, H*d]`."""
    (x,) = ins
    heads, groups = params["heads"], params["kv_heads"]
    _require(len(x.shape) == 3, "a head repeat takes [B, S, heads*d]")
    return [(x.shape[0], x.shape[1], heads * _head_dim(x, groups))]


def _repeat_backward_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """The repeat's backward, from dY `[B, S, H*d]` alone: `[B, S, G*d]`."""
    (dy,), _, _ = _saved(ins, params)
    return [(dy.shape[0], dy.shape[1], params["kv_heads"] * _head_dim(dy, params["heads"]))]


W = dim("W")  # an example's sliding window
_QKV = (x_((B, S, H * d_h), "q"), x_((B, S, H_kv * d_h), "k"))
_ATTN = (("heads", H), ("kv_heads", H_kv), ("causal", True))
_FLASH = (*_QKV, x_((B, S, H_kv * d_h), "v"))

KINDS = (
    # grouped-query attention's keys or values copied to every query head (torchtitan's
    # `repeat_kv`: an expand whose reshape copies); a copy, no arithmetic; its backward sums the
    # copies' gradients, costed by its own bytes (dY read, dX written)
    kind("repeat_heads", shape=_repeat_shape, flops=_no_flops,
         vjp="none", backward_flops=sums_gradient,
         backward_shape=_repeat_backward_shape, backward_cost=scaled_flops,
         example=Example((x_((B, S, H_kv * d_h), "k"),), (("heads", H), ("kv_heads", H_kv)))),
    kind("attention_scores", shape=_scores_shape, flops=_scores_flops,
         vjp="inputs+outputs",  # softmax backward needs P; then dQ, dK
         backward_flops=_scores_backward_flops, cp_gathers=(1,), fusion_class="matmul",
         category="attention", example=Example(_QKV, _ATTN)),
    kind("flash_attention", shape=_flash_shape, flops=_flash_flops,
         vjp=flash_attention_backward, backward_flops=_flash_backward_flops,
         backward_cost=scaled_flops, cp_gathers=(1, 2), kept=True, scores=_flash_scores,
         backward_scores=_flash_backward_scores, efficiency="attention",
         backward_efficiency="attention_backward", category="attention",
         example=Example(_FLASH, _ATTN),
         variants=(Example(_FLASH, (*_ATTN, ("window", W))),
                   Example(_FLASH, (*_ATTN, ("softcap", 50))),
                   Example(_FLASH, (*_ATTN, ("alibi", True))))),
)
