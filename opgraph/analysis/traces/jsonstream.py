"""An incremental JSON reader: the items of a trace's ``traceEvents`` list, one at a time.

`json.load` of a trace of a million kernels builds every event at once (1.2 GB). Here the
decompressed bytes are decoded a chunk at a time into a sliding text window, and the standard
library's scanner (`json.JSONDecoder.scan_once`, what `raw_decode` calls) parses one event from
it; the window then moves on. Memory is one chunk plus the largest single event, whatever the
file's size. The rest of the document is checked as `json.loads` would (one top-level value,
nothing after it) and its other members are parsed and dropped.

Numbers that are not JSON (``NaN``, ``Infinity``) and integers longer than Python converts
(4,300 digits) are errors, each a one-line `OpgraphError` naming the file, line and column.

>>> import tempfile
>>> with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
...     _ = f.write('{"schemaVersion": 1, "traceEvents": [{"ph": "X"}, 2]}'); f.flush()
...     list(trace_events(f.name))
[{'ph': 'X'}, 2]
"""

from __future__ import annotations

import codecs
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

from opgraph.core.limits import MAX_TRACE_BYTES

from .source import as_path, error, one_line, read_chunks

EXPORT_HINT = "export it with torch.profiler's export_chrome_trace"
RAISE_CAP_HINT = "pass --max-trace-gb with a larger figure if the trace really is that large"

_WHITESPACE = re.compile(r"[ \t\n\r]*")

# A failure this close to the end of the window may be a value cut by the chunk boundary (an
# escape, a literal, a number); read more and try again before calling it an error.
_TAIL = 32


class _NotJson(Exception):
    """`NaN`, `Infinity` or `-Infinity` in the text: Python accepts them, JSON does not."""


def _reject_constant(name: str):
    raise _NotJson(name)


class _Window:
    """Decoded text of a byte stream, from the first unconsumed character to what was read."""

    def __init__(self, path: Path, chunks: Iterator[bytes], hint: str):
        self.path, self.hint = path, hint
        self.chunks = chunks
        self.text, self.pos = "", 0
        self.eof = False
        self.line, self.column = 1, 1  # of text[0], for error messages
        self.decoder, self.head = None, b""
        self.scan = json.JSONDecoder(parse_constant=_reject_constant).scan_once

    def more(self) -> bool:
        """Drop what was consumed and read at least as much again; False at the end."""
        if self.eof:
            return False
        self._forget(self.pos)
        wanted, parts = max(len(self.text), 1), []
        while wanted > 0:
            data = next(self.chunks, b"")
            if self.decoder is None:  # the encoding shows in the first four bytes
                self.head += data
                if len(self.head) < 4 and data:
                    continue
                self.decoder = _text_decoder(self.head)
                data, self.head = self.head, b""
                if not data:
                    self.eof = True
                    break
            try:
                part = self.decoder.decode(data, final=not data)
            except UnicodeDecodeError:
                raise error(f"{self.path} is not JSON (it is not UTF-8 text): {self.hint}") from None
            parts.append(part)
            wanted -= len(part)
            if not data:
                self.eof = True
                break
        self.text += "".join(parts)
        return bool(parts) and any(parts)

    def _forget(self, upto: int) -> None:
        if upto <= 0:
            return
        text = self.text
        newlines = text.count("\n", 0, upto)
        if newlines:
            self.line += newlines
            self.column = upto - text.rfind("\n", 0, upto)
        else:
            self.column += upto
        self.text, self.pos = text[upto:], self.pos - upto

    def where(self, pos: int) -> str:
        text = self.text
        newlines = text.count("\n", 0, pos)
        column = pos - text.rfind("\n", 0, pos) if newlines else self.column + pos
        return f"line {self.line + newlines}, column {column}"

    def fail(self, pos: int, message: str) -> Exception:
        return error(f"{self.path} is not JSON ({self.where(pos)}: {one_line(message)}): "
                     f"{self.hint}")

    def skip_space(self) -> str:
        """Move past whitespace; the next character, or "" at the end of the input."""
        while True:
            self.pos = _WHITESPACE.match(self.text, self.pos).end()
            if self.pos < len(self.text):
                return self.text[self.pos]
            if not self.more():
                return ""

    def value(self) -> object:
        """Parse the value that starts at `pos` and move past it."""
        while True:
            text, pos = self.text, self.pos
            try:
                item, end = self.scan(text, pos)
            except StopIteration as stop:
                where, message = stop.value, "Expecting value"
            except json.JSONDecodeError as err:
                where, message = err.pos, err.msg
            except _NotJson as err:
                where, message = pos, f"{err} is not a JSON number"
            except RecursionError:
                raise error(f"{self.path} is JSON nested too deeply to be a trace: "
                            f"{self.hint}") from None
            except ValueError as err:  # int() refuses more than sys.get_int_max_str_digits()
                if "digits" not in str(err):
                    raise
                digits = sys.get_int_max_str_digits()
                raise error(f"{self.path} holds an integer too long to read (more than "
                            f"{digits:,} digits, {self.where(pos)}): {self.hint}") from None
            else:
                if end + _TAIL < len(text) or self.eof:
                    self.pos = end
                    return item
                self.more()  # a number may go on in the next chunk ("1" of "1.5e3")
                continue
            cut = where >= len(text) - _TAIL or message.startswith("Unterminated")
            if not cut or self.eof:
                raise self.fail(where, message)
            self.more()

    def items(self) -> Iterator[object]:
        """The items of the array whose "[" is at `pos`, one at a time."""
        self.pos += 1
        if self.skip_space() == "]":
            self.pos += 1
            return
        space, scan, first = _WHITESPACE.match, self.scan, True
        while True:
            text, pos = self.text, self.pos
            separator = ""
            try:  # the fast path: the item and what follows it are well inside the window
                item, end = scan(text, pos)
                end = space(text, end).end()
                if end + _TAIL < len(text):
                    separator = text[end]
            except (StopIteration, ValueError, RecursionError, _NotJson):
                pass
            if not separator:  # near the window's end, or not JSON: the careful path
                if self.skip_space() == "]" and not first:
                    raise self.fail(self.pos, "Illegal trailing comma before end of array")
                item = self.value()
                separator = self.skip_space()
                end = self.pos
            first = False
            if separator == ",":
                self.pos = space(self.text, end + 1).end()
            elif separator == "]":
                self.pos = end + 1
                yield item
                return
            else:
                raise self.fail(end, "Expecting ',' delimiter")
            yield item


def _text_decoder(first: bytes):
    """An incremental decoder for the encoding JSON's first bytes show (UTF-8, -16 or -32)."""
    encoding = json.detect_encoding(first)
    return codecs.getincrementaldecoder(encoding)("strict")


def _kind(value: object) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), "a number")


def trace_events(path: str | Path, max_bytes: int = MAX_TRACE_BYTES) -> Iterator[object]:
    """The items of a Chrome trace's event list, read incrementally.

    The document is ``{"traceEvents": [...], ...}`` or a bare list of events. Raises OpgraphError
    (one line) when the file cannot be read, is not JSON, is not a trace, or holds more than
    `max_bytes` once decompressed.
    """
    path = as_path(path, "trace")
    window = _Window(path, read_chunks(path, "trace", max_bytes, RAISE_CAP_HINT), EXPORT_HINT)
    first = window.skip_space()
    if first == "[":
        yield from window.items()
    elif first == "{":
        yield from _object_events(window)
    else:
        document = window.value()  # raises if it is not JSON at all
        _expect_end(window)
        raise error(f"{path} is JSON but not a trace (the top level is {_kind(document)}, "
                    f'not an object with "traceEvents"): {EXPORT_HINT}')
    _expect_end(window)


def _object_events(window: _Window) -> Iterator[object]:
    """The events of ``{"traceEvents": [...]}``, the object's other members parsed and dropped."""
    path, found = window.path, False
    window.pos += 1
    if window.skip_space() == "}":
        window.pos += 1
    else:
        while True:
            if window.skip_space() != '"':
                raise window.fail(window.pos, "Expecting property name enclosed in double quotes")
            key = window.value()
            if window.skip_space() != ":":
                raise window.fail(window.pos, "Expecting ':' delimiter")
            window.pos += 1
            if window.skip_space() == "[" and key == "traceEvents" and not found:
                found = True
                yield from window.items()
            else:
                value = window.value()
                if key == "traceEvents":
                    raise error(f'{path} is not a valid trace ("traceEvents" is {_kind(value)}'
                                f", not a list): {EXPORT_HINT}")
            separator = window.skip_space()
            window.pos += 1
            if separator == "}":
                break
            if separator != ",":
                raise window.fail(window.pos - 1, "Expecting ',' delimiter")
    if not found:
        _expect_end(window)
        raise error(f'{path} is JSON but not a trace (it has no "traceEvents" list): '
                    f"{EXPORT_HINT}")


def _expect_end(window: _Window) -> None:
    if window.skip_space():
        raise window.fail(window.pos, "Extra data")


def load_json(path: str | Path, what: str, max_bytes: int, hint: str) -> object:
    """A whole small JSON file (a rules file), read under a cap, with one-line errors."""
    path = as_path(path, what)
    too_large = f"a {what} is at most {max_bytes:,} bytes"
    window = _Window(path, read_chunks(path, what, max_bytes, too_large), hint)
    window.skip_space()
    document = window.value()
    _expect_end(window)
    return document
