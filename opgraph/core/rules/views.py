"""Views and copies: slice, split, concat, broadcast, reshape (a new look at their input's
memory where they can be, costing no traffic) and gather. `copy=True` on an op makes any of them
a copy (a `.contiguous()` after it)."""

from __future__ import annotations

import sympy

from ..ir import Op, Tensor
from ..symbols import B, D, H, S, d_h, dim
from .base import (Example, Shape, _always_view, _fmt, _no_backward_flops, _no_flops, _require,
                   _saved, ids_, kind, same, sums_gradient, x_)


def _axis(t: Tensor, params: dict) -> int:
    axis = params.get("axis", -1)
    _require(-len(t.shape) <= axis < len(t.shape), lambda: f"axis {axis} out of range for {t.name} "
                     f"{_fmt(t.shape)}")
    return axis % len(t.shape)


def _fits(part, whole) -> bool:
    """Whether `part` <= `whole` may hold (symbolically: not provably false)."""
    return (sympy.sympify(whole) - sympy.sympify(part)).is_negative is not True


def _slice_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """`x[..., start:start+size, ...]` along `axis`."""
    (x,) = ins
    axis = _axis(x, params)
    end = sympy.sympify(params.get("start", 0)) + params["size"]
    _require(_fits(end, x.shape[axis]),
             lambda: f"slice to {end} of {x.name} {_fmt(x.shape)} along axis {axis} ends past "
                     f"its {x.shape[axis]}")
    return [(*x.shape[:axis], params["size"], *x.shape[axis + 1:])]


def _split_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """`x` cut along `axis` into pieces of `sizes`, which sum to its extent there."""
    (x,) = ins
    axis, sizes = _axis(x, params), params["sizes"]
    _require(same(sympy.Add(*sizes), x.shape[axis]),
             lambda: f"split sizes {list(sizes)} do not add up to {x.name}'s {x.shape[axis]}")
    return [(*x.shape[:axis], size, *x.shape[axis + 1:]) for size in sizes]


def _concat_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """Inputs joined along `axis` (e.g. each head's no-rope and rope parts); the other dims
    agree."""
    axis = _axis(ins[0], params)
    for t in ins[1:]:
        _require(len(t.shape) == len(ins[0].shape)
                 and all(same(a, b) for i, (a, b) in enumerate(zip(t.shape, ins[0].shape))
                         if i != axis),
                 lambda: f"concat of {ins[0].name} {_fmt(ins[0].shape)} and {t.name} "
                         f"{_fmt(t.shape)} along axis {axis}: other dims differ")
    total = sympy.Add(*(t.shape[axis] for t in ins))
    return [(*ins[0].shape[:axis], total, *ins[0].shape[axis + 1:])]


def _broadcast_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """`x` expanded to `shape`, dims aligned from the right: each of x's is 1 or the target's."""
    (x,) = ins
    shape = tuple(sympy.sympify(d) for d in params["shape"])
    _require(len(x.shape) <= len(shape)
             and all(a == 1 or same(a, b) for a, b in zip(reversed(x.shape), reversed(shape))),
             lambda: f"cannot broadcast {x.name} {_fmt(x.shape)} to {_fmt(shape)}")
    return [shape]


def _reshape_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """`x` read as `shape`, of as many elements."""
    (x,) = ins
    shape = tuple(sympy.sympify(d) for d in params["shape"])
    _require(same(sympy.Mul(*shape), x.numel),
             lambda: f"cannot reshape {x.name} {_fmt(x.shape)} to {_fmt(shape)}: element counts "
                     "differ")
    return [shape]


def _gather_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """Rows of `x[B, S, ...]` at `index[B, M]` -> `[B, M, ...]` (masked-LM positions): the
    index's leading dims are x's."""
    x, index = ins
    lead = index.shape[:-1]
    _require(len(x.shape) >= len(index.shape)
             and all(same(a, b) for a, b in zip(x.shape, lead)),
             lambda: f"gather of {x.name} {_fmt(x.shape)} at {index.name} {_fmt(index.shape)}: "
                     "leading dims differ")
    return [(*index.shape, *x.shape[len(index.shape):])]


def _split_backward_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """A split's backward joins the gradients of its pieces (`present`: which pieces have one;
    the others are zeros) into the input's gradient, shaped by the saved input."""
    dys, (x,), _ = _saved(ins, params)
    pieces = _split_shape([x], params)
    present = params.get("present", tuple(range(len(dys))))
    _require(len(present) == len(dys), "split backward: `present` does not match its gradients")
    for dy, i in zip(dys, present):
        _require(len(dy.shape) == len(pieces[i]) and all(same(a, b)
                                                          for a, b in zip(dy.shape, pieces[i])),
                 lambda: f"{dy.name} {_fmt(dy.shape)} is not piece {i} {_fmt(pieces[i])}")
    return [x.shape]


def _contiguous_cut(ins: list[Tensor], params: dict) -> bool:
    """A slice or split is a view in place when its pieces are contiguous runs of the input:
    every dim before the cut's axis is 1. Cut further in (each head's first 128 of 192), a piece
    is strided and the next kernel reads it through a copy, unless `strided` says that kernel
    reads it in place through its strides (mamba_ssm's convolution and scan kernels do)."""
    x = ins[0]
    axis = _axis(x, params)
    return not params.get("copy") and (bool(params.get("strided"))
                                       or all(d == 1 for d in x.shape[:axis]))


def _in_place_concat(ins: list[Tensor], params: dict) -> bool:
    """A concatenation is a copy unless its producers wrote into one buffer (`in_place`)."""
    return bool(params.get("in_place")) and not params.get("copy")


def _backward_of_cut(ins: list[Tensor], params: dict) -> bool:
    """A concatenation's backward cuts dY back into pieces: a view when the cut is contiguous."""
    dys, _, _ = _saved(ins, params)
    return _contiguous_cut(dys[:1], params)


def _strided_join(ins: list[Tensor], params: dict) -> bool:
    """A `strided` split's backward: its readers' backward kernels write their gradients into
    the pieces of one buffer in place (mamba_ssm's fused backward allocates dzxbcdt and hands
    out views of it), so no join is run."""
    return bool(params.get("strided")) and not params.get("copy")


def _split_vjp(ctx, op: Op) -> list[Op]:
    """One kernel joining the pieces' gradients (zeros for a piece nobody read) into the input's,
    shaped by the saved input; `present` says which pieces have a gradient."""
    present = tuple(i for i, n in enumerate(op.outputs) if ctx.grad(n) is not None)
    dys = [ctx.grad(op.outputs[i]) for i in present]
    kernel = ctx.emit(op, "grad", "split_backward", [*dys, *op.inputs], list(op.inputs),
                      dys=len(dys), saved_inputs=1, saved_outputs=0, present=present,
                      wrt=ctx.wrt(op, list(op.inputs)))
    return [kernel] if kernel else []


M = dim("M")  # an example's gathered rows

# A view's backward is costed by its own tensors (`kind`: `scaled_flops`): twice a free view's
# nothing would hide a broadcast's reduction of dY, or a slice's gradient written at the input's
# size. The saved input gives each gradient's shape.
KINDS = (
    kind("slice", shape=_slice_shape, flops=_no_flops,  # views and copies do no arithmetic
         backward_flops=_no_backward_flops,  # dY placed into a zero gradient of x's shape
         view=_contiguous_cut,
         backward_reads_shapes=True,  # PyTorch keeps a view's sizes, not its input
         example=Example((x_((B, S, H * d_h)),), (("axis", -1), ("size", d_h), ("start", 0)))),
    kind("split", shape=_split_shape, flops=_no_flops, vjp=_split_vjp,
         backward_flops=_no_backward_flops,  # the pieces' gradients joined
         backward_shape=_split_backward_shape, view=_contiguous_cut,
         backward_view=_strided_join,
         backward_reads_shapes=True,  # PyTorch keeps a view's sizes, not its input
         example=Example((x_((B, S, 2 * D)),), (("axis", -1), ("sizes", (D, D))))),
    kind("concat", shape=_concat_shape, flops=_no_flops,
         backward_flops=_no_backward_flops,  # dY cut back into the inputs' pieces
         view=_in_place_concat, backward_view=_backward_of_cut,
         backward_reads_shapes=True,  # PyTorch keeps a view's sizes, not its input
         example=Example((x_((B, S, H, d_h), "a"), x_((B, S, H, d_h), "b")), (("axis", -1),))),
    kind("broadcast", shape=_broadcast_shape, flops=_no_flops,
         backward_flops=sums_gradient,  # dY summed over the broadcast dims
         view=_always_view,
         backward_reads_shapes=True,  # PyTorch keeps a view's sizes, not its input
         example=Example((x_((B, S, 1, d_h)),), (("shape", (B, S, H, d_h)),))),
    kind("reshape", shape=_reshape_shape, flops=_no_flops,
         backward_flops=_no_backward_flops,  # dY read in x's shape
         view=_always_view, backward_view=_always_view,
         backward_reads_shapes=True,  # PyTorch keeps a view's sizes, not its input
         example=Example((x_((B, S, H * d_h)),), (("shape", (B, S, H, d_h)),))),
    kind("gather", shape=_gather_shape, flops=_no_flops,
         backward_flops=sums_gradient,  # dY's rows scatter-added into x's gradient
         example=Example((x_((B, S, D)), ids_((B, M), "positions")))),
)
