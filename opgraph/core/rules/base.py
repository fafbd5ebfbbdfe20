"""What every kind family's rules share: the shape-rule helpers, the conventions for a backward
kernel, and `Kind`, the record of one op kind's traits.

A kind is declared once, by `kind(...)` in the module of its family (`dense`, `attention`,
`norm`, `pointwise`, `views`, `moe`, `loss`, `optimizer`, `kernels`), every trait beside the
others: its shape and FLOP rules, its VJP and its backward kernel's rules, whether it is a view,
how parallelism splits it, what fuses with it, what recomputation keeps, its FP8 operands, its
efficiency class, its eager PyTorch kernels, its example. The per-trait tables the passes and the
cost model read (`SHAPE_RULES`, `FLOP_RULES`, `VJP_RULES`, ...) are made from those records by
`opgraph.core.rules.register`, never written by hand; `opgraph.core.kinds.define_kind` declares
a user's kind through the same `kind(...)` and `register`.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import sympy

from ..ir import Role, Tensor

Shape = tuple[sympy.Expr, ...]


class ShapeError(ValueError):
    """Shapes that do not fit the op: `matmul of [B, S, D] and [F, D]: inner dims D and F`."""


def same(a, b) -> bool:
    """Symbolic equality of two dimensions."""
    return a == b or sympy.expand(a - b) == 0


def _fmt(shape: Shape) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def _require(ok: bool, message: str | Callable[[], str]) -> None:
    """ShapeError(message) unless `ok`. A message that prints shapes comes as a function, called
    only on failure: printing a shape's symbols is a sympy print, and checking every op of every
    pass's graph (`opgraph.core.verify`) built some 800,000 such messages a test run, all discarded,
    most of the time the check took."""
    if not ok:
        raise ShapeError(message() if callable(message) else message)


def _same_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """Element-wise ops: every floating input has the first input's shape."""
    for t in ins[1:]:
        _require(all(same(a, b) for a, b in zip(ins[0].shape, t.shape))
                 and len(t.shape) == len(ins[0].shape),
                 lambda: f"{t.name} {_fmt(t.shape)} does not match {ins[0].name} "
                         f"{_fmt(ins[0].shape)}")
    return [ins[0].shape]


def _saved(ins: list[Tensor], params: dict) -> tuple[list, list, list]:
    """A one-kernel backward's reads: output gradients, saved forward inputs and outputs."""
    dys, n_in = params.get("dys", 1), params.get("saved_inputs", 0)
    n_out = params.get("saved_outputs", 0)
    _require(len(ins) == dys + n_in + n_out,
             lambda: f"backward kernel reads {len(ins)} tensors, its layout says "
                     f"{dys + n_in + n_out}")
    return ins[:dys], ins[dys:dys + n_in], ins[dys + n_in:]


def backward_shape(forward_kind: str) -> Callable:
    """The shape rule of `<forward_kind>_backward`: the forward kind's rule re-run on the saved
    inputs must give the saved outputs' and the output gradients' shapes; the kernel writes the
    gradients of the inputs at `wrt`. With nothing saved (an element-wise op whose inputs have
    its output's shape) each gradient has the output gradient's shape."""
    def _backward_shape(ins: list[Tensor], params: dict) -> list[Shape]:
        dys, fwd_ins, fwd_outs = _saved(ins, params)
        wrt = params.get("wrt", (0,))
        if not fwd_ins:
            return [dys[0].shape for _ in wrt]
        expected = SHAPE_RULES[forward_kind](fwd_ins, params)
        for t, shape in zip([*dys, *fwd_outs], [*expected[:len(dys)], *expected]):
            _require(len(t.shape) == len(shape) and all(same(a, b) for a, b in zip(t.shape, shape)),
                     lambda: f"{t.name} {_fmt(t.shape)} is not the forward's output {_fmt(shape)}")
        _require(all(0 <= i < len(fwd_ins) for i in wrt), lambda: f"wrt {wrt} out of range")
        return [fwd_ins[i].shape for i in wrt]
    _backward_shape.__name__ = f"_{forward_kind}_backward_shape"
    return _backward_shape


_default_backward_shape = backward_shape  # `kind`'s argument of that name hides it


def per_element(n: int) -> Callable:
    """A rule of `n` FLOPs per output element (element-wise ops, norms)."""
    def _per_element(ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
        return n * outs[0].numel
    _per_element.__name__ = f"_per_element_{n}"
    return _per_element


def _no_flops(ins, outs, params) -> sympy.Expr:
    return sympy.Integer(0)


def per_input(n: int, index: int = 0) -> Callable:
    """A backward rule of `n` FLOPs per element of the forward's input at `index`."""
    def _per_input(ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
        _, fwd_ins, _ = _saved(ins, params)
        return n * (fwd_ins[index] if fwd_ins else ins[0]).numel
    _per_input.__name__ = f"_per_input_{n}_{index}"
    return _per_input


def sums_gradient(ins, outs, params) -> sympy.Expr:
    """A backward kernel that adds gradients together (an embedding's or a gather's
    scatter-add, a broadcast's or a repeat's copies summed, a token's K slots): one add per
    element of the output gradient dY, its first input."""
    return ins[0].numel


def _no_backward_flops(ins, outs, params) -> sympy.Expr:
    """The gradient passed through (an add's): copies, no arithmetic."""
    return sympy.Integer(0)


def _always_view(ins: list[Tensor], params: dict) -> bool:
    """Broadcast (stride 0) and reshape (of a contiguous tensor) are views unless `copy`."""
    return not params.get("copy")


def _partials(ins: list[Tensor], params: dict) -> tuple[list[Tensor], list[Tensor]]:
    """A kernel's own inputs and the partial gradients it accumulates into (read last)."""
    n = int(params.get("accumulate", 0))
    return (ins[:len(ins) - n], ins[len(ins) - n:]) if n else (ins, [])


_F32 = 4  # bytes per FP32 element, the dtype each upcast writes


# --- a backward's cost by the plate's convention, per forward kind: (scaled FLOPs, scaled bytes,
# the kernel's own bytes) -> the kernel's (FLOPs, bytes) (`opgraph.cost.costmodel`) ---------------

def scaled(flops, nbytes, own_bytes) -> tuple:
    """The plate's rule: FLOPs and bytes both the forward's, scaled."""
    return flops, nbytes


def scaled_flops(flops, nbytes, own_bytes) -> tuple:
    """FLOPs scaled from the forward; bytes those of the kernel's own tensors (FlashAttention's
    backward: its traffic is Q, K, V, O and their gradients, not twice the forward's)."""
    return flops, own_bytes


# --- VJP rules: (ctx, op) -> backward kernels. `ctx` is the backward pass's context
# (`opgraph.passes.derive_backward`): `ctx.grad(name)` a tensor's newest gradient, `ctx.emit(op,
# suffix, kind, reads, grads, **params)` a kernel, `ctx.wrt(op, names)` the inputs' positions,
# `ctx.graph` the graph. ------------------------------------------------------------------------

SAVES = ("none", "inputs", "inputs+outputs")


def one_kernel(saves: str) -> Callable:
    """A backward that is one kernel reading the output gradient and the saved forward tensors
    (`saves`: "none", "inputs" or "inputs+outputs"), writing each input's gradient."""
    def _one_kernel_vjp(ctx, op) -> list:
        ins = list(op.inputs) if saves != "none" else []
        outs = list(op.outputs) if saves == "inputs+outputs" else []
        dys = [g for g in map(ctx.grad, op.outputs) if g is not None]
        kernel = ctx.emit(op, "grad", f"{op.kind}_backward", dys + ins + outs, list(op.inputs),
                          dys=len(dys), saved_inputs=len(ins), saved_outputs=len(outs),
                          wrt=ctx.wrt(op, list(op.inputs)))
        return [kernel] if kernel else []
    _one_kernel_vjp.__name__ = f"_one_kernel_vjp_{saves.replace('+', '_')}"
    return _one_kernel_vjp


def _no_vjp(ctx, op) -> list:
    """No gradient flows through this kind."""
    return []


def twice_forward(kind: str) -> Callable:
    """The backward FLOP rule of `<kind>_backward` by the plate's ratio: twice the forward
    kind's FLOPs, re-derived from the saved inputs (from the gradients' shapes when nothing is
    saved, as for an element-wise kind)."""
    def _twice_forward(ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
        _, fwd_ins, _ = _saved(ins, params)
        fwd_ins = fwd_ins or outs
        shapes = SHAPE_RULES[kind](fwd_ins, params)
        fwd_outs = [Tensor(f"{kind}.out{i}", s) for i, s in enumerate(shapes)]
        return 2 * FLOP_RULES[kind](fwd_ins, fwd_outs, params)
    _twice_forward.__name__ = f"_{kind}_twice_forward"
    return _twice_forward


# --- the record of a kind -------------------------------------------------------------------------

@attrs.frozen
class Example:
    """One op of a kind on symbolic tensors, for the reference table (`kinds.kind_table`):
    `inputs` are (name, shape, role) triples, `params` (name, value) pairs."""

    inputs: tuple
    params: tuple = ()


# Which tables a kind has rows in: a forward kind (a model's op) has every trait; the kinds the
# passes make (the optimizer's update, a fused kernel, FP8 casts, the parallel passes' compute
# kernels, collectives) have a shape and a FLOP rule, and a collective a VJP.
GROUPS = ("forward", "optimizer", "fused", "precision", "parallel", "collective")


@attrs.frozen
class Kind:
    """One op kind, every trait it has: `kind("matmul").flops`. Made by `rules.base.kind`.

    `shape(inputs, params) -> [output shapes]` (raise `ShapeError` when they do not fit);
    `flops(inputs, outputs, params) -> FLOPs` of one instance; `vjp(ctx, op) -> [backward
    kernels]`; `backward` the name of its one-kernel backward kind, if it has one, with its
    `backward_shape`, `backward_flops` and `backward_view` rules; `view(inputs, params) ->
    bool` whether an op of it moves no bytes (None: never); `category` the profile category
    its ops are filed under; `backward_cost` how the plate's convention charges its backward
    (`scaled`, `scaled_flops`). The other traits are `kinds.define_kind`'s arguments of the
    same names (its docstring says what each means)."""

    name: str
    shape: Callable
    flops: Callable
    vjp: Callable | None = None
    backward: str | None = None
    view: Callable | None = None
    category: str = "elementwise"
    backward_cost: Callable = scaled
    grid: Callable | None = None  # a matrix multiply's (GEMMs, M, N) rule (`GEMM_GRIDS`)
    eager: Callable | None = None  # its eager PyTorch kernels' bytes (`EAGER_BYTES`)
    eager_backward: Callable | None = None  # theirs backward (`EAGER_BACKWARD_BYTES`)
    eager_saved: Callable | None = None  # what their autograd keeps more (`EAGER_SAVED`)
    eager_workspace: Callable | None = None  # what they hold while they run (`EAGER_WORKSPACE`)
    eager_backward_workspace: Callable | None = None  # the same, backward
    shards: tuple[str, ...] = ()  # its roles when parallelism splits it (`SHARDING`)
    cp_gathers: tuple[int, ...] = ()  # inputs context parallelism gathers (`CP_GATHERS`)
    fusion_class: str | None = None  # what fuses with it (`fusion.CLASSES`)
    kept: bool = False  # selective-op recomputation keeps its output (`KEPT`)
    along_sequence: bool = False  # it carries state along the sequence (`ALONG_SEQUENCE`)
    # its backward kernel reads the saved forward tensors for their shapes alone (a view's:
    # PyTorch keeps the sizes), so they are not kept for it (`SHAPE_ONLY_BACKWARD`)
    backward_reads_shapes: bool = False
    operands: int | None = None  # leading operands whose dtype sets its peak (`OPERANDS`)
    active_fraction: Callable | None = None  # a routed weight's share a token reads
    fp8_weight_dims: int | None = None  # the FP8 recipe covers it (`FP8_KINDS`)
    scores: Callable | None = None  # an attention kernel's (scores, d_qk + d_v, query rows)
    backward_scores: Callable | None = None  # its backward kernel's
    efficiency: str | None = None  # its kernel's efficiency class (`EFFICIENCY`; None: matmul)
    backward_efficiency: str | None = None  # its backward kernel's
    backward_shape: Callable | None = None
    backward_flops: Callable | None = None
    backward_view: Callable | None = None
    example: Example | None = None  # one op of it, for the reference table
    variants: tuple[Example, ...] = ()  # more, for parameters that change its count
    group: str = "forward"  # GROUPS: which tables it has rows in

    def op(self, g, inputs, *, name: str | None = None, category: str | None = None,
           **params) -> Tensor:
        """An op of this kind in builder `g`: `squared_relu.op(g, [x])`."""
        return g.op(self.name, inputs, category=category or self.category,
                    name=name or self.name, **params)


def _always(ins, params) -> bool:
    """A view whatever its inputs (unless `copy=True`)."""
    return not params.get("copy")


def _view_rule(view: bool | Callable) -> Callable | None:
    if callable(view):
        return view
    return _always if view else None


def kind(name: str, *, shape: Callable, flops: Callable,
         vjp: str | Callable | None = "inputs", backward_flops: Callable | None = None,
         backward_shape: Callable | None = None, view: bool | Callable = False,
         backward_view: bool | Callable = False, backward_cost: Callable | None = None,
         group: str = "forward", **traits) -> Kind:
    """The record of kind `name`, its conventions filled in: `vjp` one of SAVES makes one
    backward kernel `<name>_backward` (`one_kernel`) whose FLOPs are `backward_flops` (default
    `twice_forward(name)`) and whose shape rule is `backward_shape` (default the forward rule
    re-run on the saved inputs, `backward_shape(name)`); a VJP rule of its own with
    `backward_flops` names a `<name>_backward` kernel it makes; None: no gradient. A view's
    backward is costed by its own bytes (`scaled_flops`), any other's by the plate's
    convention (`scaled`). `traits` are `Kind`'s other fields."""
    if group not in GROUPS:
        raise ValueError(f"kind {name!r}: group {group!r}; give one of {', '.join(GROUPS)}")
    one = isinstance(vjp, str)
    if one:
        rule = one_kernel(vjp)
    elif vjp is None and group == "forward":
        rule = _no_vjp  # no gradient flows through it
    else:
        rule = vjp  # its own VJP rule (or none: a kind only the passes make)
    makes_backward = one or backward_flops is not None
    backward = f"{name}_backward" if makes_backward and group == "forward" else None
    view_rule = _view_rule(view)
    if backward_cost is None:
        backward_cost = scaled_flops if view_rule is not None else scaled
    return Kind(name, shape, flops, vjp=rule,
                backward=backward, view=view_rule, backward_cost=backward_cost,
                backward_shape=((backward_shape or _default_backward_shape(name)) if backward
                                else None),
                backward_flops=(backward_flops or twice_forward(name)) if backward else None,
                backward_view=_view_rule(backward_view) if backward else None,
                group=group, **traits)


# The per-trait tables, filled by `opgraph.core.rules.register` from the kinds' records (and
# read here by the rules that look up another kind's).
SHAPE_RULES: dict[str, Callable] = {}
FLOP_RULES: dict[str, Callable] = {}


def infer_shapes(kind: str, ins: list[Tensor], params: dict) -> list[Shape]:
    """The output shapes of an op of `kind` reading `ins`; ShapeError if they do not fit."""
    if kind not in SHAPE_RULES:
        raise ShapeError(f"no shape rule for op kind {kind!r}")
    own, partials = _partials(ins, params)
    shapes = SHAPE_RULES[kind](own, params)
    for t in partials:
        _require(any(len(t.shape) == len(s) and all(same(a, b) for a, b in zip(t.shape, s))
                     for s in shapes),
                 lambda: f"partial gradient {t.name} {_fmt(t.shape)} matches no output {shapes}")
    return shapes


def count_flops(kind: str, ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
    """FLOPs of one instance of an op of `kind`; accumulating into a partial gradient adds one
    per element."""
    own, partials = _partials(ins, params)
    return FLOP_RULES[kind](own, outs, params) + sympy.Add(*(t.numel for t in partials))


# --- examples' tensors: (name, shape, role) -------------------------------------------------------

def x_(shape, name="x"):
    """An activation of `shape` in an example."""
    return (name, shape, Role.ACTIVATION)


def w_(shape, name="w"):
    """A weight of `shape` in an example."""
    return (name, shape, Role.WEIGHT)


def ids_(shape, name="ids"):
    """Integer inputs (token ids, routing) of `shape` in an example."""
    return (name, shape, Role.INPUT)
