"""derive_backward: append the backward graph to a forward graph.

Invariant established: every forward op whose outputs need a gradient has backward ops (phase
`backward`, `forward=` naming it) that read the output gradients and the saved forward tensors
they need, and write gradient tensors (`grad_of=` naming the primal); each weight ends with one
final gradient tensor (`gradient_of(graph, weight)`), which the optimizer consumes.

Which kernels a backward is made of is one table, VJP_RULES, keyed by op kind. What they cost is
a second table, BACKWARD_COST: by default the plate's convention, each op's backward costs
`factor` (2) times its forward, FLOPs and bytes alike, split evenly over its kernels. A matmul's
backward is its two real matmuls, dX = dY W^T and dW = X^T dY, each exactly the forward's cost.
With `traffic="tensors"` the backward kernels' bytes are instead derived from the tensors they
really read and write (FLOPs keep the convention).

A tensor read by several ops gets its gradient contributions accumulated in the kernels' epilogues:
the second contributor reads the first one's partial gradient and writes the sum, so every tensor
is still produced once and no extra kernel appears.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import sympy

from opgraph.ir import FP32, DType, Graph, Op, Phase, Role, Tensor

TRAFFIC_MODES = ("plate", "tensors")


class _Context:
    """What a VJP rule may ask while it builds one forward op's backward kernels."""

    def __init__(self, graph: Graph, needs: set[str], weight_grad_dtype: DType):
        self.graph = graph
        self.needs = needs  # tensors that need a gradient
        self.latest: dict[str, str] = {}  # primal -> its newest (partial) gradient
        self.made: dict[str, int] = {}  # primal -> how many partial gradients so far
        self.weight_grad_dtype = weight_grad_dtype

    def grad(self, name: str) -> str | None:
        return self.latest.get(name)

    def emit(self, fwd: Op, suffix: str, kind: str, reads: list[str], grads: list[str]) -> Op:
        """A backward kernel of `fwd` reading `reads` and writing gradients of `grads` (those
        that need one), uncosted; None if none of `grads` needs a gradient."""
        grads = [n for n in dict.fromkeys(grads) if n in self.needs]
        if not grads:
            return None
        reads = list(reads)
        outs = []
        for primal in grads:
            previous = self.latest.get(primal)
            if previous is not None:
                reads.append(previous)  # accumulate into the partial gradient
            outs.append(self._new_grad(primal))
        return Op(f"{fwd.name}.{suffix}", kind, fwd.category, list(dict.fromkeys(reads)), outs,
                  count=fwd.count, phase=Phase.BACKWARD, params=fwd.params, forward=fwd.name,
                  region=fwd.region)

    def _new_grad(self, primal: str) -> str:
        t = self.graph.tensor(primal)
        n = self.made[primal] = self.made.get(primal, 0) + 1
        name = f"d.{primal}" if n == 1 else f"d.{primal}#{n}"
        dtype = self.weight_grad_dtype if t.role is Role.WEIGHT else t.dtype
        self.graph.add_tensor(Tensor(name, t.shape, dtype, Role.GRADIENT, t.count, grad_of=primal,
                                     region=t.region))
        self.latest[primal] = name
        return name


# --- VJP rules: (ctx, op) -> backward kernels -----------------------------------------------------

def one_kernel(saves: str) -> Callable:
    """A backward that is one kernel reading the output gradient and the saved forward tensors
    (`saves`: "none", "inputs" or "inputs+outputs"), writing each input's gradient."""
    def _one_kernel_vjp(ctx: _Context, op: Op) -> list[Op]:
        saved = {"none": [], "inputs": list(op.inputs),
                 "inputs+outputs": [*op.inputs, *op.outputs]}[saves]
        dys = [g for g in map(ctx.grad, op.outputs) if g is not None]
        kernel = ctx.emit(op, "grad", f"{op.kind}_backward", dys + saved, list(op.inputs))
        return [kernel] if kernel else []
    _one_kernel_vjp.__name__ = f"_one_kernel_vjp_{saves.replace('+', '_')}"
    return _one_kernel_vjp


def _matmul_vjp(ctx: _Context, op: Op) -> list[Op]:
    """dA = dY B^T and dB = A^T dY (and a bias's gradient with dB): two matmuls."""
    a, b, *bias = op.inputs
    dy = ctx.grad(op.outputs[0])
    kernels = [ctx.emit(op, "dA", "matmul", [dy, b], [a]),
               ctx.emit(op, "dB", "matmul", [a, dy], [b, *bias])]
    return [k for k in kernels if k is not None]


def _expert_matmul_vjp(ctx: _Context, op: Op) -> list[Op]:
    """dX = dY W^T and dW = X^T dY through the same routing: two expert matmuls. The routing
    (which experts) is not differentiable; the gates' gradient comes from `moe_combine`."""
    a, w, experts = op.inputs
    dy = ctx.grad(op.outputs[0])
    kernels = [ctx.emit(op, "dA", "expert_matmul", [dy, w, experts], [a]),
               ctx.emit(op, "dB", "expert_matmul", [a, dy, experts], [w])]
    return [k for k in kernels if k is not None]


def flash_attention_backward(ctx: _Context, op: Op) -> list[Op]:
    """FlashAttention's backward: one kernel reading Q, K, V, O and dO, writing dQ, dK, dV."""
    q, k, v = op.inputs
    do = ctx.grad(op.outputs[0])
    kernel = ctx.emit(op, "grad", "flash_attention_backward", [do, q, k, v, *op.outputs],
                      [q, k, v])
    return [kernel] if kernel else []


VJP_RULES: dict[str, Callable] = {
    "embedding": one_kernel("inputs"),  # scatter-add of dY rows into the table's gradient
    "matmul": _matmul_vjp,
    "rmsnorm": one_kernel("inputs"),
    "layernorm": one_kernel("inputs"),
    "rope": one_kernel("none"),  # the inverse rotation of dY
    "attention_scores": one_kernel("inputs+outputs"),  # softmax backward needs P; then dQ, dK
    "flash_attention": flash_attention_backward,
    "swiglu": one_kernel("inputs"),
    "gelu": one_kernel("inputs"),
    "add": one_kernel("none"),
    "cross_entropy": one_kernel("inputs"),  # softmax(logits) - onehot(targets)
    "topk": one_kernel("inputs+outputs"),  # softmax backward from the gates, into the logits
    "expert_matmul": _expert_matmul_vjp,
    "moe_combine": one_kernel("inputs"),  # dY times each gate; dGate = <expert output, dY>
}


# --- cost rules: (graph, forward op, its backward kernels, traffic mode, factor) -> costed --------

def _scaled_forward_cost(graph: Graph, fwd: Op, kernels: list[Op], traffic: str,
                         factor) -> list[Op]:
    """The plate's rule: the backward costs `factor` x the forward, split evenly."""
    n = len(kernels)
    flops = factor * fwd.flops / n
    bytes_ = factor * graph.op_bytes(fwd) / n if traffic == "plate" else None
    return [attrs.evolve(k, flops=flops, traffic=bytes_) for k in kernels]


def _real_traffic_cost(graph: Graph, fwd: Op, kernels: list[Op], traffic: str,
                       factor) -> list[Op]:
    """`factor` x the forward's FLOPs; bytes from the tensors the kernels really touch."""
    n = len(kernels)
    return [attrs.evolve(k, flops=factor * fwd.flops / n, traffic=None) for k in kernels]


BACKWARD_COST: dict[str, Callable] = {
    kind: _scaled_forward_cost for kind in VJP_RULES
} | {"flash_attention": _real_traffic_cost}


# --- the pass -------------------------------------------------------------------------------------

def _needs_grad(graph: Graph) -> set[str]:
    needs = {t.name for t in graph.tensors()
             if t.role is Role.WEIGHT
             or (t.role is Role.ACTIVATION and graph.producer(t.name) is None)}
    for op in graph.ops():
        if op.phase is Phase.FORWARD and any(n in needs for n in op.inputs):
            needs.update(n for n in op.outputs if graph.tensor(n).role is Role.ACTIVATION)
    return needs


def derive_backward(graph: Graph, *, traffic: str = "plate", factor=2,
                    weight_grad_dtype: DType = FP32) -> Graph:
    """The forward graph with its backward appended.

    `factor` is the backward-over-forward cost ratio (the plate's 2); weight gradients are
    written in `weight_grad_dtype` (FP32, the buffer gradients accumulate in).

        >>> step = derive_backward(preset("llama3-8b"))
    """
    if traffic not in TRAFFIC_MODES:
        raise ValueError(f"traffic must be one of {TRAFFIC_MODES}, not {traffic!r}")
    if any(op.phase is not Phase.FORWARD for op in graph.ops()):
        raise ValueError(f"graph {graph.name} already has a backward")
    out = graph.copy()
    needs = _needs_grad(graph)
    ctx = _Context(out, needs, weight_grad_dtype)
    factor = sympy.sympify(factor)
    for sink in graph.tensors():  # seed: d(loss)/d(loss) for each scalar sink
        if sink.name in needs and not graph.consumers(sink.name) and graph.producer(sink.name):
            ctx._new_grad(sink.name)
    for op in reversed(graph.ops()):
        if not any(ctx.grad(n) for n in op.outputs):
            continue
        try:
            rule = VJP_RULES[op.kind]
        except KeyError:
            raise NotImplementedError(f"no backward rule for op kind {op.kind!r} "
                                      f"(op {op.name}); add one to VJP_RULES") from None
        kernels = rule(ctx, op)
        if kernels:
            for k in BACKWARD_COST[op.kind](graph, op, kernels, traffic, factor):
                out.add_op(k)
    return out


def gradient_of(graph: Graph, name: str) -> Tensor | None:
    """The final gradient of tensor `name`: the last of its partial gradients."""
    grads = [t for t in graph.tensors() if t.grad_of == name]
    partials = {n for t in grads for op in graph.consumers(t.name)
                for n in op.outputs if graph.tensor(n).grad_of == name}
    final = [t for t in grads if t.name not in partials]
    return final[-1] if final else None
