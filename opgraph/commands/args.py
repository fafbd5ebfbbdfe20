"""Argument types shared by the subcommands: numbers are parsed, never eval'ed."""

from __future__ import annotations

import argparse
import math
import re

_INT = re.compile(r"[0-9]+(?:[_,][0-9]+)*")


def positive_int(text: str) -> int:
    """`8192`, `8_192` or `8,192`."""
    if not _INT.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    value = int(re.sub(r"[_,]", "", text))
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not positive")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value
