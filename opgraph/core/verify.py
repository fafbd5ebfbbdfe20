"""The graph verifier, run by `compile_step` and after every pass in the tests (like torch.fx's
`graph.lint()`).

A graph is well formed when it is acyclic; every tensor is produced at most once; each op's
edges are exactly its input and output tensors; every op's output shapes, whatever its phase
(forward, backward, optimizer, fused), are what its kind's shape rule infers from its inputs (so
a matmul's inner dimensions agree, dX = dY W^T included); a backward op's `forward` link names an
op of the graph; every gradient has its primal's shape (or, on a data-parallel rank, its shard);
and every dimension bound in `graph.dims` is a whole number from 1 to `limits.MAX_DIM`.

`check_model` asks more of a forward graph a user hands in (`--model file.py:build`): every
shape and trip count resolved by its dimensions to a positive whole number, and a loss.
"""

from __future__ import annotations

import numbers

import networkx as nx
import sympy

from . import rules
from .errors import OpgraphError
from .ir import Graph, Phase, Role, region_problems
from .limits import MAX_DIM, check_whole
from .symbols import dp, edp

# A data-parallel rank's gradient may be its 1/dp shard (`passes.replicate`, ZeRO-2/3).
_WHOLE = {dp: 1, edp: 1}


class VerifyError(ValueError):
    """A malformed graph; the message lists each problem."""


def verify(graph: Graph) -> Graph:
    """Check `graph`, raise VerifyError naming every problem, return it unchanged if fine."""
    problems = dim_problems(graph)
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
        problems += _cost_marks(op)
    problems += region_problems(graph)
    if problems:
        raise VerifyError(f"graph {graph.name}: " + "; ".join(problems))
    return graph


def _cost_marks(op) -> list[str]:
    """What is wrong with the parameters a pass leaves for the cost model: `launches`, the
    kernels one instance issues, a whole number from 1 or an expression of the dimensions;
    `efficiency`, one of the efficiencies an op may run at (`costmodel.RATES`)."""
    from ..cost.costmodel import RATES

    problems = []
    launches = op.param("launches")
    if launches is not None and (
            isinstance(launches, bool)
            or not isinstance(launches, int | sympy.Expr)
            or (isinstance(launches, int) and launches < 1)
            or (isinstance(launches, sympy.Expr) and launches.is_number and launches < 1)):
        problems.append(f"op {op.name}: launches {launches!r} is not a whole number from 1 or "
                        "an expression of the dimensions")
    efficiency = op.param("efficiency")
    if efficiency is not None and efficiency not in RATES:
        problems.append(f"op {op.name}: efficiency {efficiency!r} is not one of "
                        f"{', '.join(RATES)}")
    return problems


def dim_problems(graph: Graph) -> list[str]:
    """What is wrong with the values `graph.dims` binds: each must be a whole number from 1 to
    `MAX_DIM` (a float, a string, NaN, 0, a negative or a huge value is refused)."""
    problems = []
    for sym, value in graph.dims.items():
        if isinstance(value, (sympy.Integer, numbers.Integral)) and not isinstance(value, bool):
            value = int(value)  # a sympy or numpy integer is as good as an int
        try:
            check_whole(value, f"dimension {sym} =", MAX_DIM)
        except OpgraphError as e:
            problems.append(str(e))
    return problems


def check_dims(graph: Graph) -> Graph:
    """`graph` unchanged if its dimensions are in range (`dim_problems`), else VerifyError;
    cheap, so the pipeline runs it after every pass (a pass may bind new dimensions)."""
    problems = dim_problems(graph)
    if problems:
        raise VerifyError(f"graph {graph.name}: " + "; ".join(problems))
    return graph


# Dimensions a profile binds from the command line when the graph leaves them free: the
# batch from tokens per step, the sequence length from --seq-len (`passes.evaluate.resolve`).
_FROM_THE_RUN = ("B", "S")


def check_model(graph: Graph) -> Graph:
    """A forward graph as a model must be to be profiled: well formed (`verify`), every
    tensor's shape and every trip count a positive whole number once its dimensions are bound,
    and a loss (a scalar no op reads, computed from the weights) for the backward to start from.

        check_model(preset("llama3-8b"))   # the graph, or VerifyError naming each problem
    """
    verify(graph)
    problems = []
    for what, value in (("seq_len", graph.seq_len), ("max_seq_len", graph.max_seq_len)):
        if value is not None:
            try:
                check_whole(value, f"the graph's {what}", MAX_DIM)
            except OpgraphError as e:
                problems.append(str(e))
    bound = {sym: sympy.Integer(int(v)) for sym, v in graph.dims.items()}
    names = {getattr(sym, "name", str(sym)) for sym in graph.dims} | set(_FROM_THE_RUN)
    items = [(f"tensor {t.name}", t.shape) for t in graph.tensors()]
    items += [(f"region {r.name}'s trip count", (r.count,)) for r in graph.regions()]
    items += [(f"op {op.name}'s count", (op.count,)) for op in graph.ops()]
    for what, exprs in items:
        for expr in exprs:
            expr = sympy.sympify(expr)
            free = sorted(s.name for s in expr.free_symbols if s.name not in names)
            if free:
                problems.append(f"{what}: {', '.join(free)} has no value in the graph's "
                                "dimensions")
                break
            value = expr.xreplace(bound)
            if not value.free_symbols and not (value.is_Integer and value > 0):
                problems.append(f"{what}: {expr} is {value}, not a positive whole number")
                break
        if len(problems) >= 3:  # enough to act on
            break
    if not any(_is_loss(graph, t) for t in graph.tensors()):
        problems.append("no loss: end the model with a scalar loss no op reads, e.g. "
                        "g.output_head(x, table, targets) or g.cross_entropy(logits, targets)")
    if problems:
        raise VerifyError(f"graph {graph.name}: " + "; ".join(problems))
    return graph


def _is_loss(graph: Graph, tensor) -> bool:
    """A scalar that an op writes, no op reads, and some weight flows into."""
    if tensor.shape or graph.producer(tensor.name) is None or graph.consumers(tensor.name):
        return False
    upstream = nx.ancestors(graph.nx, ("tensor", tensor.name))
    return any(("tensor", w.name) in upstream for w in graph.weights())


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
