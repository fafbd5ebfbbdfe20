"""Sweeps: a step's roofline profile at many configurations, compiled once and vectorised.

    sweep = compile_sweep(step)                           # free dimensions B and S
    cols = sweep.run({"B": batch, "S": seq_len}, peak, bandwidth)   # numpy arrays in and out

`compile_sweep` puts every other dimension's value into each op's cost formula, gives the ops
whose costs are the same expression one term (a matmul's forward and its two backward kernels),
and compiles all the terms with `sympy.lambdify` into one numpy function. `run` calls it on
chunks of points and takes each term's roofline `max(flops / peak, bytes / bandwidth)` and the
sums as array operations.

Invariant: a row is `evaluate` of the same point: the same formulas, summed the same way, in
float64 (agreement to about 1e-15 relative). Layer stacks stay a multiplicity: `L` is a number
put into the formula, or a free dimension of the function, never a loop.

Ranges (`parse_range`): `START:STOP:+STEP` (linear) or `START:STOP:xFACTOR` (geometric, a whole
factor), both including STOP when they land on it; a single value; or a comma list.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import numpy as np
import sympy

from passes.evaluate import mfu_parameters, resolve

from . import numfmt
from .errors import OpgraphError
from .ir import Graph
from .profile import CATEGORIES
from .symbols import B, S

MAX_POINTS = 10_000_000
CHUNK = 8192  # points per call: a chunk's arrays stay in cache
_NUMBER = r"[0-9]+(?:_[0-9]+)*"
_RANGE = re.compile(rf"({_NUMBER}):({_NUMBER}):(.+)")
RANGE_HELP = "START:STOP:+STEP, START:STOP:xFACTOR, a value or a comma list"


# --- ranges ---------------------------------------------------------------------------------------

def parse_range(text: str, what: str = "range") -> np.ndarray:
    """The whole numbers a range names: `parse_range("1024:8192:x2")` is 1024, 2048, 4096, 8192."""
    text = text.strip()
    if re.fullmatch(rf"{_NUMBER}(?:,{_NUMBER})*", text):
        values = [int(v.replace("_", "")) for v in text.split(",")]
        if min(values) <= 0:
            raise OpgraphError(f"{what} {text}: values must be positive")
        return np.array(values, dtype=np.int64)
    m = _RANGE.fullmatch(text)
    if not m:
        raise OpgraphError(f"{what} {text!r} is not a range; write {RANGE_HELP}, "
                           "e.g. 8192:65536:+8192 or 1024:1048576:x2")
    start, stop = (int(g.replace("_", "")) for g in m.groups()[:2])
    step = m.group(3)
    if start <= 0:
        raise OpgraphError(f"{what} {text}: start must be positive")
    if stop < start:
        raise OpgraphError(f"{what} {text}: stop {stop:,} is below start {start:,}")
    if re.fullmatch(r"[+-]?[0-9]+(?:_[0-9]+)*", step) and step[0] in "+-":
        increment = int(step.replace("_", ""))
        if increment <= 0:
            raise OpgraphError(f"{what} {text}: the step {step} must be positive, e.g. +1")
        count = (stop - start) // increment + 1
        _check_count(count, what, text)
        return np.arange(count, dtype=np.int64) * increment + start
    if step[:1] in ("x", "X"):
        factor = step[1:]
        if not re.fullmatch(r"[0-9]+", factor) or int(factor) <= 1:
            raise OpgraphError(f"{what} {text}: the factor {step} must be a whole number above "
                               "1, e.g. x2")
        values, v = [], start
        while v <= stop:
            values.append(v)
            v *= int(factor)
        return np.array(values, dtype=np.int64)
    raise OpgraphError(f"{what} {text}: the step {step!r} is neither +STEP nor xFACTOR")


def _check_count(count: int, what: str, text: str) -> None:
    if count > MAX_POINTS:
        raise OpgraphError(f"{what} {text} has {count:,} points, more than {MAX_POINTS:,}; "
                           "take a coarser step")


# --- the compiled sweep ---------------------------------------------------------------------------

@attrs.frozen
class Sweep:
    """A step's costs as one numpy function of the free dimensions (`compile_sweep`)."""

    model: str
    free: tuple[str, ...]  # the function's arguments, dimension names
    categories: tuple[str, ...]
    function: Callable  # (*free) -> [flops of each term, bytes of each term, N_mfu, tokens]
    multiplicity: np.ndarray  # per term: how many ops it stands for
    membership: np.ndarray  # (categories, terms): term i's category is j

    @property
    def terms(self) -> int:
        return len(self.multiplicity)

    def columns(self) -> list[str]:
        return ["step_time_s", "flops", "bytes", "mfu_ceiling", "hfu_ceiling",
                *(f"{c}_time_share" for c in self.categories)]

    def run(self, dims: dict[str, np.ndarray], peak, bandwidth) -> dict[str, np.ndarray]:
        """Each column of `columns()` at every point: `dims` maps each free name to an array;
        `peak` and `bandwidth` are arrays of the same length or numbers."""
        n = len(next(iter(dims.values()))) if dims else 1
        peak = np.broadcast_to(np.asarray(peak, dtype=float), (n,))
        bandwidth = np.broadcast_to(np.asarray(bandwidth, dtype=float), (n,))
        out = {name: np.empty(n) for name in self.columns()}
        for lo in range(0, n, CHUNK):
            hi = min(n, lo + CHUNK)
            args = [np.asarray(dims[name][lo:hi], dtype=float) for name in self.free]
            for name, col in self._chunk(args, hi - lo, peak[lo:hi], bandwidth[lo:hi]).items():
                out[name][lo:hi] = col
        return out

    def _chunk(self, args, m, peak, bandwidth) -> dict[str, np.ndarray]:
        k = self.terms
        values = np.empty((2 * k + 2, m))
        for i, v in enumerate(self.function(*args)):
            values[i] = v  # constants broadcast
        flops, nbytes = values[:k], values[k:2 * k]
        n_mfu, tokens = values[2 * k], values[2 * k + 1]
        time = np.maximum(flops / peak, nbytes / bandwidth)
        step = self.multiplicity @ time
        shares = (self.membership * self.multiplicity) @ time / step
        total_flops = self.multiplicity @ flops
        cols = {"step_time_s": step, "flops": total_flops, "bytes": self.multiplicity @ nbytes,
                "mfu_ceiling": 6 * n_mfu * tokens / (step * peak),
                "hfu_ceiling": total_flops / (step * peak)}
        cols |= {f"{c}_time_share": shares[j] for j, c in enumerate(self.categories)}
        return cols


def compile_sweep(step: Graph, free=("B", "S")) -> Sweep:
    """The step's costs compiled over the dimensions named in `free`; every other dimension takes
    the graph's value: `compile_sweep(step, free=("B", "S", "L"))`."""
    dims = resolve(step)
    by_name = {sym.name: sym for sym in dims}
    unknown = [name for name in free if name not in by_name]
    if unknown:
        raise OpgraphError(f"unknown dimension {unknown[0]!r} for {step.name}; "
                           f"it has {', '.join(sorted(by_name))}")
    symbols = [by_name[name] for name in free]
    fixed = {sym: v for sym, v in dims.items() if sym not in symbols}
    terms: dict[tuple, int] = {}
    for op in step.ops():
        key = (op.category, (op.count * op.flops).xreplace(fixed),
               (op.count * step.op_bytes(op)).xreplace(fixed))
        terms[key] = terms.get(key, 0) + 1
    found = {key[0] for key in terms}
    categories = tuple([c for c in CATEGORIES if c in found] + sorted(found - {*CATEGORIES}))
    n_mfu = sympy.sympify(mfu_parameters(step)).xreplace(fixed)  # a MoE's active share
    exprs = [key[1] for key in terms] + [key[2] for key in terms]
    exprs += [n_mfu, (B * S).xreplace(fixed)]
    leftover = set().union(*(sympy.sympify(e).free_symbols for e in exprs)) - set(symbols)
    if leftover:
        raise OpgraphError(f"{step.name}'s costs depend on {', '.join(sorted(map(str, leftover)))}"
                           ", which has no value; give it one")
    # Plain arithmetic needs no numpy namespace (that costs ~0.1 s to set up): `*`, `+` and
    # `**` of numpy arrays are numpy's own.
    modules = [{}] if all(map(_arithmetic, exprs)) else "numpy"
    function = sympy.lambdify(symbols, exprs, modules, cse=True)
    membership = np.array([[1.0 if key[0] == c else 0.0 for key in terms] for c in categories])
    return Sweep(step.name, tuple(free), categories, function,
                 np.array(list(terms.values()), dtype=float), membership)


def _arithmetic(expr) -> bool:
    """Only numbers, symbols, sums, products and whole powers."""
    for node in sympy.preorder_traversal(sympy.sympify(expr)):
        if isinstance(node, sympy.Pow):
            if not node.exp.is_Integer:
                return False
        elif not isinstance(node, sympy.Add | sympy.Mul | sympy.Symbol | sympy.Rational):
            return False
    return True


# --- the grid of points ---------------------------------------------------------------------------

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


# --- running and writing --------------------------------------------------------------------------

def run_grid(sweep: Sweep, grid: Grid, lo: int = 0, hi: int | None = None) -> dict[str, np.ndarray]:
    """The rows for points `lo` to `hi` of `grid`: the grid's axes, then `sweep.columns()`."""
    hi = len(grid) if hi is None else hi
    at = grid.points(lo, hi)
    parts = grid.hardware
    peak = np.array([p.peak_flops for p in parts])[at["hardware"]]
    bandwidth = np.array([p.bandwidth for p in parts])[at["hardware"]]
    cols = sweep.run({name: at[name] for name in sweep.free}, peak, bandwidth)
    extra = [name for name in grid.names() if name not in ("hardware", *SHAPE_AXES)]
    rows = {"tokens": at["tokens"], "seq_len": at["seq_len"], "batch": at["batch"],
            "hardware": at["hardware"]}
    rows |= {name: at[name] for name in extra}
    return rows | cols


def chunks(grid: Grid, size: int = CHUNK) -> Iterator[tuple[int, int]]:
    for lo in range(0, len(grid), size):
        yield lo, min(len(grid), lo + size)


def _csv_chunk(rows: dict[str, np.ndarray], ids: list[str]) -> bytes:
    return numfmt.csv_block([numfmt.text_bytes(ids, col) if name == "hardware" else col
                             for name, col in rows.items()])


def _json_chunk(rows: dict[str, np.ndarray], ids: list[str], first: bool) -> str:
    names = list(rows)
    lists = [[ids[i] for i in col.tolist()] if name == "hardware" else col.tolist()
             for name, col in rows.items()]
    text = ",\n".join(json.dumps(dict(zip(names, row))) for row in zip(*lists))
    return ("" if first else ",\n") + text


def write(sweep: Sweep, grid: Grid, path: str | Path) -> int:
    """Every row of the sweep into `path` (.csv or .json), atomically: a temporary file beside
    it, renamed when complete. Returns the number of rows."""
    path = Path(path)
    kind = path.suffix.lower()
    if kind not in (".csv", ".json"):
        raise OpgraphError(f"--out {path}: write a .csv or a .json file")
    if not path.parent.is_dir():
        raise OpgraphError(f"--out {path}: the folder {path.parent} does not exist")
    ids = [p.id for p in grid.hardware]
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            for lo, hi in chunks(grid):
                rows = run_grid(sweep, grid, lo, hi)
                if kind == ".csv":
                    if lo == 0:
                        f.write((",".join(rows) + "\n").encode())
                    f.write(_csv_chunk(rows, ids))
                else:
                    if lo == 0:
                        head = json.dumps({"model": sweep.model, "points": len(grid),
                                           "columns": list(rows)})
                        f.write((head[:-1] + ', "rows": [\n').encode())
                    f.write(_json_chunk(rows, ids, lo == 0).encode())
            if kind == ".json":
                f.write(b"\n]}\n")
        mask = os.umask(0)  # mkstemp makes the file private; give it the usual permissions
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return len(grid)


def sample(n: int, rows: int) -> list[tuple[int, int]]:
    """The point ranges a table of at most `rows` rows shows: all, or the first and last."""
    if n <= rows:
        return [(0, n)]
    return [(0, rows // 2), (n - (rows - rows // 2), n)]


__all__ = ["CHUNK", "MAX_POINTS", "Grid", "Sweep", "compile_sweep", "make_grid", "parse_range",
           "run_grid", "sample", "write"]
