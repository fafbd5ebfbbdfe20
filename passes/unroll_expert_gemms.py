"""unroll_expert_gemms: a framework that issues an expert layer's grouped GEMM as one GEMM per
expert.

Invariant established: where the layout's framework does (`frameworks.Traits.gemm_per_expert`),
every op of a kind that multiplies by expert weights (a GEMM grid, `rules.gemm_grid`, and the
"expert" sharding role, `rules.SHARDING`: `expert_matmul` and its dA and dB) carries
`launches`, the GEMMs one instance runs: the experts this GPU holds (the grid's first
entry, E / ep after sharding). The cost model charges the host `host_s` for each
(`costmodel.host_floor`), so a layer whose experts are small and many waits on the host:
`max(launches x host_s, the kernels' own time)` an instance. FLOPs, bytes and the GEMMs' waves
do not change. Nothing else changes: the pass is a mark.

Why it matters: Megatron-LM's grouped expert MLP (`--moe-grouped-gemm`, `TEGroupedMLP`) runs
Transformer Engine's `GroupedLinear`, whose `general_grouped_gemm` reaches
`nvte_multi_tensor_gemm` (`transformer_engine/common/gemm/cublaslt_gemm.cu`): unless the part is
a Hopper and `NVTE_USE_CUTLASS_GROUPED_GEMM` is set (and the GEMMs are BF16 or FP16), it loops
over the GEMMs calling cuBLAS once each, spread over 4 streams (`multi_stream_cublas_gemm`).
Without `--moe-grouped-gemm`, `SequentialMLP` loops over the experts in Python. DeepSpeed-MoE's
`Experts` loops over its local experts too. One GEMM issued from C++ takes the host about one
`host_s`: in the A100 trace `host_s` is measured on (shared/traces/recsys_training_trace.json.gz),
`aten::mm`'s CPU time, dispatch and the cuBLAS call, has a median of 36 us over 1,092 calls.
torchtitan runs its experts as one `torch._grouped_mm` (`GroupedExperts`, `use_grouped_mm`),
the generic model's one kernel.

    >>> from opgraph.models import preset
    >>> from opgraph.parallel.distributed import compile_parallel
    >>> g = compile_parallel(preset("mixtral-8x7b"), Parallel(framework="megatron", ep=2,
    ...                      gpus=2))
    >>> g.op("layers.experts.up_proj").param("launches")  # Mixtral's 8 experts over ep = 2
    E/ep
"""

from __future__ import annotations

from opgraph.core import rules
from opgraph.core.contracts import LAYOUT, contract, step_pass
from opgraph.core.ir import Graph, Op, with_params
from opgraph.parallel.frameworks import traits
from opgraph.parallel.parallel import Parallel


def _expert_gemms(graph: Graph, op: Op):
    """The GEMMs one instance of `op` runs where they are a grouped expert GEMM's (its grid's
    first entry), else None."""
    if not rules.shards_as(op.kind, "expert"):
        return None
    grid = rules.gemm_grid(op.kind, [graph.tensor(n) for n in op.inputs],
                           [graph.tensor(n) for n in op.outputs], dict(op.params))
    return grid[0] if grid else None


@step_pass(at=LAYOUT + 4, bind=lambda o: o.layout and {"layout": o.layout},
           structure={"layout": lambda p: (traits(p).gemm_per_expert,)})
@contract(requires=("backward",))
def unroll_expert_gemms(graph: Graph, layout: Parallel) -> Graph:
    """`graph` with each grouped expert GEMM's `launches` set to its GEMMs where the layout's
    framework issues them one by one (see the module); `graph` itself where it does not, or
    the model has no experts."""
    if not traits(layout).gemm_per_expert:
        return graph
    return with_params(graph, {op.name: {"launches": gemms} for op in graph.ops()
                               if (gemms := _expert_gemms(graph, op)) is not None})
