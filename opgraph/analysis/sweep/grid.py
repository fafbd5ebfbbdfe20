"""The grid of points a sweep covers: every combination of its axes, and the rows at a range of
them (`run_grid`)."""

from __future__ import annotations

from collections.abc import Iterator

import attrs
import numpy as np

from ...core.errors import OpgraphError
from ...core.limits import MAX_TOKENS
from .compiled import CHUNK, Sweep
from .ranges import MAX_POINTS

SHAPE_AXES = ("tokens", "seq_len", "batch")


@attrs.frozen
class Grid:
    """Every combination of the axes' values, the last axis varying fastest.

    `axes` are (name, values) pairs; "hardware" values are indices into `hardware`. The tokens,
    sequence length and batch of a point come from whichever of those axes are given (at most
    two), the rest from `seq_len` (the model's default) and a batch of one.
    """

    axes: tuple[tuple[str, np.ndarray], ...]
    hardware: tuple = ()  # Hardware records
    seq_len: int = 0  # the model's default sequence length

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(len(v) for _, v in self.axes)

    def __len__(self) -> int:
        return int(np.prod(self.shape, dtype=object))

    def names(self) -> list[str]:
        return [name for name, _ in self.axes]

    def points(self, lo: int, hi: int) -> dict[str, np.ndarray]:
        """Each axis's value at the points `lo` to `hi`, and the derived tokens, seq_len and
        batch (the model's B and S)."""
        index = np.unravel_index(np.arange(lo, hi), self.shape)
        at = {name: values[i] for (name, values), i in zip(self.axes, index)}
        n = hi - lo
        if "seq_len" in at:
            seq = at["seq_len"]
        elif "tokens" in at and "batch" in at:
            seq = at["tokens"] // at["batch"]
        else:
            seq = np.full(n, self.seq_len, dtype=np.int64)
        batch = at["batch"] if "batch" in at else (
            at["tokens"] // seq if "tokens" in at else np.ones(n, dtype=np.int64))
        at |= {"seq_len": seq, "batch": batch, "tokens": batch * seq, "B": batch, "S": seq}
        return at


def make_grid(ranges: dict[str, np.ndarray], hardware: list, seq_len: int) -> Grid:
    """The grid over `ranges` (axis name -> values: tokens, seq_len, batch or a dimension) and
    the hardware list, checked: at most MAX_POINTS points and whole batches."""
    shape_axes = [a for a in SHAPE_AXES if a in ranges]
    if len(shape_axes) == 3:
        raise OpgraphError("give at most two of --tokens, --seq-len and --batch: "
                           "the third is fixed by tokens = batch x seq_len")
    axes = [("hardware", np.arange(len(hardware)))]
    axes += [(a, ranges[a]) for a in SHAPE_AXES if a in ranges]
    axes += [(a, v) for a, v in ranges.items() if a not in SHAPE_AXES]
    grid = Grid(tuple(axes), tuple(hardware), seq_len)
    if "tokens" not in ranges:  # batch x seq_len must stay within the bound (and int64)
        most = (int(ranges["batch"].max()) if "batch" in ranges else 1) * (
            int(ranges["seq_len"].max()) if "seq_len" in ranges else seq_len)
        if most > MAX_TOKENS:
            raise OpgraphError(f"the sweep reaches {most:,} tokens per step (batch x seq_len), "
                               f"more than opgraph's bound of {MAX_TOKENS:,} (2**40); give "
                               "smaller values")
    if len(grid) > MAX_POINTS:
        sizes = " x ".join(f"{len(v):,} {name}" for name, v in axes if len(v) > 1)
        raise OpgraphError(f"the sweep has {len(grid):,} points ({sizes}), more than "
                           f"{MAX_POINTS:,}; take coarser steps")
    if "tokens" in ranges:
        if "batch" in ranges:
            _check_whole(ranges["tokens"], ranges["batch"], "batch")
        else:
            divisor = ranges.get("seq_len", np.array([seq_len], dtype=np.int64))
            _check_whole(ranges["tokens"], divisor, "seq_len")
    return grid


def _check_whole(tokens: np.ndarray, divisor: np.ndarray, name: str) -> None:
    """Every tokens value must be a whole number of `name` (sequences, or sequence lengths)."""
    bad = np.argwhere(np.mod.outer(tokens, divisor) != 0)
    if not len(bad):
        return
    shown = ", ".join(f"{int(tokens[i]):,}" + (f" at {name} {int(divisor[j]):,}"
                                                if len(divisor) > 1 else "")
                      for i, j in bad[:3])
    more = f" and {len(bad) - 3:,} more" if len(bad) > 3 else ""
    fix = ("start the range at a multiple of it or give --seq-len" if name == "seq_len"
           else "choose values that divide")
    what = f"seq_len {int(divisor[0]):,}" if len(divisor) == 1 else name
    raise OpgraphError(f"--tokens: {shown}{more} not a whole multiple of {what}; {fix}")


def run_grid(sweep: Sweep, grid: Grid, lo: int = 0, hi: int | None = None) -> dict[str, np.ndarray]:
    """The rows for points `lo` to `hi` of `grid`: the grid's axes, then `sweep.columns()`."""
    hi = len(grid) if hi is None else hi
    at = grid.points(lo, hi)
    parts = grid.hardware
    peak = np.array([p.peak_flops for p in parts])[at["hardware"]]
    bandwidth = np.array([p.bandwidth for p in parts])[at["hardware"]]
    fp8 = np.array([p.fp8_flops or np.nan for p in parts])[at["hardware"]]
    efficiencies = None
    if sweep.cost.shapes:  # each point's part's generation
        table = [sweep.cost.figures(p) for p in parts]
        efficiencies = {k: np.array([t[k] for t in table])[at["hardware"]] for k in table[0]}
    cols = sweep.run({name: at[name] for name in sweep.free}, peak, bandwidth, fp8,
                     efficiencies)
    extra = [name for name in grid.names() if name not in ("hardware", *SHAPE_AXES)]
    rows = {"tokens": at["tokens"], "seq_len": at["seq_len"], "batch": at["batch"],
            "hardware": at["hardware"]}
    rows |= {name: at[name] for name in extra}
    return rows | cols


def chunks(grid: Grid, size: int = CHUNK) -> Iterator[tuple[int, int]]:
    for lo in range(0, len(grid), size):
        yield lo, min(len(grid), lo + size)


def sample(n: int, rows: int) -> list[tuple[int, int]]:
    """The point ranges a table of at most `rows` rows shows: all, or the first and last."""
    if n <= rows:
        return [(0, n)]
    return [(0, rows // 2), (n - (rows - rows // 2), n)]
