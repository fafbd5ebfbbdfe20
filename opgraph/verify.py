"""The graph verifier, run by `compile_step` and after every pass in the tests (like torch.fx's
`graph.lint()`).

A graph is well formed when it is acyclic; every tensor is produced at most once; each op's
edges are exactly its input and output tensors; every op's output shapes, whatever its phase
(forward, backward, optimizer, fused), are what its kind's shape rule infers from its inputs (so
a matmul's inner dimensions agree, dX = dY W^T included); a backward op's `forward` link names an
op of the graph; and every gradient has its primal's shape (or, on a data-parallel rank, its shard).
"""

from __future__ import annotations

import networkx as nx

from . import rules
from .ir import Graph, Phase, Role, region_problems
from .parallel import dp, edp

# A data-parallel rank's gradient may be its 1/dp shard (`passes.replicate`, ZeRO-2/3).
_WHOLE = {dp: 1, edp: 1}


class VerifyError(ValueError):
    """A malformed graph; the message lists each problem."""


def verify(graph: Graph) -> Graph:
    """Check `graph`, raise VerifyError naming every problem, return it unchanged if fine."""
    problems: list[str] = []
    if not nx.is_directed_acyclic_graph(graph.nx):
        cycle = nx.find_cycle(graph.nx)
        raise VerifyError(f"graph {graph.name}: cycle through {[n[1] for n, _ in cycle]}")
    for t in graph.tensors():
        producers = list(graph.nx.predecessors(("tensor", t.name)))
        if len(producers) > 1:
            problems.append(f"tensor {t.name} is produced {len(producers)} times")
        if t.role is Role.ACTIVATION and t.grad_of is not None:
            problems.append(f"tensor {t.name} is a gradient but has role activation")
        if t.grad_of is not None:
            primal = graph.tensor(t.grad_of) if graph.has_tensor(t.grad_of) else None
            if primal is None:
                problems.append(f"gradient {t.name} of missing tensor {t.grad_of}")
            elif len(primal.shape) != len(t.shape) or not all(
                    (rules.same(a, b) or rules.same(a, b.xreplace(_WHOLE)))
                    for a, b in zip(primal.shape, t.shape)):
                problems.append(f"gradient {t.name} has shape {t.shape}, "
                                f"its tensor {primal.name} {primal.shape}")
    for op in graph.ops():
        node = ("op", op.name)
        if {n[1] for n in graph.nx.predecessors(node)} != set(op.inputs):
            problems.append(f"op {op.name}: edges in differ from its inputs")
        if {n[1] for n in graph.nx.successors(node)} != set(op.outputs):
            problems.append(f"op {op.name}: edges out differ from its outputs")
        if not op.outputs:
            problems.append(f"op {op.name} writes nothing")
        if op.phase is Phase.BACKWARD and op.forward is not None and not graph.has_op(op.forward):
            problems.append(f"op {op.name} is the backward of missing op {op.forward}")
        problems += _check_shapes(graph, op)
    problems += region_problems(graph)
    if problems:
        raise VerifyError(f"graph {graph.name}: " + "; ".join(problems))
    return graph


def _check_shapes(graph: Graph, op) -> list[str]:
    if op.kind not in rules.SHAPE_RULES:
        return [f"op {op.name}: no shape rule for kind {op.kind!r}"]
    ins = [graph.tensor(n) for n in op.inputs]
    try:
        expected = rules.infer_shapes(op.kind, ins, dict(op.params))
    except rules.ShapeError as e:
        return [f"op {op.name}: {e}"]
    outs = [graph.tensor(n).shape for n in op.outputs]
    if len(expected) != len(outs) or not all(
            len(a) == len(b) and all(rules.same(x, y) for x, y in zip(a, b))
            for a, b in zip(expected, outs)):
        show = [list(map(str, s)) for s in outs], [list(map(str, s)) for s in expected]
        return [f"op {op.name}: outputs {show[0]}, its inputs give {show[1]}"]
    return []
