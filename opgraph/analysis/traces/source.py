"""A file's bytes as a stream of chunks, gunzipped when it is gzip, never more than a cap.

Nothing here holds a whole file: `read_chunks` yields at most `CHUNK` bytes at a time, so an
endless input (``/dev/zero``, a pipe) or a gzip bomb costs the time to reach the cap, not memory.
Every failure is an `OpgraphError` whose message is one line.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from pathlib import Path

from opgraph.core.errors import OpgraphError

GZIP_MAGIC = b"\x1f\x8b"

CHUNK = 1 << 20  # bytes read, and at most decompressed, at a time



def error(message: str) -> OpgraphError:
    """An OpgraphError whose message is one line even if a file name holds a newline or tab."""
    return OpgraphError("".join(c if c.isprintable() else ascii(c)[1:-1] for c in message))


def one_line(text: object) -> str:
    """Collapse any whitespace runs (newlines included) so a message stays on one line."""
    return " ".join(str(text).split())


def as_path(path: str | Path, what: str) -> Path:
    """`path` as a Path; an empty one is an error (``Path("")`` would quietly be the folder ".")."""
    if isinstance(path, str) and not path.strip():
        raise error(f"the {what} path is empty: give the path of the {what} file")
    return Path(path)


def _os_error(path: Path, what: str, err: OSError) -> OpgraphError:
    if isinstance(err, FileNotFoundError):
        return error(f"{path} does not exist: check the path of the {what}")
    if isinstance(err, IsADirectoryError):
        return error(f"{path} is a directory: pass the path of the {what} file")
    if isinstance(err, PermissionError):
        return error(f"{path} cannot be read (permission denied): check its permissions")
    reason = one_line(err.strerror or err)
    return error(f"{path} cannot be read ({reason}): check the path of the {what}")


def _corrupt(path: Path, reason: str) -> OpgraphError:
    return error(f"{path} is a truncated or corrupt gzip file ({reason}): "
                 "copy or export the trace again")


def read_chunks(path: str | Path, what: str, max_bytes: int, too_large: str) -> Iterator[bytes]:
    """The bytes of `path`, gunzipped when they start with the gzip magic (whatever the name).

    Raises OpgraphError once more than `max_bytes` (decompressed) have been read; its message
    ends with `too_large`, which says how to raise the cap.

    >>> import gzip, tempfile
    >>> with tempfile.NamedTemporaryFile(suffix=".gz") as f:
    ...     _ = f.write(gzip.compress(b"[1, 2]")); f.flush()
    ...     b"".join(read_chunks(f.name, "trace", 100, "raise the cap"))
    b'[1, 2]'
    """
    path = as_path(path, what)
    try:
        file = open(path, "rb")  # noqa: SIM115 - closed below, after the generator is done
    except OSError as err:
        raise _os_error(path, what, err) from None
    with file:
        def raw() -> Iterator[bytes]:
            while True:
                try:
                    data = file.read(CHUNK)
                except OSError as err:
                    raise _os_error(path, what, err) from None
                if not data:
                    return
                yield data

        blocks = raw()
        first = b""
        for block in blocks:  # the magic is two bytes; a pipe may hand over fewer at first
            first += block
            if len(first) >= len(GZIP_MAGIC):
                break
        gzipped = first.startswith(GZIP_MAGIC)
        chunks = _gunzip(path, first, blocks) if gzipped else _chain(first, blocks)
        total = 0
        for chunk in chunks:
            total += len(chunk)
            if total > max_bytes:
                size = f"{max_bytes / 1e9:g} GB" if max_bytes >= 1e8 else f"{max_bytes:,} bytes"
                raise error(f"{path} holds more than {size}{' once decompressed' if gzipped else ''}"
                            f", the most a {what} may hold: {too_large}")
            yield chunk


def _chain(first: bytes, rest: Iterator[bytes]) -> Iterator[bytes]:
    if first:
        yield first
    yield from rest


def _gunzip(path: Path, first: bytes, rest: Iterator[bytes]) -> Iterator[bytes]:
    """Inflate gzip members one after the other, `CHUNK` bytes of output at a time.

    Zero bytes between or after members are padding, as gzip itself reads them.
    """
    inflate, in_member, data = zlib.decompressobj(wbits=31), True, first
    while True:
        if not in_member:  # between members: skip padding, then a new member must start
            data = data.lstrip(b"\0")
            if data:
                inflate, in_member = zlib.decompressobj(wbits=31), True
        if in_member and data:
            try:
                out = inflate.decompress(data, CHUNK)
            except zlib.error as err:
                raise _corrupt(path, one_line(err)) from None
            data = inflate.unconsumed_tail
            if inflate.eof:  # a member ended; what follows it is padding or another member
                data, in_member = inflate.unused_data, False
            if out:
                yield out
            if data or out:
                continue
        elif in_member:  # no input left; the member may still hold output
            out = inflate.decompress(b"", CHUNK)
            if out:
                yield out
                continue
        data = next(rest, b"")
        if not data:
            if in_member:
                raise _corrupt(path, "the file ends inside the compressed data")
            return
