"""regather_inputs: under sequence parallelism, keep a column-parallel matmul's sequence shard for
its backward and all-gather it again there, as Megatron-LM does, instead of keeping the
gathered input; and under ring attention, keep each GPU's own keys and values and pass them
around the ring again in the backward, as every ring implementation does, instead of keeping
the whole sequence's.

Invariant established: no backward op reads the output of a forward `all_gather` over `tp`
(where the framework keeps the shard) or over `cp` (ring attention) inside a layer, nor does a
recomputed attention core the latter; each such gather has one op of phase `recompute`,
`<gather>.re`, reading the same shard and writing `<gathered>@regather`, placed just before the
first of those readers, and they read its copy. The forward's gathered tensor then lives
only until the forward matmul has read it: a layer saves S/tp x D of the matmul's input, not
S x D (Korthikanti et al. 2022, section 4.2.2: "we store only the sequence-parallel sharded
input ... and perform an extra all-gather in the backward pass"; Megatron-LM's
`LinearWithGradAccumulationAndAsyncCommunication`, `megatron/core/tensor_parallel/layers.py`).
The extra all-gather moves the forward's bytes again, once per layer per micro-batch. Megatron
issues it as the matmul's backward begins and hides it under the input-gradient GEMM; the
schedule (`opgraph.parallel.schedule`) starts a collective as soon as its input is written, so it
runs on the tp stream under the forward's compute instead: hidden either way while a GEMM outlasts
it.

Which frameworks do it is `frameworks.Traits.sp_saves_shard`; for the others (and for layouts
without sequence parallelism) the pass returns its input. A gather a recomputation policy already
re-runs (`full`) has no backward reader left: nothing to do.

Ring attention's gathers of keys and values (`rules.ring_gather`, context parallelism with
`cp_comm` "ring") are run again the same way, whatever the framework: a ring keeps only the
GPU's own block for its backward and rotates the blocks again there (PyTorch's
`_templated_ring_attention_backward`, `torch/distributed/tensor/experimental/_attention.py`,
which all-gathers them again through its rotater before each step's kernel; Transformer
Engine's `AttnFuncWithCPAndKVP2P`, which Megatron-LM runs, sends them around the ring in its
backward). A layer then saves S/cp of the keys and values, not S.

    >>> from opgraph.models import preset
    >>> from opgraph.parallel.distributed import compile_parallel
    >>> g = compile_parallel(preset("llama3-8b"), Parallel(tp=8, sequence_parallel=True,
    ...                                                   framework="megatron"))
    >>> g.op("layers.attn_norm.all_gather.tp.re").phase.value
    'recompute'
"""

from __future__ import annotations

import attrs

from opgraph.core import rules
from opgraph.core.contracts import LAYOUT, contract, step_pass
from opgraph.core.ir import Graph, Phase
from opgraph.parallel.frameworks import traits
from opgraph.parallel.parallel import Parallel


@step_pass(at=LAYOUT, bind=lambda o: o.layout and {"layout": o.layout},
           structure={"layout": lambda p: (p.sequence_parallel
                                           and traits(p).sp_saves_shard,
                                           p.cp > 1 and p.cp_comm == "ring")})
@contract(requires=("backward",))
def regather_inputs(graph: Graph, layout: Parallel) -> Graph:
    """`graph` (a step with its backward) with each sequence-parallel gather and each ring
    attention's gather that a backward op reads run again before it (see the module);
    unchanged where the layout's framework keeps the gathered input and no ring runs."""
    sequence = layout.sequence_parallel and traits(layout).sp_saves_shard
    ring = layout.cp > 1 and layout.cp_comm == "ring"
    if not (sequence or ring):
        return graph
    order = {op.name: i for i, op in enumerate(graph.ops())}
    out = graph.copy()
    for op in graph.ops():
        if op.region is None or not ((sequence and rules.sequence_gather(op))
                                     or (ring and rules.ring_gather(op))):
            continue
        (gathered,) = op.outputs
        # a ring's readers after the forward: the backward's, and an attention core a
        # recomputation runs again (selective), which reads the blocks as the backward does
        after = ((Phase.BACKWARD, Phase.RECOMPUTE) if rules.ring_gather(op)
                 else (Phase.BACKWARD,))
        readers = sorted((c for c in graph.consumers(gathered) if c.phase in after),
                         key=lambda c: order[c.name])
        if not readers:
            continue
        copy = f"{gathered}@regather"
        first = readers[0].name
        out.add_tensor(attrs.evolve(graph.tensor(gathered), name=copy), before=first)
        out.add_op(attrs.evolve(op, name=f"{op.name}.re", outputs=(copy,),
                                phase=Phase.RECOMPUTE, forward=op.name), before=first)
        out.reroute(readers, gathered, copy)  # a reader of two gathers (K and V): both
    return out
