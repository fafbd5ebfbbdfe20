"""derive_backward: append the backward graph to a forward graph.

Invariant established: every forward op whose outputs need a gradient has backward ops (phase
`backward`, `forward=` naming it) that read the output gradients and the saved forward tensors
they need, and write gradient tensors (`grad_of=` naming the primal); each weight ends with one
final gradient tensor (`gradient_of(graph, weight)`), which the optimizer consumes.

Which kernels a backward is made of is each kind's VJP rule (`vjp`, declared with the kind in
its family's module, `opgraph.core.rules`; VJP_RULES is their table); every kernel is
well typed, an op of a kind with a shape rule and a FLOP rule (`opgraph.core.rules`): a matmul's
backward is two real matmuls, dX = dY W^T (`transpose_b` flipped) and dW = X^T dY
(`contract="leading"`, the token dims summed, the weight's shape). Nothing here is costed: what
a backward kernel costs is the cost model's choice (`opgraph.cost.costmodel`), by default the
plate's convention through each kernel's `forward` link.

A tensor read by several ops gets its gradient contributions accumulated in the kernels' epilogues:
the second contributor reads the first one's partial gradient and writes the sum, so every tensor
is still produced once and no extra kernel appears.
"""

from __future__ import annotations

from collections.abc import Callable

from opgraph.core import rules
from opgraph.core.contracts import BACKWARD, contract, step_pass
from opgraph.core.ir import FP32, DType, Graph, Op, Phase, Role, Tensor


class _Context:
    """What a VJP rule may ask while it builds one forward op's backward kernels."""

    def __init__(self, graph: Graph, needs: set[str], weight_grad_dtype: DType):
        self.graph = graph
        self.needs = needs  # tensors that need a gradient
        self.latest: dict[str, str] = {}  # primal -> its newest (partial) gradient
        self.made: dict[str, int] = {}  # primal -> how many partial gradients so far
        self.weight_grad_dtype = weight_grad_dtype
        self.fixed: dict[str, str] = {}  # primal -> the existing tensor its gradient must be

    def grad(self, name: str) -> str | None:
        return self.latest.get(name)

    def emit(self, fwd: Op, suffix: str, kind: str, reads: list[str], grads: list[str],
             **params) -> Op | None:
        """A backward kernel of `fwd` reading `reads` and writing gradients of `grads` (those
        that need one), with `fwd`'s parameters updated by `params`; None if none of `grads`
        needs a gradient. Partial gradients it accumulates into are read last (`accumulate`)."""
        grads = [n for n in dict.fromkeys(grads) if n in self.needs]
        if not grads:
            return None
        reads = list(reads)  # a tensor read twice (mul(x, x)) is listed twice: the layout counts it
        own = len(reads)
        outs = []
        for primal in grads:
            previous = self.latest.get(primal)
            if previous is not None and previous not in reads:
                reads.append(previous)  # accumulate into the partial gradient
            outs.append(self._new_grad(primal))
        merged = {k: v for k, v in {**dict(fwd.params), **params}.items() if v is not None}
        if len(reads) > own:
            merged["accumulate"] = len(reads) - own
        return Op(f"{fwd.name}.{suffix}", kind, fwd.category, reads, outs, count=fwd.count,
                  phase=Phase.BACKWARD, params=merged, forward=fwd.name,
                  region=fwd.region)

    def wrt(self, fwd: Op, names: list[str]) -> tuple[int, ...]:
        """Positions in `fwd`'s inputs of those of `names` that need a gradient."""
        return tuple(fwd.inputs.index(n) for n in dict.fromkeys(names) if n in self.needs)

    def _new_grad(self, primal: str) -> str:
        if primal in self.fixed:  # rebuilding kernels inside a backward: the name stays
            self.latest[primal] = self.fixed[primal]
            return self.fixed[primal]
        t = self.graph.tensor(primal)
        n = self.made[primal] = self.made.get(primal, 0) + 1
        name = f"d.{primal}" if n == 1 else f"d.{primal}#{n}"
        dtype = self.weight_grad_dtype if t.role is Role.WEIGHT else t.dtype
        self.graph.add_tensor(Tensor(name, t.shape, dtype, Role.GRADIENT, t.count, grad_of=primal,
                                     region=t.region))
        self.latest[primal] = name
        return name


# Which kernels a backward is made of: each kind's `vjp` (its family's module in
# `opgraph.core.rules`), one table keyed by kind.
VJP_RULES: dict[str, Callable] = rules.VJP_RULES


# --- the pass -------------------------------------------------------------------------------------

def _needs_grad(graph: Graph) -> set[str]:
    needs = {t.name for t in graph.tensors()
             if t.role is Role.WEIGHT
             or (t.role is Role.ACTIVATION and graph.producer(t.name) is None)}
    for op in graph.ops():
        if op.phase is Phase.FORWARD and any(n in needs for n in op.inputs):
            needs.update(n for n in op.outputs if graph.tensor(n).role is Role.ACTIVATION)
    return needs


@step_pass(at=BACKWARD)
@contract(forbids=("backward",))
def derive_backward(graph: Graph, *, weight_grad_dtype: DType = FP32) -> Graph:
    """The forward graph with its backward appended; weight gradients are written in
    `weight_grad_dtype` (FP32, the buffer gradients accumulate in).

        >>> from opgraph.models import preset
        >>> step = derive_backward(preset("llama3-8b"))
        >>> [op.kind for op in step.ops() if op.forward == "layers.q_proj"]
        ['matmul', 'matmul']
    """
    if any(op.phase is not Phase.FORWARD for op in graph.ops()):
        raise ValueError(f"graph {graph.name} already has a backward")
    out = graph.copy()
    needs = _needs_grad(graph)
    ctx = _Context(out, needs, weight_grad_dtype)
    for sink in graph.tensors():  # seed: d(loss)/d(loss) for each scalar sink
        if sink.name in needs and not graph.consumers(sink.name) and graph.producer(sink.name):
            ctx._new_grad(sink.name)
    for op in reversed(graph.ops()):
        if not any(ctx.grad(n) for n in op.outputs):
            continue
        try:
            rule = VJP_RULES[op.kind]
        except KeyError:
            raise NotImplementedError(f"no backward rule for op kind {op.kind!r} (op {op.name}); "
                                      "declare its vjp (opgraph.core.kinds.define_kind)") from None
        for kernel in rule(ctx, op):
            out.add_op(kernel)
    return out


def backward_kernels(graph: Graph, op: Op, *, output_grads: dict[str, str],
                     writes: dict[str, str], accumulate: dict[str, str] | None = None
                     ) -> list[Op]:
    """The kernels VJP_RULES make for `op` inside a step whose backward exists already (a pass
    that replaces forward ops replaces their backward kernels this way): `output_grads` maps
    each of `op`'s outputs to its gradient, `writes` each input that gets a gradient to the
    existing tensor that gradient must be, and `accumulate` an input to the partial gradient
    the kernel adds into. No tensor is made; the kernels read and write those named."""
    ctx = _Context(graph, set(writes), FP32)
    ctx.latest = {**output_grads, **(accumulate or {})}
    ctx.fixed = dict(writes)
    return VJP_RULES[op.kind](ctx, op)


def gradient_of(graph: Graph, name: str) -> Tensor | None:
    """The final gradient of tensor `name`: the last of its partial gradients."""
    grads = [t for t in graph.tensors() if t.grad_of == name]
    # a partial that a kernel reads to write a later partial of the same tensor is not final
    accumulated = {t.name for t in grads for op in graph.consumers(t.name)
                   if any(graph.tensor(n).grad_of == name for n in op.outputs)}
    final = [t for t in grads if t.name not in accumulated]
    return final[-1] if final else None
