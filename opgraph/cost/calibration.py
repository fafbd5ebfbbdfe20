"""Calibrated efficiencies: how far below the roofline real kernels and collectives run.

The roofline is a ceiling. The calibrated cost model (`CalibratedCostModel`) keeps its structure
and scales each term by an efficiency of the hardware generation (`Efficiencies`), read from
`calibration.toml` beside this file (or a file of the user's, `--calibration FILE`):

    kernel time = max(host_s x launches, launch_s + max(compute, memory))
    compute     = (FLOPs x waves + matmul_half_flops) / (efficiency(kind) x clock x peak)
    memory      = bytes / (bandwidth x HBM bandwidth)

`host_s` is the host's time to issue one kernel: a training step in eager PyTorch launches
kernels one by one from Python, so a stream of kernels shorter than that runs at the host's
pace, the GPU idle between them (small models split by tensor parallelism, small micro-batches).
`launches` is 1 but for an op that issues several kernels (`costmodel.Cost.launches`: a grouped
expert GEMM its framework runs one GEMM per expert). A kernel doing no work (a view) costs
nothing.

`clock` is the part's sustained clock over the one its peak assumes (`Hardware.clock_ratio`:
1, or (P / TDP)^(1/3) when power-capped at P), so a power limit is not folded into an
efficiency. `waves` is a matrix multiply's wave quantisation (`costmodel.wave_quantum`): its
M x N output is cut into `matmul_tile_m` x `matmul_tile_n` tiles, one per SM at a time, and
it runs ceil(tiles / SMs) full waves; where the tiles fill less than one wave (a narrow
model's weight gradient: a small output, a K of every token) K is split into floor(SMs / tiles)
slices to fill it (split-K, `costmodel.split_k`); `waves` is the slots paid for over those
filled (1 for any other kernel, for a part without an SM count, or a generation whose tiles are
0), times (K + `matmul_k_overhead`) / K (`costmodel.k_overhead`, K a slice's): each tile spends
that many more steps of its K loop filling the pipeline and writing its output, so a GEMM of
small inner dimension (a tensor-parallel shard of a row-parallel layer) runs below the rate.
So `matmul` is the sustained rate of a large GEMM's full waves, and a tensor-parallel shard,
with fewer tiles to fill its waves or a shorter K, runs below it. A table of measured GEMMs sets
the tile and the K overhead (`opgraph calibrate --gemms`, `opgraph.cost.gemms`). A GEMM whose N
is not a multiple of 8 runs at `matmul_unaligned` of the rate (`costmodel.unaligned`: cuBLAS's
align-1 kernels).
Measured on its best shapes, cuBLAS BF16 reaches 0.869 of the dense peak on an A100 SXM
(271.2 of 312 TFLOP/s) and, in a cold burst, 0.803 on an H100 SXM (794.5 of 989): S. Bekman,
*Machine Learning Engineering*, compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS
comparison table" (mamf-finder.py, torch 2.6-2.7). Run back to back at its 700 W limit, as a
training step runs them, a Hopper part sustains less: 0.719 of the peak on one H200, its clock at
a median 1,515 MHz of 1,830 (`opgraph calibrate --gemms h200`, the GEMMs of
opgraph/data/gemms_h200.csv). Such a measured ceiling, the sustained one where it is measured, is
a generation's `matmul_ceiling`, and where it has one a fit sets `matmul` as a share of it, one
share for every generation (`opgraph.analysis.fit`): how close a training step's GEMMs come to
the part's ceiling is a property of kernels and shapes, while the ceilings differ by part (an H100
loses more of its peak to its power limit than an A100 does).

`efficiency(kind)` is `matmul` for matrix multiplies (and fused kernels around one), `attention`
for FlashAttention's kernels and the unfused attention core, `matmul` otherwise. A matrix
multiply whose operands are FP8 runs at the part's FP8 peak and at `matmul` x `fp8_ratio` of it
(`matmul_fp8`): on its best shapes cuBLAS reaches a smaller share of an H100's FP8 peak than of
its BF16 peak (70.9% against 80.3%, Bekman's table above), so a generation's FP8 GEMMs run at
that ratio of the share its BF16 ones reach. The saturating
term makes small matrix multiplies run below the large ones' rate: a kernel of F FLOPs runs at
`matmul x F / (F + matmul_half_flops)` of the peak (half of `matmul`'s rate at F =
`matmul_half_flops`); equivalently it costs `matmul_half_flops / (matmul x peak)` seconds more,
a K-independent prologue and epilogue (filling the pipeline, writing the last tiles).
`attention` is FlashAttention's fraction of the peak at head dims 128 + 128, where it is
published; a kernel of other head dims has more or fewer FLOPs per softmax exponential, each
taking `attention_exp_ratio` tensor FLOPs' time, and scales by `costmodel.exp_factor` (head
dim 64 runs at 3/4 of `attention` on an H100, 256 at 6/5). Each row of queries runs its own
loop over the keys it sees and spends the time of `attention_kv_overhead` more keys outside it
(`attention_backward_kv_overhead` in a backward), so a kernel of short rows runs below the
rate (`costmodel.row_factor`): measured on an H200, a causal FlashAttention-2 forward and
backward at 1,024 tokens ran at 0.60 of its rate at 32,768 (`opgraph calibrate --attention`,
`opgraph.cost.attention_table`).

A collective runs at `node` (or `network`) x the tier's bandwidth, and pays `launch_s` too;
communication running beside compute slows it by `overlap_slowdown` x its hidden time
(`opgraph.parallel.schedule`).

Each generation's values say where they come from: a published microbenchmark or datasheet, or
the fit `opgraph calibrate --fit` makes on published runs (`fitted` names those).
"""

from __future__ import annotations

import math
from pathlib import Path

import attrs

from ..core.datafile import check_keys, load_tables, pick
from ..core.errors import OpgraphError

CATALOG = Path(__file__).parents[1] / "calibration.toml"

# What each efficiency scales, for docs and errors; all are fractions in (0, 1] except the
# times and FLOPs.
FIELDS = {
    "matmul": "fraction of the dense peak a large matrix multiply reaches",
    "matmul_ceiling": "fraction of the dense peak the part's best GEMM reaches in a published "
                      "microbenchmark (0: none; a fit then sets `matmul` itself)",
    "fp8_ratio": "an FP8 GEMM's share of the dense FP8 peak over a BF16 GEMM's share of the "
                 "BF16 peak: an FP8 matrix multiply runs at `matmul` x this (1: the same share)",
    "matmul_half_flops": "FLOPs at which a kernel reaches half of `matmul`'s rate",
    "matmul_tile_m": "rows of the output tile a GEMM kernel computes per SM (0: no waves)",
    "matmul_tile_n": "columns of that tile",
    "matmul_unaligned": "fraction of `matmul`'s rate a GEMM reaches whose N is not a "
                        "multiple of 8 (rows off 16-byte boundaries: cuBLAS's align-1 kernels; "
                        "1: no such penalty)",
    "matmul_k_overhead": "steps of its K loop each output tile spends outside it (prologue, "
                         "epilogue): a GEMM of inner dimension K runs at K / (K + this) of "
                         "`matmul` (0: none)",
    "attention_exp_ratio": "tensor FLOPs one exponential's time holds (0: none counted)",
    "attention_kv_overhead": "keys of its loop each query row of an attention forward spends "
                             "outside it (loading the queries, writing the output): a row that "
                             "sees L keys runs at L / (L + this) of the rate (0: none)",
    "attention_backward_kv_overhead": "the same for an attention backward's rows (0: none)",
    "attention": "fraction of the dense peak FlashAttention's kernels reach",
    "attention_fused": "fraction of the dense peak a fused attention library's kernels reach "
                       "(cuDNN's, which Transformer Engine picks on Hopper and later), over a "
                       "forward and its backward (0: as `attention`)",
    "bandwidth": "fraction of the HBM bandwidth a memory-bound kernel reaches",
    "launch_s": "seconds each kernel adds (launch and tail)",
    "host_s": "seconds the host takes to issue one kernel: no kernel runs shorter",
    "node": "fraction of the node fabric's bandwidth a collective reaches",
    "network": "fraction of the network's bandwidth a collective reaches",
    "overlap_slowdown": "share of a hidden collective's time it adds to the compute beside it",
}
# and matmul_ceiling and attention_fused, or 0:
FRACTIONS = ("matmul", "fp8_ratio", "matmul_unaligned", "attention", "bandwidth", "node",
             "network")
_KEYS = {*FIELDS, "fitted", "sources"}


@attrs.frozen
class Efficiencies:
    """One hardware generation's efficiencies (see the module)."""

    generation: str
    matmul: float = 1.0
    matmul_ceiling: float = 0.0
    fp8_ratio: float = 1.0
    matmul_half_flops: float = 0.0
    matmul_tile_m: float = 0.0
    matmul_tile_n: float = 0.0
    matmul_k_overhead: float = 0.0
    matmul_unaligned: float = 1.0
    attention_exp_ratio: float = 0.0
    attention_kv_overhead: float = 0.0
    attention_backward_kv_overhead: float = 0.0
    attention: float = 1.0
    attention_fused: float = 0.0
    bandwidth: float = 1.0
    launch_s: float = 0.0
    host_s: float = 0.0
    node: float = 1.0
    network: float = 1.0
    overlap_slowdown: float = 0.0
    fitted: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    sources: tuple[tuple[str, str], ...] = attrs.field(default=(), converter=tuple)

    def values(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in FIELDS}


def _number(table: dict, key: str, where: str) -> float:
    value = table[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise OpgraphError(f"{where}: {key} = {value!r} must be a finite number")
    value = float(value)
    if key in ("matmul_ceiling", "attention_fused") and not 0 <= value <= 1:
        raise OpgraphError(f"{where}: {key} = {value:g} must be 0 (none) or a fraction at most 1")
    if key in FRACTIONS and not 0 < value <= 1:
        raise OpgraphError(f"{where}: {key} = {value:g} must be a fraction above 0 and at most 1")
    if key not in (*FRACTIONS, "matmul_ceiling", "attention_fused") and not 0 <= value < 1e15:
        raise OpgraphError(f"{where}: {key} = {value:g} must be 0 or more")
    return value


def _parse(generation: str, table: object, where: str) -> Efficiencies:
    where = f"{where} [{generation}]"
    if not isinstance(table, dict):
        raise OpgraphError(f"{where} must be a table of efficiencies ({', '.join(FIELDS)})")
    check_keys(table, _KEYS, where)
    fitted = table.get("fitted", [])
    if not isinstance(fitted, list) or not all(f in FIELDS for f in fitted):
        raise OpgraphError(f"{where}: fitted must be a list of the names above")
    sources = table.get("sources", {})
    if not isinstance(sources, dict) or not all(isinstance(v, str) for v in sources.values()):
        raise OpgraphError(f"{where}: sources must be a table of strings, one per efficiency")
    return Efficiencies(generation, **{k: _number(table, k, where) for k in FIELDS if k in table},
                        fitted=tuple(fitted), sources=tuple(sorted(sources.items())))


def load(path: str | Path) -> dict[str, Efficiencies]:
    """Every generation's efficiencies in a calibration file, by generation."""
    tables = load_tables(path, "calibration file", noun="generation",
                         example="[hopper] with matmul = 0.7, bandwidth = 0.85, ...",
                         is_one=lambda d: "matmul" in d)
    return {g: _parse(g, t, str(path)) for g, t in tables.items()}


def header(path: str | Path) -> str:
    """The comment lines a calibration file opens with (kept when `opgraph calibrate`
    rewrites it)."""
    lines = []
    for line in Path(path).read_text().splitlines():
        if not line.startswith("#") and line.strip():
            break
        lines.append(line)
    return "\n".join(lines).rstrip()


def catalog() -> dict[str, Efficiencies]:
    """The shipped efficiencies (`calibration.toml`)."""
    return load(CATALOG)


def get(name_or_path: str) -> Efficiencies:
    return pick(name_or_path, load, catalog, "generation")


def for_hardware(part, table: dict[str, Efficiencies] | None = None) -> Efficiencies:
    """The efficiencies of `part`'s generation, or an error saying how to name one."""
    table = catalog() if table is None else table
    if not part.generation:
        raise OpgraphError(f"hardware {part.id!r} names no generation, so it has no calibrated "
                           "efficiencies; add generation = \"hopper\" (or another of "
                           f"{', '.join(table)}) to its table, or use --cost roofline")
    if part.generation not in table:
        raise OpgraphError(f"no calibrated efficiencies for generation {part.generation!r} "
                           f"({part.id}); the calibration has {', '.join(table)}")
    return table[part.generation]
