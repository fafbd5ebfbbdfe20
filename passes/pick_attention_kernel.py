"""pick_attention_kernel: a job whose attention runs another library's kernels (cuDNN's fused
attention, flash-attn's Triton FlashAttention) rather than FlashAttention-2's.

Invariant established: where the job's attention library (`frameworks.attention_library`: the
layout's, else its framework's) is one of KERNELS, every FlashAttention op, forward and
backward, carries `efficiency`, the efficiency of its generation its arithmetic runs at:
`attention_fused` for cuDNN (its backward `attention_fused_backward`, the same rate in the
backward's charged FLOPs), which `calibration.toml` gives where measured and which is
`attention` elsewhere; `attention_triton` and `attention_triton_backward` for Triton's, and
`attention_flash1`'s for FlashAttention 1 (`costmodel.SLOWER_THAN_FLASH2`). FLOPs, bytes and the
ops do not change. Nothing else changes: the pass is a mark.

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
from opgraph.cost.costmodel import SLOWER_THAN_FLASH2
from opgraph.parallel.frameworks import attention_library
from opgraph.parallel.parallel import Parallel

# An attention library -> for each FlashAttention kind, the efficiency its kernel runs at there
# (FlashAttention-2's, "flash", is the kinds' own)
KERNELS = {
    "cudnn": {"flash_attention": "attention_fused",
              "flash_attention_backward": "attention_fused_backward"},
    **{kernel: {"flash_attention": f"attention_{kernel}",
                "flash_attention_backward": f"attention_{kernel}_backward"}
       for kernel in SLOWER_THAN_FLASH2},
}


@step_pass(at=LAYOUT + 5, bind=lambda o: o.layout and {"layout": o.layout},
           structure={"layout": lambda p: (attention_library(p),)})
@contract(requires=("backward",))
def pick_attention_kernel(graph: Graph, layout: Parallel) -> Graph:
    """`graph` with each FlashAttention op marked to run at its library's efficiency where the
    job runs another library than FlashAttention-2 (see the module); `graph` itself where it
    does not, or the step has no FlashAttention op."""
    kernels = KERNELS.get(attention_library(layout))
    if kernels is None:
        return graph
    return with_params(graph, {op.name: {"efficiency": kernels[op.kind]} for op in graph.ops()
                               if op.kind in kernels})
