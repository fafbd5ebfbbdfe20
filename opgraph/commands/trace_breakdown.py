"""`opgraph trace-breakdown`: GPU time per kernel category, and idle time, in a real trace."""

from __future__ import annotations

import json

from ..traces.kineto import KERNEL_RULES, breakdown, format_breakdown, load_rules, read_trace


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
        "idle time between kernels.",
    )
    p.add_argument(
        "trace",
        metavar="TRACE",
        help="the trace file, from torch.profiler's export_chrome_trace (.json or .json.gz)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument(
        "--rules",
        metavar="FILE",
        help='a JSON file of extra rules, [{"category": ..., "pattern": ...}, ...], tried '
        "before the built-in ones (first match wins)",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    """Print the breakdown of ``args.trace`` (a table, or JSON with ``--json``); return 0.

    Bad input raises OpgraphError, which the main CLI prints as one line.

    Example::

        run(argparse.Namespace(trace="step.json.gz", json=True, rules=None))
    """
    rules = load_rules(args.rules) if args.rules else KERNEL_RULES
    result = breakdown(read_trace(args.trace), rules)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(format_breakdown(result))
    return 0
