"""A measured attention table sets a generation's attention rates and row overheads:
`opgraph calibrate --attention`.

The calibrated cost model times an attention kernel at its FLOPs over `attention` (or
`attention_fused`) x the peak, times `costmodel.row_factor`: each row of queries runs its own
loop over the keys it sees and spends the time of k more keys outside it (loading its queries,
rescaling and writing its output). A causal row of S tokens sees S/2 keys on average, so

    1 / rate(S) = (1 / rate_inf) x (1 + 2k / S),

a line in 1/S. A table of measured causal attention kernels (rows of backend, head_dim, seq,
fwd_tflops, bwd_tflops, as `benchmarks/device/measure_gpu.py` measures them: "flash" for
FlashAttention-2, "cudnn" for cuDNN's fused attention; the backward's TFLOP/s counted at 2.5 x
the forward's FLOPs, as the calibration counts them) is fitted per backend, head dim and
direction (least squares on 1 / rate over 1 / S). At head dim 128, the reference
`attention_exp_ratio` scales from, the generation takes:

- `attention` and `attention_fused`: FlashAttention-2's and cuDNN's long-row rates over a
  forward and its backward, 3.5 / (1 / forward + 2.5 / backward);
- `attention_kv_overhead` and `attention_backward_kv_overhead`: the forward's and the backward's
  k, the mean over the backends measured.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from ..core.datafile import csv_rows, locate_table, shipped_tables
from ..core.errors import OpgraphError

DATA = Path(__file__).parents[1] / "data"  # the shipped tables: data/attention_<name>.csv
COLUMNS = ("backend", "head_dim", "seq", "fwd_tflops", "bwd_tflops")
BACKENDS = {"flash": "attention", "cudnn": "attention_fused"}  # backend -> the rate it sets
BACKWARD_RATIO = 2.5  # the backward's FLOPs over the forward's (`costmodel.runs_per_charged`)
REFERENCE_HEAD_DIM = 128


@attrs.frozen
class Kernel:
    """One measured causal attention kernel: its forward's and backward's TFLOP/s at `seq`."""

    backend: str
    head_dim: int
    seq: int
    fwd_tflops: float
    bwd_tflops: float


@attrs.frozen
class Line:
    """One backend, head dim and direction fitted: its long-row rate (of the peak), its row
    overhead k in keys, and the worst |predicted / measured - 1| over the table's lengths."""

    backend: str
    head_dim: int
    direction: str  # "fwd" or "bwd"
    rate: float
    overhead: float
    worst: float


def shipped() -> dict[str, Path]:
    """The measured tables installed with opgraph, by name: `data/attention_<name>.csv`."""
    return shipped_tables(DATA, "attention_")


def locate(name_or_path: str) -> str:
    """A shipped table's path by its name (`h200`), or the path given."""
    return locate_table(name_or_path, shipped(), "attention table", ", ".join(COLUMNS))


def read(path: str) -> list[Kernel]:
    """The rows of a CSV table whose header names at least `COLUMNS` (other columns ignored)."""
    names, rows = csv_rows(path, "attention table", COLUMNS,
                           f"{', '.join(COLUMNS)}, one row per measured kernel")
    at = {c: names.index(c) for c in COLUMNS}
    kernels = []
    for where, cells in rows:
        backend = cells[at["backend"]]
        if backend not in BACKENDS:
            raise OpgraphError(f"{where}: backend {backend!r}; give one of "
                               f"{', '.join(BACKENDS)}")
        kernels.append(Kernel(backend, *(_number(cells[at[c]], c, where, c in ("head_dim", "seq"))
                                         for c in COLUMNS[1:])))
    return kernels


def _number(text: str, column: str, where: str, whole: bool) -> float:
    try:
        value = int(text) if whole else float(text)
    except ValueError:
        raise OpgraphError(f"{where}: {column} = {text.strip()!r} is not a "
                           f"{'whole ' if whole else ''}number") from None
    if not value > 0 or value != value or value == float("inf"):
        raise OpgraphError(f"{where}: {column} = {text.strip()!r} must be above 0")
    return value


def _line(seqs: list[float], rates: list[float]) -> tuple[float, float]:
    """(rate_inf, k) of 1 / rate = (1 / rate_inf)(1 + 2k / S), least squares in 1 / S."""
    xs, ys = [1 / s for s in seqs], [1 / r for r in rates]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / spread if spread else 0.0
    intercept = my - slope * mx
    return 1 / intercept, slope / intercept / 2


def fit(rows: list[Kernel], peak_tflops: float) -> list[Line]:
    """Each backend, head dim and direction's line (see the module), in the table's order."""
    lines = []
    for backend, head_dim in dict.fromkeys((r.backend, r.head_dim) for r in rows):
        mine = sorted((r for r in rows if (r.backend, r.head_dim) == (backend, head_dim)),
                      key=lambda r: r.seq)
        if len({r.seq for r in mine}) < 2:
            raise OpgraphError(f"{backend} at head dim {head_dim}: measured at one sequence "
                               "length; a row overhead needs two or more")
        seqs = [float(r.seq) for r in mine]
        for direction in ("fwd", "bwd"):
            rates = [getattr(r, f"{direction}_tflops") / peak_tflops for r in mine]
            rate, overhead = _line(seqs, rates)
            worst = max(abs(rate / (1 + 2 * overhead / s) / r - 1) for s, r in zip(seqs, rates))
            lines.append(Line(backend, head_dim, direction, rate, overhead, worst))
    return lines


def together(forward: float, backward: float) -> float:
    """A forward and its backward as one rate, the backward doing 2.5 x the forward's FLOPs."""
    return (1 + BACKWARD_RATIO) / (1 / forward + BACKWARD_RATIO / backward)


def efficiencies(lines: list[Line]) -> dict[str, float]:
    """What a generation takes from the table at the reference head dim (see the module)."""
    at = {(x.backend, x.direction): x for x in lines if x.head_dim == REFERENCE_HEAD_DIM}
    backends = [b for b in BACKENDS if (b, "fwd") in at]
    if not backends:
        raise OpgraphError(f"the table measures no kernel at head dim {REFERENCE_HEAD_DIM}, "
                           "the head dim the calibration's rates are at")
    values = {BACKENDS[b]: together(at[b, "fwd"].rate, at[b, "bwd"].rate) for b in backends}
    for name, direction in (("attention_kv_overhead", "fwd"),
                            ("attention_backward_kv_overhead", "bwd")):
        values[name] = sum(at[b, direction].overhead for b in backends) / len(backends)
    return values


__all__ = ["BACKENDS", "COLUMNS", "Kernel", "Line", "efficiencies", "fit", "locate", "read",
           "shipped", "together"]
