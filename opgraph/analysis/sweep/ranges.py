"""Ranges of whole numbers as `opgraph sweep` takes them: `START:STOP:+STEP` (linear) or
`START:STOP:xFACTOR` (geometric, a whole factor), both including STOP when they land on it; a
single value; or a comma list."""

from __future__ import annotations

import re

import numpy as np

from ...core.errors import OpgraphError
from ...core.limits import MAX_DIGITS, MAX_DIM

MAX_POINTS = 10_000_000
_NUMBER = r"[0-9]+(?:_[0-9]+)*"
_RANGE = re.compile(rf"({_NUMBER}):({_NUMBER}):(.+)")
RANGE_HELP = "START:STOP:+STEP, START:STOP:xFACTOR, a value or a comma list"


def _whole(text: str, what: str, maximum: int) -> int:
    """One number of a range, at most `maximum` (so that products stay within int64)."""
    digits = text.replace("_", "").lstrip("0") or "0"
    if len(digits) > MAX_DIGITS or int(digits) > maximum:
        shown = f"{int(digits):,}" if len(digits) <= MAX_DIGITS else f"a {len(digits):,}-digit number"
        raise OpgraphError(f"{what}: {shown} is more than opgraph's bound of {maximum:,} "
                           f"(2**{maximum.bit_length() - 1}); give smaller values")
    return int(digits)


def parse_range(text: str, what: str = "range", maximum: int = MAX_DIM,
                points: int = MAX_POINTS) -> np.ndarray:
    """The whole numbers a range names, each at most `maximum`, at most `points` of them:
    `parse_range("1024:8192:x2")` is 1024, 2048, 4096, 8192."""
    text = text.strip()
    if re.fullmatch(rf"{_NUMBER}(?:,{_NUMBER})*", text):
        _check_count(text.count(",") + 1, what, text, points)
        values = [_whole(v, what, maximum) for v in text.split(",")]
        if min(values) <= 0:
            raise OpgraphError(f"{what} {text}: values must be positive")
        return np.array(values, dtype=np.int64)
    m = _RANGE.fullmatch(text)
    if not m:
        raise OpgraphError(f"{what} {text!r} is not a range; write {RANGE_HELP}, "
                           "e.g. 8192:65536:+8192 or 1024:1048576:x2")
    start, stop = (_whole(g, what, maximum) for g in m.groups()[:2])
    step = m.group(3)
    if start <= 0:
        raise OpgraphError(f"{what} {text}: start must be positive")
    if stop < start:
        raise OpgraphError(f"{what} {text}: stop {stop:,} is below start {start:,}")
    if re.fullmatch(r"[+-]?[0-9]+(?:_[0-9]+)*", step) and step[0] in "+-":
        increment = _whole(step[1:], what, maximum) if step[0] == "+" else -1
        if increment <= 0:
            raise OpgraphError(f"{what} {text}: the step {step} must be positive, e.g. +1")
        count = (stop - start) // increment + 1
        _check_count(count, what, text, points)
        return np.arange(count, dtype=np.int64) * increment + start
    if step[:1] in ("x", "X"):
        factor = step[1:]
        if not re.fullmatch(r"[0-9]{1,20}", factor) or int(factor) <= 1:
            raise OpgraphError(f"{what} {text}: the factor {step} must be a whole number above "
                               "1, e.g. x2")
        values, v = [], start
        while v <= stop:
            values.append(v)
            v *= int(factor)
        _check_count(len(values), what, text, points)
        return np.array(values, dtype=np.int64)
    raise OpgraphError(f"{what} {text}: the step {step!r} is neither +STEP nor xFACTOR")


def _check_count(count: int, what: str, text: str, points: int = MAX_POINTS) -> None:
    if count > points:
        raise OpgraphError(f"{what} {text} has {count:,} points, more than {points:,} "
                           "(opgraph's bound); take a coarser step")
