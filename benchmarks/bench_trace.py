"""How fast `trace-breakdown` reads a large trace, and in how much memory, against `json.load`.

Writes a synthetic gzipped Kineto trace of 1,000,000 GPU kernels (a realistic mix of names, two
streams, launch gaps, one cudaLaunchKernel runtime event per kernel and a cpu_op per four) into
a temporary folder, then runs, each in a fresh interpreter so that its peak resident memory is
its own (``ru_maxrss``):

- the baseline, ``json.load(gzip.open(path))`` as a user would write it;
- ``breakdown(iter_kernels(path))``, what ``opgraph trace-breakdown`` does;
- with ``--legacy CHECKOUT``, the same through an older checkout's ``read_trace`` (to compare
  before and after a change of the reader).

Each figure is the median of ``--repeats`` runs; the line printed gives seconds and peak MB, and
both as ratios to ``json.load`` of the same file, measured in this one run::

    python benchmarks/bench_trace.py                   # 1,000,000 kernels, about 2 minutes
    python benchmarks/bench_trace.py --kernels 100000 --repeats 1

It is not part of the test suite.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

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


def synthetic_events(kernels: int, seed: int = 0):
    """Kineto-shaped events: compute kernels on stream 7, NCCL and copies on stream 20."""
    rng = random.Random(seed)
    names = [name for name, _, _ in KERNEL_MIX]
    weights = [weight for _, _, weight in KERNEL_MIX]
    durations = {name: dur for name, dur, _ in KERNEL_MIX}
    ts = 1_700_000_000_000_000.0
    yield {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "python"}}
    for i in range(kernels):
        name = rng.choices(names, weights)[0]
        dur = round(durations[name] * rng.uniform(0.5, 1.5), 3)
        side = name.startswith(("nccl", "Memcpy"))
        stream = 20 if side else 7
        # A side-stream kernel starts alongside the compute stream; a compute kernel follows a
        # launch gap, now and then a long host stall.
        gap = 200.0 if rng.random() < 0.01 else rng.uniform(0.0, 4.0)
        start = ts - rng.uniform(0.0, 50.0) if side else ts + gap
        yield {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 0,
               "tid": 1, "ts": start - 5.0, "dur": 3.0, "args": {"correlation": i}}
        if i % 4 == 0:
            yield {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 0, "tid": 1,
                   "ts": start - 8.0, "dur": 7.0, "args": {"External id": i}}
        yield {"ph": "X", "cat": _category(name), "name": name, "pid": 0, "tid": stream,
               "ts": round(start, 3), "dur": dur,
               "args": {"device": 0, "stream": stream, "correlation": i,
                        "grid": [132, 1, 1], "block": [256, 1, 1]}}
        if not side:
            ts = start + dur


def write_trace(path: Path, kernels: int) -> int:
    """Write the synthetic trace gzipped, one event per line as Kineto does; its JSON bytes."""
    size = 0
    with gzip.open(path, "wb", compresslevel=6) as f:
        def put(text: str) -> None:
            nonlocal size
            data = text.encode()
            size += len(data)
            f.write(data)

        put('{\n  "schemaVersion": 1,\n  "traceEvents": [\n')
        for i, event in enumerate(synthetic_events(kernels)):
            put((",\n  " if i else "  ") + json.dumps(event))
        put('\n  ],\n  "displayTimeUnit": "ms"\n}\n')
    return size


# Each runs in a fresh interpreter: argv[1] is the trace, argv[2] the kernels it must find. It
# prints its seconds and its peak resident set (ru_maxrss is in KiB on Linux).
_TIMED = """
import resource, sys, time
sys.path.insert(0, {root!r})
{imports}
start = time.perf_counter()
{work}
seconds = time.perf_counter() - start
print(seconds, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""
IMPORT_ONLY = ("from opgraph.analysis.traces import breakdown, iter_kernels", "pass")
JSON_LOAD = ("import gzip, json", "with gzip.open(sys.argv[1]) as f: json.load(f)")
STREAMING = ("from opgraph.analysis.traces import breakdown, iter_kernels",
             "assert breakdown(iter_kernels(sys.argv[1])).kernels == int(sys.argv[2])")
LEGACY = ("from opgraph.analysis.traces.kineto import breakdown, read_trace",
          "assert breakdown(read_trace(sys.argv[1])).kernels == int(sys.argv[2])")


def measure(root: Path, code: tuple[str, str], path: Path, kernels: int, repeats: int):
    """Median seconds and median peak MB of `repeats` fresh runs of `code`."""
    imports, work = code
    script = _TIMED.format(root=str(root), imports=imports, work=work)
    runs = []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", script, str(path), str(kernels)],
                             capture_output=True, text=True, check=True).stdout
        runs.append(tuple(float(x) for x in out.split()))
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--legacy", type=Path, metavar="CHECKOUT",
                        help="also time an older checkout's trace reader "
                             "(opgraph.analysis.traces.kineto.read_trace)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "synthetic.json.gz"
        size = write_trace(path, args.kernels)
        print(f"trace: {args.kernels:,} kernels, {size / 1e6:,.0f} MB of JSON, "
              f"{path.stat().st_size / 1e6:,.0f} MB gzipped")
        _, import_mb = measure(ROOT, IMPORT_ONLY, path, args.kernels, 1)
        print(f"python + import opgraph.analysis.traces alone: peak {import_mb:,.0f} MB")
        base_s, base_mb = measure(ROOT, JSON_LOAD, path, args.kernels, args.repeats)
        print(f"json.load alone:  {base_s:6.2f} s, peak {base_mb:6,.0f} MB")
        rows = [("trace-breakdown", ROOT, STREAMING)]
        if args.legacy:
            rows.append((f"{args.legacy}", args.legacy.resolve(), LEGACY))
        for label, root, code in rows:
            seconds, mb = measure(root, code, path, args.kernels, args.repeats)
            print(f"{label}: {seconds:.2f} s ({seconds / base_s:.2f} x json.load), peak "
                  f"{mb:,.0f} MB ({mb / base_mb:.2f} x json.load); median of {args.repeats}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
