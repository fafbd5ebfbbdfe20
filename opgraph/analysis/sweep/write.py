"""Writing every row of a sweep to a CSV or JSON file, chunk by chunk, atomically."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ...core.errors import OpgraphError
from ...io.outputs import numfmt
from ...io.outputs.atomic import write_atomic
from .compiled import Sweep
from .grid import Grid, chunks, run_grid


def _csv_chunk(rows: dict[str, np.ndarray], ids: list[str]) -> bytes:
    return numfmt.csv_block([numfmt.text_bytes(ids, col) if name == "hardware" else col
                             for name, col in rows.items()])


def _json_chunk(rows: dict[str, np.ndarray], ids: list[str], first: bool) -> str:
    names = list(rows)
    lists = [[ids[i] for i in col.tolist()] if name == "hardware" else col.tolist()
             for name, col in rows.items()]
    text = ",\n".join(json.dumps(dict(zip(names, row)), allow_nan=False) for row in zip(*lists))
    return ("" if first else ",\n") + text


def write(sweep: Sweep, grid: Grid, path: str | Path) -> int:
    """Every row of the sweep into `path` (.csv or .json), chunk by chunk, atomically
    (`opgraph.io.outputs.atomic.write_atomic`). Returns the number of rows."""
    kind = Path(path).suffix.lower()
    if kind not in (".csv", ".json"):
        raise OpgraphError(f"--out {path}: write a .csv or a .json file")
    ids = [p.id for p in grid.hardware]

    def dump(f) -> None:
        for lo, hi in chunks(grid):
            rows = run_grid(sweep, grid, lo, hi)
            _check_finite(rows)
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

    write_atomic(path, dump, mode="wb")
    return len(grid)


def _check_finite(rows: dict[str, np.ndarray]) -> None:
    """No row may hold inf or nan (JSON has no such numbers; a CSV reader would choke)."""
    for name, col in rows.items():
        if col.dtype.kind == "f" and not np.isfinite(col).all():
            raise OpgraphError(f"the sweep's {name} is not finite at some point; the sizes or "
                               "hardware figures are out of range")
