"""regather_inputs: under sequence parallelism, keep a column-parallel matmul's sequence shard for
its backward and all-gather it again there, as Megatron-LM does, instead of keeping the
gathered input.

Invariant established: no backward op reads the output of a forward `all_gather` over `tp`
inside a layer; each such gather has one op of phase `recompute`, `<gather>.re`, reading the
same sequence shard and writing `<gathered>@regather`, placed just before the first backward op
that reads it, and those backward ops read its copy. The forward's gathered tensor then lives
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
                                           and traits(p).sp_saves_shard,)})
@contract(requires=("backward",))
def regather_inputs(graph: Graph, layout: Parallel) -> Graph:
    """`graph` (a step with its backward) with each sequence-parallel gather that a backward
    op reads run again before it (see the module); unchanged where the layout's framework
    keeps the gathered input."""
    if not (layout.sequence_parallel and traits(layout).sp_saves_shard):
        return graph
    order = {op.name: i for i, op in enumerate(graph.ops())}
    out = graph.copy()
    for op in graph.ops():
        if not rules.sequence_gather(op) or op.region is None:
            continue
        (gathered,) = op.outputs
        readers = sorted((c for c in graph.consumers(gathered) if c.phase is Phase.BACKWARD),
                         key=lambda c: order[c.name])
        if not readers:
            continue
        copy = f"{gathered}@regather"
        first = readers[0].name
        out.add_tensor(attrs.evolve(graph.tensor(gathered), name=copy), before=first)
        out.add_op(attrs.evolve(op, name=f"{op.name}.re", outputs=(copy,),
                                phase=Phase.RECOMPUTE, forward=op.name), before=first)
        for reader in readers:
            out.replace_op(attrs.evolve(reader, inputs=tuple(copy if n == gathered else n
                                                             for n in reader.inputs)))
    return out
