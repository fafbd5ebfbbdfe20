"""A state-space mixer, Mamba-2's (Dao and Gu 2024, "Transformers are SSMs", arXiv:2405.21060):
the causal depthwise convolution, and the state-space dual (SSD) scan as its chunked algorithm
runs it (section 6; `mamba_ssm.ops.triton.ssd_combined`, the kernels Megatron-Core's
`MambaMixer` calls).

The scan is two ops, the kernels' split: `ssd_chunk_state` sums each chunk of Q tokens into the
state it hands on (`_chunk_state_fwd`, then `_state_passing_fwd` carrying it across the chunks),
written to HBM in FP32, [B, ceil(S/Q), H x P x N]; `ssd_chunk_scan` reads those states back with the
tokens and writes the output (`_bmm_chunk_fwd`'s C B^T within each chunk, `_chunk_scan_fwd`).
Their bytes are their tensors', so the states' round trip through HBM is counted (the state
passing's own read and write of them, one more round trip, is not). Per token and head
(head width P, state N, G groups sharing B and C, chunks of Q), in multiply-adds x 2:

- chunk state: B^T x, 2 N P; carrying it across chunks, 2 N P / Q;
- chunk scan: C B^T within the chunk, 2 Q N per group; its masked product with x, 2 Q P; C
  times the chunk's incoming state, 2 N P; the skip D x, 2 P.

The backward follows the same split (mamba_ssm's `_mamba_chunk_scan_combined_bwd`): the chunk
scan's kernel recomputes the chunk states from x, B and dt, so no state is kept for it, and
writes the gradients of its inputs and of the states (`_chunk_scan_bwd_dstates` and its
neighbours; FLOPs twice the scan's plus the states' re-run); the chunk state's kernel carries the
states' gradient back across the chunks and on to x, dt and B (`_state_passing_bwd`,
`_chunk_state_bwd_*`; twice its forward's FLOPs). The plate's convention charges each twice its
forward op, so there the re-run is not charged; the "derived" convention charges it.

Tensor parallelism splits the heads and the groups (Megatron-Core's `MambaMixer`: `in_proj`
column-parallel, `out_proj` row-parallel, everything between on each rank's heads). They run
along the sequence (`along_sequence`), so context parallelism gives them the whole sequence of
1/cp of the heads by all-to-all, as Megatron-Core does (`passes.shard`).
"""

from __future__ import annotations

import sympy

from ..ir import Tensor
from ..symbols import B, G_m, H_m, N_m, Q_m, S, d_m, k_m
from .base import Example, Shape, _fmt, _require, _saved, kind, same, w_, x_

# The convolution's SiLU, x * sigmoid(x): as SwiGLU's (pointwise.swiglu), 4 FLOPs per element;
# the bias 1 more.
CONV_EPILOGUE_FLOPS = 5


def _conv_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    x, w, *bias = ins
    _require(len(x.shape) == 3,
             lambda: f"causal_conv1d takes [B, S, channels], not {_fmt(x.shape)}")
    _require(len(w.shape) == 2 and same(w.shape[0], x.shape[-1]),
             lambda: f"conv weight {w.name} {_fmt(w.shape)} is not [channels {x.shape[-1]}, width]")
    for b in bias:
        _require(len(b.shape) == 1 and same(b.shape[0], x.shape[-1]),
                 lambda b=b: f"conv bias {b.name} {_fmt(b.shape)} is not [{x.shape[-1]}]")
    return [x.shape]


def _conv_flops(ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
    """Each output element: the width's multiply-adds over its channel's last k tokens, the
    bias and the SiLU."""
    return (2 * ins[1].shape[1] + CONV_EPILOGUE_FLOPS) * outs[0].numel


def _scan_dims(x: Tensor, bc: Tensor, params: dict) -> tuple:
    """(tokens, heads, head width P, groups, state N, chunk Q) of a scan over `x` [B, S, H x P]
    whose B (or C) is `bc` [B, S, G x N]."""
    heads, groups, chunk = params.get("heads"), params.get("groups"), params.get("chunk")
    _require(None not in (heads, groups, chunk),
             "an SSD scan needs `heads`, `groups` and `chunk` (its chunk length)")
    _require(len(x.shape) == 3 and len(bc.shape) == 3 and same(x.shape[1], bc.shape[1]),
             lambda: f"an SSD scan takes x [B, S, heads x P] and B, C [B, S, groups x N], not "
                     f"{_fmt(x.shape)} and {_fmt(bc.shape)}")
    tokens = x.shape[0] * x.shape[1]
    return tokens, heads, x.shape[2] / heads, groups, bc.shape[2] / groups, chunk


def _per_head(t: Tensor, heads, what: str) -> None:
    _require(len(t.shape) == 1 and same(t.shape[0], heads),
             lambda: f"{what} {t.name} {_fmt(t.shape)} is not one per head [{heads}]")


def _check_dt(x: Tensor, dt: Tensor, heads) -> None:
    _require(len(dt.shape) == 3 and same(dt.shape[1], x.shape[1]) and same(dt.shape[2], heads),
             lambda: f"dt {dt.name} {_fmt(dt.shape)} is not [B, S, heads {heads}]")


def _chunks(x: Tensor, chunk) -> sympy.Expr:
    """The chunks of the sequence of `x` [B, S, ...]: the last one padded (mamba_ssm's
    `nchunks = ceil(seqlen / chunk_size)`)."""
    return sympy.ceiling(x.shape[1] / chunk)


def _state_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """(x, dt, dt_bias, A, B) -> the chunk states [B, S/Q, H x P x N]."""
    _require(len(ins) == 5, "ssd_chunk_state reads x, dt, dt_bias, A and B")
    x, dt, dt_bias, a, b = ins
    _, heads, p, _, n, chunk = _scan_dims(x, b, params)
    _check_dt(x, dt, heads)
    _per_head(dt_bias, heads, "dt_bias")
    _per_head(a, heads, "A")
    return [(x.shape[0], _chunks(x, chunk), heads * p * n)]


def _state_flops(ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
    tokens, heads, p, _, n, chunk = _scan_dims(ins[0], ins[4], params)
    return 2 * tokens * heads * p * n * (1 + 1 / chunk)


def _scan_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """(x, dt, dt_bias, A, B, C, D[, states]) -> y [B, S, H x P]; without the states (its
    backward's saved inputs) the same output."""
    _require(len(ins) in (7, 8), "ssd_chunk_scan reads x, dt, dt_bias, A, B, C, D and the states")
    x, dt, dt_bias, a, b, c, d, *states = ins
    _, heads, p, _, n, chunk = _scan_dims(x, b, params)
    _check_dt(x, dt, heads)
    for t, what in ((dt_bias, "dt_bias"), (a, "A"), (d, "D")):
        _per_head(t, heads, what)
    _require(all(same(u, v) for u, v in zip(c.shape, b.shape)) and len(c.shape) == 3,
             lambda: f"C {_fmt(c.shape)} is not B's shape {_fmt(b.shape)}")
    expected = (x.shape[0], _chunks(x, chunk), heads * p * n)
    for t in states:
        _require(len(t.shape) == 3 and all(same(u, v) for u, v in zip(t.shape, expected)),
                 lambda t=t: f"states {t.name} {_fmt(t.shape)} are not {_fmt(expected)}")
    return [x.shape]


def _scan_flops(ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
    tokens, heads, p, groups, n, chunk = _scan_dims(ins[0], ins[4], params)
    return 2 * tokens * (chunk * groups * n + chunk * heads * p + heads * n * p + heads * p)


def _scan_backward_flops(ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
    """Twice the chunk scan's FLOPs, and the chunk states recomputed once."""
    _, saved, _ = _saved(ins, params)
    return 2 * _scan_flops(list(saved), [], params) + _state_flops(list(saved[:5]), [], params)


def _scan_backward_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """The gradients of the chunk scan's inputs at `wrt`, from the saved ones (the states',
    which are not saved, from x and B)."""
    _, saved, _ = _saved(ins, params)
    shapes = [t.shape for t in saved] + _state_shape(list(saved[:5]), params)
    wrt = params.get("wrt", ())
    _require(all(0 <= i < len(shapes) for i in wrt), lambda: f"wrt {wrt} out of range")
    return [shapes[i] for i in wrt]


def ssd_chunk_scan_backward(ctx, op) -> list:
    """The chunk scan's backward, one kernel: dY, x, dt, dt_bias, A, B, C and D read (not the
    states: it recomputes them), every input's gradient written, the states' too, which
    `ssd_chunk_state`'s backward carries on to x, dt and B."""
    *saved, _ = op.inputs  # the states come last
    dy = ctx.grad(op.outputs[0])
    kernel = ctx.emit(op, "grad", "ssd_chunk_scan_backward", [dy, *saved], list(op.inputs),
                      dys=1, saved_inputs=len(saved), saved_outputs=0,
                      wrt=ctx.wrt(op, list(op.inputs)))
    return [kernel] if kernel else []


_SCAN = (("heads", H_m), ("groups", G_m), ("chunk", Q_m))
_X = x_((B, S, H_m * d_m))
_DT, _BC = x_((B, S, H_m), "dt"), x_((B, S, G_m * N_m), "B")
_PER_HEAD = (w_((H_m,), "dt_bias"), w_((H_m,), "A"))

KINDS = (
    kind("causal_conv1d", shape=_conv_shape, flops=_conv_flops,  # depthwise, then bias and SiLU
         along_sequence=True, category="scan",
         example=Example((x_((B, S, H_m * d_m + 2 * G_m * N_m)),
                          w_((H_m * d_m + 2 * G_m * N_m, k_m)),
                          w_((H_m * d_m + 2 * G_m * N_m,), "b")))),
    kind("ssd_chunk_state", shape=_state_shape, flops=_state_flops,
         vjp="inputs",  # dStates back through the chunks, then to x, dt and B
         along_sequence=True, category="scan",
         example=Example((_X, _DT, *_PER_HEAD, _BC), _SCAN)),
    kind("ssd_chunk_scan", shape=_scan_shape, flops=_scan_flops, vjp=ssd_chunk_scan_backward,
         backward_flops=_scan_backward_flops, backward_shape=_scan_backward_shape,
         along_sequence=True, category="scan",
         example=Example((_X, _DT, *_PER_HEAD, _BC, x_((B, S, G_m * N_m), "C"), w_((H_m,), "D"),
                          x_((B, sympy.ceiling(S / Q_m), H_m * d_m * N_m), "states")), _SCAN)),
)
