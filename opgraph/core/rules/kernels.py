"""Kernels the passes make, not a model: a fused kernel (`opgraph.core.rewrite.Replacement.fuse`),
FP8's scaling casts and the rescale of a row-wise scaled product (`opgraph.passes.precision`, as
torchao's Float8Linear and Transformer Engine do them; the pass places them in both phases
itself, so they have no VJP), the
sum of the partial products a micro-pipelined matmul reduce-scatter exchanged
(`opgraph.passes.sum_tp_partials`), and collectives (`opgraph.passes.shard`,
`opgraph.parallel.collectives`)."""

from __future__ import annotations

import sympy

from ..ir import Op, Tensor
from .base import (Shape, _always_view, _fmt, _no_flops, _require, count_flops, infer_shapes, kind,
                   per_element)

# A fused kernel's params carry the member ops (`body`, in execution order), the tensors that stay
# inside it (`inner`) and the names of what it writes (`outputs`), so its shapes and FLOPs are its
# members', derived by their own rules; its traffic is its boundary tensors, like any op's.
#
# A collective moves a tensor between the GPUs of a group. Its parameters name the group
# (`group`: a parallel degree, "tp", "cp", "ep", "dp" or "pp") and, for a gather or scatter, the
# dimension it joins or splits (`axis`) and the group's size (`size`: the degree's symbol). They
# do no arithmetic the roofline counts (a reduction's adds run on the communication kernel's own
# SMs) and move no HBM bytes on the compute stream: their time is the network's (`costmodel`).


def _fused_tensors(ins: list[Tensor], params: dict) -> dict[str, Tensor]:
    """Every tensor a fused kernel's members touch, by name; the kernel's outputs re-derived by
    the members' shape rules (their dtype is not a shape's concern)."""
    known = {t.name: t for t in (*ins, *params["inner"])}
    for op in params["body"]:
        shapes = infer_shapes(op.kind, [known[n] for n in op.inputs], dict(op.params))
        for name, shape in zip(op.outputs, shapes):
            known.setdefault(name, Tensor(name, shape))
    return known


def _fused_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    known = _fused_tensors(ins, params)
    return [known[name].shape for name in params["outputs"]]


def _fused_flops(ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
    """Fusion moves no arithmetic: the members' FLOPs, each by its kind's rule."""
    known = _fused_tensors(ins, params) | {t.name: t for t in outs}
    return sympy.Add(*(count_flops(op.kind, [known[n] for n in op.inputs],
                                   [known[n] for n in op.outputs], dict(op.params))
                       for op in params["body"]))


def _amax_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """A tensor -> its largest magnitude: one scalar (tensor-wise scaling), or with `axes` one
    per slice along the axes it keeps (row-wise scaling: `axes` (-1,) gives each row of a
    [tokens, K] operand its own)."""
    _require(len(ins) == 1, lambda: f"amax reads one tensor, not {len(ins)}")
    axes = params.get("axes")
    if axes is None:
        return [()]
    rank = len(ins[0].shape)
    _require(all(-rank <= a < rank for a in axes),
             lambda: f"amax over axes {tuple(axes)} of {_fmt(ins[0].shape)}")
    over = {a % rank for a in axes}
    return [tuple(n for i, n in enumerate(ins[0].shape) if i not in over)]


def _cast_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """A tensor and its amax (a scalar, or one per row) -> the tensor scaled into the FP8 range,
    in the output's dtype."""
    _require(len(ins) == 2 and len(ins[1].shape) < max(1, len(ins[0].shape)),
             "cast reads a tensor and its amax, a scalar or one per row")
    return [ins[0].shape]


def _amax_flops(ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
    """|x| and the running max: 2 per element read."""
    return 2 * ins[0].numel


def _rescale_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """A product of FP8 operands cast with unit scales and its operands' two amaxes -> the
    product at its true scale (a partial gradient it adds into is read last, `accumulate`)."""
    _require(len(ins) == 3, "rescale reads a product and the amaxes of its two operands")
    return [ins[0].shape]


def _gathered(ins: list[Tensor], params: dict, grow: bool) -> list[Shape]:
    _require(len(ins) == 1, lambda: f"a collective reads one tensor, not {len(ins)}")
    axis, size = int(params["axis"]), params["size"]
    shape = list(ins[0].shape)
    _require(-len(shape) <= axis < len(shape), lambda: f"axis {axis} of {_fmt(ins[0].shape)}")
    shape[axis] = shape[axis] * size if grow else shape[axis] / size
    return [tuple(shape)]


def _all_gather_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """Each GPU's shard -> the whole, `size` shards joined along `axis`."""
    return _gathered(ins, params, grow=True)


def _reduce_scatter_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """Each GPU's partial sum of the whole -> its shard of the sum, split along `axis`."""
    return _gathered(ins, params, grow=False)


def _sum_partials_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """The `size` partial sums of one GPU's shard that the group's GPUs computed, side by side
    along `axis` as an all-to-all left them -> their sum, the shard."""
    return _gathered(ins, params, grow=False)


def _sum_partials_flops(ins: list[Tensor], outs: list[Tensor], params: dict) -> sympy.Expr:
    """`size` - 1 adds per element of the shard."""
    return ins[0].numel - outs[0].numel


def _exchange_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    _require(len(ins) == 1, lambda: f"a collective reads one tensor, not {len(ins)}")
    return [ins[0].shape]


def _all_to_all_shape(ins: list[Tensor], params: dict) -> list[Shape]:
    """Tokens to their experts' GPUs and back: the shape it read. With `gather_axis` and
    `split_axis` (context parallelism's all-to-all, DeepSpeed-Ulysses'), each of the `size`
    GPUs sends every other its `split_axis` shard and keeps its own: `gather_axis` grows
    `size` times, `split_axis` shrinks as much (a sequence shard of every head becomes the
    whole sequence of a head shard)."""
    if params.get("split_axis") is None:
        return _exchange_shape(ins, params)
    _require(len(ins) == 1, lambda: f"a collective reads one tensor, not {len(ins)}")
    shape, size = list(ins[0].shape), params["size"]
    gather, split = int(params["gather_axis"]), int(params["split_axis"])
    for axis in (gather, split):
        _require(-len(shape) <= axis < len(shape), lambda: f"axis {axis} of {_fmt(ins[0].shape)}")
    shape[gather], shape[split] = shape[gather] * size, shape[split] / size
    return [tuple(shape)]


def _collective_vjp(ctx, op: Op) -> list[Op]:
    """A collective's gradient is the collective `opgraph.parallel.collectives` pairs it with
    (Megatron's f and g: all-gather <-> reduce-scatter, all-reduce <-> identity), over the same
    group."""
    from ...parallel import collectives  # the pairing's home; parallel imports core

    paired = collectives.backward(op.kind.replace("_", "-")).replace("-", "_")
    dy = ctx.grad(op.outputs[0])
    # an all-to-all that moved shards back moves the gradient's back: its axes swap
    swapped = ({"gather_axis": op.param("split_axis"), "split_axis": op.param("gather_axis")}
               if op.param("split_axis") is not None else {})
    kernel = ctx.emit(op, "grad", paired, [dy], [op.inputs[0]], **swapped)
    return [kernel] if kernel else []


KINDS = (
    kind("fused", shape=_fused_shape, flops=_fused_flops, vjp=None, group="fused"),
    kind("amax", shape=_amax_shape, flops=_amax_flops, vjp=None, group="precision"),
    kind("cast", shape=_cast_shape,
         flops=per_element(2),  # times the scale (fp8_max / amax), clamped to the range
         vjp=None, group="precision"),
    kind("rescale", shape=_rescale_shape,
         flops=per_element(2),  # each element times its row's and its column's inverse scale
         vjp=None, group="precision"),
    kind("sum_partials", shape=_sum_partials_shape, flops=_sum_partials_flops, vjp=None,
         group="parallel"),
    kind("all_reduce", shape=_exchange_shape,  # partial sums -> their sum, on every GPU
         flops=_no_flops, vjp=_collective_vjp, group="collective"),
    kind("reduce_scatter", shape=_reduce_scatter_shape, flops=_no_flops, vjp=_collective_vjp,
         group="collective"),
    kind("all_gather", shape=_all_gather_shape, flops=_no_flops, vjp=_collective_vjp,
         group="collective"),
    kind("all_to_all", shape=_all_to_all_shape,  # tokens to their experts' GPUs and back
         flops=_no_flops, vjp=_collective_vjp, group="collective"),
    kind("send_recv", shape=_exchange_shape,  # to the next pipeline stage (or back)
         flops=_no_flops, vjp=_collective_vjp, group="collective"),
    kind("identity", shape=_exchange_shape,  # Megatron's f: a copy forward, an all-reduce back
         flops=_no_flops, vjp=_collective_vjp, view=_always_view, group="collective"),
)
