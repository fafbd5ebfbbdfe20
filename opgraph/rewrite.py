"""Graph rewriting: find a pattern, written with the builder like a model, and replace it.

A pattern is a small Graph. A match binds each pattern op to a graph op of the same kind (and the
same parameter names), and each pattern tensor to a graph tensor, so that every pattern edge is a
graph edge at the same input position. A replacement says which ops and tensors go and which come;
the driver rejects a match whose removed tensors are still read by an op it keeps (an inner
tensor used outside the match), and returns the matches it applied.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from .ir import Graph, Op, Tensor


@attrs.frozen
class Match:
    """Pattern op -> graph op and pattern tensor -> graph tensor, as sorted pairs."""

    ops: tuple[tuple[str, str], ...]
    tensors: tuple[tuple[str, str], ...]

    def op(self, pattern_name: str) -> str:
        return dict(self.ops)[pattern_name]

    def tensor(self, pattern_name: str) -> str:
        return dict(self.tensors)[pattern_name]


@attrs.frozen
class Replacement:
    remove_ops: tuple[str, ...]
    remove_tensors: tuple[str, ...]
    add_tensors: tuple[Tensor, ...] = ()
    add_ops: tuple[Op, ...] = ()


def _fits(pattern_op: Op, op: Op) -> bool:
    return (op.kind == pattern_op.kind and op.phase == pattern_op.phase
            and len(op.inputs) == len(pattern_op.inputs)
            and {k for k, _ in op.params} == {k for k, _ in pattern_op.params})


def find(pattern: Graph, graph: Graph) -> list[Match]:
    """Every match of `pattern` in `graph`, in the graph's op order."""
    pattern_ops = pattern.ops()
    matches = []
    for anchor in graph.ops():
        if not _fits(pattern_ops[0], anchor):
            continue
        found = _extend(pattern, graph, pattern_ops, {pattern_ops[0].name: anchor}, {})
        if found is not None:
            ops, tensors = found
            matches.append(Match(tuple(sorted(ops.items())), tuple(sorted(tensors.items()))))
    return matches


def _bind(p_op: Op, g_op: Op, tensors: dict[str, str]) -> dict[str, str] | None:
    """`tensors` extended with `p_op`'s tensors bound to `g_op`'s, or None if they clash."""
    new = dict(tensors)
    for p, g in zip((*p_op.inputs, *p_op.outputs), (*g_op.inputs, *g_op.outputs)):
        if new.setdefault(p, g) != g:
            return None
    if len(set(new.values())) != len(new):  # two pattern tensors on one graph tensor
        return None
    return new


def _extend(pattern: Graph, graph: Graph, pattern_ops: list[Op], ops: dict[str, Op],
            tensors: dict[str, str]):
    tensors = _bind(pattern_ops[0], ops[pattern_ops[0].name], tensors)
    if tensors is None:
        return None
    for p_op in pattern_ops[1:]:
        bound = [(i, tensors[n]) for i, n in enumerate(p_op.inputs) if n in tensors]
        if not bound:
            return None  # patterns are connected: each op reads something matched earlier
        i, tensor = bound[0]
        candidates = [op for op in graph.consumers(tensor)
                      if _fits(p_op, op) and op.inputs[i] == tensor and op not in ops.values()]
        for op in candidates:
            extended = _bind(p_op, op, tensors)
            if extended is not None:
                ops[p_op.name], tensors = op, extended
                break
        else:
            return None
    return {p: op.name for p, op in ops.items()}, tensors


def rewrite(graph: Graph, pattern: Graph,
            replace: Callable[[Graph, Match], Replacement | None],
            ) -> tuple[Graph, list[tuple[Match, Replacement]]]:
    """A new graph with every non-overlapping match replaced, and each match applied with
    what replaced it."""
    out = graph.copy()
    applied = []
    for match in find(pattern, graph):
        if not all(out.has_op(g) for _, g in match.ops):
            continue  # overlapped an earlier match
        plan = replace(out, match)
        if plan is None or not _closed(out, plan):
            continue
        for name in plan.remove_ops:
            out.remove_op(name)
        for name in plan.remove_tensors:
            out.remove_tensor(name)
        for t in plan.add_tensors:
            out.add_tensor(t)
        for op in plan.add_ops:
            out.add_op(op)
        applied.append((match, plan))
    return out, applied


def _closed(graph: Graph, plan: Replacement) -> bool:
    """No op that stays reads a tensor that goes."""
    gone = set(plan.remove_ops)
    return all(op.name in gone for t in plan.remove_tensors for op in graph.consumers(t))
