"""cache_fp8_weights: a framework that casts each weight to FP8 once a step, not per micro-batch.

Invariant established: where the layout's framework caches FP8 weights
(`frameworks.Traits.caches_fp8_weights`), every forward `amax` and `cast` op that reads a weight
(`passes.precision` makes them, one pair per weight the FP8 matmuls read) carries
`cached=True`. The schedule runs such an op once per step rather than once per micro-batch
(`schedule.once_per_step`), and the step's memory holds its output once, with the weights
(`memory.resident_tensors`), rather than as an activation each micro-batch in flight keeps
until its backward. Nothing else changes: the pass is a mark.

Why it matters: Transformer Engine casts a weight to FP8 on a step's first micro-batch and
reuses the copy for the others (`is_first_microbatch`, which Megatron-LM passes to its TE
layers: `megatron/core/extensions/transformer_engine.py`). A pipeline stage of Llama 3 70B at
TP 4 holds 10 layers of 215 M parameters each; kept per micro-batch, their FP8 copies would
take 2.15 GB for each of the 9.4 micro-batches in flight. torchao's Float8Linear, which
torchtitan runs, casts the weight in every forward: the precision pass's own behaviour.

    >>> from opgraph.models import preset
    >>> from opgraph.parallel.distributed import compile_parallel
    >>> g = compile_parallel(preset("llama3.2-1b"), Parallel(framework="megatron"),
    ...                      precision="fp8")
    >>> g.op("fp8.layers.q_proj.weight.cast").param("cached")
    True
"""

from __future__ import annotations

from opgraph.core.contracts import LAYOUT, contract, step_pass
from opgraph.core.ir import Graph, Phase, Role, with_params
from opgraph.parallel.frameworks import traits
from opgraph.parallel.parallel import Parallel

CASTS = ("amax", "cast")  # the kinds `passes.precision` makes an FP8 copy with


@step_pass(at=LAYOUT + 2, bind=lambda o: o.layout and {"layout": o.layout},
           structure={"layout": lambda p: (traits(p).caches_fp8_weights,)})
@contract(requires=("backward",))
def cache_fp8_weights(graph: Graph, layout: Parallel) -> Graph:
    """`graph` with the FP8 casts of its weights marked `cached` where the layout's framework
    casts them once a step (see the module); `graph` itself where it does not, or nothing is
    cast."""
    if not traits(layout).caches_fp8_weights:
        return graph
    return with_params(graph, {op.name: {"cached": True} for op in graph.ops()
                               if op.kind in CASTS and op.phase is Phase.FORWARD
                               and graph.tensor(op.inputs[0]).role is Role.WEIGHT})
