"""sum_tp_partials: under async TP, where the framework micro-pipelines a matmul's reduce-scatter
as PyTorch does, exchange the matmul's partial products and sum them on the compute stream.

PyTorch's async TP (`torch.distributed._symmetric_memory`, `_fused_matmul_reduce_scatter_impl`,
which torchtitan's `enable_async_tensor_parallel` turns on) does not reduce inside the
collective as NCCL's reduce-scatter does. Each GPU computes the block of the matmul's output
that each other GPU keeps, block after block, and the GPUs copy the blocks to their owners
under the next block's compute (`_pipelined_produce_and_all2all`: an all-to-all); then each
sums the tp blocks of its own shard it holds, in one kernel of its own on the compute stream
(`reduce_partials`): it reads tp shards and writes one.

Invariant established: no `reduce_scatter` over `tp` whose input a matrix multiply writes is
left; each is an `all_to_all` over `tp` (its name and place kept, the same bytes on the wire)
writing `<shard>@partials`, the shape of its input, and an op `<name>.sum` of kind
`sum_partials` (the forward's and the backward's alike: the input gradient of a
column-parallel matmul is reduce-scattered so) reads that and writes the shard. A
reduce-scatter of what no matmul writes (a vocabulary-parallel embedding's partial sums) is
NCCL's: left.

The schedule (`opgraph.parallel.schedule`) runs the all-to-all beside the matmul that wrote it,
as it runs any tensor-parallel collective under async TP, from the matmul's first block on.
Which frameworks do this is `frameworks.Traits.sums_tp_partials`; for the others, and for
layouts without async TP, the pass returns its input.

    >>> from opgraph.models import preset
    >>> from opgraph.parallel.distributed import compile_parallel
    >>> g = compile_parallel(preset("llama3-8b"), Parallel(tp=8, sequence_parallel=True,
    ...                      async_tp=True, framework="torchtitan"))
    >>> g.op("layers.o_proj.reduce_scatter.tp.sum").kind
    'sum_partials'
"""

from __future__ import annotations

import attrs

from opgraph.core import rules
from opgraph.core.contracts import LAYOUT, contract, step_pass
from opgraph.core.ir import Graph, Op
from opgraph.parallel.frameworks import traits
from opgraph.parallel.parallel import Parallel


def _pipelined(layout: Parallel) -> bool:
    return layout.async_tp and layout.tp > 1 and traits(layout).sums_tp_partials


def _fused(graph: Graph, op: Op) -> bool:
    """Whether `op` is a tensor-parallel reduce-scatter of a matrix multiply's output."""
    if op.kind != "reduce_scatter" or op.param("group") != "tp":
        return False
    writer = graph.producer(op.inputs[0])
    return writer is not None and writer.kind in rules.GEMM_GRIDS


@step_pass(at=LAYOUT + 6, bind=lambda o: o.layout and {"layout": o.layout},
           structure={"layout": lambda p: (_pipelined(p),)})
@contract(requires=("backward",))
def sum_tp_partials(graph: Graph, layout: Parallel) -> Graph:
    """`graph` (a step with its backward) with each matmul's tensor-parallel reduce-scatter an
    all-to-all of its partial products and their sum (see the module); `graph` itself where
    the layout's framework reduces in the collective or async TP is off."""
    if not _pipelined(layout):
        return graph
    order = {op.name: i for i, op in enumerate(graph.ops())}
    out = graph.copy()
    for op in graph.ops():
        if not _fused(graph, op):
            continue
        (shard,) = op.outputs
        partials = f"{shard}@partials"
        readers = graph.consumers(shard)
        first = min(readers, key=lambda c: order[c.name]).name if readers else None
        out.add_tensor(attrs.evolve(graph.tensor(op.inputs[0]), name=partials), before=first)
        out.replace_op(attrs.evolve(op, kind="all_to_all", outputs=(partials,),
                                    params=tuple((k, v) for k, v in op.params
                                                 if k not in ("axis", "size"))))
        out.add_op(Op(f"{op.name}.sum", "sum_partials", "elementwise", (partials,), (shard,),
                      count=op.count, phase=op.phase, region=op.region,
                      params=(("axis", op.param("axis")), ("size", op.param("size")))),
                   before=first)
    return out
