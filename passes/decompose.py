"""decompose: the op kinds a framework runs in eager PyTorch cost the kernels eager PyTorch runs.

Invariant established: every forward and re-run op whose kind the layout's framework runs eagerly
(`frameworks.Traits.eager`) carries `eager=True`, and the cost model charges it the HBM bytes of
that kind's eager kernels (`rules.EAGER_BYTES`) in place of one kernel's; its backward, costed
from it, follows; and the step's liveness holds the tensors those kernels write beside the op's
own while it runs (`rules.EAGER_WORKSPACE`: the loss's FP32 copies of the logits) and those
their autograd keeps for the backward (`rules.EAGER_SAVED`: a norm's FP32 input, SwiGLU's
silu). Nothing else changes: the ops, tensors and FLOPs are the same, so the pass is a mark
rather than a rewrite, and a compiled run's fusion (`fuse_elementwise`) takes the mark off the
kinds it generates kernels for, except where the framework compiles only the
transformer blocks and the op lies outside them (`eager="always"`: torchtitan's final norm, and
its loss before it compiled the loss too, the row "torchtitan-2024").

Why it matters: a memory-bound op moves its tensor once in a fused kernel, but torchtitan's
eager RMSNorm moves it nine times over (an FP32 copy, its square, the scaled copy, the cast
back, the weight's product), so a run without torch.compile spends a share of its step in HBM
traffic that a fused model does not see. torchtitan measured Llama 3.1 8B on 8 H100s at 5,762
tokens/s per GPU eager and 6,667 compiled (`benchmarks/llama3_h100_202412_torchtitan.md`).

    >>> from opgraph.models import preset
    >>> from opgraph.parallel.distributed import compile_parallel
    >>> g = compile_parallel(preset("llama3-8b"), Parallel(dp=8, zero=3, framework="torchtitan"))
    >>> g.op("layers.attn_norm").param("eager")
    True
"""

from __future__ import annotations

from opgraph.core.contracts import LAYOUT, contract, step_pass
from opgraph.core.ir import Graph, Phase, with_params
from opgraph.parallel.frameworks import traits
from opgraph.parallel.parallel import Parallel

MARKED = (Phase.FORWARD, Phase.RECOMPUTE)  # a re-run forward op runs the same kernels again
# the mark of an op outside the layer stack where the framework compiles the blocks alone
# (`Traits.compiles_blocks_only`): eager in a compiled run too, so no fusion takes it
ALWAYS = "always"


@step_pass(at=LAYOUT + 1, bind=lambda o: o.layout and {"layout": o.layout},
           structure={"layout": lambda p: (traits(p).eager, traits(p).compiles_blocks_only,
                                           traits(p).compiles_outside_blocks)})
@contract(requires=("backward",))
def decompose(graph: Graph, layout: Parallel) -> Graph:
    """`graph` with its ops of the layout's framework's eager kinds marked `eager` (see the
    module); `graph` itself where the framework runs none."""
    t = traits(layout)
    return with_params(graph, {
        op.name: {"eager": ALWAYS if (t.compiles_blocks_only and op.region is None
                                      and op.kind not in t.compiles_outside_blocks) else True}
        for op in graph.ops()
        if op.kind in t.eager and op.phase in MARKED and not op.param("eager")})
