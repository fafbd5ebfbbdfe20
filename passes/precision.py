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
from opgraph.core.ir import FP8, FP32, Graph, Op, Phase, Role, Tensor

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
    """The FP8 copies made so far, one per source tensor and phase."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.made: dict[tuple[str, Phase], str] = {}

    def fp8(self, source: str, at: Op, phase: Phase) -> str:
        """The FP8 copy of `source`, made by an `amax` and a `cast` op in `at`'s region."""
        key = (source, phase)
        if key in self.made:
            return self.made[key]
        g, t = self.graph, self.graph.tensor(source)
        role = Role.GRADIENT if t.role is Role.GRADIENT else Role.ACTIVATION
        amax = g.add_tensor(Tensor(f"amax.{source}", (), FP32, role, at.count, region=at.region))
        copy = g.add_tensor(Tensor(f"fp8.{source}", t.shape, FP8, role, at.count,
                                   region=at.region))
        category = "elementwise"
        g.add_op(Op(f"fp8.{source}.amax", "amax", category, [source], [amax.name],
                    count=at.count, phase=phase, region=at.region))
        g.add_op(Op(f"fp8.{source}.cast", "cast", category, [source, amax.name], [copy.name],
                    count=at.count, phase=phase, region=at.region))
        self.made[key] = copy.name
        return copy.name


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
    casts = _Casts(out)
    matmuls = fp8_matmuls(graph)
    for gather in _fp8_gathers(graph, matmuls):
        shard = casts.fp8(gather.inputs[0], gather, Phase.FORWARD)
        out.replace_op(attrs.evolve(gather, inputs=(shard, *gather.inputs[1:])))
        (gathered,) = gather.outputs
        out.replace_tensor(attrs.evolve(out.tensor(gathered), dtype=FP8))
        casts.made[(gathered, Phase.FORWARD)] = gathered
    backward = {}
    for op in graph.ops():
        if op.phase is Phase.BACKWARD and op.forward is not None:
            backward.setdefault(op.forward, []).append(op)
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
    return out


__all__ = ["FP8_KINDS", "PRECISIONS", "apply_precision", "fp8_matmuls"]
