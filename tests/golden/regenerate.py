"""Rewrite the golden files from the current code: `python tests/golden/regenerate.py`.

Regenerating is a decision: commit the new files on their own, saying why they changed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# name -> the `opgraph profile` arguments it records.
CASES = {
    "llama3-8b": ["--model", "llama3-8b"],
    "llama3-8b-unfused": ["--model", "llama3-8b", "--no-fused-attention"],
    "mixtral-8x7b": ["--model", "mixtral-8x7b"],
    "gpt2": ["--model", "gpt2"],
}


def step_text(argv: list[str]) -> str:
    """The compiled step's textual form for the CLI arguments `argv`."""
    from opgraph.cli import build_parser
    from opgraph.commands.common import setup

    args = build_parser().parse_args(["profile", *argv])
    return str(setup(args).step) + "\n"


def profile_json(argv: list[str]) -> str:
    """`opgraph profile ARGV --json --ops`, as the CLI prints it."""
    import contextlib
    import io

    from opgraph.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(["profile", *argv, "--json", "--ops"])
    if code != 0:
        raise SystemExit(f"profile {' '.join(argv)} exited {code}")
    json.loads(out.getvalue())  # it must be one JSON object
    return out.getvalue()


def main() -> None:
    for name, argv in CASES.items():
        (HERE / f"{name}.step.txt").write_text(step_text(argv))
        (HERE / f"{name}.profile.json").write_text(profile_json(argv))
        print(f"wrote {name}", file=sys.stderr)


if __name__ == "__main__":
    main()
