"""Op kinds as a public extension point: define a kind in one call, look any kind up, and render
the reference table of the built-in ones.

    from opgraph.core.kinds import define_kind, same_shape
    from opgraph.core.rules import per_element, per_input

    squared_relu = define_kind("squared_relu", shape=same_shape, flops=per_element(2),
                               vjp="inputs", backward_flops=per_input(3))
    y = squared_relu.op(g, [x])                 # or g.op("squared_relu", [x], category=...)

Invariant: a kind is one record (`rules.Kind`), made by `rules.kind` with every trait it has,
and its rows in the per-trait tables are made from it by `rules.register`. The built-in kinds are
declared that way in their families' modules (`opgraph.core.rules.dense`, `.attention`, ...);
`define_kind` declares a user's kind the same way, so every pass, the verifier, the cost model and
everything built on it (`evaluate`, `formula`, `solve`, `sweep`) treat it as they treat a built-in
one. `kind` reads a kind's record back.

The reference table (`kind_table`, in docs/writing-a-model.md) is computed, not written: each
built-in kind has an example (EXAMPLES) whose forward FLOPs its FLOP rule gives and whose backward
FLOPs `derive_backward` and the cost model's "derived" convention give, so it cannot drift from
the rules.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import sympy

from ..cost import costmodel
from ..passes import derive_backward as _backward
from . import fusion, rules
from .errors import OpgraphError
from .ir import BF16, INT32, Graph, Op, Phase, Role, Tensor
from .rules.base import SAVES, Example, Kind, twice_forward
from .rules.base import _same_shape as same_shape  # element-wise: every input has the first's


_DEFINED: dict[str, Kind] = {}  # kinds made by define_kind, by name


def define_kind(name: str, *, shape: Callable, flops: Callable,
                vjp: str | Callable | None = "inputs", backward_flops: Callable | None = None,
                backward_shape: Callable | None = None, view: bool | Callable = False,
                backward_view: bool | Callable = False, category: str = "elementwise",
                backward_cost: Callable | None = None, grid: Callable | None = None,
                eager: Callable | None = None, eager_backward: Callable | None = None,
                shards: Sequence[str] = (), cp_gathers: Sequence[int] = (),
                fusion_class: str | None = None, kept: bool = False,
                along_sequence: bool = False, backward_reads_shapes: bool = False,
                operands: int | None = None, active_fraction: Callable | None = None,
                fp8_weight_dims: int | None = None, eager_saved: Callable | None = None,
                eager_workspace: Callable | None = None,
                eager_backward_workspace: Callable | None = None,
                scores: Callable | None = None, backward_scores: Callable | None = None,
                efficiency: str | None = None, backward_efficiency: str | None = None,
                example: Example | None = None, variants: Sequence[Example] = (),
                replace: bool = False) -> Kind:
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
    - `along_sequence`: it carries state along the sequence (a causal convolution, a recurrent
      scan), so context parallelism, which gives each GPU a slice of the sequence, runs it on
      the whole sequence of 1/cp of its channels, its inputs and output passing all-to-alls
      (Megatron-Core's Mamba context parallelism; `passes.shard`), its per-channel weights
      sliced.
    - `backward_reads_shapes`: its backward kernel reads the saved forward tensors for their
      shapes alone (a view's, whose sizes PyTorch keeps), so the memory model keeps none of
      them for it (`rules.SHAPE_ONLY_BACKWARD`).
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
    - `eager_saved`, `eager_workspace`, `eager_backward_workspace`: for a kind a framework runs
      eagerly, `(inputs, outputs, params) -> ((name, shape, dtype), ...)`: the tensors its
      autograd keeps beyond its inputs, and those its kernels (forward, backward) hold while
      they run (`rules.EAGER_SAVED`, `EAGER_WORKSPACE`, `EAGER_BACKWARD_WORKSPACE`).
    - `scores`, `backward_scores`: for an attention kernel and its backward, `(inputs, outputs,
      params) -> (scores, d_qk + d_v, query rows)`, the exponentials and rows the calibrated
      model times (`rules.ATTENTION_SCORES`); `efficiency`, `backward_efficiency`: the
      calibrated efficiency class of its kernels (`rules.EFFICIENCY`; None: "matmul").
    - `example`, `variants`: an op of it on symbolic tensors (`rules.Example`), for the
      reference table.

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
    for trait, value in (("efficiency", efficiency), ("backward_efficiency",
                                                       backward_efficiency)):
        if value is not None and value not in costmodel.RATES:
            raise OpgraphError(f"kind {name!r}: {trait}={value!r}; give one of "
                               f"{', '.join(costmodel.RATES)} or None")
    for trait, value in (("shape", shape), ("flops", flops), ("scores", scores),
                         ("backward_scores", backward_scores), ("grid", grid)):
        if value is not None and not callable(value):
            raise OpgraphError(f"kind {name!r}: {trait} must be a rule (a function), "
                               f"not {type(value).__name__}")
    if any(not isinstance(e, Example) for e in (example, *variants) if e is not None):
        raise OpgraphError(f"kind {name!r}: example and variants are rules.Example records")
    if name in _DEFINED:
        remove_kind(name)
    record = rules.kind(
        name, shape=shape, flops=flops, vjp=vjp, backward_flops=backward_flops,
        backward_shape=backward_shape, view=view, backward_view=backward_view,
        backward_cost=backward_cost, category=category, grid=grid, eager=eager,
        eager_backward=eager_backward, eager_saved=eager_saved, eager_workspace=eager_workspace,
        eager_backward_workspace=eager_backward_workspace, shards=tuple(shards),
        cp_gathers=tuple(cp_gathers), fusion_class=fusion_class, kept=kept,
        along_sequence=along_sequence, backward_reads_shapes=backward_reads_shapes,
        operands=operands,
        active_fraction=active_fraction, fp8_weight_dims=fp8_weight_dims, scores=scores,
        backward_scores=backward_scores, efficiency=efficiency,
        backward_efficiency=backward_efficiency, example=example, variants=tuple(variants))
    rules.register(record, builtin=False)
    _DEFINED[name] = record
    costmodel._own_of.cache_clear()  # costs kept by op were made by the rules before
    return record


def _tables() -> tuple[dict, ...]:
    """Every per-kind table a kind has rows in (`rules.register` writes them)."""
    return rules.TABLES


def remove_kind(name: str) -> None:
    """Take a kind made by `define_kind` out of every table (a test cleaning up after itself)."""
    if _DEFINED.pop(name, None) is None:
        raise OpgraphError(f"op kind {name!r} was not made by define_kind")
    rules.unregister(name)
    costmodel._own_of.cache_clear()


def kind(name: str) -> Kind:
    """Any forward kind, built in or defined, its record: `kind("geglu").flops`."""
    found = rules.KINDS.get(name)
    if found is None or found.group != "forward":
        raise OpgraphError(f"unknown op kind {name!r}; the kinds are "
                           f"{', '.join(sorted(rules.FORWARD_KINDS))}")
    return found


def defined_kinds() -> tuple[str, ...]:
    """The kinds made by `define_kind`, in the order they were."""
    return tuple(_DEFINED)


def builtin_kinds() -> tuple[str, ...]:
    """The forward kinds opgraph ships, in table order (not those made by `define_kind`)."""
    return tuple(k for k in rules.FORWARD_KINDS if k not in _DEFINED)


# --- the reference table --------------------------------------------------------------------------

def example_graph(kind_name: str, example: Example) -> Graph:
    """A one-op graph of `example`, an op of `kind_name` (its inputs fed from outside)."""
    graph = Graph(f"example-{kind_name}")
    tensors = []
    for name, shape, role in example.inputs:
        dtype = INT32 if role is Role.INPUT else BF16
        tensors.append(graph.add_tensor(Tensor(name, shape, dtype, role)))
    params = dict(example.params)
    shapes = rules.infer_shapes(kind_name, tensors, params)
    outs = [graph.add_tensor(Tensor("out" if i == 0 else f"out{i}", s))
            for i, s in enumerate(shapes)]
    graph.add_op(Op(kind_name, kind_name, rules.KINDS[kind_name].category,
                    [t.name for t in tensors], [t.name for t in outs], params=params))
    return graph


# One example per built-in forward kind, in the shapes a model gives it (VARIANTS: more, for
# parameters that change the count): each kind's `example` and `variants`.
EXAMPLES: dict[str, Example] = {name: rules.KINDS[name].example for name in rules.FORWARD_KINDS
                                if rules.KINDS[name].example is not None}
VARIANTS: tuple[tuple[str, Example], ...] = tuple(
    (name, e) for name in rules.FORWARD_KINDS for e in rules.KINDS[name].variants)


def _figures(kind_name: str, example: Example) -> tuple[sympy.Expr, sympy.Expr, str]:
    """Forward FLOPs, backward FLOPs (its kernels' own rules) and whether it is a view."""
    graph = example_graph(kind_name, example)
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


__all__ = ["EXAMPLES", "SAVES", "VARIANTS", "Example", "Kind", "builtin_kinds", "define_kind",
           "example_graph", "kind",
           "kind_table", "remove_kind", "same_shape", "twice_forward"]
