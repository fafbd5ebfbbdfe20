"""Parameter counts derived from the graph: all of them, and the ones a token uses.

A weight's active fraction is the share of it one token's forward pass reads. It is 1 for a
dense weight; for a weight read by a routed op it is what that op's kind says (ACTIVE_FRACTION,
keyed by kind): an expert matmul routes each token to K of the E experts of `w[E, in, out]`, so
K / E, with K read from the routing tensor and E from the weight. A mixture of experts' active
parameters are then `sum(numel x count x fraction)`, nothing typed in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import sympy

from .ir import Graph, Op, Phase, Tensor


def _routed_experts(graph: Graph, op: Op, weight: Tensor) -> sympy.Expr:
    """K of E experts: K the routing's last dimension, E the expert weight's first."""
    experts = graph.tensor(op.inputs[2])
    return experts.shape[-1] / weight.shape[0]


ACTIVE_FRACTION: dict[str, Callable[[Graph, Op, Tensor], sympy.Expr]] = {
    "expert_matmul": _routed_experts,
}


def active_fraction(graph: Graph, weight: Tensor) -> sympy.Expr:
    """The share of `weight` one token reads: 1, or K/E for experts' weights."""
    readers = [op for op in graph.consumers(weight.name) if op.phase is Phase.FORWARD]
    routed = [op for op in readers if op.kind in ACTIVE_FRACTION]
    if not routed or len(routed) < len(readers):  # read densely somewhere: all of it is used
        return sympy.Integer(1)
    return ACTIVE_FRACTION[routed[0].kind](graph, routed[0], weight)


def active_parameters(graph: Graph, weights: Iterable[Tensor] | None = None) -> sympy.Expr:
    """Parameters one token uses: `active_parameters(preset("mixtral-8x7b"))` is
    `... + 3*D*F*K*L + ...` where the total has `3*D*E*F*L`."""
    weights = graph.weights() if weights is None else weights
    return sympy.Add(*(w.numel * w.count * active_fraction(graph, w) for w in weights))


def is_routed(graph: Graph) -> bool:
    """Whether some weight is read by a routed op (a mixture of experts)."""
    return any(op.kind in ACTIVE_FRACTION for op in graph.ops())
