"""sort_local_experts: a framework whose dispatcher sorts the tokens a GPU receives by local
expert before the expert GEMMs, and back before returning them.

Invariant established: where the layout's framework does
(`frameworks.Traits.sorts_by_local_expert`) and experts are spread over GPUs, the output of each
expert-parallel all-to-all an expert GEMM reads goes through a `moe_sort` copy (the tokens
grouped by local expert), and each expert GEMM output an all-to-all returns through another (back
in the order the sources sent them, before the tensor-parallel reduction where there is one, as
Megatron-LM unsorts before it). Each is marked `eager`, so that its bytes are its kind's rule's
(`rules.EAGER_BYTES`): its copy's where a GPU holds more than one expert and none where it holds
one (`rules.moe.SORTS`, E / ep), as the dispatcher skips it there; the host's launches for it
(`launches`) likewise; so is its backward, the gradient's copy the other way. No FLOPs. The
sorted tensor stands where the received one stood, so the expert GEMMs keep a tensor of the
same size.

Why it matters: Megatron-LM's all-to-all dispatcher receives each local expert's tokens as one
chunk per source rank and concatenates them by expert, then restores the order for the return
(`sort_chunks_by_idxs` in `MoEAlltoAllTokenDispatcher.dispatch_postprocess` and
`combine_preprocess`, megatron/core/transformer/moe/token_dispatcher.py): with top-8 routing
each copy moves 8 times the layer's tokens, more than the dispatch's own permutation.

    >>> from opgraph.models import preset
    >>> from opgraph.parallel.distributed import compile_parallel
    >>> g = compile_parallel(preset("mixtral-8x7b"), Parallel(ep=4, dp=4, framework="megatron"))
    >>> [op.name for op in g.ops() if op.kind == "moe_sort"]
    ['layers.experts.permute.all_to_all.ep.sort', 'layers.experts.down_proj.unsort']
"""

from __future__ import annotations

import attrs

from opgraph.core import rules
from opgraph.core.contracts import SHARD, step_pass
from opgraph.core.ir import Graph, Op
from opgraph.core.rules.moe import SORTS
from opgraph.parallel.frameworks import traits
from opgraph.parallel.parallel import Parallel


def _expert_exchanges(graph: Graph) -> tuple[list[Op], list[Op]]:
    """The forward expert-parallel all-to-alls an expert GEMM reads from (the dispatch), and
    the expert GEMMs whose output an all-to-all sends back, through the tensor-parallel
    reduction where there is one (the return: Megatron-LM unsorts before that reduction)."""
    dispatches, returns = [], []
    for op in graph.ops():
        if op.kind != "all_to_all" or op.param("group") != "ep":
            continue
        if any(rules.shards_as(r.kind, "expert") for r in graph.consumers(op.outputs[0])):
            dispatches.append(op)
            continue
        writer = graph.producer(op.inputs[0])
        while (writer is not None and writer.kind in rules.COLLECTIVE_KINDS
               and writer.param("group") == "tp"):
            writer = graph.producer(writer.inputs[0])
        if writer is not None and rules.shards_as(writer.kind, "expert"):
            returns.append(writer)
    return dispatches, returns


def _sort(graph: Graph, out: Graph, source: str, name: str, at: Op) -> None:
    """A `moe_sort` of tensor `source` in `out` where op `at` runs, before the first op that
    reads `source` in `graph`; every such op reads the sorted tensor instead."""
    readers = graph.consumers(source)
    t = out.tensor(source)
    sorted_ = out.add_tensor(attrs.evolve(t, name=f"{name}@sorted"), before=readers[0].name)
    out.add_op(Op(name, "moe_sort", "routing", (source,), (sorted_.name,), count=at.count,
                  params={"eager": True, "launches": SORTS}, region=at.region),
               before=readers[0].name)
    out.reroute(readers, source, sorted_.name)


@step_pass(at=SHARD + 1, bind=lambda o: o.layout and {"layout": o.layout},
           structure={"layout": lambda p: (traits(p).sorts_by_local_expert and p.ep > 1,)})
def sort_local_experts(graph: Graph, layout: Parallel) -> Graph:
    """`graph` (sharded, before its backward) with the dispatcher's sorts by local expert
    where the layout's framework runs them (see the module); `graph` itself otherwise."""
    if not (traits(layout).sorts_by_local_expert and layout.ep > 1):
        return graph
    dispatches, returns = _expert_exchanges(graph)
    if not (dispatches or returns):
        return graph
    out = graph.copy()
    for a2a in dispatches:  # what the expert GEMMs read, grouped by local expert
        _sort(graph, out, a2a.outputs[0], f"{a2a.name}.sort", a2a)
    for gemm in returns:  # what they wrote, back in the order it came in
        _sort(graph, out, gemm.outputs[0], f"{gemm.outputs[0]}.unsort", gemm)
    return out
