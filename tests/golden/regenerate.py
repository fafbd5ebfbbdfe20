"""Rewrite the golden files from the current code: `python tests/golden/regenerate.py`.

Regenerating is a decision: commit the new files on their own, saying why they changed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# the checkout this file is in, not whichever opgraph is installed: run as a script, the
# script's folder (not the working directory) heads sys.path
sys.path.insert(0, str(HERE.parent.parent))

# name -> the `opgraph profile` arguments it records.
CASES = {
    "llama3-8b": ["--model", "llama3-8b"],
    "llama3-8b-unfused": ["--model", "llama3-8b", "--no-fused-attention"],
    "mixtral-8x7b": ["--model", "mixtral-8x7b"],
    "gpt2": ["--model", "gpt2"],
    # many GPUs (issue 21): recorded before the lowered step's defects were fixed; on the
    # roofline, named (a job over many GPUs is calibrated by default)
    "llama3-8b-tp2-pp2-dp2-zero1": ["--model", "llama3-8b", "--gpus", "8", "--tp", "2",
                                    "--pp", "2", "--zero", "1", "--global-batch", "8",
                                    "--cost", "roofline"],
    "mixtral-8x7b-tp2-ep8": ["--model", "mixtral-8x7b", "--gpus", "64", "--tp", "2",
                             "--ep", "8", "--global-batch", "64", "--cost", "roofline"],
    "llama3-8b-tp2-dp8-zero1-calibrated": ["--model", "llama3-8b", "--gpus", "16", "--tp", "2",
                                           "--zero", "1", "--global-batch", "16",
                                           "--cost", "calibrated"],
    "llama3-8b-tp2-dp4-zero1-fp8": ["--model", "llama3-8b", "--gpus", "8", "--tp", "2",
                                    "--zero", "1", "--global-batch", "8",
                                    "--precision", "fp8", "--cost", "roofline"],
    # a Mamba-2 hybrid: the SSD scan's kernels, TP over the Mamba heads and groups
    "nemotron-h-8b-tp2": ["--model", "nemotron-h-8b", "--gpus", "8", "--tp", "2",
                          "--global-batch", "4", "--cost", "roofline"],
}


def step_text(argv: list[str]) -> str:
    """The compiled step's textual form for the CLI arguments `argv`: with many-GPU flags, the
    step one data-parallel rank runs, every pipeline stage together (`compile_parallel`)."""
    from opgraph.cli import build_parser
    from opgraph.commands.common import load_forward, setup
    from opgraph.commands.layout import layout_from, wants_layout

    args = build_parser().parse_args(["profile", *argv])
    layout = None
    if wants_layout(args):
        layout = layout_from(args, args.seq_len or load_forward(args).seq_len)
    return str(setup(args, layout=layout).step) + "\n"


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
