"""pick_attention_kernel: a framework whose attention runs a fused attention library's kernels
(cuDNN's) rather than FlashAttention's.

Invariant established: where the layout's framework does (`frameworks.Traits.attention_library`
is "cudnn"), every FlashAttention op, forward and backward, carries `efficiency`, the
efficiency of its generation its arithmetic runs at: `attention_fused` (its backward
`attention_fused_backward`, the same rate in the backward's charged FLOPs), which
`calibration.toml` gives where measured and which is `attention` elsewhere. FLOPs, bytes and
the ops do not change. Nothing else changes: the pass is a mark.

Why it matters: Megatron-LM's attention is Transformer Engine's `DotProductAttention`, which
on Hopper and later picks cuDNN's fused attention over FlashAttention ("Disabling
FlashAttention to give FusedAttention preference on Hopper+ for performance reasons",
`transformer_engine/pytorch/attention/dot_product_attention/utils.py`,
`get_attention_backend`). On one H200 cuDNN's kernel ran causal attention at head dim 128 and
8,192 tokens at 586 TFLOP/s forward and 496 backward, FlashAttention-2's at 330 and 298
(benchmarks/device/h200). torchtitan (PyTorch's SDPA) and nanotron (flash-attn) are taken to run
FlashAttention-2, the generic model's kernel.

    >>> from opgraph.models import preset
    >>> from opgraph.parallel.distributed import compile_parallel
    >>> g = compile_parallel(preset("llama3.2-1b"), Parallel(framework="megatron"))
    >>> g.op("layers.attn.flash").param("efficiency")
    'attention_fused'
"""

from __future__ import annotations

from opgraph.core.contracts import LAYOUT, contract, step_pass
from opgraph.core.ir import Graph, with_params
from opgraph.parallel.frameworks import traits
from opgraph.parallel.parallel import Parallel

# A FlashAttention kind -> the efficiency its kernel runs at in a fused attention library
FUSED = {"flash_attention": "attention_fused",
         "flash_attention_backward": "attention_fused_backward"}


@step_pass(at=LAYOUT + 5, bind=lambda o: o.layout and {"layout": o.layout},
           structure={"layout": lambda p: (traits(p).attention_library,)})
@contract(requires=("backward",))
def pick_attention_kernel(graph: Graph, layout: Parallel) -> Graph:
    """`graph` with each FlashAttention op marked to run at the fused library's efficiency
    where the layout's framework runs one (see the module); `graph` itself where it does not,
    or the step has no FlashAttention op."""
    if traits(layout).attention_library != "cudnn":
        return graph
    return with_params(graph, {op.name: {"efficiency": FUSED[op.kind]} for op in graph.ops()
                               if op.kind in FUSED})
