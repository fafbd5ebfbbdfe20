"""apply_precision: run the layers' matrix multiplies in FP8, with the casts they need.

Invariant established, for `precision="fp8"`: every forward `matmul` (and a mixture of experts'
`expert_matmul`, `FP8_KINDS`) inside a layer region that multiplies by a weight (not attention's
per-head products, not the output head, which stay BF16) reads FP8 copies of both operands, and
its two backward matmuls (dX = dY W^T, dW = X^T dY) read FP8 copies of theirs: as torchao's
Float8Linear and Transformer Engine's tensor-wise ("current" / dynamic) scaling recipes run
them. Each copy is made by two kernels of the step, costed by their rules like any op
(`opgraph.core.rules`): `amax`, the tensor's largest magnitude (one pass over it), then `cast`, the
tensor times fp8_max / amax, written in FP8 (a second pass). A tensor read by several matmuls
(the normed input of Q, K and V) is cast once; the activation and the weight are cast in the
forward, the output gradient in the backward, and the backward reads the FP8 copies the forward
made (torchao saves those, not the BF16 tensors). The matmuls' outputs stay BF16. Under sequence
parallelism an input gathered over the tensor-parallel group only for FP8 matmuls is cast on its
shard and gathered in FP8, one byte an element (`_fp8_gathers`), as Transformer Engine's and
torchao's sequence-parallel linears do; a framework that keeps the shard for the backward then
gathers the FP8 shard again there (`passes.regather_inputs`).

For `precision="fp8-rowwise"` (torchao's row-wise recipe, `Float8LinearConfig.from_recipe_name
("rowwise")`, as torchtitan runs it; pytorch/ao@6243040) each copy has a scale per row along the
axis its matmul contracts, so one tensor needs a copy per axis it is contracted along: the
forward casts the activation along K and the weight along K; the input gradient's matmul casts
the output gradient along N and the weight again along N; the weight gradient's casts the
activation again and the output gradient along the tokens. Each copy is an `amax` over those
axes (one per row) and a `cast`. The backward copies are made from the BF16 tensors, so the
forward's input stays saved in BF16 (torchao saves `input_hp`). The backward matmuls run without
fast accumulation, where torchao calls cuBLAS with unit scales and multiplies the product by the
rows' and columns' inverse scales afterwards (`addmm_float8_unwrapped`): a `rescale` kernel after
each, which also adds the partial gradient the matmul would have accumulated into. A
sequence-parallel gather stays BF16: torchtitan applies its Float8 tensor-parallel styles to the
tensor-wise recipe only (`enable_float8_tensorwise_tp`, torchtitan@820504e
models/llama3/parallelize_llama.py). The forward's row-scaled matmul (CUTLASS, fast
accumulation) runs at the tensor-wise rate: pytorch/ao#2185 measured the two within 1% on
Llama 3 70B's shapes.

Nothing here picks a peak: the cost model runs a matmul whose operands are all FP8 at the part's
dense FP8 peak (`opgraph.cost.costmodel.compute_dtype`), everything else at its BF16 peak.
`precision="bf16"` leaves the graph as it is.

    >>> from opgraph.models import preset
    >>> from opgraph.core.pipeline import compile_step
    >>> step = compile_step(preset("llama3-8b"), precision="fp8")
    >>> [step.tensor(n).dtype.name for n in step.op("layers.q_proj").inputs]
    ['fp8', 'fp8']
"""

from __future__ import annotations

import attrs

from opgraph.core import rules
from opgraph.core.choices import PRECISIONS
from opgraph.core.contracts import PRECISION, contract, step_pass
from opgraph.core.errors import OpgraphError
from opgraph.core.ir import BF16, FP8, FP32, Graph, Op, Phase, Role, Tensor

# Kind -> the dimensions of the weight whose products the FP8 recipe covers: a linear layer's
# [in, out]; a mixture of experts' [E, in, out], its grouped GEMM (Transformer Engine's
# GroupedLinear and torchao's float8 grouped matmul run the experts in FP8 too).
# `kinds.define_kind(fp8_weight_dims=...)` adds a kind of the user's.
FP8_KINDS: dict[str, int] = rules.FP8_KINDS  # a kind's `fp8_weight_dims`


def fp8_matmuls(graph: Graph) -> list[Op]:
    """The forward matrix multiplies the FP8 recipe covers: inside a region, of a kind of
    `FP8_KINDS`, by a weight of its dimensions (not attention's per-head products)."""
    out = []
    for op in graph.ops():
        if op.phase is not Phase.FORWARD or op.kind not in FP8_KINDS or op.region is None:
            continue
        if op.param("heads") is not None or len(op.inputs) < 2:
            continue
        w = graph.tensor(op.inputs[1])
        if w.role is Role.WEIGHT and len(w.shape) == FP8_KINDS[op.kind]:
            out.append(op)
    return out


def _fp8_gathers(graph: Graph, matmuls: list[Op]) -> list[Op]:
    """The sequence-parallel all-gathers (forward, over `tp`) whose output only FP8 matmuls
    read in the forward: they gather the FP8 copy of their shard rather than BF16 to be cast
    after (Transformer Engine's sequence-parallel linears and torchao's Float8 column-parallel
    linears cast, then gather, at one byte an element)."""
    fp8 = {op.name for op in matmuls}
    found = []
    for op in graph.ops():
        if not rules.sequence_gather(op):
            continue
        readers = [c for c in graph.consumers(op.outputs[0]) if c.phase is Phase.FORWARD]
        if readers and all(c.name in fp8 and c.inputs[0] == op.outputs[0] for c in readers):
            found.append(op)
    return found


class _Casts:
    """The FP8 copies made so far, one per source tensor, phase and scaling axes."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.made: dict[tuple, str] = {}
        self.amaxes: dict[str, str] = {}  # an FP8 copy -> the amax its scale came from

    def fp8(self, source: str, at: Op, phase: Phase, axes: tuple[int, ...] | None = None) -> str:
        """The FP8 copy of `source`, made by an `amax` (over `axes`, one per row; None: the
        whole tensor) and a `cast` op in `at`'s region."""
        g, t = self.graph, self.graph.tensor(source)
        if axes is not None:
            axes = tuple(sorted(a % len(t.shape) for a in axes))
        key = (source, phase, axes)
        if key in self.made:
            return self.made[key]
        # tensor-wise copies keep the names they always had; a row-wise one names its axes
        name = source if axes is None else f"{source}.over{'_'.join(map(str, axes))}"
        role = Role.GRADIENT if t.role is Role.GRADIENT else Role.ACTIVATION
        kept = () if axes is None else tuple(n for i, n in enumerate(t.shape) if i not in axes)
        amax = g.add_tensor(Tensor(f"amax.{name}", kept, FP32, role, at.count, region=at.region))
        copy = g.add_tensor(Tensor(f"fp8.{name}", t.shape, FP8, role, at.count,
                                   region=at.region))
        category = "elementwise"
        params = {} if axes is None else {"axes": axes}
        g.add_op(Op(f"fp8.{name}.amax", "amax", category, [source], [amax.name],
                    count=at.count, phase=phase, region=at.region, params=params))
        g.add_op(Op(f"fp8.{name}.cast", "cast", category, [source, amax.name], [copy.name],
                    count=at.count, phase=phase, region=at.region))
        self.made[key] = copy.name
        self.amaxes[copy.name] = amax.name
        return copy.name


def _tensorwise(graph: Graph, out: Graph, matmuls: list[Op], backward: dict) -> None:
    """Tensor-wise scaling (see the module): one copy of each tensor a phase reads, the
    sequence-parallel gathers of FP8 matmuls' inputs made in FP8."""
    casts = _Casts(out)
    for gather in _fp8_gathers(graph, matmuls):
        shard = casts.fp8(gather.inputs[0], gather, Phase.FORWARD)
        out.replace_op(attrs.evolve(gather, inputs=(shard, *gather.inputs[1:])))
        (gathered,) = gather.outputs
        out.replace_tensor(attrs.evolve(out.tensor(gathered), dtype=FP8))
        casts.made[(gathered, Phase.FORWARD, None)] = gathered
    for op in matmuls:
        x, w = op.inputs[:2]
        swap = {x: casts.fp8(x, op, Phase.FORWARD), w: casts.fp8(w, op, Phase.FORWARD)}
        out.replace_op(attrs.evolve(op, inputs=[swap[x], swap[w], *op.inputs[2:]]))
        for kernel in backward.get(op.name, []):
            a, b = kernel.inputs[:2]
            for name in (a, b):
                if name not in swap and graph.tensor(name).grad_of == op.outputs[0]:
                    swap[name] = casts.fp8(name, kernel, Phase.BACKWARD)
            out.replace_op(attrs.evolve(kernel, inputs=[swap.get(a, a), swap.get(b, b),
                                                        *kernel.inputs[2:]]))


def _rowwise(graph: Graph, out: Graph, matmuls: list[Op], backward: dict) -> None:
    """Row-wise scaling (see the module): each operand cast along the axes its matmul
    contracts, and each backward product rescaled after its matmul."""
    casts = _Casts(out)
    for op in matmuls:
        x, w = op.inputs[:2]
        dims = FP8_KINDS[op.kind]  # the weight's: [in, out], or [E, in, out]
        # the rows a weight gradient contracts: every token's (a grouped GEMM's per expert,
        # a scale per expert and column: the same bytes read, E times the few scales written)
        tokens = tuple(range(len(graph.tensor(x).shape) - 1))
        k, n = dims - 2, dims - 1  # the weight's axes the forward and dX contract
        out.replace_op(attrs.evolve(op, inputs=[casts.fp8(x, op, Phase.FORWARD, (-1,)),
                                                casts.fp8(w, op, Phase.FORWARD, (k,)),
                                                *op.inputs[2:]]))
        for kernel in backward.get(op.name, []):
            a, b = kernel.inputs[:2]
            if w in (a, b):  # dX = dY W^T: both along N
                axes = {w: (n,)}
                grad_axes = (-1,)
            else:  # dW = X^T dY: both along the tokens
                axes = {x: tokens}
                grad_axes = tokens
            pair = []
            for name in (a, b):
                if name in axes:
                    pair.append(casts.fp8(name, kernel, Phase.BACKWARD, axes[name]))
                elif graph.tensor(name).grad_of == op.outputs[0]:
                    pair.append(casts.fp8(name, kernel, Phase.BACKWARD, grad_axes))
                else:
                    pair.append(name)
            _rescaled(out, kernel, pair, [casts.amaxes.get(t) for t in pair])


def _rescaled(out: Graph, kernel: Op, pair: list[str], amaxes: list[str | None]) -> None:
    """`kernel` reading `pair` and writing its product to a tensor of its own, and a `rescale`
    op that scales the product by its operands' amaxes into the kernel's output, adding the
    partial gradients the kernel accumulated into."""
    if None in amaxes:  # an operand the recipe does not cast: nothing to rescale
        out.replace_op(attrs.evolve(kernel, inputs=[*pair, *kernel.inputs[2:]]))
        return
    written, *rest = kernel.outputs  # the product; a fused bias gradient stays the kernel's
    target = out.tensor(written)
    accumulated = int(kernel.param("accumulate", 0))
    own = kernel.inputs[2:len(kernel.inputs) - accumulated]
    product = out.add_tensor(attrs.evolve(target, name=f"{written}.unscaled", dtype=BF16))
    params = tuple((k, v) for k, v in kernel.params if k != "accumulate")
    out.replace_op(attrs.evolve(kernel, inputs=[*pair, *own], outputs=[product.name, *rest],
                                params=params))
    partials = kernel.inputs[len(kernel.inputs) - accumulated:] if accumulated else ()
    out.add_op(Op(f"{kernel.name}.rescale", "rescale", "elementwise",
                  [product.name, *amaxes, *partials], [written], count=kernel.count,
                  phase=kernel.phase, region=kernel.region,
                  params={"accumulate": accumulated} if accumulated else {}))


@step_pass(at=PRECISION,
           bind=lambda o: o.precision != "bf16" and {"precision": o.precision})
@contract(requires=("backward",), forbids=("recomputed",))
def apply_precision(graph: Graph, precision: str = "bf16") -> Graph:
    """`graph` (a step with its backward) with the layers' matmuls in `precision`:
    `apply_precision(derive_backward(forward), "fp8")`."""
    if precision not in PRECISIONS:
        raise OpgraphError(f"unknown precision {precision!r}; choose one of "
                           f"{', '.join(PRECISIONS)}")
    out = graph.copy()
    if precision == "bf16":
        return out
    matmuls = fp8_matmuls(graph)
    backward = {}
    for op in graph.ops():
        if op.phase is Phase.BACKWARD and op.forward is not None:
            backward.setdefault(op.forward, []).append(op)
    (_rowwise if precision == "fp8-rowwise" else _tensorwise)(graph, out, matmuls, backward)
    return out


__all__ = ["FP8_KINDS", "PRECISIONS", "apply_precision", "fp8_matmuls"]
