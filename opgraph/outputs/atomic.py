"""Writing output files so that a failure never leaves a half-written one behind.

    write_atomic("out.json", dump)      # dump(f) writes to a temp file, renamed over out.json

The temp file sits in the target's own folder, so the final `os.replace` is a rename on one
file system: readers see the old file or the whole new one, never a part.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from ..errors import OpgraphError


def write_atomic(path: str | os.PathLike, write: Callable, mode: str = "w") -> None:
    """Call `write(file)` on a temp file beside `path`, then rename it over `path`.

    A missing folder or an OS error becomes one `OpgraphError` line; the temp file is removed.
    """
    path = Path(path)
    folder = path.parent
    if not folder.is_dir():
        raise OpgraphError(f"cannot write {path}: folder {folder} does not exist; create it first")
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise OpgraphError(f"cannot write {path}: {e.strerror or e}") from None
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it private; give it a normal file's mode
        with os.fdopen(fd, mode) as f:
            write(f)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise OpgraphError(f"cannot write {path}: {e.strerror or e}") from None
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
