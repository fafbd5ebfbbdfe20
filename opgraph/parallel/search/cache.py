"""Compiled structures kept between runs of `opgraph plan`: a file per search context, read
when the next search of the same context starts.

Compiling a structure (the passes, `split_stages`, the formulas of `bounds._compile_stage`)
is most of a plan's time, and a user re-running `plan` on the same model and part (another
`--top`, `--compare`, `--sensitivity`, another GPU count) compiles the same structures again.
So the `Searcher` that `plan` makes keeps what it compiled in one file, named by a digest
(`context`) of everything a compiled structure depends on besides its own key:

- the code: every source and data file of the `opgraph` package, its passes and its models, and
  the versions of Python, sympy, networkx and numpy (`fingerprint`); any edit is a new context;
- the model: its graph, every tensor, op and region as its record prints (`repr`: each field,
  the formulas included), its dimensions and sequence lengths;
- the part (its record), the cost model (its record: the calibrated efficiencies included),
  the dimension values (the sequence length) and the layers pipeline stages split.

The structure and compute keys inside (`bounds.structure`, `bounds.compute_key`) are the
ones a search already trusts within a run. A cache that can be wrong is worse than none, so
what cannot be shown equal is not reused: a file of another context is never read, and a file
that does not load (cut short, another format) is a miss and is written again.

The folder is `$OPGRAPH_CACHE_DIR`, else `$XDG_CACHE_HOME/opgraph`, else `~/.cache/opgraph`;
`OPGRAPH_CACHE_DIR=off` (or empty) keeps nothing, as `plan --no-cache` does. The files are
Python pickles (zlib-compressed), which run code when read, so a file is read only from a
folder and a file the user owns that no one else may write (the folder is made so: mode
0700). The `KEEP` most recently used files are kept. Writes go to a temporary file renamed into
place, so a reader never sees half a file.

What a file holds: the structures (their stages without their graphs, which are most of a
structure's size and of the time to read it back: `Searcher.stage_graph` makes one again where
a layout not scheduled before needs it, and stops the search if it does not match), the
compute keys' formulas, the schedule's plans, and `Searcher.fitting`'s counts.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import os
import pickle
import stat
import sys
import tempfile
import zlib
from pathlib import Path

ENV = "OPGRAPH_CACHE_DIR"
OFF = ("", "off", "0", "none")
KEEP = 16  # files kept in the folder, the most recently used
SUFFIX = ".structures"
FORMAT = 3  # the files' layout: MAGIC, then zlib({"format", "structures", "computes",
# "fits"}): the last, how many of a structure's rows fit (`Searcher.fitting`)
MAGIC = b"opgraph compiled structures\n"


def folder() -> Path | None:
    """Where the files live (see the module); None where caching is off."""
    given = os.environ.get(ENV)
    if given is not None:
        return None if given.strip().lower() in OFF else Path(given).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "opgraph"
    try:
        return Path.home() / ".cache" / "opgraph"
    except (RuntimeError, KeyError):  # no home folder to find: keep nothing
        return None


@functools.lru_cache(maxsize=1)
def fingerprint() -> str:
    """A digest of the code a compiled structure comes from (see the module)."""
    import networkx
    import numpy
    import sympy

    h = hashlib.sha256()
    h.update(f"{sys.version} {sympy.__version__} {networkx.__version__} "
             f"{numpy.__version__}".encode())
    for package in PACKAGES:
        h.update(files_digest(Path(importlib.import_module(package).__file__).parent))
    return h.hexdigest()


# the code a compiled structure comes from (the passes and models install as these names)
PACKAGES = ("opgraph", "opgraph.passes", "opgraph.models")
SOURCES = (".py", ".toml", ".json", ".csv")  # its files: the code, and the data it reads


def files_digest(root: Path) -> bytes:
    """A digest of every source and data file under `root` (`SOURCES`), each by its path
    and its bytes; compiled bytecode left out."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.suffix in SOURCES and "__pycache__" not in path.parts:
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.digest()


def context(forward, hardware, cost, values: dict, layers) -> str:
    """The digest that names a search context's file (see the module)."""
    h = hashlib.sha256(fingerprint().encode())
    for part in (forward.name, sorted((str(k), str(v)) for k, v in forward.dims.items()),
                 forward.seq_len, forward.max_seq_len,
                 sorted((str(k), str(v)) for k, v in values.items()), layers, hardware, cost):
        h.update(repr(part).encode())
    for t in forward.tensors():
        h.update(repr(t).encode())
    for r in forward.regions():
        h.update(repr(r).encode())
    for op in forward.ops():
        h.update(repr(op).encode())
    return h.hexdigest()[:32]


def load(where: Path, name: str) -> dict | None:
    """The context's file read back (`{"structures": ..., "computes": ..., "fits": ...}`),
    or None: none yet, or one that is not the user's alone, or that does not load."""
    path = where / f"{name}{SUFFIX}"
    try:
        if not (_private(where) and _private(path)):
            return None
        data = path.read_bytes()
        if not data.startswith(MAGIC):
            return None
        found = pickle.loads(zlib.decompress(data[len(MAGIC):]))
        if not (isinstance(found, dict) and found.get("format") == FORMAT):
            return None
        os.utime(path)  # used now: kept among the newest
        return found
    except Exception:  # cut short, unpicklable, removed meanwhile: a miss, written again
        return None


def save(where: Path, name: str, structures: dict, computes: dict, fits: dict) -> bool:
    """Write the context's file (whole, then renamed into place) and keep the newest `KEEP`;
    False where the folder cannot be written (the search's answer does not depend on it)."""
    try:
        where.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not _private(where):
            return False
        fd, tmp = tempfile.mkstemp(dir=where, suffix=".tmp")
        try:
            data = pickle.dumps({"format": FORMAT, "structures": structures,
                                 "computes": computes, "fits": fits},
                                protocol=pickle.HIGHEST_PROTOCOL)
            with os.fdopen(fd, "wb") as f:
                # compressed: the liveness matrices are bands of small integers (DeepSeek-V2-
                # Lite's --rank search: 119 MB as pickled, 7.3 MB so, 0.2 s each way)
                f.write(MAGIC + zlib.compress(data, 1))
            os.replace(tmp, where / f"{name}{SUFFIX}")
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        files = sorted(where.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime,
                       reverse=True)
        for old in files[KEEP:]:
            old.unlink(missing_ok=True)
        return True
    except Exception:  # a read-only home, a full disk: the next run compiles again
        return False


def remove(where: Path | None, name: str) -> Path | None:
    """Remove the context's file (one found not to match what the code compiles); its path."""
    if where is None:
        return None
    path = where / f"{name}{SUFFIX}"
    path.unlink(missing_ok=True)
    return path


def _private(path: Path) -> bool:
    """Whether `path` is the user's and no one else may write it (never, where the system
    has no user ids to compare)."""
    uid = getattr(os, "getuid", None)
    s = path.stat()
    return (uid is not None and s.st_uid == uid()
            and not s.st_mode & (stat.S_IWGRP | stat.S_IWOTH))
