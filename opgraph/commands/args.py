"""Argument types shared by the subcommands: numbers are parsed, never eval'ed, and bounded
(`opgraph.core.limits`); the files a command reads and writes; JSON that is always valid JSON."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re

from ..core.errors import OpgraphError
from ..core.limits import MAX_COUNT, MAX_DIGITS, check_whole
from ..io.outputs.atomic import check_outputs

_INT = re.compile(r"[0-9]+(?:[_,][0-9]+)*")


def whole(maximum: int):
    """An argparse type: a whole number from 1 to `maximum`, written `8192`, `8_192` or
    `8,192`; `whole(2**30)("8,192") == 8192`."""
    def parse(text: str) -> int:
        if not _INT.fullmatch(text.strip()):
            if _INT.fullmatch(text.strip().removeprefix("-")):
                raise argparse.ArgumentTypeError(f"{text!r} is not positive; give a whole "
                                                 "number above 0")
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
        digits = re.sub(r"[_,]", "", text.strip()).lstrip("0") or "0"
        if len(digits) > MAX_DIGITS:  # beyond every bound, and int() of 4,300 digits fails
            raise argparse.ArgumentTypeError(
                f"a {len(digits):,}-digit number is more than opgraph's bound of {maximum:,}")
        value = int(digits)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} is not positive")
        try:
            return check_whole(value, "", maximum)
        except OpgraphError as e:
            raise argparse.ArgumentTypeError(str(e).strip()) from None
    parse.__name__ = "whole number"
    return parse


positive_int = whole(MAX_COUNT)
# Any figure a flag takes (TFLOP/s, TB/s, a share): far from float overflow and denormals. The
# hardware's own ranges (`opgraph.cost.hardware.RANGES`) are narrower.
FLOAT_RANGE = (1e-9, 1e9)


def recompute(text: str) -> str:
    """A recompute policy (`choices.recompute_policy`): a name, or selective: and Megatron-Core's
    modules."""
    from ..core.choices import recompute_policy

    try:
        return recompute_policy(text)
    except OpgraphError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def positive_float(text: str, zero: bool = False) -> float:
    """`text` as a finite number above 0 within `FLOAT_RANGE`; with `zero`, 0 too."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        wanted = "a number of 0 or more" if zero else "a positive number"
        raise argparse.ArgumentTypeError(f"{text!r} is not {wanted}")
    if value == 0:  # allowed here; FLOAT_RANGE bounds the positive ones
        return value
    if not FLOAT_RANGE[0] <= value <= FLOAT_RANGE[1]:
        raise argparse.ArgumentTypeError(f"{text!r} is out of range; give a number from "
                                         f"{FLOAT_RANGE[0]:g} to {FLOAT_RANGE[1]:g}")
    return value


def non_negative_float(text: str) -> float:
    """`positive_float` that takes 0 as well (`plan --headroom 0`, the default)."""
    return positive_float(text, zero=True)


def input_files(args: argparse.Namespace) -> list[str]:
    """Every file a command reads, from its options: a config.json (or its folder's), hardware
    TOML files, a rules file, a case file (`--fit`, validate's cases), a calibration file, a
    trace, a job config (`--torchtitan`, `--megatron-args @FILE`), a cluster file, a model file
    (`--model FILE.py:build`)."""
    files = [getattr(args, name, None) for name in ("fit", "calibration", "cases",
                                                     "torchtitan", "cluster")]
    if getattr(args, "command", None) != "profile":  # profile's --trace is what it writes
        files.append(getattr(args, "trace", None))
    megatron = getattr(args, "megatron_args", None)
    if isinstance(megatron, str) and megatron.startswith("@"):
        files.append(megatron[1:])
    model = getattr(args, "model", None)
    if isinstance(model, str) and ".py" in model:
        files.append(model if model.endswith(".py") else model.rpartition(":")[0])
    config = getattr(args, "config", None)
    if config:
        files += [config, os.path.join(config, "config.json")]
    for part in (getattr(args, "hardware", None) or "").split(","):
        if part.strip().endswith(".toml") or "/" in part:
            files.append(part.strip())
    files.append(getattr(args, "rules", None))
    return [f for f in files if isinstance(f, str) and f]


def check_command_outputs(args: argparse.Namespace, outputs: dict[str, str | None],
                          suffixes: dict[str, tuple[str, ...]] | None = None) -> None:
    """Check a command's outputs before it computes anything (`check_outputs`), with its inputs
    from `input_files`, and each output's suffix; a --plot also needs matplotlib."""
    for flag, path in outputs.items():
        allowed = (suffixes or {}).get(flag)
        if path and allowed and not path.lower().endswith(allowed):
            raise OpgraphError(f"{flag} {path}: write a {' or a '.join(allowed)} file")
    check_outputs(outputs, input_files(args))
    if outputs.get("--plot") and importlib.util.find_spec("matplotlib") is None:
        raise OpgraphError("plotting needs matplotlib: pip install 'opgraph[plot]'")


def json_text(obj) -> str:
    """`json.dumps(obj, indent=2)`, refusing inf and nan (JSON has neither) with one line."""
    try:
        return json.dumps(obj, indent=2, allow_nan=False)
    except ValueError:
        raise OpgraphError("a figure came out infinite or not a number; the sizes or hardware "
                           "figures are out of range") from None


def layer_counts(text: str) -> tuple[int, ...]:
    """An argparse type: every pipeline stage's layers, `6/5/5/0` or `6,5,5,0`, each a whole
    number from 0."""
    parts = re.split(r"[/,]", text.strip())
    if len(parts) > 4096 or not all(re.fullmatch(r"[0-9]{1,9}", p.strip()) for p in parts):
        raise argparse.ArgumentTypeError(f"{text[:40]!r}: give each pipeline stage's layers, "
                                         "first to last, as 6/5/5/0")
    return tuple(int(p) for p in parts)
