"""Graph rewriting: find a pattern, written with the builder like a model, and replace it.

A pattern is a small Graph. A match binds each pattern op to a graph op of the same kind, phase,
parameter names and numbers of inputs and outputs, and each pattern tensor to a graph tensor, so
that every pattern edge is a graph edge at the same input (or output) position. Matching is
complete: every such binding is found (networkx's VF2 `DiGraphMatcher` enumerates the
monomorphisms of the op/tensor graph), not only the first that a greedy walk reaches.

A match is kept when it is convex (no path leaves its ops and re-enters them: replacing them by
one kernel would make a cycle) and every predicate given with `where=` holds. Matches are
ordered by where their ops stand in the graph's op order; where two overlap, the earlier wins.

A replacement says which ops and tensors go and which come, or simply that the matched ops
become one kernel (`Replacement.fuse`): the new op reads the group's boundary inputs and writes
the outputs read outside it, its inner tensors vanish, and since an op's bytes derive from its
tensors, its traffic is its boundary for free. The driver rejects a replacement whose removed
tensors are still read by an op it keeps, and returns what it applied. `fixpoint` runs a list
of rewrites until none applies, with a guard on the number of rounds.

    fused, applied = rewrite(graph, pattern, lambda g, m: Replacement.fuse(
        g, m.graph_ops, kind="add_rmsnorm", name=m.op("norm") + ".fused"))
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence

import attrs
import networkx as nx
import sympy
from networkx.algorithms import isomorphism

from . import rules
from .ir import Graph, Op, Tensor
from .rules import rule_flops


class RewriteError(ValueError):
    """A rewrite that cannot be applied, or a fixed-point loop that does not end."""


@attrs.frozen
class Match:
    """Pattern op -> graph op and pattern tensor -> graph tensor, as sorted pairs."""

    ops: tuple[tuple[str, str], ...]
    tensors: tuple[tuple[str, str], ...]

    def op(self, pattern_name: str) -> str:
        return dict(self.ops)[pattern_name]

    def tensor(self, pattern_name: str) -> str:
        return dict(self.tensors)[pattern_name]

    @property
    def graph_ops(self) -> tuple[str, ...]:
        """The matched graph ops (in the order of the pattern ops' names)."""
        return tuple(g for _, g in self.ops)


Predicate = Callable[[Graph, Match], bool]
Replace = Callable[[Graph, Match], "Replacement | None"]


# --- matching ---------------------------------------------------------------------------------

def _view(graph: Graph, *, drop_isolated: bool = False) -> nx.DiGraph:
    """The op/tensor graph with each edge's positions: the input indices at which an op reads
    a tensor (a set: `add(x, x)` reads x at 0 and 1), or the output index it writes it at."""
    view = nx.DiGraph()
    for op in graph.ops():  # ops first: VF2 extends from the first node, and a kind is rare
        view.add_node(("op", op.name), payload=op)
    for t in graph.tensors():
        view.add_node(("tensor", t.name), payload=t)
    for op in graph.ops():
        reads: dict[str, frozenset[int]] = {}
        for i, name in enumerate(op.inputs):
            reads[name] = reads.get(name, frozenset()) | {i}
        for name, positions in reads.items():
            view.add_edge(("tensor", name), ("op", op.name), positions=positions)
        for i, name in enumerate(op.outputs):
            view.add_edge(("op", op.name), ("tensor", name), positions=frozenset({i}))
    if drop_isolated:  # a pattern tensor no op touches would match every tensor
        view.remove_nodes_from([n for n in list(view) if view.degree(n) == 0])
    return view


def _node_match(graph_node: dict, pattern_node: dict) -> bool:
    g, p = graph_node["payload"], pattern_node["payload"]
    if isinstance(p, Tensor):
        return isinstance(g, Tensor)
    return (isinstance(g, Op) and g.kind == p.kind and g.phase == p.phase
            and len(g.inputs) == len(p.inputs) and len(g.outputs) == len(p.outputs)
            and {k for k, _ in g.params} == {k for k, _ in p.params})


def _edge_match(graph_edge: dict, pattern_edge: dict) -> bool:
    return graph_edge["positions"] == pattern_edge["positions"]


def _may_hold(graph: Graph, pattern: Graph) -> bool:
    """Whether `graph` has at least as many ops of each (kind, phase) as `pattern`: a match
    binds distinct ops of the same kind and phase (`_node_match`), so without them there is
    none, and the matcher need not run."""
    def kinds(g: Graph) -> Counter:
        return Counter((d["payload"].kind, d["payload"].phase)
                       for node, d in g.nx.nodes(data=True) if node[0] == "op")

    need, have = kinds(pattern), kinds(graph)
    return all(have[key] >= count for key, count in need.items())


def matches(pattern: Graph, graph: Graph) -> list[Match]:
    """Every binding of `pattern` in `graph`, convex or not, without predicates, in the
    graph's op order."""
    p_view = _view(pattern, drop_isolated=True)
    if not any(kind == "op" for kind, _ in p_view):
        raise RewriteError(f"pattern {pattern.name} has no op")
    if not _may_hold(graph, pattern):
        return []
    matcher = isomorphism.DiGraphMatcher(_view(graph), p_view, node_match=_node_match,
                                         edge_match=_edge_match)
    found = set()
    for mapping in matcher.subgraph_monomorphisms_iter():
        ops = tuple(sorted((p[1], g[1]) for g, p in mapping.items() if g[0] == "op"))
        tensors = tuple(sorted((p[1], g[1]) for g, p in mapping.items() if g[0] == "tensor"))
        found.add(Match(ops, tensors))
    index = {op.name: i for i, op in enumerate(graph.ops())}

    def order(m: Match):
        return (sorted(index[g] for g in m.graph_ops), [index[g] for g in m.graph_ops],
                m.tensors)

    return sorted(found, key=order)


def is_convex(graph: Graph, ops: Iterable[str]) -> bool:
    """Whether no path leaves `ops` and re-enters them: only then can they become one kernel
    without making a cycle. `a -> t -> b` is inside; `a -> t -> c -> u -> b`, `c` outside, is
    not convex."""
    inside = {("op", name) for name in ops}
    frontier = [c for node in inside for t in graph.nx.successors(node)
                for c in graph.nx.successors(t) if c not in inside]
    seen = set(frontier)
    while frontier:
        for nxt in graph.nx.successors(frontier.pop()):
            if nxt in inside:
                return False
            if nxt not in seen:
                seen.add(nxt)
                frontier.append(nxt)
    return True


def _predicates(where: Predicate | Sequence[Predicate]) -> tuple[Predicate, ...]:
    return (where,) if callable(where) else tuple(where)


def find(pattern: Graph, graph: Graph, where: Predicate | Sequence[Predicate] = ()
         ) -> list[Match]:
    """Every convex match of `pattern` in `graph` for which every predicate in `where`
    holds, in the graph's op order (overlapping matches included)."""
    checks = _predicates(where)
    return [m for m in matches(pattern, graph)
            if is_convex(graph, m.graph_ops) and all(check(graph, m) for check in checks)]


def one_region(graph: Graph, match: Match) -> bool:
    """A predicate: the matched ops run in one region, the same number of times."""
    ops = [graph.op(n) for n in match.graph_ops]
    return (len({op.region for op in ops}) == 1
            and all(rules.same(op.count, ops[0].count) for op in ops))


# --- replacements -----------------------------------------------------------------------------

def fused_flops(graph: Graph, ops: Iterable[str]) -> sympy.Expr:
    """FLOPs of `ops` fused into one kernel: the sum of each member's, by its kind's rule
    (`rules.count_flops`). Fusion moves no arithmetic; only the inner tensors' traffic goes."""
    return sympy.Add(*(rule_flops(graph, graph.op(n)) for n in ops))


@attrs.frozen
class Replacement:
    """What a rewrite removes and adds; `Replacement.fuse` for "these ops become one kernel"."""

    remove_ops: tuple[str, ...] = attrs.field(converter=tuple)
    remove_tensors: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    add_tensors: tuple[Tensor, ...] = attrs.field(default=(), converter=tuple)
    add_ops: tuple[Op, ...] = attrs.field(default=(), converter=tuple)

    @classmethod
    def fuse(cls, graph: Graph, ops: Iterable[str], *, name: str, kind: str = "fused",
             category: str | None = None, params=(), forward: str | None = None,
             dropping: Iterable[str] = ()) -> Replacement:
        """`ops` become one kernel `name`: it reads the group's boundary inputs (in the order
        first read), writes each output of the group that an op outside it reads or that
        nothing reads (a graph output), and runs in the members' region, phase and count. The
        other outputs, inner tensors, vanish. Its category is the first member's unless given.

        With the default kind "fused" the kernel carries its members (`body`, `inner`,
        `outputs` in its params), so its shapes and FLOPs are theirs by their own rules
        (`opgraph.core.rules`); a library kernel's kind instead (`flash_attention`) costs by that
        kind's rules, and the caller checks they agree (`fused_flops`).

        `dropping` names ops that go with the group without joining it (a pass that rebuilds
        their replacements itself, such as the group's backward kernels): what only they read
        is inner too."""
        order = {op.name: i for i, op in enumerate(graph.ops())}
        members = [graph.op(n) for n in sorted(set(ops), key=order.__getitem__)]
        if not members:
            raise RewriteError(f"fusing {name}: no ops to fuse")
        first = members[0]
        for what in ("region", "phase"):
            if len({getattr(op, what) for op in members}) > 1:
                raise RewriteError(f"fusing {name}: ops {[op.name for op in members]} are in "
                                   f"different {what}s")
        if not all(rules.same(op.count, first.count) for op in members):
            raise RewriteError(f"fusing {name}: ops {[op.name for op in members]} run "
                               f"different numbers of times")
        names = {op.name for op in members}
        if not is_convex(graph, names):
            raise RewriteError(f"fusing {name}: a path leaves {sorted(names)} and re-enters "
                               f"them; one kernel would make a cycle")
        if graph.has_op(name) and name not in names:
            raise RewriteError(f"fusing {name}: the graph has an op of that name already")
        made = [n for op in members for n in op.outputs]
        reads = dict.fromkeys(n for op in members for n in op.inputs if n not in made)
        gone = names | set(dropping)
        writes = [n for n in made if not graph.consumers(n)
                  or any(c.name not in gone for c in graph.consumers(n))]
        if kind == "fused":
            inner = tuple(graph.tensor(n) for n in made if n not in writes)
            params = {**dict(params), "body": tuple(members), "inner": inner,
                      "outputs": tuple(writes)}
        fused = Op(name, kind, category or first.category, list(reads), writes,
                   count=first.count, phase=first.phase, params=params, forward=forward,
                   region=first.region)
        return cls(remove_ops=[op.name for op in members] + sorted(set(dropping) - names),
                   remove_tensors=[n for n in made if n not in writes], add_ops=[fused])


# --- the driver -------------------------------------------------------------------------------

def _intact(graph: Graph, original: Graph, match: Match) -> bool:
    """Whether every op and tensor `match` binds in `original` is still in `graph`, unchanged
    (an earlier replacement did not take it)."""
    return (all(graph.has_op(g) and graph.op(g) is original.op(g) for g in match.graph_ops)
            and all(graph.has_tensor(g) for _, g in match.tensors))


def _closed(graph: Graph, plan: Replacement) -> bool:
    """No op that stays reads a tensor that goes."""
    gone = set(plan.remove_ops)
    return all(op.name in gone for t in plan.remove_tensors for op in graph.consumers(t))


def _apply(graph: Graph, plan: Replacement) -> None:
    for name in plan.remove_ops:
        graph.remove_op(name)
    for name in plan.remove_tensors:
        graph.remove_tensor(name)
    for t in plan.add_tensors:
        graph.add_tensor(t)
    for op in plan.add_ops:
        graph.add_op(op)


def rewrite(graph: Graph, pattern: Graph, replace: Replace, *,
            where: Predicate | Sequence[Predicate] = ()
            ) -> tuple[Graph, list[tuple[Match, Replacement]]]:
    """A new graph with every match of `find(pattern, graph, where)` replaced by what
    `replace(graph, match)` returns (None: leave it), the earlier of two overlapping matches
    winning, and each match applied with what replaced it."""
    out = graph.copy()
    applied = []
    for match in find(pattern, graph, where):
        if not _intact(out, graph, match):
            continue  # overlapped an earlier match
        if applied and not is_convex(out, match.graph_ops):
            continue  # an earlier replacement closed a path around it
        plan = replace(out, match)
        if plan is None or not _closed(out, plan):
            continue
        _apply(out, plan)
        applied.append((match, plan))
    return out, applied


@attrs.frozen
class Rewrite:
    """One (pattern, replacement) pair with its predicates, for `fixpoint`."""

    pattern: Graph
    replace: Replace
    where: tuple[Predicate, ...] = attrs.field(default=(), converter=_predicates)


def fixpoint(graph: Graph, rewrites: Sequence[Rewrite], *, max_rounds: int = 100
             ) -> tuple[Graph, list[tuple[Match, Replacement]]]:
    """Apply `rewrites`, in order, round after round until a round applies none; the graph
    and everything applied. Raises RewriteError after `max_rounds` rounds that all changed
    the graph (a replacement that recreates its own pattern never stops)."""
    applied: list[tuple[Match, Replacement]] = []
    for _ in range(max_rounds):
        changed = []
        for r in rewrites:
            graph, done = rewrite(graph, r.pattern, r.replace, where=r.where)
            changed += done
        if not changed:
            return graph, applied
        applied += changed
    last = sorted({op.name for _, plan in changed for op in plan.add_ops})
    raise RewriteError(
        f"rewriting {graph.name} reached no fixed point in {max_rounds} rounds; the last round "
        f"still made {', '.join(last[:5]) or 'changes'}: a replacement that matches its own "
        f"pattern again never stops (or give a larger max_rounds)")


__all__ = ["Match", "Replacement", "Rewrite", "RewriteError", "find", "fixpoint",
           "fused_flops", "is_convex", "matches", "one_region", "rewrite"]
