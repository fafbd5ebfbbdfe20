"""Per-kind rules for every op kind: output shapes and FLOPs, one table each, keyed by op kind.

Forward kinds, their backward kernels (`matmul` as dX = dY W^T and dW = X^T dY, the
`*_backward` kinds, `flash_attention_backward`) and the optimizer's `adamw` all have a row in
both tables. The builder uses them to make an op; the verifier re-runs SHAPE_RULES on every
op of every phase; the cost model (`opgraph.cost.costmodel`) counts an op's FLOPs with FLOP_RULES.
FLOP counts per element for the cheap ops are conventions, written beside each rule; the plate's
figures are dominated by the matrix multiplies, whose counts are exact (2 FLOPs per multiply-add).

A backward kernel that accumulates into gradients written earlier (a tensor read by several
ops) reads those partial gradients last; its `accumulate` parameter says how many. The rules
see the kernel without them (`infer_shapes` and `count_flops` strip them): each partial must
have the shape of one of the kernel's outputs and costs one add per element.

A one-kernel backward (`rmsnorm_backward`, ...) reads, in order, the gradients of its forward
op's outputs (`dys` of them), the forward inputs it saved (`saved_inputs`), the forward
outputs it saved (`saved_outputs`); it writes the gradients of the forward inputs at the
positions `wrt`. Its shape rule re-runs the forward kind's rule on the saved inputs.

VIEWS says which kinds can be a new look at their input's memory (reshape, broadcast, a
contiguous slice or split, an in-place concatenation) and when: the cost model charges such an
op no bytes. A user's kind gets its rows here through `opgraph.core.kinds.define_kind`.
"""

from __future__ import annotations

from collections.abc import Callable

import sympy

from .ir import Graph, Op, Phase, Tensor

Shape = tuple[sympy.Expr, ...]


class ShapeError(ValueError):
    """Shapes that do not fit the op: `matmul of [B, S, D] and [F, D]: inner dims D and F`."""


def same(a, b) -> bool:
    """Symbolic equality of two dimensions."""
    return a == b or sympy.expand(a - b) == 0


def _fmt(shape: Shape) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def _require(ok: bool, message: str | Callable[[], str]) -> None:
    """ShapeError(message) unless `ok`. A message that prints shapes comes as a function, called
    only on failure: printing a shape's symbols is a sympy print, and checking every op of every
    pass's graph (`opgraph.core.verify`) built some 800,000 such messages a test run, all discarded,
    most of the time the check took."""
    if not ok:
        raise ShapeError(message() if callable(message) else message)


# --- shape rules: (inputs, params) -> output shapes -----------------------------------------------

def _same_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """Element-wise ops: every floating input has the first input's shape."""
    for t in ins[1:]:
        _require(all(same(a, b) for a, b in zip(ins[0].shape, t.shape))
                 and len(t.shape) == len(ins[0].shape),
                 lambda: f"{t.name} {_fmt(t.shape)} does not match {ins[0].name} "
                         f"{_fmt(ins[0].shape)}")
    return [ins[0].shape]


def _norm_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    x, *affine = ins
    for w in affine:
        _require(len(w.shape) == 1 and same(w.shape[0], x.shape[-1]),
                 lambda: f"norm weight {w.name} {_fmt(w.shape)} does not match width {x.shape[-1]}")
    return [x.shape]


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


def _topk_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """Router logits `[..., E]` -> the top-`k` gates `[..., K]` and their expert ids `[..., K]`."""
    (logits,) = ins
    lead = logits.shape[:-1]
    return [(*lead, params["k"]), (*lead, params["k"])]


def _expert_lead(a: Tensor, route: Shape) -> Shape:
    """`a`'s leading dims as routed: `[..., in]` is sent to each of its K experts."""
    return a.shape[:-1] if len(a.shape) == len(route) + 1 else (*a.shape[:-1], route[-1])


def _expert_matmul_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """Each token through the K experts it is routed to, with expert weights `w[E, K_in, N]`
    and the routing `experts[..., K]`: `x[..., K_in]` -> `[..., K, N]` (the token is sent to
    each of its K experts), or `h[..., K, K_in]` -> `[..., K, N]` (each of the token's K
    slots through its own expert).

    Its backward: `transpose_b`, dX = dY W^T through the same routing, `dy[..., K, N]` ->
    `[..., K, K_in]` (`reduce_slots`: summed over the K slots, `[..., K_in]`); and
    `contract="leading"`, dW = X^T dY per expert, `x`, `dy[..., K, N]` -> `[E, K_in, N]`,
    E given as the parameter `experts`."""
    a, b, experts = ins
    route = experts.shape
    lead = _expert_lead(a, route)
    _require(len(lead) == len(route) and all(same(x, y) for x, y in zip(lead, route)),
             lambda: f"{a.name} {_fmt(a.shape)} does not fit the routing {experts.name} "
                     f"{_fmt(route)}")
    if params.get("contract") == "leading":
        _require(len(b.shape) == len(route) + 1
                 and all(same(x, y) for x, y in zip(b.shape[:-1], route)),
                 lambda: f"{b.name} {_fmt(b.shape)} does not fit the routing {experts.name} "
                         f"{_fmt(route)}")
        return [(params["experts"], a.shape[-1], b.shape[-1])]
    _require(len(b.shape) == 3,
             lambda: f"expert weights {b.name} {_fmt(b.shape)} must be [E, in, out]")
    k, n = (b.shape[2], b.shape[1]) if params.get("transpose_b") else (b.shape[1], b.shape[2])
    _require(same(a.shape[-1], k),
             lambda: f"expert matmul of {a.name} {_fmt(a.shape)} and {b.name} {_fmt(b.shape)}: "
                     f"inner dims {a.shape[-1]} and {k} differ")
    return [(*(route[:-1] if params.get("reduce_slots") else route), n)]


def _combine_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """Expert outputs `[..., K, D]` weighted by the gates `[..., K]` and summed -> `[..., D]`."""
    y, gates = ins
    _require(len(y.shape) == len(gates.shape) + 1
             and all(same(a, b) for a, b in zip(y.shape[:-1], gates.shape)),
             lambda: f"expert outputs {y.name} {_fmt(y.shape)} do not match gates "
                     f"{gates.name} {_fmt(gates.shape)}")
    return [(*y.shape[:-2], y.shape[-1])]


def _loss_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    logits, targets = ins
    _require(all(same(a, b) for a, b in zip(logits.shape[:-1], targets.shape)),
             lambda: f"targets {_fmt(targets.shape)} do not match logits {_fmt(logits.shape)}")
    return [()]


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


def _saved(ins: list[Tensor], params: dict) -> tuple[list, list, list]:
    """A one-kernel backward's reads: output gradients, saved forward inputs and outputs."""
    dys, n_in = params.get("dys", 1), params.get("saved_inputs", 0)
    n_out = params.get("saved_outputs", 0)
    _require(len(ins) == dys + n_in + n_out,
             lambda: f"backward kernel reads {len(ins)} tensors, its layout says "
                     f"{dys + n_in + n_out}")
    return ins[:dys], ins[dys:dys + n_in], ins[dys + n_in:]


def backward_shape(forward_kind: str) -> Callable:
    """The shape rule of `<forward_kind>_backward`: the forward kind's rule re-run on the saved
    inputs must give the saved outputs' and the output gradients' shapes; the kernel writes the
    gradients of the inputs at `wrt`. With nothing saved (an element-wise op whose inputs have
    its output's shape) each gradient has the output gradient's shape."""
    def _backward_shape(ins: list[Tensor], params: dict) -> list[Shape]:
        dys, fwd_ins, fwd_outs = _saved(ins, params)
        wrt = params.get("wrt", (0,))
        if not fwd_ins:
            return [dys[0].shape for _ in wrt]
        expected = SHAPE_RULES[forward_kind](fwd_ins, params)
        for t, shape in zip([*dys, *fwd_outs], [*expected[:len(dys)], *expected]):
            _require(len(t.shape) == len(shape) and all(same(a, b) for a, b in zip(t.shape, shape)),
                     lambda: f"{t.name} {_fmt(t.shape)} is not the forward's output {_fmt(shape)}")
        _require(all(0 <= i < len(fwd_ins) for i in wrt), lambda: f"wrt {wrt} out of range")
        return [fwd_ins[i].shape for i in wrt]
    _backward_shape.__name__ = f"_{forward_kind}_backward_shape"
    return _backward_shape


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


def _loss_flops(ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
    """Cross-entropy: max, subtract, exp, sum over each logit: 4 per logit."""
    return 4 * ins[0].numel


def _topk_flops(ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
    """Softmax over each router logit (max, subtract, exp, sum, divide: 5), then the chosen
    gates renormalised (sum, divide: 2 each); picking the top k is comparisons, not FLOPs."""
    return 5 * ins[0].numel + 2 * outs[0].numel


def _expert_matmul_flops(ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
    """Only the routed experts compute: 2 x (tokens x K) x in x out, with `[E, in, out]` the
    expert weights (the weight-gradient form's output). dX and dW do the forward's count; a sum
    of dX over the K slots is in the epilogue, not counted."""
    w = outs[0] if params.get("contract") == "leading" else ins[1]
    return 2 * sympy.Mul(*ins[2].shape) * w.shape[1] * w.shape[2]


# --- a matrix multiply's output as its kernel tiles it: (GEMMs per instance, M, N) -----------

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


def _expert_matmul_grid(ins: list[Tensor], outs: list[Tensor], params: dict) -> tuple:
    """One GEMM per expert held: the routed token slots spread evenly over the experts (a
    grouped GEMM of E problems; balance assumed, as the FLOP rule does), or dW per expert."""
    out = outs[0].shape
    if params.get("contract") == "leading":
        return out
    experts = ins[1].shape[0]
    return (experts, ins[2].numel / experts, out[-1])


def _combine_flops(ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
    """Each expert output element times its gate, then added into the token's sum: 2 each."""
    return 2 * ins[0].numel


def _adamw_flops(ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
    """`flops_per_param` (attach_adamw's AdamW record: 12) per element of the gradient."""
    return params["flops_per_param"] * ins[0].numel


def per_input(n: int, index: int = 0) -> Callable:
    """A backward rule of `n` FLOPs per element of the forward's input at `index`."""
    def _per_input(ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
        _, fwd_ins, _ = _saved(ins, params)
        return n * (fwd_ins[index] if fwd_ins else ins[0]).numel
    _per_input.__name__ = f"_per_input_{n}_{index}"
    return _per_input


def _no_backward_flops(ins, outs, params) -> sympy.Expr:
    """The gradient passed through (an add's): copies, no arithmetic."""
    return sympy.Integer(0)


def _embedding_backward_flops(ins, outs, params) -> sympy.Expr:
    """A scatter-add of each row of dY into the table's gradient: one add per element."""
    return ins[0].numel


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


def _loss_backward_flops(ins, outs, params) -> sympy.Expr:
    """softmax(logits) - onehot(targets), scaled by dLoss / tokens: the softmax recomputed from
    the saved logits (max, subtract, exp, sum, divide: 5) and the scale, 6 per logit."""
    _, (logits, _), _ = _saved(ins, params)
    return 6 * logits.numel


def _topk_backward_flops(ins, outs, params) -> sympy.Expr:
    """The renormalisation's backward per gate (2), then softmax's backward per router logit,
    dl = p * (dp - sum(p * dp)) (4)."""
    _, (logits,), (gates, _) = _saved(ins, params)
    return 4 * logits.numel + 2 * gates.numel


def _combine_backward_flops(ins, outs, params) -> sympy.Expr:
    """dY times each gate (1 per expert output element) and dGate = <expert output, dY> (2)."""
    _, (y, _), _ = _saved(ins, params)
    return 3 * y.numel


# --- element-wise kinds with a parameter, views, gather -------------------------------------------

# RoPE on a fraction of each head (GPT-NeoX's `rotary_pct`): `rotary=R` of each head's d
# dimensions are rotated, the rest pass through; one kernel reads and writes the whole tensor
# (Megatron-LM's `apply_rotary_pos_emb` cuts the rotated part off and joins it back), 3 FLOPs
# per rotated element forward (x*cos + rotate(x)*sin) and backward (the inverse rotation).
ROPE_FLOPS = 3


def _rotated(t: Tensor, params: dict) -> sympy.Expr:
    """Elements RoPE rotates in `t[..., heads*d]`: all of them, or `rotary` of each head's d."""
    if params.get("rotary") is None:
        return t.numel
    return t.numel / t.shape[-1] * params["heads"] * params["rotary"]


def _rope_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    if params.get("rotary") is not None:
        _require(params.get("heads") is not None,
                 "rope with `rotary` (dims rotated per head) needs `heads`")
    return _same_shape(ins, params)


def _rope_flops(ins, outs, params) -> sympy.Expr:
    return ROPE_FLOPS * _rotated(outs[0], params)


def _rope_backward_flops(ins, outs, params) -> sympy.Expr:
    """The inverse rotation, dY*cos - rotate(dY)*sin, on the rotated elements of dY."""
    return ROPE_FLOPS * _rotated(ins[0], params)


# ReLU, max(x, 0): one FLOP per element forward (a max, as IEEE 754's maximumNumber is one
# operation), and one backward (dY where x > 0, a select).
RELU_FLOPS = RELU_BACKWARD_FLOPS = 1


# Dropout, x * mask / (1 - p) with the mask drawn from a counter-based RNG (Philox): integer work
# and a select, counted as no FLOPs (as the MFU conventions count it), forward and backward (dY
# where kept); an op of it moves bytes only. `p`, the probability an element is dropped, is a
# number in [0, 1).
def _dropout_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    p = params.get("p")
    _require(isinstance(p, (int, float)) and not isinstance(p, bool) and 0 <= p < 1,
             lambda: f"dropout p={p!r}: give the probability of dropping an element, in [0, 1)")
    return _same_shape(ins, params)


# GELU, exact (0.5 x (1 + erf(x / sqrt 2))) or its tanh approximation (`approximate="tanh"`,
# the default, GPT-2's): FLOPs per element forward, and backward (recomputed, its derivative,
# times dY).
GELU_FLOPS = {"tanh": 8, "none": 5}
GELU_BACKWARD_FLOPS = {"tanh": 16, "none": 10}


def _approximate(params: dict) -> str:
    form = params.get("approximate", "tanh")
    _require(form in GELU_FLOPS,
             lambda: f"gelu approximate={form!r}: choose 'tanh' or 'none' (exact)")
    return form


def _gelu_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    _approximate(params)
    return _same_shape(ins, params)


def _gelu_flops(ins, outs, params) -> sympy.Expr:
    return GELU_FLOPS[_approximate(params)] * outs[0].numel


def _geglu_flops(ins, outs, params) -> sympy.Expr:
    """gelu(gate) * up: the GELU, then one multiply."""
    return (GELU_FLOPS[_approximate(params)] + 1) * outs[0].numel


def _gelu_backward_flops(ins, outs, params) -> sympy.Expr:
    return GELU_BACKWARD_FLOPS[_approximate(params)] * _saved(ins, params)[1][0].numel


def _geglu_backward_flops(ins, outs, params) -> sympy.Expr:
    """GELU's backward on the gate, times up (1 more), and dUp = dY * gelu(gate) (1)."""
    return (GELU_BACKWARD_FLOPS[_approximate(params)] + 2) * _saved(ins, params)[1][0].numel


def _mul_backward_flops(ins, outs, params) -> sympy.Expr:
    """dA = dY * b and dB = dY * a: one multiply per element for each gradient written."""
    return len(params.get("wrt", (0, 1))) * ins[0].numel


def _scale_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    _require("factor" in params, "scale needs a `factor`")
    return _same_shape(ins, params)


def _softcap_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    _require("cap" in params, "softcap needs a `cap` (cap * tanh(x / cap))")
    return _same_shape(ins, params)


def _axis(t: Tensor, params: dict) -> int:
    axis = params.get("axis", -1)
    _require(-len(t.shape) <= axis < len(t.shape), lambda: f"axis {axis} out of range for {t.name} "
                     f"{_fmt(t.shape)}")
    return axis % len(t.shape)


def _fits(part, whole) -> bool:
    """Whether `part` <= `whole` may hold (symbolically: not provably false)."""
    return (sympy.sympify(whole) - sympy.sympify(part)).is_negative is not True


def _slice_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """`x[..., start:start+size, ...]` along `axis`."""
    (x,) = ins
    axis = _axis(x, params)
    end = sympy.sympify(params.get("start", 0)) + params["size"]
    _require(_fits(end, x.shape[axis]),
             lambda: f"slice to {end} of {x.name} {_fmt(x.shape)} along axis {axis} ends past "
                     f"its {x.shape[axis]}")
    return [(*x.shape[:axis], params["size"], *x.shape[axis + 1:])]


def _split_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """`x` cut along `axis` into pieces of `sizes`, which sum to its extent there."""
    (x,) = ins
    axis, sizes = _axis(x, params), params["sizes"]
    _require(same(sympy.Add(*sizes), x.shape[axis]),
             lambda: f"split sizes {list(sizes)} do not add up to {x.name}'s {x.shape[axis]}")
    return [(*x.shape[:axis], size, *x.shape[axis + 1:]) for size in sizes]


def _concat_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """Inputs joined along `axis` (e.g. each head's no-rope and rope parts); the other dims
    agree."""
    axis = _axis(ins[0], params)
    for t in ins[1:]:
        _require(len(t.shape) == len(ins[0].shape)
                 and all(same(a, b) for i, (a, b) in enumerate(zip(t.shape, ins[0].shape))
                         if i != axis),
                 lambda: f"concat of {ins[0].name} {_fmt(ins[0].shape)} and {t.name} "
                         f"{_fmt(t.shape)} along axis {axis}: other dims differ")
    total = sympy.Add(*(t.shape[axis] for t in ins))
    return [(*ins[0].shape[:axis], total, *ins[0].shape[axis + 1:])]


def _broadcast_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """`x` expanded to `shape`, dims aligned from the right: each of x's is 1 or the target's."""
    (x,) = ins
    shape = tuple(sympy.sympify(d) for d in params["shape"])
    _require(len(x.shape) <= len(shape)
             and all(a == 1 or same(a, b) for a, b in zip(reversed(x.shape), reversed(shape))),
             lambda: f"cannot broadcast {x.name} {_fmt(x.shape)} to {_fmt(shape)}")
    return [shape]


def _reshape_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """`x` read as `shape`, of as many elements."""
    (x,) = ins
    shape = tuple(sympy.sympify(d) for d in params["shape"])
    _require(same(sympy.Mul(*shape), x.numel),
             lambda: f"cannot reshape {x.name} {_fmt(x.shape)} to {_fmt(shape)}: element counts "
                     "differ")
    return [shape]


def _gather_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """Rows of `x[B, S, ...]` at `index[B, M]` -> `[B, M, ...]` (masked-LM positions): the
    index's leading dims are x's."""
    x, index = ins
    lead = index.shape[:-1]
    _require(len(x.shape) >= len(index.shape)
             and all(same(a, b) for a, b in zip(x.shape, lead)),
             lambda: f"gather of {x.name} {_fmt(x.shape)} at {index.name} {_fmt(index.shape)}: "
                     "leading dims differ")
    return [(*index.shape, *x.shape[len(index.shape):])]


def _gather_backward_flops(ins, outs, params) -> sympy.Expr:
    """A scatter-add of each gathered row of dY into dX: one add per element of dY."""
    return ins[0].numel


def _broadcast_backward_flops(ins, outs, params) -> sympy.Expr:
    """dY summed over the broadcast dims: one add per element of dY."""
    return ins[0].numel


def _split_backward_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """A split's backward joins the gradients of its pieces (`present`: which pieces have one;
    the others are zeros) into the input's gradient, shaped by the saved input."""
    dys, (x,), _ = _saved(ins, params)
    pieces = _split_shape([x], params)
    present = params.get("present", tuple(range(len(dys))))
    _require(len(present) == len(dys), "split backward: `present` does not match its gradients")
    for dy, i in zip(dys, present):
        _require(len(dy.shape) == len(pieces[i]) and all(same(a, b)
                                                          for a, b in zip(dy.shape, pieces[i])),
                 lambda: f"{dy.name} {_fmt(dy.shape)} is not piece {i} {_fmt(pieces[i])}")
    return [x.shape]


# --- views: kinds that can be a new look at their input's memory, costing no traffic ------------
# A view's kernel moves nothing (`opgraph.cost.costmodel` charges it no bytes) when its output is a
# view of its input; when it cannot be one it is a copy, costed by its tensors like any kernel.
# `copy=True` makes any of them a copy (a `.contiguous()` after it).

def _contiguous_cut(ins: list[Tensor], params: dict) -> bool:
    """A slice or split is a view in place when its pieces are contiguous runs of the input:
    every dim before the cut's axis is 1. Cut further in (each head's first 128 of 192), a piece
    is strided and the next kernel reads it through a copy."""
    x = ins[0]
    axis = _axis(x, params)
    return not params.get("copy") and all(d == 1 for d in x.shape[:axis])


def _always_view(ins: list[Tensor], params: dict) -> bool:
    """Broadcast (stride 0) and reshape (of a contiguous tensor) are views unless `copy`."""
    return not params.get("copy")


def _in_place_concat(ins: list[Tensor], params: dict) -> bool:
    """A concatenation is a copy unless its producers wrote into one buffer (`in_place`)."""
    return bool(params.get("in_place")) and not params.get("copy")


def _backward_of_cut(ins: list[Tensor], params: dict) -> bool:
    """A concatenation's backward cuts dY back into pieces: a view when the cut is contiguous."""
    dys, _, _ = _saved(ins, params)
    return _contiguous_cut(dys[:1], params)


VIEWS: dict[str, Callable[[list[Tensor], dict], bool]] = {
    "slice": _contiguous_cut,
    "split": _contiguous_cut,
    "concat": _in_place_concat,
    "broadcast": _always_view,
    "reshape": _always_view,
    "reshape_backward": _always_view,  # dY read in x's shape
    "concat_backward": _backward_of_cut,
}


def is_view(kind: str, ins: list[Tensor], params: dict) -> bool:
    """Whether an op of `kind` reading `ins` is a view (moves no bytes): VIEWS' rule, if any."""
    rule = VIEWS.get(kind)
    return rule is not None and bool(rule(ins, params))


SHAPE_RULES: dict[str, Callable] = {
    "embedding": _embedding_shape,
    "matmul": _matmul_shape,
    "rmsnorm": _norm_shape,
    "layernorm": _norm_shape,
    "rope": _rope_shape,
    "attention_scores": _scores_shape,
    "flash_attention": _flash_shape,
    "swiglu": _same_shape,
    "gelu": _gelu_shape,
    "add": _same_shape,
    "cross_entropy": _loss_shape,
    "topk": _topk_shape,
    "expert_matmul": _expert_matmul_shape,
    "moe_combine": _combine_shape,
    "mul": _same_shape,
    "scale": _scale_shape,  # x * factor
    "geglu": _gelu_shape,  # gelu(gate) * up
    "softcap": _softcap_shape,  # cap * tanh(x / cap)
    "slice": _slice_shape,
    "split": _split_shape,
    "concat": _concat_shape,
    "broadcast": _broadcast_shape,
    "reshape": _reshape_shape,
    "gather": _gather_shape,
    "relu": _same_shape,  # max(x, 0)
    "dropout": _dropout_shape,  # x * mask / (1 - p)
}

FORWARD_KINDS = tuple(SHAPE_RULES)

# Backward kernels that are not a forward kind again (a matmul's are matmuls): one per forward
# kind whose VJP is one kernel, `<kind>_backward`, shaped by `backward_shape(kind)`.
BACKWARD_KINDS = tuple(f"{kind}_backward" for kind in FORWARD_KINDS
                       if kind not in ("matmul", "expert_matmul"))

SHAPE_RULES |= {kind: backward_shape(kind.removesuffix("_backward")) for kind in BACKWARD_KINDS}
SHAPE_RULES["split_backward"] = _split_backward_shape
SHAPE_RULES["adamw"] = _adamw_shape

FLOP_RULES: dict[str, Callable] = {
    "embedding": _no_flops,  # a gather: bytes only
    "matmul": _matmul_flops,
    "rmsnorm": per_element(4),  # square, mean, scale by 1/rms, scale by weight
    "layernorm": per_element(7),  # mean, subtract, square, mean, scale, weight, bias
    "rope": _rope_flops,  # x*cos + rotate(x)*sin on the rotated elements (ROPE_FLOPS)
    "attention_scores": _scores_flops,
    "flash_attention": _flash_flops,
    "swiglu": per_element(5),  # silu(g) = g*sigmoid(g): ~4; times up: 1
    "gelu": _gelu_flops,  # GELU_FLOPS: tanh approximation 8, exact 5
    "add": per_element(1),
    "cross_entropy": _loss_flops,
    "topk": _topk_flops,
    "expert_matmul": _expert_matmul_flops,
    "moe_combine": _combine_flops,
    # backward kernels: their own arithmetic (what the cost model's "derived" mode reports)
    "embedding_backward": _embedding_backward_flops,
    # x-hat recomputed (2), dY*w (1), the two row means (4), dX (3), dW's sum of dY*x-hat (2)
    "rmsnorm_backward": per_input(12),
    "layernorm_backward": per_input(16),  # as RMSNorm's, with the mean and the bias's sum
    "rope_backward": _rope_backward_flops,  # the inverse rotation: dY*cos - rotate(dY)*sin
    "attention_scores_backward": _scores_backward_flops,
    "flash_attention_backward": _flash_backward_flops,
    # sigmoid recomputed (3), silu (1), dUp = dY*silu (1), silu' (4), dGate = dY*up*silu' (2)
    "swiglu_backward": per_input(11),
    # tanh form: recomputed (8), its derivative (7), times dY (1); exact: 10 (GELU_BACKWARD_FLOPS)
    "gelu_backward": _gelu_backward_flops,
    "add_backward": _no_backward_flops,
    "cross_entropy_backward": _loss_backward_flops,
    "topk_backward": _topk_backward_flops,
    "moe_combine_backward": _combine_backward_flops,
    "mul": per_element(1),
    "scale": per_element(1),
    "geglu": _geglu_flops,
    "softcap": per_element(SOFTCAP_FLOPS),  # divide, tanh, multiply
    "slice": _no_flops,  # views and copies move data, they do no arithmetic
    "split": _no_flops,
    "concat": _no_flops,
    "broadcast": _no_flops,
    "reshape": _no_flops,
    "gather": _no_flops,
    "mul_backward": _mul_backward_flops,
    "scale_backward": per_input(1),  # dY * factor
    "geglu_backward": _geglu_backward_flops,
    "softcap_backward": per_input(SOFTCAP_BACKWARD_FLOPS),  # tanh recomputed, dY * (1 - t^2)
    "slice_backward": _no_backward_flops,  # dY placed into zeros
    "split_backward": _no_backward_flops,  # the pieces' gradients joined
    "concat_backward": _no_backward_flops,  # dY cut into the inputs' gradients
    "broadcast_backward": _broadcast_backward_flops,
    "reshape_backward": _no_backward_flops,
    "gather_backward": _gather_backward_flops,
    "relu": per_element(RELU_FLOPS),
    "relu_backward": per_input(RELU_BACKWARD_FLOPS),  # dY where x > 0
    "dropout": _no_flops,  # an RNG's integer work and a select (see _dropout_shape)
    "dropout_backward": _no_backward_flops,  # dY where kept
    "adamw": _adamw_flops,
}


# --- a fused kernel: ops that became one kernel (`opgraph.core.rewrite.Replacement.fuse`) ---------
# Its params carry the member ops (`body`, in execution order), the tensors that stay inside it
# (`inner`) and the names of what it writes (`outputs`), so its shapes and FLOPs are its members',
# derived by their own rules; its traffic is its boundary tensors, like any op's.

def _fused_tensors(ins: list[Tensor], params: dict) -> dict[str, Tensor]:
    """Every tensor a fused kernel's members touch, by name; the kernel's outputs re-derived by
    the members' shape rules (their dtype is not a shape's concern)."""
    known = {t.name: t for t in (*ins, *params["inner"])}
    for op in params["body"]:
        shapes = infer_shapes(op.kind, [known[n] for n in op.inputs], dict(op.params))
        for name, shape in zip(op.outputs, shapes):
            known.setdefault(name, Tensor(name, shape))
    return known


def _fused_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    known = _fused_tensors(ins, params)
    return [known[name].shape for name in params["outputs"]]


def _fused_flops(ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
    """Fusion moves no arithmetic: the members' FLOPs, each by its kind's rule."""
    known = _fused_tensors(ins, params) | {t.name: t for t in outs}
    return sympy.Add(*(count_flops(op.kind, [known[n] for n in op.inputs],
                                   [known[n] for n in op.outputs], dict(op.params))
                       for op in params["body"]))


SHAPE_RULES["fused"] = _fused_shape
FLOP_RULES["fused"] = _fused_flops


# --- the precision pass's kernels (`opgraph.passes.precision`): tensor-wise FP8 scaling, as
# torchao's Float8Linear and Transformer Engine do it; no backward, the pass places them in both
# phases itself ----------------------------------------------------------------------------------

def _amax_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """A tensor -> its largest magnitude, one scalar (the tensor-wise scale follows from it)."""
    _require(len(ins) == 1, lambda: f"amax reads one tensor, not {len(ins)}")
    return [()]


def _cast_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """A tensor and its amax -> the tensor scaled into the FP8 range, in the output's dtype."""
    _require(len(ins) == 2 and ins[1].shape == (), "cast reads a tensor and its scalar amax")
    return [ins[0].shape]


def _amax_flops(ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
    """|x| and the running max: 2 per element read."""
    return 2 * ins[0].numel


PRECISION_KINDS = ("amax", "cast")
SHAPE_RULES |= {"amax": _amax_shape, "cast": _cast_shape}
FLOP_RULES |= {"amax": _amax_flops,
               "cast": per_element(2)}  # times the scale (fp8_max / amax), clamped to the range


# --- collectives (`opgraph.passes.shard`, `opgraph.passes.shard_data`,
# `opgraph.parallel.collectives`): a kernel that moves a tensor between the GPUs of a group. Its
# parameters name the group (`group`: a parallel degree, "tp", "cp", "ep", "dp" or "pp") and, for a
# gather or scatter, the dimension it joins or splits (`axis`) and the group's size (`size`: the
# degree's symbol). They do no arithmetic the roofline counts (a reduction's adds run on the
# communication kernel's own SMs) and move no HBM bytes on the compute stream: their time is the
# network's (`costmodel`). -------

def _gathered(ins: list[Tensor], params: dict, grow: bool) -> list[Shape]:
    _require(len(ins) == 1, lambda: f"a collective reads one tensor, not {len(ins)}")
    axis, size = int(params["axis"]), params["size"]
    shape = list(ins[0].shape)
    _require(-len(shape) <= axis < len(shape), lambda: f"axis {axis} of {_fmt(ins[0].shape)}")
    shape[axis] = shape[axis] * size if grow else shape[axis] / size
    return [tuple(shape)]


def _all_gather_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """Each GPU's shard -> the whole, `size` shards joined along `axis`."""
    return _gathered(ins, params, grow=True)


def _reduce_scatter_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """Each GPU's partial sum of the whole -> its shard of the sum, split along `axis`."""
    return _gathered(ins, params, grow=False)


def _exchange_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    _require(len(ins) == 1, lambda: f"a collective reads one tensor, not {len(ins)}")
    return [ins[0].shape]


COLLECTIVE_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send_recv",
                    "identity")
SHAPE_RULES |= {"all_reduce": _exchange_shape,  # partial sums -> their sum, on every GPU
                "reduce_scatter": _reduce_scatter_shape,
                "all_gather": _all_gather_shape,
                "all_to_all": _exchange_shape,  # tokens to their experts' GPUs and back
                "send_recv": _exchange_shape,  # to the next pipeline stage (or back)
                "identity": _exchange_shape}  # Megatron's f: a copy forward, an all-reduce back
FLOP_RULES |= {kind: _no_flops for kind in COLLECTIVE_KINDS}
VIEWS["identity"] = _always_view


def _partials(ins: list[Tensor], params: dict) -> tuple[list[Tensor], list[Tensor]]:
    """A kernel's own inputs and the partial gradients it accumulates into (read last)."""
    n = int(params.get("accumulate", 0))
    return (ins[:len(ins) - n], ins[len(ins) - n:]) if n else (ins, [])


def infer_shapes(kind: str, ins: list[Tensor], params: dict) -> list[Shape]:
    """The output shapes of an op of `kind` reading `ins`; ShapeError if they do not fit."""
    if kind not in SHAPE_RULES:
        raise ShapeError(f"no shape rule for op kind {kind!r}")
    own, partials = _partials(ins, params)
    shapes = SHAPE_RULES[kind](own, params)
    for t in partials:
        _require(any(len(t.shape) == len(s) and all(same(a, b) for a, b in zip(t.shape, s))
                     for s in shapes),
                 lambda: f"partial gradient {t.name} {_fmt(t.shape)} matches no output {shapes}")
    return shapes


# How parallelism splits each kind (`passes.shard`), by role:
# - "column": a weight (its second input) split along its output makes the op column-parallel:
#   a replicated input first passes Megatron's f (an all-reduce of its gradient backward);
# - "contracting": its output sums over a dimension of its inputs, so split inputs and an
#   unsplit output leave partial sums, which Megatron's g (an all-reduce) adds;
# - "expert": its weight's first dimension holds the experts, which expert parallelism spreads
#   over GPUs; the tokens travel to them by all-to-all;
# - "combine": the routed tokens come back by all-to-all before it;
# - "local": it runs on the shards its inputs hold, no collective of its own (an element-wise
#   kind reading a split bias); a built-in kind with no row is so.
SHARD_ROLES = ("column", "contracting", "expert", "combine", "local")
SHARDING: dict[str, tuple[str, ...]] = {
    "matmul": ("column", "contracting"),
    "expert_matmul": ("column", "contracting", "expert"),
    "embedding": ("contracting",),
    "moe_combine": ("combine",),
}
# Per attention kind: which inputs context parallelism gathers along the sequence (K and V).
CP_GATHERS: dict[str, tuple[int, ...]] = {"flash_attention": (1, 2), "attention_scores": (1,)}


def sequence_gather(op) -> bool:
    """Whether `op` (an `ir.Op`) is a forward all-gather over the tensor-parallel group:
    sequence parallelism's f, which `passes.shard` inserts to gather a sequence shard for a
    column-parallel matmul (`passes.precision` casts its shard, `passes.regather_inputs` runs it
    again in the backward)."""
    return (op.phase is Phase.FORWARD and op.kind == "all_gather"
            and op.param("group") == "tp")


def shards_as(kind: str, role: str) -> bool:
    """Whether parallelism splits `kind` in `role` (`SHARDING`)."""
    return role in SHARDING.get(kind, ())


# Kind -> (GEMMs, M, N) of one instance's matrix multiplies, for the kinds that are one
# (`gemm_grid`): what the calibrated cost model's wave quantisation tiles.
GEMM_GRIDS: dict[str, Callable] = {"matmul": _matmul_grid, "expert_matmul": _expert_matmul_grid}


def _flash_scores(ins: list[Tensor], outs: list[Tensor], params: dict) -> tuple:
    """FlashAttention's forward: (scores computed, d_qk + d_v, query rows): one exponential
    per score beside its tensor-core FLOPs, and B x H rows of queries, each of which runs its
    own loop over the keys it sees."""
    q, k, v = ins
    return (_attention_products(q, k, params),
            _head_dim(q, params["heads"]) + _head_dim(v, params["kv_heads"]),
            q.shape[0] * params["heads"] * q.shape[1])


def _flash_backward_scores(ins: list[Tensor], outs: list[Tensor], params: dict) -> tuple:
    """FlashAttention's backward: the forward's scores, their exponentials recomputed."""
    _, saved, _ = _saved(ins, params)
    return _flash_scores(list(saved), outs, params)


# Kind -> (scores, d_qk + d_v, query rows) of one instance of an attention kernel
# (`attention_scores`): how many exponentials its softmax takes beside its FLOPs, and how many
# rows of queries each loop over their keys.
ATTENTION_SCORES: dict[str, Callable] = {"flash_attention": _flash_scores,
                                         "flash_attention_backward": _flash_backward_scores}
# the attention kernels that are a backward (their row loop pays the backward's overhead:
# `calibration.Efficiencies.attention_backward_kv_overhead`)
ATTENTION_BACKWARD = frozenset(ATTENTION_SCORES).intersection(BACKWARD_KINDS)


def attention_scores(kind: str, ins: list[Tensor], outs: list[Tensor], params: dict) -> tuple:
    """`(scores, d_qk + d_v, query rows)` of one instance of an attention kernel of `kind`,
    sympy expressions; `()` for another kind."""
    rule = ATTENTION_SCORES.get(kind)
    if rule is None:
        return ()
    own, _ = _partials(ins, params)
    return tuple(sympy.sympify(e) for e in rule(own, outs, params))


def gemm_grid(kind: str, ins: list[Tensor], outs: list[Tensor], params: dict) -> tuple:
    """`(count, M, N)`: one instance of an op of `kind` as `count` GEMMs of an M x N output,
    sympy expressions of the dimensions; `()` for a kind that is not a matrix multiply.

        gemm_grid("matmul", [x, w], [y], {})  # x[B, S, D] @ w[D, F]: (1, B*S, F)
    """
    rule = GEMM_GRIDS.get(kind)
    if rule is None:
        return ()
    own, _ = _partials(ins, params)
    return tuple(sympy.sympify(e) for e in rule(own, outs, params))


def count_flops(kind: str, ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
    """FLOPs of one instance of an op of `kind`; accumulating into a partial gradient adds one
    per element."""
    own, partials = _partials(ins, params)
    return FLOP_RULES[kind](own, outs, params) + sympy.Add(*(t.numel for t in partials))


def rule_flops(graph: Graph, op: Op) -> sympy.Expr:
    """FLOPs of one instance of `op` by its kind's FLOP rule."""
    ins = [graph.tensor(n) for n in op.inputs]
    outs = [graph.tensor(n) for n in op.outputs]
    return count_flops(op.kind, ins, outs, dict(op.params))



# --- eager PyTorch: a composite op run as the kernels its Python code launches --------------------
# Under a framework that runs an op kind in eager PyTorch (`frameworks.Traits.eager`, marked by
# `passes.decompose`), one op of the plate's granularity is several kernels, each reading and
# writing a whole tensor, often upcast to FP32. EAGER_BYTES gives the HBM bytes of those kernels
# from the op's own tensors (x the op's first input, b its bytes per element, N its elements; a
# row's statistics and the weight are small beside them and counted too). FLOPs are unchanged:
# the same arithmetic, split over more kernels. The backward is costed from the forward by the
# plate's convention (twice its bytes: autograd's kernels for RMSNorm move about that), or,
# where autograd's kernels move otherwise (RoPE, the loss), by EAGER_BACKWARD_BYTES.

_F32 = 4  # bytes per FP32 element, the dtype each upcast writes


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


def _eager_rope(ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
    """torchtitan's `apply_rotary_emb` (`torchtitan/models/llama/model.py`): `x.float()` viewed
    as complex (N x (b + 4)), the complex product with the table (8N, the table itself S x d/2
    complex64, small beside it), `.type_as(x)` (N x (4 + b))."""
    x = ins[0]
    n, b = _rotated(x, params), x.dtype.itemsize
    return n * (b + _F32) + 2 * _F32 * n + n * (_F32 + b) + (x.numel - n) * 2 * b


def _eager_swiglu(ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
    """`silu(gate) * up` as two kernels (torchtitan's `FeedForward.forward`,
    `F.silu(self.w1(x)) * self.w3(x)`; nanotron's `GLUActivation`, `self.act(gate) * up`): the
    activation reads and writes the gate (2Nb), the product reads it again with the up
    projection and writes the output (3Nb), against one kernel's 3Nb."""
    gate = ins[0]
    return 5 * gate.numel * gate.dtype.itemsize


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


def _eager_rope_backward(ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
    """RoPE's autograd backward: the cast of the output's gradient to FP32, the complex
    product with the conjugate table, the cast back: the forward's kernels once, not twice."""
    return _eager_rope(ins, outs, params)


EAGER_BYTES: dict[str, Callable] = {
    "rmsnorm": _eager_rmsnorm,
    "rope": _eager_rope,
    "swiglu": _eager_swiglu,
    "cross_entropy": _eager_loss,
}

# The backward of an eager op, over all its backward kernels, where autograd's kernels move
# other than the plate's twice the forward (the rest keep the convention: RMSNorm's autograd
# moves about 2.1 x its forward, SwiGLU's 1.8 x).
EAGER_BACKWARD_BYTES: dict[str, Callable] = {
    "rope": _eager_rope_backward,
    "cross_entropy": _eager_loss_backward,
}


def eager_bytes(kind: str, ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
    """HBM bytes of one instance of an op of `kind` run as eager PyTorch's kernels
    (EAGER_BYTES); a kind without an eager decomposition is one kernel either way: None."""
    rule = EAGER_BYTES.get(kind)
    return None if rule is None else sympy.sympify(rule(ins, outs, params))


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


# What an eager op's autograd keeps for its backward beyond what one fused kernel keeps (its
# inputs), by kind: `(name, shape, dtype)` each, saved from the op to its backward
# (`memory.Liveness`; where the op is re-run, from the re-run to the backward).
def _eager_swiglu_saved(ins: list[Tensor], outs: list[Tensor], params: dict) -> tuple:
    """`act(gate) * up` (`_eager_swiglu`): the product's autograd keeps both its operands, so
    silu(gate), a tensor of the gate's size that one fused kernel never writes, is kept beside
    the gate (silu's own input) and the up projection."""
    gate = ins[0]
    return (("silu", gate.shape, gate.dtype.name),)


def _eager_rmsnorm_saved(ins: list[Tensor], outs: list[Tensor], params: dict) -> tuple:
    """torchtitan's `RMSNorm` (`_eager_rmsnorm`): `pow` and the product with the rsqrt keep the
    FP32 copy of the input, and the product with the weight keeps the normalized BF16 tensor
    (standing where a fused norm keeps its input): the FP32 copy more."""
    x = ins[0]
    return (("fp32_input", x.shape, "fp32"),)


def _eager_rope_saved(ins: list[Tensor], outs: list[Tensor], params: dict) -> tuple:
    """`apply_rotary_emb` (`_eager_rope`): the complex product keeps its FP32 operand, the
    rotated elements upcast."""
    x = ins[0]
    return (("fp32_input", (_rotated(x, params),), "fp32"),)


EAGER_SAVED: dict[str, Callable] = {"swiglu": _eager_swiglu_saved,
                                    "rmsnorm": _eager_rmsnorm_saved,
                                    "rope": _eager_rope_saved}
EAGER_WORKSPACE: dict[str, Callable] = {"cross_entropy": _eager_loss_workspace}
EAGER_BACKWARD_WORKSPACE: dict[str, Callable] = {"cross_entropy": _eager_loss_backward_workspace}


def eager_saved(kind: str, ins: list[Tensor], outs: list[Tensor], params: dict) -> tuple:
    """The `(name, shape, dtype)` of each tensor the autograd of an eager op of `kind` keeps
    for its backward beyond a fused kernel's (EAGER_SAVED); () for a kind without one."""
    rule = EAGER_SAVED.get(kind)
    return () if rule is None else rule(ins, outs, params)


def eager_workspace(kind: str, ins: list[Tensor], outs: list[Tensor], params: dict,
                    backward: bool = False) -> tuple:
    """The `(name, shape, dtype)` of each tensor the eager kernels of an op of `kind` (or, with
    `backward`, of its backward; `ins`/`outs` the forward's either way) hold while they run,
    besides the op's own tensors (EAGER_WORKSPACE, EAGER_BACKWARD_WORKSPACE); () for a kind
    without one."""
    rule = (EAGER_BACKWARD_WORKSPACE if backward else EAGER_WORKSPACE).get(kind)
    return () if rule is None else rule(ins, outs, params)


def eager_backward_bytes(kind: str, ins: list[Tensor], outs: list[Tensor],
                         params: dict) -> sympy.Expr | None:
    """HBM bytes of the backward of one eager op of `kind` (inputs and outputs its forward's),
    all its kernels together (EAGER_BACKWARD_BYTES); None: the cost model's convention."""
    rule = EAGER_BACKWARD_BYTES.get(kind)
    return None if rule is None else sympy.sympify(rule(ins, outs, params))

__all__ = ["ATTENTION_SCORES", "BACKWARD_KINDS", "COLLECTIVE_KINDS", "EAGER_BACKWARD_BYTES",
           "EAGER_BYTES", "EAGER_BACKWARD_WORKSPACE", "EAGER_SAVED", "EAGER_WORKSPACE",
           "eager_saved", "eager_workspace",
           "FLOP_RULES",
           "FORWARD_KINDS", "GEMM_GRIDS", "ATTENTION_BACKWARD", "attention_scores",
           "PRECISION_KINDS", "SHAPE_RULES",
           "VIEWS", "ShapeError", "backward_shape", "count_flops", "eager_backward_bytes",
           "eager_bytes", "gemm_grid",
           "infer_shapes",
           "is_view",
           "per_element", "per_input", "same"]
