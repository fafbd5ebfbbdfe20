"""The lowered step: a compiled graph as the one typed record every interpreter reads.

    low = lower(step, CalibratedCostModel())
    low.ops[0]                     # LoweredOp(name=..., count=L, cost=Cost(flops=..., ...))
    low.mfu_parameters, low.tokens  # N and B x S of the MFU convention, as formulas
    low.at({B: 8, S: 8192, ...})   # the same ops as numbers (`OpValues`)

`lower` asks the cost model once for every op's cost (`CostModel.op_costs`: one instance's
FLOPs, HBM bytes, compute dtype, a collective's message and its share of a call, a matrix
multiply's grid, the kernels it launches, the efficiency its arithmetic runs at) and keeps each
with the op's count, kind, category, phase and region, and a collective's group. All of them are
sympy expressions over the graph's free symbols: its dimensions and, for a sharded step, the
layout's degrees. The step's MFU parameters, parameters and tokens are lowered beside them.

The interpreters differ only in their number system:
- `opgraph.passes.evaluate` substitutes one point (`Lowered.at`: Python floats) and times each op
  (`CostModel.op_time`);
- `opgraph.cost.formula` keeps the expressions (sympy; `calibrated_time`, `sympy.Max`);
- `opgraph.analysis.sweep` compiles them into one numpy function (`sympy.lambdify`);
- `opgraph.parallel.distributed` takes each stage's numbers (`Lowered.at`) to its schedule, and
  `opgraph.parallel.search` keeps a stage's expressions over the degrees for its arrays.

Liveness (what is held when) is the graph's, read by `opgraph.cost.memory` from `graph`.
"""

from __future__ import annotations

import attrs
import sympy

from ..core.errors import OpgraphError
from ..core.ir import Graph, Op, Phase
from ..core.parameters import active_parameters, is_routed, mfu_parameters
from ..core.rules import COLLECTIVE_KINDS
from ..core.symbols import B, S
from .costmodel import DEFAULT, Cost, CostModel


@attrs.frozen
class LoweredOp:
    """One op of the lowered step: `count` instances, each costing `cost` (`costmodel.Cost`)."""

    name: str
    kind: str
    category: str
    phase: Phase
    region: str | None  # the innermost region it runs in
    count: sympy.Expr
    cost: Cost
    group: str | None = None  # a collective's group ("tp", "dp", ...); None for compute

    @property
    def flops(self) -> sympy.Expr:
        """Over its count."""
        return self.count * self.cost.flops

    @property
    def bytes(self) -> sympy.Expr:
        """Over its count."""
        return self.count * self.cost.bytes


@attrs.frozen
class OpValues:
    """A `LoweredOp` at a point: its count and, over the count, its FLOPs and bytes; per
    instance, a collective's message and share of a call, a matrix multiply's grid and the
    kernels it launches."""

    name: str
    kind: str
    category: str
    phase: Phase
    count: int
    flops: float
    bytes: float
    compute: str | None
    efficiency: str
    grid: tuple[float, ...]
    launches: float
    group: str | None
    message: float
    calls: float


@attrs.frozen
class Lowered:
    """A step lowered under one cost model (`lower`): its ops in the graph's order and the
    figures the utilisation conventions read, all as formulas."""

    graph: Graph
    cost: CostModel
    ops: tuple[LoweredOp, ...]
    tokens: sympy.Expr = B * S
    _by_name: dict = attrs.field(init=False, eq=False, repr=False)
    _figures: dict = attrs.field(init=False, eq=False, repr=False, factory=dict)

    def __attrs_post_init__(self):
        object.__setattr__(self, "_by_name", {o.name: o for o in self.ops})

    def _figure(self, name: str, rule):
        if name not in self._figures:  # each read of the graph once, where it is asked for
            self._figures[name] = rule(self.graph)
        return self._figures[name]

    @property
    def parameters(self) -> sympy.Expr:
        return self._figure("parameters", Graph.parameters)

    @property
    def mfu_parameters(self) -> sympy.Expr:
        """N of the MFU convention (`core.parameters.mfu_parameters`)."""
        return self._figure("mfu_parameters", mfu_parameters)

    @property
    def active_parameters(self) -> sympy.Expr | None:
        """The parameters a token uses; None for a dense model."""
        return self._figure("active_parameters",
                            lambda g: active_parameters(g) if is_routed(g) else None)

    @property
    def name(self) -> str:
        return self.graph.name

    def has_op(self, name: str) -> bool:
        return name in self._by_name

    def op(self, name: str) -> LoweredOp:
        if name not in self._by_name:
            raise OpgraphError(f"no op {name!r} in {self.name}'s step")
        return self._by_name[name]

    def at(self, subs: dict) -> tuple[OpValues, ...]:
        """Every op as numbers at `subs` (symbol -> value, e.g. `evaluate.resolve`'s): an
        error naming the op and the symbols that have no value where one is missing."""
        return tuple(_values(o, subs) for o in self.ops)


def number(expr, subs: dict, what: str):
    """`expr` at `subs` as a sympy number, or an OpgraphError naming `what` and the symbols
    that have no value."""
    value = sympy.sympify(expr).xreplace(subs)
    if not value.is_number:
        missing = ", ".join(sorted(map(str, value.free_symbols)))
        raise OpgraphError(f"{what} depends on {missing}, which has no value; give it one")
    return value


def _values(o: LoweredOp, subs: dict) -> OpValues:
    c = o.cost
    collective = o.group is not None
    return OpValues(
        o.name, o.kind, o.category, o.phase,
        int(number(o.count, subs, f"op {o.name}'s count")),
        float(number(o.flops, subs, f"op {o.name}'s FLOPs")),
        float(number(o.bytes, subs, f"op {o.name}'s bytes")),
        c.compute, c.efficiency,
        tuple(float(number(g, subs, f"op {o.name}'s matrix shape")) for g in c.grid),
        float(number(c.launches, subs, f"op {o.name}'s kernel launches")),
        o.group,
        float(number(c.message, subs, f"op {o.name}'s message")) if collective else 0.0,
        float(number(c.calls, subs, f"op {o.name}'s share of a call")) if collective else 1.0)


def lower(graph: Graph, cost: CostModel = DEFAULT, *, like: Lowered | None = None) -> Lowered:
    """`graph` lowered under `cost` (see the module): every op's cost asked for once. `like`:
    a step lowered under `cost` that `graph` is cut from (a pipeline stage of it,
    `passes.split_stages`), whose ops' per-instance costs `graph`'s ops of the same name share;
    only the others are costed."""
    if like is None:
        costs = cost.op_costs(graph)
    else:
        costs = {op.name: (like.op(op.name).cost if like.has_op(op.name)
                           else cost.op_cost(graph, op)) for op in graph.ops()}
    return Lowered(graph, cost, tuple(_lowered(op, costs[op.name]) for op in graph.ops()))


def lower_op(graph: Graph, op: Op, cost: CostModel = DEFAULT) -> LoweredOp:
    """One op of `graph` lowered alone (`lower` for many: it indexes the graph once)."""
    return _lowered(op, cost.op_cost(graph, op))


def _lowered(op: Op, c: Cost) -> LoweredOp:
    return LoweredOp(op.name, op.kind, op.category, op.phase, op.region,
                     sympy.sympify(op.count), c,
                     op.param("group") if op.kind in COLLECTIVE_KINDS else None)
