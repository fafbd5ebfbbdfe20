"""Op kinds as a public extension point: define a kind in one call, look any kind up, and render
the reference table of the built-in ones.

    from opgraph.core.kinds import define_kind, same_shape
    from opgraph.core.rules import per_element, per_input

    squared_relu = define_kind("squared_relu", shape=same_shape, flops=per_element(2),
                               vjp="inputs", backward_flops=per_input(3))
    y = squared_relu.op(g, [x])                 # or g.op("squared_relu", [x], category=...)

Invariant: a kind is its rows in the per-kind tables, nowhere else. `define_kind` writes them
(`rules.SHAPE_RULES`, `rules.FLOP_RULES`, `rules.VIEWS`, `derive_backward.VJP_RULES`,
`costmodel.BACKWARD_COST`, how parallelism splits it, `rules.SHARDING` and `rules.CP_GATHERS`,
and the rows of its backward kernel `<kind>_backward`) and lists the
kind in `rules.FORWARD_KINDS`, so every pass, the verifier, the cost model and everything built
on it (`evaluate`, `formula`, `solve`, `sweep`) treat it as they treat a built-in one. `kind`
reads a kind back from those tables.

The reference table (`kind_table`, in docs/writing-a-model.md) is computed, not written: each
built-in kind has an example (EXAMPLES) whose forward FLOPs its FLOP rule gives and whose backward
FLOPs `derive_backward` and the cost model's "derived" convention give, so it cannot drift from
the rules.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import sympy

from ..cost import costmodel
from ..passes import derive_backward as _backward
from ..passes import precision, recompute
from . import fusion, parameters, rules
from .errors import OpgraphError
from .ir import BF16, INT32, Graph, Op, Phase, Role, Tensor
from .symbols import B, D, E, F, H, H_kv, K, S, V, d_h, dim

SAVES = ("none", "inputs", "inputs+outputs")

same_shape = rules._same_shape  # element-wise: every input has the first one's shape


@attrs.frozen
class Kind:
    """One op kind, as its table rows: `kind("matmul").flops`.

    `shape(inputs, params) -> [output shapes]` (raise `rules.ShapeError` when they do not fit);
    `flops(inputs, outputs, params) -> FLOPs` of one instance; `vjp(ctx, op) -> [backward
    kernels]` (None: no gradient flows through it); `backward` the name of its one-kernel
    backward kind, if it has one; `view(inputs, params) -> bool` whether an op of it moves no
    bytes (None: never); `category` the profile category its ops are filed under by `op`;
    `backward_cost` how the plate's convention charges its backward (`costmodel.scaled`)."""

    name: str
    shape: Callable
    flops: Callable
    vjp: Callable | None = None
    backward: str | None = None
    view: Callable | None = None
    category: str = "elementwise"
    backward_cost: Callable = costmodel.scaled
    grid: Callable | None = None  # a matrix multiply's (GEMMs, M, N) rule (`rules.GEMM_GRIDS`)
    eager: Callable | None = None  # its eager PyTorch kernels' bytes (`rules.EAGER_BYTES`)
    eager_backward: Callable | None = None  # theirs backward (`rules.EAGER_BACKWARD_BYTES`)
    shards: tuple[str, ...] = ()  # its roles when parallelism splits it (`rules.SHARDING`)
    cp_gathers: tuple[int, ...] = ()  # inputs context parallelism gathers (`rules.CP_GATHERS`)
    fusion_class: str | None = None  # what fuses with it (`fusion.DEFINED_CLASSES`)
    kept: bool = False  # selective-op recomputation keeps its output (`recompute.SAVE_KINDS`)
    operands: int | None = None  # leading operands whose dtype sets its peak (`OPERANDS`)
    active_fraction: Callable | None = None  # a routed weight's share a token reads
    fp8_weight_dims: int | None = None  # the FP8 recipe covers it (`precision.FP8_KINDS`)

    def op(self, g, inputs: Sequence, *, name: str | None = None, category: str | None = None,
           **params) -> Tensor:
        """An op of this kind in builder `g`: `squared_relu.op(g, [x])`."""
        return g.op(self.name, inputs, category=category or self.category,
                    name=name or self.name, **params)


_DEFINED: dict[str, Kind] = {}  # kinds made by define_kind, by name
_CATEGORY: dict[str, str] = {}


def _no_vjp(ctx, op) -> list:
    """No gradient flows through this kind."""
    return []


def _always(ins, params) -> bool:
    """A view whatever its inputs (unless `copy=True`)."""
    return not params.get("copy")


def twice_forward(kind: str) -> Callable:
    """The backward FLOP rule of `<kind>_backward` by the plate's ratio: twice the forward
    kind's FLOPs, re-derived from the saved inputs (from the gradients' shapes when nothing is
    saved, as for an element-wise kind)."""
    def _twice_forward(ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
        _, fwd_ins, _ = rules._saved(ins, params)
        fwd_ins = fwd_ins or outs
        shapes = rules.SHAPE_RULES[kind](fwd_ins, params)
        fwd_outs = [Tensor(f"{kind}.out{i}", s) for i, s in enumerate(shapes)]
        return 2 * rules.FLOP_RULES[kind](fwd_ins, fwd_outs, params)
    _twice_forward.__name__ = f"_{kind}_twice_forward"
    return _twice_forward


def define_kind(name: str, *, shape: Callable, flops: Callable,
                vjp: str | Callable | None = "inputs", backward_flops: Callable | None = None,
                backward_shape: Callable | None = None, view: bool | Callable = False,
                backward_view: bool | Callable = False, category: str = "elementwise",
                backward_cost: Callable | None = None, grid: Callable | None = None,
                eager: Callable | None = None, eager_backward: Callable | None = None,
                shards: Sequence[str] = (), cp_gathers: Sequence[int] = (),
                fusion_class: str | None = None, kept: bool = False,
                operands: int | None = None, active_fraction: Callable | None = None,
                fp8_weight_dims: int | None = None, replace: bool = False) -> Kind:
    """Define op kind `name` in every table; returns its `Kind`.

    - `shape`, `flops`: its shape and FLOP rules (`rules.per_element(n)` for n FLOPs per output
      element).
    - `vjp`: its backward. One of SAVES for one kernel `<name>_backward` reading the output
      gradients and the saved forward inputs (and outputs), writing the inputs' gradients; its
      FLOPs are `backward_flops` (default `twice_forward(name)`), its shape rule
      `backward_shape` (default `rules.backward_shape(name)`: the forward rule re-run on the
      saved inputs). Or a VJP rule `(ctx, op) -> [kernels]` of kinds that exist. None: no
      gradient flows through it.
    - `view`: True (or a rule `(inputs, params) -> bool`) when an op of it is a new look at its
      input's memory, costing no bytes (`copy=True` on an op makes it a copy); `backward_view`
      likewise for its backward kernel.
    - `category`: what `Kind.op` files its ops under; `backward_cost`: how the plate's
      convention charges its backward (default `costmodel.scaled`, twice the forward's FLOPs and
      bytes; for a view `costmodel.scaled_flops`, the backward kernel's own bytes).
    - `grid`: for a kind that is a matrix multiply, `(inputs, outputs, params) -> (GEMMs, M,
      N)` of one instance (as `rules.GEMM_GRIDS`' rows), which the calibrated cost model's
      wave quantisation tiles; None: its time has no waves.
    - `eager`: `(inputs, outputs, params) -> bytes` of one op of it run as eager PyTorch's
      kernels (as `rules.EAGER_BYTES`' rows), charged where a framework runs the kind eagerly
      (`frameworks.Traits.eager`); `eager_backward` those of its backward kernels together
      (default: the convention's, twice the forward's). None: one kernel either way.
    - `shards`: how tensor and expert parallelism split it, roles of `rules.SHARD_ROLES`
      ("column", "contracting" for a matrix multiply by a weight; "expert", "combine" for a
      mixture of experts' expert matmul and its combine; "local" for one that runs on the
      shards its inputs hold, as an element-wise kind does); `cp_gathers`: the inputs (keys
      and values, by position) context parallelism gathers along the sequence for an attention
      kind. A kind with no role that reads a weight tensor parallelism splits is an error
      under `--tp`, not a silent replica.
    - `fusion_class`: "pointwise", "reduction" or "matmul" (`fusion.CLASSES`), what the built-in
      fusion policies (`--fuse`) may put in one kernel with it; None: it never fuses.
    - `kept`: torchtitan's per-op recomputation (`selective-op`) keeps its output, as it keeps
      the matmuls' and the attention kernel's, rather than re-running it.
    - `operands`: for a matrix multiply, how many leading inputs are its operands: where all are
      FP8 it runs at the part's FP8 peak (`costmodel.OPERANDS`).
    - `active_fraction`: for a routed kind (a mixture of experts' expert matmul), `(tensor,
      op, weight) -> the share of the weight one token reads`, which the MFU's active
      parameters count (`parameters.ACTIVE_FRACTION`).
    - `fp8_weight_dims`: the FP8 recipe (`--precision fp8`) casts both operands of an op of it
      whose second input is a weight of this many dimensions, and of its backward kernels
      (`passes.precision.FP8_KINDS`; give `operands` too, so that it runs at the FP8 peak).

    Defining a kind that exists raises OpgraphError unless `replace=True`.

        >>> k = define_kind("cube", shape=same_shape, flops=rules.per_element(2),
        ...                 backward_flops=rules.per_input(3))
        >>> k.backward
        'cube_backward'
    """
    if not name or not name.replace("_", "").isalnum():
        raise OpgraphError(f"kind name {name!r}: use letters, digits and underscores")
    if name in rules.SHAPE_RULES and not replace:
        raise OpgraphError(f"op kind {name!r} exists already; pick another name or pass "
                           "replace=True")
    if name in rules.SHAPE_RULES and name not in _DEFINED:
        raise OpgraphError(f"op kind {name!r} is built in; define a kind of another name")
    if isinstance(vjp, str) and vjp not in SAVES:
        raise OpgraphError(f"kind {name!r}: vjp={vjp!r}; give one of {', '.join(SAVES)}, a VJP "
                           "rule or None")
    if fusion_class is not None and fusion_class not in fusion.CLASSES:
        raise OpgraphError(f"kind {name!r}: fusion_class={fusion_class!r}; give one of "
                           f"{', '.join(fusion.CLASSES)} or None")
    unknown = [r for r in shards if r not in rules.SHARD_ROLES]
    if unknown:
        raise OpgraphError(f"kind {name!r}: shards={tuple(shards)!r}; its roles are among "
                           f"{', '.join(rules.SHARD_ROLES)}")
    if name in _DEFINED:
        remove_kind(name)
    backward = f"{name}_backward" if isinstance(vjp, str) else None
    rule = (_backward.one_kernel(vjp) if isinstance(vjp, str)
            else _no_vjp if vjp is None else vjp)
    view_rule = _view_rule(view)
    if backward_cost is None:
        backward_cost = costmodel.scaled_flops if view_rule is not None else costmodel.scaled
    record = Kind(name, shape, flops, rule, backward, view_rule, category, backward_cost, grid,
                  eager, eager_backward, tuple(shards), tuple(cp_gathers), fusion_class, kept,
                  operands, active_fraction, fp8_weight_dims)
    rules.SHAPE_RULES[name] = shape
    rules.FLOP_RULES[name] = flops
    _backward.VJP_RULES[name] = rule
    costmodel.BACKWARD_COST[name] = backward_cost
    # the tables a trait has a row in only where the kind declares it
    for value, table in ((view_rule, rules.VIEWS), (grid, rules.GEMM_GRIDS),
                         (eager, rules.EAGER_BYTES), (eager_backward, rules.EAGER_BACKWARD_BYTES),
                         (tuple(shards) or None, rules.SHARDING),
                         (tuple(cp_gathers) or None, rules.CP_GATHERS),
                         (fusion_class, fusion.DEFINED_CLASSES), (operands, costmodel.OPERANDS),
                         (active_fraction, parameters.ACTIVE_FRACTION),
                         (fp8_weight_dims, precision.FP8_KINDS)):
        if value is not None:
            table[name] = value
    if fusion_class is not None and backward is not None:  # its backward fuses as it does
        fusion.DEFINED_CLASSES[backward] = fusion_class
    if kept:
        recompute.SAVE_KINDS = (*recompute.SAVE_KINDS, name)
    rules.FORWARD_KINDS = (*rules.FORWARD_KINDS, name)
    if backward is not None:
        rules.SHAPE_RULES[backward] = backward_shape or rules.backward_shape(name)
        rules.FLOP_RULES[backward] = backward_flops or twice_forward(name)
        if _view_rule(backward_view) is not None:
            rules.VIEWS[backward] = _view_rule(backward_view)
        rules.BACKWARD_KINDS = (*rules.BACKWARD_KINDS, backward)
    _DEFINED[name] = record
    costmodel._own_of.cache_clear()  # costs kept by op were made by the rules before
    return record


def _view_rule(view: bool | Callable) -> Callable | None:
    if callable(view):
        return view
    return _always if view else None


def _tables() -> tuple[dict, ...]:
    """Every per-kind table a kind has rows in: `define_kind` writes its rows, `remove_kind`
    clears them (and `recompute.SAVE_KINDS`, a tuple)."""
    return (rules.SHAPE_RULES, rules.FLOP_RULES, rules.VIEWS, _backward.VJP_RULES,
            costmodel.BACKWARD_COST, rules.GEMM_GRIDS, rules.EAGER_BYTES,
            rules.EAGER_BACKWARD_BYTES, rules.SHARDING, rules.CP_GATHERS,
            fusion.DEFINED_CLASSES, costmodel.OPERANDS, parameters.ACTIVE_FRACTION,
            precision.FP8_KINDS)


def remove_kind(name: str) -> None:
    """Take a kind made by `define_kind` out of every table (a test cleaning up after itself)."""
    record = _DEFINED.pop(name, None)
    if record is None:
        raise OpgraphError(f"op kind {name!r} was not made by define_kind")
    recompute.SAVE_KINDS = tuple(k for k in recompute.SAVE_KINDS if k != name)
    for table in _tables():
        table.pop(name, None)
        if record.backward:
            table.pop(record.backward, None)
    rules.FORWARD_KINDS = tuple(k for k in rules.FORWARD_KINDS if k != name)
    rules.BACKWARD_KINDS = tuple(k for k in rules.BACKWARD_KINDS if k != record.backward)
    costmodel._own_of.cache_clear()


def kind(name: str) -> Kind:
    """Any forward kind, built in or defined, as its table rows: `kind("geglu").flops`."""
    if name in _DEFINED:
        return _DEFINED[name]
    if name not in rules.FORWARD_KINDS:
        raise OpgraphError(f"unknown op kind {name!r}; the kinds are "
                           f"{', '.join(sorted(rules.FORWARD_KINDS))}")
    backward = f"{name}_backward"
    return Kind(name, rules.SHAPE_RULES[name], rules.FLOP_RULES[name],
                _backward.VJP_RULES[name], backward if backward in rules.SHAPE_RULES else None,
                rules.VIEWS.get(name), EXAMPLES[name].category if name in EXAMPLES else
                "elementwise", costmodel.BACKWARD_COST[name], rules.GEMM_GRIDS.get(name),
                rules.EAGER_BYTES.get(name), rules.EAGER_BACKWARD_BYTES.get(name),
                rules.SHARDING.get(name, ()), rules.CP_GATHERS.get(name, ()),
                {**fusion.DEFINED_CLASSES, **fusion.KIND_CLASSES}.get(name),
                name in recompute.SAVE_KINDS, costmodel.OPERANDS.get(name),
                parameters.ACTIVE_FRACTION.get(name), precision.FP8_KINDS.get(name))


def defined_kinds() -> tuple[str, ...]:
    """The kinds made by `define_kind`, in the order they were."""
    return tuple(_DEFINED)


def builtin_kinds() -> tuple[str, ...]:
    """The forward kinds opgraph ships, in table order (not those made by `define_kind`)."""
    return tuple(k for k in rules.FORWARD_KINDS if k not in _DEFINED)


# --- the reference table --------------------------------------------------------------------------

@attrs.frozen
class Example:
    """One op of a kind on symbolic tensors: `inputs` are (name, shape, role) triples."""

    inputs: tuple
    params: tuple = ()
    category: str = "elementwise"

    def graph(self, kind_name: str) -> Graph:
        """A one-op graph of this example (its inputs fed from outside)."""
        graph = Graph(f"example-{kind_name}")
        tensors = []
        for name, shape, role in self.inputs:
            dtype = INT32 if role is Role.INPUT else BF16
            tensors.append(graph.add_tensor(Tensor(name, shape, dtype, role)))
        params = dict(self.params)
        shapes = rules.infer_shapes(kind_name, tensors, params)
        outs = [graph.add_tensor(Tensor("out" if i == 0 else f"out{i}", s))
                for i, s in enumerate(shapes)]
        graph.add_op(Op(kind_name, kind_name, self.category, [t.name for t in tensors],
                        [t.name for t in outs], params=params))
        return graph


def _x(shape, name="x", role=Role.ACTIVATION):
    return (name, shape, role)


def _w(shape, name="w"):
    return (name, shape, Role.WEIGHT)


def _ids(shape, name="ids"):
    return (name, shape, Role.INPUT)


M, W, R = dim("M"), dim("W"), dim("R")
_QKV = (_x((B, S, H * d_h), "q"), _x((B, S, H_kv * d_h), "k"))
_ATTN = {"heads": H, "kv_heads": H_kv, "causal": True}

# One example per built-in forward kind, in the shapes a model gives it (VARIANTS: more, for
# parameters that change the count).
EXAMPLES: dict[str, Example] = {
    "embedding": Example((_ids((B, S)), _w((V, D), "table")), category="embedding"),
    "matmul": Example((_x((B, S, D)), _w((D, F))), category="matmul"),
    "rmsnorm": Example((_x((B, S, D)), _w((D,))), category="norm"),
    "layernorm": Example((_x((B, S, D)), _w((D,)), _w((D,), "b")), category="norm"),
    "rope": Example((_x((B, S, H * d_h)),)),
    "attention_scores": Example(_QKV, tuple(_ATTN.items()), "attention"),
    "flash_attention": Example((*_QKV, _x((B, S, H_kv * d_h), "v")), tuple(_ATTN.items()),
                               "attention"),
    "swiglu": Example((_x((B, S, F), "gate"), _x((B, S, F), "up"))),
    "gelu": Example((_x((B, S, F)),)),
    "add": Example((_x((B, S, D), "a"), _x((B, S, D), "b"))),
    "cross_entropy": Example((_x((B, S, V), "logits"), _ids((B, S), "targets")),
                             category="output_head"),
    "topk": Example((_x((B, S, E), "logits"),), (("k", K),), "routing"),
    "expert_matmul": Example((_x((B, S, D)), _w((E, D, F)), _ids((B, S, K), "experts")),
                             category="matmul"),
    "moe_combine": Example((_x((B, S, K, D), "y"), _x((B, S, K), "gates")), category="routing"),
    "mul": Example((_x((B, S, F), "a"), _x((B, S, F), "b"))),
    "scale": Example((_x((B, S, D)),), (("factor", 2),)),
    "geglu": Example((_x((B, S, F), "gate"), _x((B, S, F), "up"))),
    "softcap": Example((_x((B, S, V)),), (("cap", 30),)),
    "slice": Example((_x((B, S, H * d_h)),), (("axis", -1), ("size", d_h), ("start", 0))),
    "split": Example((_x((B, S, 2 * D)),), (("axis", -1), ("sizes", (D, D)))),
    "concat": Example((_x((B, S, H, d_h), "a"), _x((B, S, H, d_h), "b")), (("axis", -1),)),
    "broadcast": Example((_x((B, S, 1, d_h)),), (("shape", (B, S, H, d_h)),)),
    "reshape": Example((_x((B, S, H * d_h)),), (("shape", (B, S, H, d_h)),)),
    "gather": Example((_x((B, S, D)), _ids((B, M), "positions"))),
    "relu": Example((_x((B, S, F)),)),
    "dropout": Example((_x((B, H, S, S)),), (("p", 0.1),)),
}
VARIANTS: tuple[tuple[str, Example], ...] = (
    ("flash_attention", Example(EXAMPLES["flash_attention"].inputs,
                                (*_ATTN.items(), ("window", W)), "attention")),
    ("flash_attention", Example(EXAMPLES["flash_attention"].inputs,
                                (*_ATTN.items(), ("softcap", 50)), "attention")),
    ("gelu", Example(EXAMPLES["gelu"].inputs, (("approximate", "none"),))),
    ("rope", Example(EXAMPLES["rope"].inputs, (("heads", H), ("rotary", R)))),
    ("flash_attention", Example(EXAMPLES["flash_attention"].inputs,
                                (*_ATTN.items(), ("alibi", True)), "attention")),
)


def _figures(kind_name: str, example: Example) -> tuple[sympy.Expr, sympy.Expr, str]:
    """Forward FLOPs, backward FLOPs (its kernels' own rules) and whether it is a view."""
    graph = example.graph(kind_name)
    (op,) = graph.ops()
    forward = rules.rule_flops(graph, op)
    step = _backward.derive_backward(graph)
    backward = sympy.Add(*(rules.rule_flops(step, o) for o in step.ops()
                           if o.phase is Phase.BACKWARD))
    ins = [graph.tensor(n) for n in op.inputs]
    view = ("when contiguous" if kind_name in ("slice", "split")
            else "when in place" if kind_name == "concat"
            else "yes" if rules.is_view(kind_name, ins, dict(op.params)) else "")
    return _tidy(forward), _tidy(backward), view


def _tidy(expr: sympy.Expr) -> sympy.Expr:
    """Factored, unless it holds a Min (a window's), which factoring turns inside out."""
    return sympy.expand(expr) if expr.has(sympy.Min) else sympy.factor(expr)


def _signature(kind_name: str, example: Example) -> str:
    args = ", ".join(f"{name}[{', '.join(map(str, shape))}]" for name, shape, _ in example.inputs)
    params = ", ".join(f"{k}={_param(v)}" for k, v in example.params
                       if not (kind_name in ("attention_scores", "flash_attention")
                               and k in ("heads", "kv_heads")))
    return f"{kind_name}({args}{', ' + params if params else ''})"


def _param(value) -> str:
    if isinstance(value, tuple):
        return "(" + ", ".join(map(str, value)) + ")"
    return str(value)


def kind_table() -> str:
    """The built-in kinds as a markdown table: an example op, its forward FLOPs by its FLOP
    rule, its backward's FLOPs by its backward kernels' own rules (`CostModel(backward=
    "derived")`; the plate's convention charges twice the forward instead), and whether it
    is a view. docs/writing-a-model.md holds this table; a test keeps the two equal."""
    lines = ["| kind | example | forward FLOPs | backward FLOPs (derived) | view |",
             "| --- | --- | --- | --- | --- |"]
    for name in builtin_kinds():
        for example in [EXAMPLES[name], *(e for k, e in VARIANTS if k == name)]:
            fwd, bwd, view = _figures(name, example)
            lines.append(f"| `{name}` | `{_signature(name, example)}` | `{fwd}` | `{bwd}` "
                         f"| {view} |")
    return "\n".join(lines) + "\n"


__all__ = ["EXAMPLES", "SAVES", "VARIANTS", "Example", "Kind", "builtin_kinds", "define_kind", "kind",
           "kind_table", "remove_kind", "same_shape", "twice_forward"]
