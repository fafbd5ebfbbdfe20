"""The command line: `opgraph profile` and friends. Bad input is one line and exit status 2."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import signal
import sys
import threading

from .core.collector import fewer_collections
from .core.errors import OpgraphError

COMMANDS = ("profile", "formula", "solve", "sweep", "diff", "trace_breakdown", "compare", "models",
            "hardware", "validate", "calibrate", "plan")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage + message
        raise OpgraphError(f"{message} (see `{self.prog} --help`)")


def _version() -> str:
    from . import __version__

    return f"opgraph {__version__}"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="opgraph", description="Roofline profiles of a training step, "
                     "compiled from a symbolic op graph.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMANDS:
        importlib.import_module(f"opgraph.commands.{name}").register(sub)
    return parser


def _no_empty_strings(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """An option or argument given as '' (or blanks) is a mistake, never "use the default"."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for action in sub.choices[args.command]._actions:
        value = getattr(args, action.dest, None)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str) and not item.strip():
                flag = action.option_strings[-1] if action.option_strings else action.metavar
                raise OpgraphError(f"{flag or action.dest}: the value is empty; give one "
                                   f"(see `opgraph {args.command} --help`)")


def _unrecognized(parser: argparse.ArgumentParser, command: str, extra: list[str]) -> str:
    """What argparse says of arguments no option takes, pointing at the command's own help, with
    the nearest flag of that command where one is close."""
    import difflib

    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags = [f for a in sub.choices[command]._actions if a.help != argparse.SUPPRESS
             for f in a.option_strings]
    near = difflib.get_close_matches(extra[0].split("=")[0], flags, n=1, cutoff=0.75)
    hint = f"; did you mean {near[0]}?" if near and extra[0].startswith("-") else ""
    return (f"unrecognized arguments: {' '.join(extra)}{hint} "
            f"(see `opgraph {command} --help`)")


def _one_line(message: str) -> str:
    """A message with a newline or a control character in it (from a file name) escaped."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in message)


class _Terminated(BaseException):
    """SIGTERM or SIGHUP, raised where the program is, so that what it was writing is cleaned up
    on the way out (`outputs.atomic` removes its temp files on any exception)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_terminated(signum, _frame):
    raise _Terminated(signum)


@contextlib.contextmanager
def _signals_raise():
    """SIGTERM and SIGHUP raise `_Terminated` inside the block (where a handler can be set:
    the main thread); the previous handlers come back after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    names = [n for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n)]
    before = {n: signal.signal(getattr(signal, n), _raise_terminated) for n in names}
    try:
        yield
    finally:
        for n, handler in before.items():
            signal.signal(getattr(signal, n), handler)


def _stdout_gone() -> None:
    """Point stdout at /dev/null: what is still buffered for a closed pipe or a full disk
    would fail again at exit, with Python's two-line "Exception ignored" (and status 120)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        pass  # not a real file (a test's capture): nothing is flushed at exit


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # numpy's BLAS threads gain nothing on opgraph's small matrices (`plan`'s run no faster
    # with them) and would spin on every core; numpy is not imported yet, so this holds
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    # sympy memoises in LRU caches of SYMPY_CACHE_SIZE entries (default 1,000), read when it is
    # first imported (not yet): a search's structures evict what the next asks for again, and
    # 20,000 changes no result, only how often one is made (`plan` of 8B on 64 GPUs: 2.4 s of
    # CPU against 2.6)
    os.environ.setdefault("SYMPY_CACHE_SIZE", "20000")
    if argv == ["--version"]:
        print(_version())
        return 0
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
        argv = ["profile", *argv]  # `opgraph` alone, or `opgraph --json`, profiles
    try:
        with _signals_raise(), fewer_collections():
            parser = build_parser()
            args, extra = parser.parse_known_args(argv)
            if args.command is None:
                raise OpgraphError("give a command, e.g. `opgraph profile` (see `opgraph "
                                   "--help`)")
            if extra:
                raise OpgraphError(_unrecognized(parser, args.command, extra))
            _no_empty_strings(parser, args)
            code = args.func(args)
            sys.stdout.flush()  # a full disk is found now, in here, not at exit
            return code
    except OpgraphError as e:
        print(f"opgraph: error: {_one_line(str(e))}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `opgraph plan --json | head -1`: the reader has all it wants
        _stdout_gone()
        return 0
    except OSError as e:  # writing stdout failed (a full disk, an I/O error), or a file did
        if e.filename is not None:
            print(f"opgraph: error: {_one_line(str(e.filename))}: {e.strerror or e}",
                  file=sys.stderr)
            return 2
        _stdout_gone()
        print(f"opgraph: error: cannot write the output: {e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the user knows why; one line, the shell's 128 + SIGINT
        print("opgraph: interrupted", file=sys.stderr)
        return 130
    except _Terminated as e:  # files being written were removed on the way here
        print(f"opgraph: stopped by {signal.Signals(e.signum).name}", file=sys.stderr)
        return 128 + e.signum
