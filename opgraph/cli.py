"""The command line: `opgraph profile` and friends. Bad input is one line and exit status 2."""

from __future__ import annotations

import argparse
import importlib
import sys

from .errors import OpgraphError

COMMANDS = ("profile", "formula", "solve", "sweep", "diff", "trace_breakdown", "compare", "models",
            "hardware")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage + message
        raise OpgraphError(f"{message} (see `{self.prog} --help`)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="opgraph", description="Roofline profiles of a training step, "
                     "compiled from a symbolic op graph.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMANDS:
        importlib.import_module(f"opgraph.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["profile", *argv]  # `opgraph` alone, or `opgraph --json`, profiles
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except OpgraphError as e:
        print(f"opgraph: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
