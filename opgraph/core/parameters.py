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

from . import rules
from .ir import Graph, Op, Phase, Tensor


# kind -> (a tensor by name, the op, the weight) -> the share of the weight one token reads
# (a kind's `active_fraction`: the expert matmul's in `opgraph.core.rules.moe`)
ACTIVE_FRACTION: dict[str, Callable[[Callable, Op, Tensor], sympy.Expr]] = rules.ACTIVE_FRACTION


def _readers(graph: Graph, weight: Tensor) -> list[tuple[Op, Callable[[str], Tensor]]]:
    """The forward ops that read `weight`, each with a lookup of the tensors it sees; a fused
    kernel stands for its members that read it (their inner tensors are its params')."""
    out = []
    for op in graph.consumers(weight.name):
        if op.phase is not Phase.FORWARD:
            continue
        if op.kind != "fused":
            out.append((op, graph.tensor))
            continue
        inner = {t.name: t for t in op.param("inner")}

        def tensor(name, inner=inner):
            return inner[name] if name in inner else graph.tensor(name)

        out += [(m, tensor) for m in op.param("body") if weight.name in m.inputs]
    return out


def active_fraction(graph: Graph, weight: Tensor) -> sympy.Expr:
    """The share of `weight` one token reads: 1, or K/E for experts' weights (also inside a
    fused kernel)."""
    readers = _readers(graph, weight)
    routed = [(op, tensor) for op, tensor in readers if op.kind in ACTIVE_FRACTION]
    if not routed or len(routed) < len(readers):  # read densely somewhere: all of it is used
        return sympy.Integer(1)
    op, tensor = routed[0]
    return ACTIVE_FRACTION[op.kind](tensor, op, weight)


def active_parameters(graph: Graph, weights: Iterable[Tensor] | None = None) -> sympy.Expr:
    """Parameters one token uses: `active_parameters(preset("mixtral-8x7b"))` is
    `... + 3*D*F*K*L + ...` where the total has `3*D*E*F*L`."""
    weights = graph.weights() if weights is None else weights
    return sympy.Add(*(w.numel * w.count * active_fraction(graph, w) for w in weights))


def is_routed(graph: Graph) -> bool:
    """Whether some weight is read by a routed op (a mixture of experts), fused or not."""
    return any(op.kind in ACTIVE_FRACTION for w in graph.weights()
               for op, _ in _readers(graph, w))


def mfu_weights(graph: Graph) -> list:
    """The weights the MFU convention counts: every weight an op other than the embedding
    lookup (and its gradient) reads, forward or backward. The backward counts too because a
    pass may move a weight's forward use: `fuse_elementwise`'s loop rotation computes the final
    norm inside the stack, and `final_norm.weight` is then read by its gradient alone."""
    lookup = ("embedding", "embedding_backward")
    return [w for w in graph.weights()
            if any(op.kind not in lookup and op.phase is not Phase.OPTIMIZER
                   for op in graph.consumers(w.name))]


def mfu_parameters(graph: Graph) -> sympy.Expr:
    """N of the MFU convention: the `mfu_weights`, each times the share a token uses."""
    return active_parameters(graph, mfu_weights(graph))
