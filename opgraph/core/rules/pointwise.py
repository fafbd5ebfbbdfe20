"""Element-wise kinds: RoPE, the gated and plain activations, add, mul, scale, soft-capping,
dropout, and the kernels eager PyTorch runs RoPE and SwiGLU as."""

from __future__ import annotations

import sympy

from ..ir import Tensor
from ..symbols import B, D, F, H, S, V, d_h, dim
from .attention import SOFTCAP_BACKWARD_FLOPS, SOFTCAP_FLOPS
from .base import (_F32, Example, Shape, _no_backward_flops, _no_flops, _require, _same_shape,
                   _saved, kind, per_element, per_input, x_)

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


def _eager_rope_backward(ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
    """RoPE's autograd backward: the cast of the output's gradient to FP32, the complex
    product with the conjugate table, the cast back: the forward's kernels once, not twice."""
    return _eager_rope(ins, outs, params)


# What an eager op's autograd keeps for its backward beyond what one fused kernel keeps (its
# inputs), by kind: `(name, shape, dtype)` each, saved from the op to its backward
# (`memory.Liveness`; where the op is re-run, from the re-run to the backward).
def _eager_swiglu_saved(ins: list[Tensor], outs: list[Tensor], params: dict) -> tuple:
    """`act(gate) * up` (`_eager_swiglu`): the product's autograd keeps both its operands, so
    silu(gate), a tensor of the gate's size that one fused kernel never writes, is kept beside
    the gate (silu's own input) and the up projection."""
    gate = ins[0]
    return (("silu", gate.shape, gate.dtype.name),)


def _eager_rope_saved(ins: list[Tensor], outs: list[Tensor], params: dict) -> tuple:
    """`apply_rotary_emb` (`_eager_rope`): the complex product keeps its FP32 operand, the
    rotated elements upcast."""
    x = ins[0]
    return (("fp32_input", (_rotated(x, params),), "fp32"),)


R = dim("R")  # an example's rotated dimensions per head

KINDS = (
    kind("rope", shape=_rope_shape,
         flops=_rope_flops,  # x*cos + rotate(x)*sin on the rotated elements (ROPE_FLOPS)
         vjp="none",  # the inverse rotation of dY
         backward_flops=_rope_backward_flops,  # dY*cos - rotate(dY)*sin
         fusion_class="pointwise", eager=_eager_rope, eager_backward=_eager_rope_backward,
         eager_saved=_eager_rope_saved, example=Example((x_((B, S, H * d_h)),)),
         variants=(Example((x_((B, S, H * d_h)),), (("heads", H), ("rotary", R))),)),
    kind("swiglu", shape=_same_shape,
         flops=per_element(5),  # silu(g) = g*sigmoid(g): ~4; times up: 1
         # sigmoid recomputed (3), silu (1), dUp = dY*silu (1), silu' (4), dGate = dY*up*silu' (2)
         backward_flops=per_input(11), fusion_class="pointwise", eager=_eager_swiglu,
         eager_saved=_eager_swiglu_saved,
         example=Example((x_((B, S, F), "gate"), x_((B, S, F), "up")))),
    kind("gelu", shape=_gelu_shape,
         flops=_gelu_flops,  # GELU_FLOPS: tanh approximation 8, exact 5
         # tanh form: recomputed (8), its derivative (7), times dY (1); exact: 10
         backward_flops=_gelu_backward_flops, fusion_class="pointwise",
         example=Example((x_((B, S, F)),)),
         variants=(Example((x_((B, S, F)),), (("approximate", "none"),)),)),
    kind("add", shape=_same_shape, flops=per_element(1), vjp="none",
         backward_flops=_no_backward_flops, fusion_class="pointwise",
         example=Example((x_((B, S, D), "a"), x_((B, S, D), "b")))),
    kind("mul", shape=_same_shape, flops=per_element(1),
         vjp="inputs",  # dA = dY * b, dB = dY * a
         backward_flops=_mul_backward_flops,
         example=Example((x_((B, S, F), "a"), x_((B, S, F), "b")))),
    kind("scale", shape=_scale_shape, flops=per_element(1),  # x * factor
         vjp="none", backward_flops=per_input(1),  # dY * factor
         example=Example((x_((B, S, D)),), (("factor", 2),))),
    kind("geglu", shape=_gelu_shape, flops=_geglu_flops,  # gelu(gate) * up
         backward_flops=_geglu_backward_flops,
         example=Example((x_((B, S, F), "gate"), x_((B, S, F), "up")))),
    kind("softcap", shape=_softcap_shape,  # cap * tanh(x / cap)
         flops=per_element(SOFTCAP_FLOPS),  # divide, tanh, multiply
         vjp="inputs",  # dY * (1 - tanh(x / cap)^2)
         backward_flops=per_input(SOFTCAP_BACKWARD_FLOPS),  # tanh recomputed, dY * (1 - t^2)
         example=Example((x_((B, S, V)),), (("cap", 30),))),
    # ReLU squared, max(x, 0)^2 (So et al. 2021, Primer; HF's "relu2", Megatron's squared_relu;
    # Nemotron-4's and Nemotron-H's MLPs): the max and a multiply; backward 2 x dY where x > 0
    kind("relu2", shape=_same_shape, flops=per_element(RELU_FLOPS + 1),
         backward_flops=per_input(3), fusion_class="pointwise", example=Example((x_((B, S, F)),))),
    kind("relu", shape=_same_shape, flops=per_element(RELU_FLOPS),  # max(x, 0)
         backward_flops=per_input(RELU_BACKWARD_FLOPS),  # dY where x > 0
         fusion_class="pointwise", example=Example((x_((B, S, F)),))),
    # dY where kept: the backward reads its mask; the saved input stands in for it (where
    # dropout follows a softmax, the softmax's backward keeps that tensor anyway)
    kind("dropout", shape=_dropout_shape,  # x * mask / (1 - p)
         flops=_no_flops,  # an RNG's integer work and a select (see _dropout_shape)
         backward_flops=_no_backward_flops, fusion_class="pointwise",
         example=Example((x_((B, H, S, S)),), (("p", 0.1),))),
)
