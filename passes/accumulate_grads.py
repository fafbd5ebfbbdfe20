"""accumulate_grads: a framework that adds each micro-batch's BF16 weight gradients into FP32
buffers with kernels of their own.

Invariant established: where the layout's framework does (`frameworks.Traits.adds_grads_in_fp32`),
each weight's FP32 gradient is written by an `add` of the backward, reading the BF16 gradient its
last backward kernel now writes and the FP32 buffer as the micro-batches before left it (a
resident gradient buffer, not a new one). The add runs every micro-batch, after the backward, and
each BF16 gradient is live until it runs.

Why: nanotron's `FP32GradientAccumulator` (`src/nanotron/optim/gradient_accumulator.py`, the
playbook's runs set `accumulate_grad_in_fp32`) lets autograd write `param.grad` in BF16, then
after `loss.backward()` runs `fp32_grad.add_(half_param.grad)` for every parameter and frees the
BF16 gradient: 2 + 4 bytes read and 4 written per parameter, every micro-batch. Megatron-LM's
weight-gradient GEMM accumulates into its FP32 main gradient itself
(`--gradient-accumulation-fusion`, on by default), the generic model's one kernel.

    >>> from opgraph.models import preset
    >>> from opgraph.parallel.distributed import compile_parallel
    >>> g = compile_parallel(preset("llama3.2-1b"), Parallel(framework="nanotron"))
    >>> add = g.op("accumulate.layers.q_proj.weight")
    >>> [g.tensor(n).dtype.name for n in (*add.inputs, *add.outputs)]
    ['bf16', 'fp32', 'fp32']
"""

from __future__ import annotations

import attrs

from opgraph.core.contracts import LAYOUT, contract, step_pass
from opgraph.core.ir import BF16, FP32, Graph, Op, Phase, Role, Tensor
from opgraph.parallel.frameworks import traits
from opgraph.parallel.parallel import Parallel

from .derive_backward import gradient_of


@step_pass(at=LAYOUT + 3, bind=lambda o: o.layout and {"layout": o.layout},
           structure={"layout": lambda p: (traits(p).adds_grads_in_fp32,)})
@contract(requires=("optimizer",), forbids=("replicated",))
def accumulate_grads(graph: Graph, layout: Parallel) -> Graph:
    """`graph` with each weight's FP32 gradient accumulated by an add of its own where the
    layout's framework does so (see the module); `graph` itself where it does not."""
    if not traits(layout).adds_grads_in_fp32:
        return graph
    out = graph.copy()
    for w in graph.weights():
        g = gradient_of(graph, w.name)
        # from `out`: one kernel may write several weights' gradients (a norm's weight and bias)
        writer = None if g is None else out.producer(g.name)
        if writer is None or writer.phase is not Phase.BACKWARD or g.dtype is not FP32:
            continue
        half = out.add_tensor(attrs.evolve(g, name=f"{g.name}.bf16", dtype=BF16,
                                           role=Role.ACTIVATION, grad_of=None))
        buffer = out.add_tensor(Tensor(f"{g.name}.fp32", g.shape, FP32, Role.GRADIENT, g.count,
                                       grad_of=w.name, region=g.region))
        out.replace_op(attrs.evolve(writer, outputs=tuple(
            half.name if n == g.name else n for n in writer.outputs)))
        out.add_op(Op(f"accumulate.{w.name}", "add", "elementwise", (half.name, buffer.name),
                      (g.name,), count=g.count, phase=Phase.BACKWARD, region=g.region))
    return out
