"""A measured GEMM table sets a generation's matmul shape parameters: `opgraph calibrate --gemms`.

The calibrated cost model times a matrix multiply of M x N x K at

    FLOPs x waves(M, N) x (K + matmul_k_overhead) / K / (matmul x peak)

(`costmodel.wave_quantum` over `matmul_tile_m` x `matmul_tile_n` tiles, `costmodel.k_overhead`).
A table of measured GEMMs (rows of m, n, k and TFLOP/s, as `benchmarks/device/measure_gpu.py`
writes or a microbenchmark such as mamf-finder prints) decides the shape parameters: for each
candidate tile (`TILES` x `TILES`) and K overhead (`K_OVERHEADS`) the table's efficiency is the
geometric mean of `TFLOP/s x shape / peak` over its rows, and the candidate whose predictions
have the least mean squared log error wins. Its efficiency is `matmul` (the sustained rate of
full waves on that part, at the clock it held while measured); a case fit
(`opgraph calibrate --fit`) replaces `matmul` where the generation names it fitted, and keeps
the shape.
"""

from __future__ import annotations

import math
from pathlib import Path

import attrs

from ..core.datafile import csv_rows, locate_table, shipped_tables
from ..core.errors import OpgraphError
from .costmodel import k_overhead, wave_quantum

DATA = Path(__file__).parents[1] / "data"  # the shipped tables: data/gemms_<name>.csv
TILES = (0, 64, 128, 192, 256)  # 0: no waves (with 0 for the other side)
K_OVERHEADS = tuple(range(0, 513, 8))
COLUMNS = ("m", "n", "k", "tflops")
_ALIASES = {"tflop/s": "tflops"}
# A GEMM shorter than this is left out of a fit: in eager PyTorch the host issues a matmul in
# about 20 us (an H200 host measured 8 us per elementwise op, more through cuBLAS's dispatch),
# so a shorter kernel's time is the host's, not its shape's.
MIN_SECONDS = 50e-6


@attrs.frozen
class Gemm:
    m: int
    n: int
    k: int
    tflops: float
    sm_mhz: float = 0.0  # the SM clock read while it ran, where the table has it


@attrs.frozen
class ShapeFit:
    """One shape model over a table: its efficiency and how far its predictions miss."""

    tile_m: int
    tile_n: int
    k0: int
    matmul: float       # geometric mean of TFLOP/s x shape / peak
    mean_error: float   # mean |predicted / measured - 1|
    worst_error: float
    log_mse: float


def _number(text: str, column: str, where: str, integer: bool) -> float:
    try:
        value = int(text) if integer else float(text)
    except ValueError:
        kind = "a whole number" if integer else "a number"
        raise OpgraphError(f"{where}: {column} = {text!r} is not {kind}") from None
    if not (value > 0 and math.isfinite(value)):
        raise OpgraphError(f"{where}: {column} = {text!r} must be above 0")
    return value


def shipped() -> dict[str, Path]:
    """The measured tables installed with opgraph, by name: `data/gemms_<name>.csv`."""
    return shipped_tables(DATA, "gemms_")


def locate(name_or_path: str) -> str:
    """A shipped table's path by its name (`h200`), or the path given."""
    return locate_table(name_or_path, shipped(), "GEMM table", "m, n, k, tflops")


def read(path: str) -> list[Gemm]:
    """The rows of a CSV table with a header naming at least m, n, k and tflops (or TFLOP/s),
    in any order and case; other columns are ignored but `sm_mhz`, read where present."""
    names, rows = csv_rows(path, "GEMM table", COLUMNS,
                           "m, n, k and tflops (TFLOP/s), one row per measured GEMM", _ALIASES)
    at = {c: names.index(c) for c in (*COLUMNS, "sm_mhz") if c in names}
    return [Gemm(**{c: _number(cells[i], c, where, c in ("m", "n", "k")) for c, i in at.items()})
            for where, cells in rows]


def seconds(g: Gemm) -> float:
    """The measured time of one GEMM: its FLOPs over its rate."""
    return 2.0 * g.m * g.n * g.k / (g.tflops * 1e12)


def shape(g: Gemm, sms: int, tile_m: int, tile_n: int, k0: int) -> float:
    """The calibrated model's shape factor of one GEMM: its waves times its K overhead."""
    flops = 2.0 * g.m * g.n * g.k
    waves = wave_quantum(1, g.m, g.n, sms, tile_m, tile_n) if tile_m and sms else 1.0
    return waves * k_overhead(flops, 1, g.m, g.n, k0)


def judge(rows: list[Gemm], peak_tflops: float, sms: int, tile_m: int, tile_n: int,
          k0: int) -> ShapeFit:
    """How one shape model does over the table, with its best single efficiency."""
    logs = [math.log(g.tflops * shape(g, sms, tile_m, tile_n, k0) / peak_tflops) for g in rows]
    mean = sum(logs) / len(logs)
    misses = [x - mean for x in logs]  # log(efficiency_i / efficiency): measured over predicted
    errors = [abs(math.exp(-d) - 1) for d in misses]
    return ShapeFit(tile_m, tile_n, k0, math.exp(mean), sum(errors) / len(errors), max(errors),
                    sum(d * d for d in misses) / len(misses))


def fit(rows: list[Gemm], peak_tflops: float, sms: int) -> ShapeFit:
    """The candidate tile and K overhead whose predictions miss the table least (mean squared
    log error; ties to the earlier candidate, so the result is the same everywhere)."""
    if not sms:
        raise OpgraphError("the part names no SM count (`sms` in its hardware table), so its "
                           "waves cannot be fitted; add it, or use a catalog part")
    candidates = [judge(rows, peak_tflops, sms, tm, tn, k0)
                  for tm in TILES for tn in TILES for k0 in K_OVERHEADS if (tm == 0) == (tn == 0)]
    return min(candidates, key=lambda f: f.log_mse)
