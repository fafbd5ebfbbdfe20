"""Progress bars on stderr while a long command works, and only where a person watches it: when
stderr is a terminal. Piped, redirected or under a test runner, nothing is written, so a
command's stderr stays its warnings and errors alone.

    with progress("plan: structures", total=len(keys), unit="structure") as bar:
        for key in keys:
            ...
            bar.update()

tqdm draws the bar (`leave=False`: it is erased when done, so the table after it stands alone).
"""

from __future__ import annotations

import sys


class _Silent:
    """What `progress` hands back when no one watches: every call does nothing."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str = "", refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _Silent:
        return self

    def __exit__(self, *exc) -> None:
        pass


def watched(stream=None) -> bool:
    """Whether `stream` (default: the current sys.stderr) is a terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def progress(desc: str, *, total: int | None = None, unit: str = "it"):
    """A bar counting `unit`s up to `total` (None: a running count) on stderr, or a silent
    stand-in when stderr is not a terminal; both have `update`, `set_postfix_str`, `close` and
    work as context managers."""
    stream = sys.stderr
    if not watched(stream):
        return _Silent()
    try:
        from tqdm import tqdm
    except ImportError:  # a dependency, but a progress bar is never worth failing over
        return _Silent()
    return tqdm(desc=desc, total=total, unit=unit, file=stream, leave=False,
                dynamic_ncols=True, mininterval=0.2)


def progressed(iterable, desc: str, *, total: int | None = None, unit: str = "it"):
    """Each item of `iterable`, counted on a `progress` bar that closes at the end."""
    if total is None:
        try:
            total = len(iterable)
        except TypeError:
            total = None
    with progress(desc, total=total, unit=unit) as bar:
        for item in iterable:
            yield item
            bar.update()
