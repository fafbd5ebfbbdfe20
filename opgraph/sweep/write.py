"""Writing every row of a sweep to a CSV or JSON file, chunk by chunk, atomically."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np

from ..errors import OpgraphError
from ..outputs import numfmt
from .compiled import Sweep
from .grid import Grid, chunks, run_grid


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
