"""A mixture of experts: the router's top-k, the dispatch's permutation (each token copied to
its K experts' slots), the expert matmul (each token through K of E experts' weights, which
expert parallelism spreads over GPUs) and the gated combine."""

from __future__ import annotations

from collections.abc import Callable

import sympy

from ..ir import Op, Tensor
from ..symbols import B, D, E, F, K, S, ep
from .base import (
    Example,
    Shape,
    _fmt,
    _no_backward_flops,
    _no_flops,
    _require,
    _saved,
    ids_,
    kind,
    same,
    scaled_flops,
    sums_gradient,
    w_,
    x_,
)


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


def _permute_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """Tokens `x[..., D]` and their routing `experts[..., K]` -> `[..., K, D]`: each token
    copied once for each of its K experts, grouped by expert (in the experts' order; the
    shape counts the copies, not their order)."""
    x, experts = ins
    _require(len(x.shape) == len(experts.shape)
             and all(same(a, b) for a, b in zip(x.shape[:-1], experts.shape[:-1])),
             lambda: f"tokens {x.name} {_fmt(x.shape)} do not match the routing "
                     f"{experts.name} {_fmt(experts.shape)}")
    return [(*experts.shape, x.shape[-1])]


def _permute_backward_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """The tokens' gradient from the slots' `dy[..., K, D]`: `[..., D]`."""
    (dy,), (experts,), _ = _saved(ins, params)
    _require(len(dy.shape) == len(experts.shape) + 1
             and all(same(a, b) for a, b in zip(dy.shape[:-1], experts.shape)),
             lambda: f"{dy.name} {_fmt(dy.shape)} does not match the routing "
                     f"{experts.name} {_fmt(experts.shape)}")
    return [(*dy.shape[:-2], dy.shape[-1])]


def _permute_vjp(ctx, op: Op) -> list[Op]:
    """The tokens' gradient, their K slots' gradients summed back in the tokens' order
    (Megatron's unpermute of dY): one kernel reading dY and the routing, not the tokens."""
    x, experts = op.inputs
    dy = ctx.grad(op.outputs[0])
    if dy is None:
        return []
    kernel = ctx.emit(op, "grad", "moe_permute_backward", [dy, experts], [x], dys=1,
                      saved_inputs=1, saved_outputs=0)
    return [kernel] if kernel else []


def _sorted_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """The received token slots, in another order: the same shape."""
    return [ins[0].shape]


# a GPU holding more than one expert sorts what it receives by expert (1), one holding one
# does not (0): E / ep is a whole number of experts
SORTS = sympy.Min(1, E / ep - 1)


def _sort_bytes(ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
    """The sort's copy, read and written where a GPU holds more than one expert (`SORTS`), as
    Megatron-LM's `sort_chunks_by_idxs` concatenates the chunks in their new order."""
    return SORTS * (ins[0].nbytes + outs[0].nbytes)


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


def _topk_backward_flops(ins, outs, params) -> sympy.Expr:
    """The renormalisation's backward per gate (2), then softmax's backward per router logit,
    dl = p * (dp - sum(p * dp)) (4)."""
    _, (logits,), (gates, _) = _saved(ins, params)
    return 4 * logits.numel + 2 * gates.numel


def _combine_backward_flops(ins, outs, params) -> sympy.Expr:
    """dY times each gate (1 per expert output element) and dGate = <expert output, dY> (2)."""
    _, (y, _), _ = _saved(ins, params)
    return 3 * y.numel


def _expert_matmul_vjp(ctx, op: Op) -> list[Op]:
    """dX = dY W^T and dW = X^T dY through the same routing: two expert matmuls. The routing
    (which experts) is not differentiable; the gates' gradient comes from `moe_combine`."""
    a, w, experts = op.inputs
    dy = ctx.grad(op.outputs[0])
    # x[..., in] went to each of its K experts: its gradient sums the K slots
    broadcast = len(ctx.graph.tensor(a).shape) == len(ctx.graph.tensor(experts).shape)
    kernels = [ctx.emit(op, "dA", "expert_matmul", [dy, w, experts], [a], transpose_b=True,
                        reduce_slots=broadcast or None),
               ctx.emit(op, "dB", "expert_matmul", [a, dy, experts], [w], contract="leading",
                        experts=ctx.graph.tensor(w).shape[0])]
    return [k for k in kernels if k is not None]


def _routed_experts(tensor: Callable[[str], Tensor], op: Op, weight: Tensor) -> sympy.Expr:
    """The share of an expert weight one token reads (`active_fraction`): K of E experts, K the
    routing's last dimension, E the expert weight's first."""
    experts = tensor(op.inputs[2])
    return experts.shape[-1] / weight.shape[0]


KINDS = (
    kind("topk", shape=_topk_shape, flops=_topk_flops,
         vjp="inputs+outputs",  # softmax backward from the gates, into the logits
         backward_flops=_topk_backward_flops, category="routing",
         example=Example((x_((B, S, E), "logits"),), (("k", K),))),
    kind("moe_permute", shape=_permute_shape, flops=_no_flops,  # a copy: bytes only
         vjp=_permute_vjp, backward_flops=sums_gradient,
         backward_shape=_permute_backward_shape,
         backward_cost=scaled_flops,  # its own traffic: dY, the routing, dX
         category="routing",
         example=Example((x_((B, S, D)), ids_((B, S, K), "experts")))),
    # the received tokens sorted by local expert (and back): a copy that runs as eager PyTorch
    # (`passes.sort_local_experts` marks it so), bytes only, where a GPU holds several experts;
    # its backward is the same copy of the gradient, the other way
    kind("moe_sort", shape=_sorted_shape, flops=_no_flops, vjp="none",
         backward_flops=_no_backward_flops, eager=_sort_bytes, eager_backward=_sort_bytes,
         category="routing", example=Example((x_((B, S, K, D), "slots"),))),
    kind("expert_matmul", shape=_expert_matmul_shape, flops=_expert_matmul_flops,
         vjp=_expert_matmul_vjp, grid=_expert_matmul_grid,
         shards=("column", "contracting", "expert"), fusion_class="matmul", kept=True,
         operands=2, fp8_weight_dims=3, active_fraction=_routed_experts, category="matmul",
         example=Example((x_((B, S, D)), w_((E, D, F)), ids_((B, S, K), "experts")))),
    kind("moe_combine", shape=_combine_shape, flops=_combine_flops,
         vjp="inputs",  # dY times each gate; dGate = <expert output, dY>
         backward_flops=_combine_backward_flops, shards=("combine",), fusion_class="reduction",
         category="routing",
         example=Example((x_((B, S, K, D), "y"), x_((B, S, K), "gates")))),
)
