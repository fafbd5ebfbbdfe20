"""`opgraph trace-breakdown`: GPU time per kernel category, and idle time, in a real trace."""

from __future__ import annotations

import argparse
import math

from ..core.limits import MAX_TRACE_BYTES  # the reader itself (with numpy) loads when it runs
from .args import json_text


def max_trace_gb(text: str) -> float:
    """The --max-trace-gb figure: a positive, finite number of gigabytes (10**9 bytes)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of gigabytes") from None
    if not math.isfinite(value) or value <= 0 or value > 1e6:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size above 0 and at most 1e6 GB")
    return value


def add_trace_args(parser: argparse.ArgumentParser) -> None:
    """The options every command reading a trace takes: --rules and --max-trace-gb."""
    parser.add_argument(
        "--rules",
        metavar="FILE",
        help='a JSON file of extra rules, [{"category": ..., "pattern": ...}, ...], tried '
        "before the built-in ones (first match wins)",
    )
    parser.add_argument(
        "--max-trace-gb", type=max_trace_gb, default=MAX_TRACE_BYTES / 1e9, metavar="GB",
        help="stop with an error past this much JSON, decompressed (default "
        f"{MAX_TRACE_BYTES / 1e9:g} GB: a step of a million kernels is about 0.7 GB)",
    )


def read_breakdown(args):
    """The breakdown of ``args.trace`` under ``args.rules`` and ``args.max_trace_gb``."""
    from ..analysis.traces import KERNEL_RULES, breakdown, iter_kernels, load_rules

    rules = load_rules(args.rules) if args.rules else KERNEL_RULES
    return breakdown(iter_kernels(args.trace, int(args.max_trace_gb * 1e9)), rules)


def register(subparsers) -> None:
    """Add the ``trace-breakdown`` parser to ``subparsers``.

    Example::

        sub = argparse.ArgumentParser().add_subparsers()
        register(sub)
    """
    p = subparsers.add_parser(
        "trace-breakdown",
        help="GPU time per kernel category and idle time in a PyTorch profiler trace",
        description="Read a Kineto / Chrome-trace JSON file (.json or .json.gz) exported by "
        "torch.profiler, sort its GPU kernels into categories by name and print the time per "
        "category, the busy time (kernels overlapping on several streams counted once) and the "
        "idle time between kernels. The file is read incrementally, in memory that does not "
        "grow with its size.",
    )
    p.add_argument(
        "trace",
        metavar="TRACE",
        help="the trace file, from torch.profiler's export_chrome_trace (.json or .json.gz)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    add_trace_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    """Print the breakdown of ``args.trace`` (a table, or JSON with ``--json``); return 0.

    Bad input raises OpgraphError, which the main CLI prints as one line.

    Example::

        run(argparse.Namespace(trace="step.json.gz", json=True, rules=None, max_trace_gb=2))
    """
    from ..analysis.traces import format_breakdown

    result = read_breakdown(args)
    print(json_text(result.to_json()) if args.json else format_breakdown(result))
    return 0
