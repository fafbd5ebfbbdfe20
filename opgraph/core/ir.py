"""The IR: tensors, ops and the graph that holds them.

A graph is a networkx DiGraph whose nodes are tensors and ops, joined by dataflow edges
(tensor -> op for each input, op -> tensor for each output). Payloads are frozen attrs records;
passes copy the graph and replace records with `attrs.evolve`, never edit one in place.

A stack of identical layers is held once: its ops and tensors carry a multiplicity, `count`
(the symbolic layer count `L`), so the graph does not grow with depth. The stack itself is a
`Region` the graph holds (its trip count, its parent for nested repeats, and the tensors one
iteration hands the next), and each of its ops and tensors names it in `region`, so passes and
printers read the structure instead of recovering it from names. A stack that is not uniform is
several regions, each with its own count.

No op stores a cost: its FLOPs come from its kind's FLOP rule (`opgraph.core.rules`), its HBM bytes
from the tensors it reads and writes, both when the step is evaluated (`opgraph.cost.costmodel`,
which also applies the plate's convention to backward kernels through their `forward` link).
"""

from __future__ import annotations

import enum
import functools
import heapq
from collections.abc import Iterable, Iterator

import attrs
import networkx as nx
import sympy


@attrs.frozen
class DType:
    name: str
    itemsize: int  # bytes per element


BF16 = DType("bf16", 2)
FP16 = DType("fp16", 2)
FP32 = DType("fp32", 4)
FP8 = DType("fp8", 1)
INT32 = DType("int32", 4)
INT64 = DType("int64", 8)
DTYPES = {dt.name: dt for dt in (BF16, FP16, FP32, FP8, INT32, INT64)}


class Role(enum.Enum):
    INPUT = "input"  # data fed to the step: token ids, targets
    ACTIVATION = "activation"
    WEIGHT = "weight"
    GRADIENT = "gradient"
    OPTIMIZER_STATE = "optimizer_state"


class Phase(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    RECOMPUTE = "recompute"  # a forward op run again in the backward (`passes.recompute`)


def _expr(value) -> sympy.Expr:
    return sympy.sympify(value) if not isinstance(value, sympy.Basic) else value


def _shape(dims: Iterable) -> tuple[sympy.Expr, ...]:
    if type(dims) is tuple and all(isinstance(d, sympy.Basic) for d in dims):
        return dims  # already one (a record copied with `attrs.evolve`, most of a pass's)
    return tuple(_expr(d) for d in dims)


class _Params(tuple):
    """An op's parameters as `_params` makes them: (str, value) pairs in key order. A tuple in
    every other way (equal to, hashed and printed as one)."""

    __slots__ = ()


def _params(value) -> tuple[tuple[str, object], ...]:
    if type(value) is _Params:
        return value  # already one (a record copied with `attrs.evolve`)
    items = value.items() if isinstance(value, dict) else value
    return _Params(sorted((str(k), v) for k, v in items))


@attrs.frozen
class Tensor:
    """A value that lives in HBM: `Tensor("x", (B, S, D), BF16, Role.ACTIVATION)`."""

    name: str
    shape: tuple[sympy.Expr, ...] = attrs.field(converter=_shape)
    dtype: DType = BF16
    role: Role = Role.ACTIVATION
    count: sympy.Expr = attrs.field(default=1, converter=_expr)  # instances, e.g. one per layer
    grad_of: str | None = None  # for a gradient: the tensor it is the gradient of
    region: str | None = None  # the innermost region (repeated block) it belongs to

    @property
    def numel(self) -> sympy.Expr:
        return sympy.Mul(*self.shape)

    @property
    def nbytes(self) -> sympy.Expr:
        """Bytes of one instance."""
        return _nbytes(self.shape, self.dtype.itemsize)


@functools.lru_cache(maxsize=65536)
def _nbytes(shape: tuple, itemsize: int) -> sympy.Expr:
    """A shape's bytes, formed once per shape (tensors of one shape recur across a step's
    passes and a search's thousands of compiled graphs)."""
    return sympy.Mul(*shape) * itemsize


@attrs.frozen
class Op:
    """One kernel: `Op("q_proj", "matmul", "matmul", ("h", "w_q"), ("q",))`.

    `count` says how many instances the step runs; `params` are the kind's parameters (what
    its shape and FLOP rules read).
    """

    name: str
    kind: str
    category: str
    inputs: tuple[str, ...] = attrs.field(converter=tuple)
    outputs: tuple[str, ...] = attrs.field(converter=tuple)
    count: sympy.Expr = attrs.field(default=1, converter=_expr)
    phase: Phase = Phase.FORWARD
    params: tuple[tuple[str, object], ...] = attrs.field(default=(), converter=_params)
    forward: str | None = None  # for a backward op: the forward op it differentiates
    region: str | None = None  # the innermost region (repeated block) it runs in

    def param(self, key: str, default=None):
        # a few pairs: a scan (from the end, as a dict of them keeps the last of a key), not a
        # dict made each call
        for name, value in reversed(self.params):
            if name == key:
                return value
        return default


def _carries(value) -> tuple[tuple[str, str], ...]:
    return tuple((str(a), str(b)) for a, b in value)


@attrs.frozen
class Region:
    """A repeated block: `Region("layers", L, carries=[("embed", "layers.mlp_residual")])`.

    Its ops and tensors run `count` times per run of its `parent` region (trip counts multiply
    down a nest). `carries` are its loop-carried tensors, as JAX's scan counts `num_carry` and
    XLA's while holds a carried tuple: pairs (the tensor entering iteration 0, the tensor an
    iteration hands to the next). The graph holds one iteration: its ops read the entering
    tensor, which in iteration i > 0 stands for iteration i-1's handed tensor; the last
    iteration's handed tensor is what ops after the region read.
    """

    name: str
    count: sympy.Expr = attrs.field(converter=_expr)
    parent: str | None = None
    carries: tuple[tuple[str, str], ...] = attrs.field(default=(), converter=_carries)


def _tnode(name: str) -> tuple[str, str]:
    return ("tensor", name)


def _onode(name: str) -> tuple[str, str]:
    return ("op", name)


class Graph:
    """Ops and tensors joined by dataflow. `dims` holds the configuration's default values.

    Build one with `opgraph.GraphBuilder`; passes return new graphs and leave their input alone.
    """

    def __init__(self, name: str, dims: dict[sympy.Symbol, int] | None = None, *,
                 seq_len: int | None = None, max_seq_len: int | None = None):
        self.name = name
        self.dims: dict[sympy.Symbol, int] = dict(dims or {})
        self.seq_len = seq_len  # the default sequence length of a profile; None: unknown
        self.max_seq_len = max_seq_len  # the longest it can take (a learned position table)
        self.nx = nx.DiGraph()
        self._seq = 0
        self._order: list[Op] | None = None
        self._tensors: list[Tensor] | None = None  # `tensors()`, until a tensor changes
        self._regions: dict[str, Region] = {}  # by name, in the order they were made

    # --- construction -------------------------------------------------------------------------
    def add_tensor(self, tensor: Tensor, *, before: str | None = None) -> Tensor:
        """Add `tensor`; `before` as `add_op`'s, for the tensor an op placed so writes."""
        node = _tnode(tensor.name)
        if node in self.nx:
            raise ValueError(f"tensor {tensor.name!r} is already in graph {self.name!r}")
        self.nx.add_node(node, payload=tensor, seq=self._place(before))
        self._tensors = None
        return tensor

    def add_op(self, op: Op, *, before: str | None = None) -> Op:
        """Add `op`, last in the order among ops ready together; `before` names an op that
        reads what this one writes, whose place in the order it takes (it runs just before
        that op, not after every op added earlier: a pass inserting a producer keeps the
        order of the ops around it)."""
        node = _onode(op.name)
        if node in self.nx:
            raise ValueError(f"op {op.name!r} is already in graph {self.name!r}")
        for name in (*op.inputs, *op.outputs):
            if _tnode(name) not in self.nx:
                raise ValueError(f"op {op.name!r} uses unknown tensor {name!r}")
        self.nx.add_node(node, payload=op, seq=self._place(before))
        for name in op.inputs:
            self.nx.add_edge(_tnode(name), node)
        for name in op.outputs:
            self.nx.add_edge(node, _tnode(name))
        self._order = None
        return op

    def _place(self, before: str | None) -> int:
        """A new node's key in the order (`_sorted_order`): the next, or `before`'s own (the
        node becomes ready before `before` does, so ties between them never arise)."""
        if before is not None:
            return self.nx.nodes[_onode(before)]["seq"]
        self._seq += 1
        return self._seq

    def replace_op(self, op: Op) -> Op:
        """Put `op` in place of the op of the same name (new inputs, say), keeping its place
        among ties in the execution order."""
        seq = self.nx.nodes[_onode(op.name)]["seq"]
        self.remove_op(op.name)
        self.add_op(op)
        self.nx.nodes[_onode(op.name)]["seq"] = seq
        return op

    def reroute(self, readers, old: str, new: str) -> None:
        """Each of `readers` (ops, or their names) reads tensor `new` wherever it read `old`,
        the op as this graph holds it now (an op reading two rerouted tensors keeps both)."""
        for reader in readers:
            now = self.op(getattr(reader, "name", reader))
            self.replace_op(attrs.evolve(now, inputs=tuple(new if n == old else n
                                                           for n in now.inputs)))

    def replace_tensor(self, tensor: Tensor) -> Tensor:
        """Put `tensor` in place of the tensor of the same name (a new shape, say), keeping
        its edges and its place in the order."""
        self.nx.nodes[_tnode(tensor.name)]["payload"] = tensor
        self._tensors = None
        return tensor

    def remove_op(self, name: str) -> None:
        self.nx.remove_node(_onode(name))
        self._order = None

    def remove_tensor(self, name: str) -> None:
        self.nx.remove_node(_tnode(name))
        self._tensors = None

    def copy(self, name: str | None = None) -> Graph:
        new = Graph(name or self.name, self.dims, seq_len=self.seq_len,
                    max_seq_len=self.max_seq_len)
        new.nx = self.nx.copy()
        new._seq = self._seq
        new._order = self._order  # the same ops in the same order until either one changes
        new._tensors = self._tensors
        new._regions = dict(self._regions)
        return new

    # --- queries ------------------------------------------------------------------------------
    def tensor(self, name: str) -> Tensor:
        try:
            return self.nx.nodes[_tnode(name)]["payload"]
        except KeyError:
            raise KeyError(f"no tensor {name!r} in graph {self.name!r}") from None

    def op(self, name: str) -> Op:
        try:
            return self.nx.nodes[_onode(name)]["payload"]
        except KeyError:
            raise KeyError(f"no op {name!r} in graph {self.name!r}") from None

    def has_op(self, name: str) -> bool:
        return _onode(name) in self.nx

    def has_tensor(self, name: str) -> bool:
        return _tnode(name) in self.nx

    def tensors(self) -> list[Tensor]:
        """All tensors, in the order they were added."""
        if self._tensors is None:
            nodes = [(d["seq"], d["payload"]) for n, d in self.nx.nodes(data=True)
                     if n[0] == "tensor"]
            self._tensors = [t for _, t in sorted(nodes, key=lambda pair: pair[0])]
        return list(self._tensors)

    def ops(self) -> list[Op]:
        """All ops in a deterministic topological order (ties broken by insertion order)."""
        if self._order is None:
            self._order = self._insertion_order() or self._sorted_order()
        return list(self._order)

    def _sorted_order(self) -> list[Op]:
        """The ops in the lexicographic topological order of the nodes by `seq` (ties: the
        order the nodes were added), as networkx's `lexicographical_topological_sort` gives it;
        Kahn's algorithm over a heap, written out because passes ask it of every graph they
        make."""
        nodes, pred, succ = self.nx.nodes, self.nx.pred, self.nx.succ
        waiting = {}
        ready = []
        for i, (n, d) in enumerate(nodes(data=True)):
            waiting[n] = [len(pred[n]), (d["seq"], i, n)]
            if not waiting[n][0]:
                ready.append(waiting[n][1])
        heapq.heapify(ready)
        out = []
        while ready:
            _, _, n = heapq.heappop(ready)
            if n[0] == "op":
                out.append(nodes[n]["payload"])
            for m in succ[n]:
                entry = waiting[m]
                entry[0] -= 1
                if not entry[0]:
                    heapq.heappush(ready, entry[1])
            del waiting[n]
        if waiting:
            raise nx.NetworkXUnfeasible(f"graph {self.name!r} contains a cycle")
        return out

    def _insertion_order(self) -> list[Op] | None:
        """The ops by insertion, where every op comes after the producers of its inputs (as
        passes usually build graphs): then it is the lexicographic topological order too (a
        tensor is added before its producer, so the smallest unplaced op is always ready);
        None otherwise."""
        nodes = self.nx.nodes
        ops = sorted(((d["seq"], n) for n, d in nodes(data=True) if n[0] == "op"))
        for seq, n in ops:
            for t in self.nx.predecessors(n):
                for producer in self.nx.predecessors(t):
                    if nodes[producer]["seq"] >= seq:  # equal: placed `before` it
                        return None
        return [nodes[n]["payload"] for _, n in ops]

    def __iter__(self) -> Iterator[Op]:
        return iter(self.ops())

    def producer(self, tensor: str) -> Op | None:
        preds = list(self.nx.predecessors(_tnode(tensor)))
        return self.nx.nodes[preds[0]]["payload"] if preds else None

    def consumers(self, tensor: str) -> list[Op]:
        seq = self.nx.nodes
        succ = sorted(self.nx.successors(_tnode(tensor)), key=lambda n: seq[n]["seq"])
        return [seq[n]["payload"] for n in succ]

    def op_bytes(self, op: Op) -> sympy.Expr:
        """HBM bytes of one instance of `op`: every tensor it reads and writes, once each (the
        cost model's conventions may charge a backward kernel otherwise)."""
        names = dict.fromkeys((*op.inputs, *op.outputs))  # a tensor read twice crosses once
        return sympy.Add(*(self.tensor(n).nbytes for n in names))

    def weights(self) -> list[Tensor]:
        return [t for t in self.tensors() if t.role is Role.WEIGHT]

    def parameters(self) -> sympy.Expr:
        """Total parameter count: every weight's elements times its multiplicity."""
        return sympy.Add(*(t.numel * t.count for t in self.weights()))

    def __str__(self) -> str:
        return format_graph(self)

    # --- regions ------------------------------------------------------------------------------
    def add_region(self, region: Region) -> Region:
        if region.name in self._regions:
            raise ValueError(f"region {region.name!r} is already in graph {self.name!r}")
        if region.parent is not None and region.parent not in self._regions:
            raise ValueError(f"region {region.name!r} names unknown parent {region.parent!r}")
        self._regions[region.name] = region
        return region

    def update_region(self, region: Region) -> Region:
        """Replace the region of the same name (e.g. with its carries set)."""
        self.region(region.name)
        self._regions[region.name] = region
        return region

    def region(self, name: str) -> Region:
        try:
            return self._regions[name]
        except KeyError:
            raise KeyError(f"no region {name!r} in graph {self.name!r}") from None

    def regions(self) -> list[Region]:
        """All regions, in the order they were made (a parent before its children)."""
        return list(self._regions.values())

    def region_chain(self, name: str | None) -> tuple[Region, ...]:
        """The regions around region `name`, outermost first, ending with it; () for None."""
        chain = []
        while name is not None:
            region = self.region(name)
            chain.append(region)
            name = region.parent
        return tuple(reversed(chain))

    def trip_count(self, name: str | None) -> sympy.Expr:
        """How many times the body of region `name` runs in one step: its count times its
        parents'. 1 for None (outside every region)."""
        return sympy.Mul(*(r.count for r in self.region_chain(name)))

    def within(self, region: str | None, name: str) -> bool:
        """Whether something tagged `region` is inside region `name` (or a region nested in
        it): `graph.within(op.region, "layers")`."""
        return any(r.name == name for r in self.region_chain(region))


def with_params(graph: Graph, marks: dict[str, dict]) -> Graph:
    """`graph` with each op `marks` names given those parameters beside its own: what a pass
    that only marks ops returns (`cached`, `eager`, `launches`, `efficiency`, read by the cost
    model and the schedule); `graph` itself where `marks` is empty."""
    if not marks:
        return graph
    out = graph.copy()
    for name, params in marks.items():
        op = graph.op(name)
        out.replace_op(attrs.evolve(op, params={**dict(op.params), **params}))
    return out


def format_op(graph: Graph, op: Op, figures=None) -> str:
    """`name = kind(in, ...) : dtype[shape]  xcount  flops=...  bytes=...`, one line; the
    figures are one instance's under the default cost model (`figures`: its `Cost` for `op`,
    when the caller has them already)."""
    if figures is None:
        from ..cost.costmodel import DEFAULT

        figures = DEFAULT.op_cost(graph, op)
    outs = ", ".join(f"{t.dtype.name}[{', '.join(map(str, t.shape))}]"
                     for t in map(graph.tensor, op.outputs))
    count = "" if op.count == 1 else f"  x{op.count}"
    return (f"{op.name} = {op.kind}({', '.join(op.inputs)}) : {outs}{count}"
            f"  flops={figures.flops}  bytes={figures.bytes}")


def _equal(a: sympy.Expr, b: sympy.Expr) -> bool:
    return a == b or sympy.expand(a - b) == 0


def region_problems(graph: Graph) -> list[str]:
    """What is wrong with `graph`'s regions, for a verifier: an op or tensor naming an unknown
    region or running other than its region's trip count; a carry whose entering tensor is
    not outside its region or whose handed tensor is not inside it. [] when all is well."""
    problems = []
    items = [("op", op) for op in graph.ops()] + [("tensor", t) for t in graph.tensors()]
    for what, item in items:
        if item.region is not None and item.region not in graph._regions:
            problems.append(f"{what} {item.name} is in unknown region {item.region!r}")
        elif not _equal(item.count, graph.trip_count(item.region)):
            problems.append(f"{what} {item.name} runs {item.count} times, its region "
                            f"{item.region} {graph.trip_count(item.region)}")
    for region in graph.regions():
        for entering, handed in region.carries:
            if not graph.has_tensor(entering) or graph.within(graph.tensor(entering).region,
                                                              region.name):
                problems.append(f"region {region.name} carries {entering}, which is not a "
                                f"tensor made before it")
            if not graph.has_tensor(handed) or not graph.within(graph.tensor(handed).region,
                                                                region.name):
                problems.append(f"region {region.name} hands on {handed}, which is not a "
                                f"tensor made inside it")
    return problems


def format_region(region: Region) -> str:
    """`region layers x L carries embed -> layers.mlp_residual`, one line."""
    parent = "" if region.parent is None else f" in {region.parent}"
    carries = ", ".join(f"{a} -> {b}" for a, b in region.carries)
    return (f"region {region.name} x {region.count}{parent}"
            f"{f' carries {carries}' if carries else ''}")


def format_graph(graph: Graph, *, regions: bool = True) -> str:
    """The textual form: one line per region (`format_region`: its trip count and what one
    iteration hands the next), the inputs and weights, then one line per op in execution
    order."""
    lines = [f"graph {graph.name}"]
    if regions:
        lines += [f"  {format_region(r)}" for r in graph.regions()]
    for t in graph.tensors():
        if graph.producer(t.name) is None:
            count = "" if t.count == 1 else f"  x{t.count}"
            shape = ", ".join(map(str, t.shape))
            lines.append(f"  {t.role.value} {t.name} : {t.dtype.name}[{shape}]{count}")
    from ..cost.costmodel import DEFAULT

    costs = DEFAULT.op_costs(graph)
    lines += [f"  {format_op(graph, op, costs[op.name])}" for op in graph.ops()]
    return "\n".join(lines)


__all__ = [
    "BF16",
    "DTYPES",
    "FP8",
    "FP16",
    "FP32",
    "INT32",
    "INT64",
    "DType",
    "Graph",
    "Op",
    "Phase",
    "Region",
    "Role",
    "Tensor",
    "format_graph",
    "format_op",
    "format_region",
    "region_problems",
    "with_params",
]
