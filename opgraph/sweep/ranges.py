"""Ranges of whole numbers as `opgraph sweep` takes them: `START:STOP:+STEP` (linear) or
`START:STOP:xFACTOR` (geometric, a whole factor), both including STOP when they land on it; a
single value; or a comma list."""

from __future__ import annotations

import re

import numpy as np

from ..errors import OpgraphError

MAX_POINTS = 10_000_000
_NUMBER = r"[0-9]+(?:_[0-9]+)*"
_RANGE = re.compile(rf"({_NUMBER}):({_NUMBER}):(.+)")
RANGE_HELP = "START:STOP:+STEP, START:STOP:xFACTOR, a value or a comma list"


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
