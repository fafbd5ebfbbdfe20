"""Output files: every output of a command is checked before any is written, and each is written
atomically, so a failed run writes, replaces or destroys nothing.

    paths = check_outputs({"--plot": "p.png", "--trace": "t.json"}, inputs=["config.json"])
    with outputs():                          # renames happen only if the block completes
        write_atomic(paths["--plot"], draw, mode="wb")
        write_atomic(paths["--trace"], dump)

`check_outputs` refuses an empty name, a name with a newline or another control character, a
missing folder, a directory, a device, a FIFO or anything else that is not a regular file, two
outputs that are one file, and an output that is one of the command's inputs (compared through
symlinks and hard links). `write_atomic` writes to a temp file beside the target and renames it
over the target: readers see the old file or the whole new one, never a part. A symlink is
written through: its target is replaced and the link kept. Inside `outputs()`, the renames wait
until the block completes; if it fails, every temp file is removed and nothing is replaced.
Every OS error (full disk, read-only folder, file size limit) is one `OpgraphError` line.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

from ...core.errors import OpgraphError

_pending: list[list[tuple[str, str]]] = []  # open `outputs()` blocks: (temp, target) pairs


def _shown(path: str | os.PathLike) -> str:
    """A path as a message shows it: on one line, control characters escaped."""
    text = os.fspath(path)
    return text if text.isprintable() else ascii(text)


def check_output(path: str | os.PathLike, what: str = "output") -> Path:
    """`path` if a regular file can be written there (it need not exist yet), else one line.

    A symlink is followed: its target must be writable in the same way."""
    text = os.fspath(path)
    if not text.strip():
        raise OpgraphError(f"{what}: the file name is empty; give a path such as out.json")
    if any(not c.isprintable() for c in text):
        raise OpgraphError(f"{what} {_shown(text)}: the file name holds a newline or another "
                           "control character; give a plain name")
    if text.endswith(("/", os.sep)):
        raise OpgraphError(f"{what} {_shown(text)} names a folder; give a file name")
    target = Path(os.path.realpath(text))
    if target.exists() or os.path.lexists(text):
        try:
            mode = os.stat(text).st_mode
        except OSError:  # a dangling link: its target is created
            mode = None
        if mode is not None and stat.S_ISDIR(mode):
            raise OpgraphError(f"{what} {_shown(text)} is a directory; give a file name")
        if mode is not None and not stat.S_ISREG(mode):
            raise OpgraphError(f"{what} {_shown(text)} is not a regular file (a device, a FIFO "
                               "or a socket); give a file name")
    folder = target.parent
    if not folder.is_dir():
        raise OpgraphError(f"{what} {_shown(text)}: the folder {_shown(Path(text).parent)} "
                           "does not exist; create it first")
    return Path(text)


def _same(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    with contextlib.suppress(OSError):
        if os.path.samefile(a, b):
            return True
    return os.path.realpath(a) == os.path.realpath(b)


def check_outputs(outputs: Mapping[str, str | os.PathLike | None],
                  inputs: Iterable[str | os.PathLike | None] = ()) -> dict[str, Path]:
    """Check every output (flag -> path; None means not asked for) before any is written: each
    must be writable (`check_output`), no two may be one file and none may be an input."""
    checked = {what: check_output(path, what) for what, path in outputs.items()
               if path is not None}
    sources = [p for p in inputs if p is not None and os.fspath(p) != ""]
    seen: list[tuple[str, Path]] = []
    for what, path in checked.items():
        for other, earlier in seen:
            if _same(path, earlier):
                raise OpgraphError(f"{other} and {what} are the same file, "
                                   f"{_shown(path)}; give each its own")
        for source in sources:
            if os.path.exists(source) and _same(path, source):
                raise OpgraphError(f"{what} {_shown(path)} is an input of this command "
                                   f"({_shown(source)}); writing it would destroy it: give "
                                   "another name")
        seen.append((what, path))
    return checked


@contextlib.contextmanager
def outputs() -> Iterator[None]:
    """Defer every `write_atomic` rename inside the block to its end; on failure, none happen."""
    batch: list[tuple[str, str]] = []
    _pending.append(batch)
    try:
        yield
    except BaseException:
        for tmp, _ in batch:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise
    finally:
        _pending.remove(batch)
    for i, (tmp, target) in enumerate(batch):
        try:
            os.replace(tmp, target)
        except OSError as e:
            for later, _ in batch[i:]:
                with contextlib.suppress(OSError):
                    os.unlink(later)
            raise OpgraphError(f"cannot write {_shown(target)}: {e.strerror or e}") from None


def write_atomic(path: str | os.PathLike, write: Callable, mode: str = "w") -> None:
    """Call `write(file)` on a temp file beside `path` (beside a symlink's target), then rename
    it over `path`'s target; `write` may write in as many pieces as it likes.

    A bad path or an OS error becomes one `OpgraphError` line; the temp file is removed.
    """
    path = check_output(path)
    target = os.path.realpath(path)  # a symlink is written through, the link kept
    folder, name = os.path.split(target)
    try:
        keep = stat.S_IMODE(os.stat(target).st_mode)
    except OSError:
        keep = 0o666 & ~_umask()  # mkstemp makes it private; give it a normal file's mode
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
    except OSError as e:
        raise OpgraphError(f"cannot write {_shown(path)}: {e.strerror or e}") from None
    try:
        os.chmod(tmp, keep)
        with os.fdopen(fd, mode) as f:
            write(f)
        if _pending:
            _pending[-1].append((tmp, target))
        else:
            os.replace(tmp, target)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise OpgraphError(f"cannot write {_shown(path)}: {e.strerror or e}") from None
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


__all__ = ["check_output", "check_outputs", "outputs", "write_atomic"]
