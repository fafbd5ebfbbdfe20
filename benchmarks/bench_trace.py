"""How fast `trace-breakdown` reads a large trace, against a bare `json.load` of the same file.

Writes a synthetic gzipped Kineto trace of 100,000 GPU kernels (a realistic mix of names, two
streams, launch gaps, one cudaLaunchKernel runtime event per kernel and a cpu_op per four) into
a temporary folder, then times `read_trace` + `breakdown` (median of 3) and prints one line. The
baseline is `json.load(gzip.open(path))` as a user would write it, with the garbage collector
on; `read_trace` pauses it while parsing, so the ratio can come out below 1:

    python benchmarks/bench_trace.py
"""

from __future__ import annotations

import gzip
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from opgraph.traces.kineto import breakdown, read_trace

KERNELS = 100_000
REPEATS = 3

GEMM_CUBLAS = (
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_"
    "execute_segment_k_off_kernel__5x_cublas"
)
FLASH = (
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, "
    "false, cutlass::bfloat16_t, Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, "
    "false, true, false, false, true, true, false>(pytorch_flash::Flash_fwd_params)"
)
ADD = (
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::"
    "BFloat16>, at::detail::Array<char*, 3> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, "
    "at::detail::Array<char*, 3>)"
)
SUM = (
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::"
    "func_wrapper_t<float, at::native::sum_functor<float, float, float>::operator()"
    "(at::TensorIterator&)::{lambda(float, float)#1}>, unsigned int, float, 4> >"
)
ADAM = (
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::"
    "(anonymous namespace)::TensorListMetadata<4>, at::native::(anonymous namespace)::"
    "FusedAdamMathFunctor<float, 4, (at::native::ADAM_MODE)1, false>, double*, double, double, "
    "double, double, double, bool, float const*, float const*>"
)
NCCL = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"

# (kernel name, typical duration in us, weight in the mix)
KERNEL_MIX = (
    (GEMM_CUBLAS, 180.0, 20),
    ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NNT", 150.0, 10),
    (FLASH, 400.0, 4),
    (ADD, 12.0, 25),
    ("triton_poi_fused_mul_silu_0", 20.0, 10),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1", 15.0, 8),
    (SUM, 9.0, 6),
    (ADAM, 30.0, 4),
    (NCCL, 250.0, 3),
    ("Memset (Device)", 2.0, 5),
    ("Memcpy HtoD (Pinned -> Device)", 25.0, 5),
)


def _category(name: str) -> str:
    if name.startswith("Memset"):
        return "gpu_memset"
    if name.startswith("Memcpy"):
        return "gpu_memcpy"
    return "kernel"


def synthetic_trace(kernels: int, seed: int = 0) -> dict:
    """A Kineto-shaped trace: compute kernels on stream 7, NCCL and copies on stream 20."""
    rng = random.Random(seed)
    names = [name for name, _, _ in KERNEL_MIX]
    weights = [weight for _, _, weight in KERNEL_MIX]
    durations = {name: dur for name, dur, _ in KERNEL_MIX}
    ts = 1_700_000_000_000_000.0
    events = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "python"}}]
    for i in range(kernels):
        name = rng.choices(names, weights)[0]
        dur = round(durations[name] * rng.uniform(0.5, 1.5), 3)
        side = name.startswith(("nccl", "Memcpy"))
        stream = 20 if side else 7
        # A side-stream kernel starts alongside the compute stream; a compute kernel follows a
        # launch gap, now and then a long host stall.
        gap = 200.0 if rng.random() < 0.01 else rng.uniform(0.0, 4.0)
        start = ts - rng.uniform(0.0, 50.0) if side else ts + gap
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 0,
                       "tid": 1, "ts": start - 5.0, "dur": 3.0, "args": {"correlation": i}})
        if i % 4 == 0:
            events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 0, "tid": 1,
                           "ts": start - 8.0, "dur": 7.0, "args": {"External id": i}})
        events.append({"ph": "X", "cat": _category(name), "name": name, "pid": 0, "tid": stream,
                       "ts": round(start, 3), "dur": dur,
                       "args": {"device": 0, "stream": stream, "correlation": i,
                                "grid": [132, 1, 1], "block": [256, 1, 1]}})
        if not side:
            ts = start + dur
    return {"schemaVersion": 1, "traceEvents": events}


def median_of(repeats: int, work) -> float:
    """The median of `repeats` timed calls of `work()`, in seconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "synthetic.json.gz"
        path.write_bytes(gzip.compress(json.dumps(synthetic_trace(KERNELS)).encode(), 6))

        def read_and_break_down():
            result = breakdown(read_trace(path))
            assert result.kernels == KERNELS

        def baseline():
            with gzip.open(path) as f:
                json.load(f)

        ours = median_of(REPEATS, read_and_break_down)
        base = median_of(REPEATS, baseline)
    print(f"trace-breakdown: {KERNELS:,} kernels in {ours:.2f} s "
          f"({ours / KERNELS * 1e6:.1f} µs per kernel, median of {REPEATS}); json.load of the "
          f"same file alone: {base:.2f} s (ratio {ours / base:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
