"""`opgraph sweep`: the profile's figures over ranges of tokens, seq_len, batch and hardware."""

from __future__ import annotations

import argparse

from ..io.outputs.atomic import outputs
from .args import check_command_outputs, positive_int
from .options import add_model_args


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "sweep", help="the step's figures over ranges of tokens, seq_len, batch, hardware",
        description="Compiles the step's cost formulas once (sympy.lambdify to numpy) and "
                    "evaluates them at every combination of the ranges given. Each row equals "
                    "`opgraph profile` of that point. A RANGE is START:STOP:+STEP (linear), "
                    "START:STOP:xFACTOR (geometric), N or N,N,...; both forms include STOP when "
                    "they land on it. "
                    "Give at most two of --tokens, --seq-len and --batch (tokens = batch x "
                    "seq_len); with --tokens alone the sequence length is the model's and every "
                    "value must be a whole number of sequences.")
    add_model_args(p, tokens=False)
    g = p.add_argument_group("ranges")
    g.add_argument("--tokens", dest="tokens_range", metavar="RANGE", help="tokens per step")
    g.add_argument("--seq-len", dest="seq_len_range", metavar="RANGE", help="sequence length")
    g.add_argument("--batch", dest="batch_range", metavar="RANGE", help="sequences per step")
    g.add_argument("--dim", action="append", default=[], metavar="NAME=RANGE",
                   help="any other dimension of the model, e.g. L=16:128:+16 (repeatable); "
                        "the others keep the preset's values")
    p.epilog = "--hardware takes a comma list of parts here, e.g. h100-sxm,h100-pcie."
    p.add_argument("--out", metavar="FILE", help="write every row to FILE.csv or FILE.json")
    p.add_argument("--plot", metavar="FILE",
                   help="draw the category shares (stacked) and the MFU ceiling against the "
                        "swept dimension to a .png or .svg (sweep one dimension, one part)")
    p.add_argument("--rows", type=positive_int, default=20, metavar="N",
                   help="rows the printed table shows at most (default 20: first and last ten)")
    p.set_defaults(func=run)


def _bound(axis: str) -> int:
    from ..core.limits import MAX_DIM, MAX_TOKENS

    return MAX_TOKENS if axis == "tokens" else MAX_DIM


def _ranges(args, dims: list[str]) -> dict:
    from ..analysis.sweep import parse_range
    from ..core.errors import OpgraphError

    ranges = {}
    for axis in ("tokens", "seq_len", "batch"):
        text = getattr(args, f"{axis}_range")
        if text is not None:
            ranges[axis] = parse_range(text, f"--{axis.replace('_', '-')}", _bound(axis))
    aliases = {"B": "batch", "S": "seq_len", "tokens": "tokens", "seq_len": "seq_len",
               "batch": "batch"}
    for item in args.dim:
        name, sep, text = item.partition("=")
        if not sep:
            raise OpgraphError(f"--dim {item}: write NAME=RANGE, e.g. L=16:128:+16")
        axis = aliases.get(name, name)
        if axis not in aliases.values() and axis not in dims:
            raise OpgraphError(f"--dim {item}: unknown dimension {name!r}; choose tokens, "
                               f"seq_len, batch or one of {', '.join(sorted(dims))}")
        if axis in ranges:
            raise OpgraphError(f"--dim {item}: {axis} is given twice")
        ranges[axis] = parse_range(text, f"--dim {name}", _bound(axis))
    return ranges


def run(args) -> int:
    from ..analysis.sweep import compile_sweep, make_grid, write
    from ..core.errors import OpgraphError
    from ..core.pipeline import compile_step
    from .common import (
        DEFAULT_PART,
        cost_model,
        load_forward,
        load_hardware,
        step_options,
        token_values,
    )

    check_command_outputs(args, {"--plot": args.plot, "--out": args.out},
                          {"--plot": (".png", ".svg"), "--out": (".csv", ".json")})
    forward = load_forward(args)
    parts = [load_hardware(argparse.Namespace(**{**vars(args), "hardware": part.strip()}))
             for part in (args.hardware or DEFAULT_PART).split(",") if part.strip()]
    if not parts:
        raise OpgraphError("--hardware: give at least one part")
    dims = [sym.name for sym in forward.dims if sym.name not in ("B", "S")]
    ranges = _ranges(args, dims)
    seq_len = forward.seq_len or 0
    if not seq_len and "seq_len" not in ranges and not {"tokens", "batch"} <= set(ranges):
        raise OpgraphError(f"{forward.name} has no default sequence length; give --seq-len")
    grid = make_grid(ranges, parts, seq_len)
    token_values(forward, None, _longest(ranges, seq_len))  # within the model's positions
    step = compile_step(forward, **step_options(args))
    extra = [a for a in ranges if a not in ("tokens", "seq_len", "batch")]
    sweep = compile_sweep(step, free=("B", "S", *extra), cost=cost_model(args))
    with outputs():  # both files or neither
        if args.plot:
            _plot(sweep, grid, args.plot)
        if args.out:
            write(sweep, grid, args.out)
    print(_table(sweep, grid, args.rows, args.out))
    return 0


def _longest(ranges: dict, seq_len: int) -> int:
    """The longest sequence the sweep asks for."""
    if "seq_len" in ranges:
        return int(ranges["seq_len"].max())
    if "tokens" in ranges and "batch" in ranges:
        return max(int(ranges["tokens"].max()) // int(ranges["batch"].min()), 1)
    return seq_len


def _plot(sweep, grid, path: str) -> None:
    from ..analysis.sweep import run_grid
    from ..core.errors import OpgraphError
    from ..io.outputs.plot import plot_sweep

    swept = [name for name, values in grid.axes if len(values) > 1]
    if len(swept) != 1 or swept[0] == "hardware":
        raise OpgraphError(f"--plot draws one swept dimension; this sweep varies "
                           f"{', '.join(swept) or 'nothing'}")
    plot_sweep(run_grid(sweep, grid), swept[0], path,
               title=f"{sweep.model}: category shares of the step's time and the MFU ceiling")


def _table(sweep, grid, rows: int, out: str | None) -> str:
    from ..analysis.sweep import run_grid, sample

    extra = [a for a in grid.names() if a not in ("hardware", "tokens", "seq_len", "batch")]
    head = (f"{'tokens':>13} {'seq_len':>8} {'batch':>8} {'hardware':<10}"
            + "".join(f" {a:>8}" for a in extra)
            + f" {'step (ms)':>11} {'MFU':>6}"
            + "".join(f" {c:>{max(len(c), 7)}}" for c in sweep.categories))
    title = (f"{sweep.model}: {len(grid):,} points; "
             f"{'MFU ceiling' if sweep.cost.name == 'roofline' else 'MFU (calibrated)'} "
             "and each category's share of "
             "the step's time")
    lines = [title, head]
    ranges = sample(len(grid), rows)
    for k, (lo, hi) in enumerate(ranges):
        if k:
            lines.append(f"{'...':>13}  ({len(grid) - rows:,} rows not shown"
                         + ("; all are in " + out if out else "; --out FILE.csv writes all")
                         + ")")
        r = run_grid(sweep, grid, lo, hi)
        for i in range(hi - lo):
            line = (f"{r['tokens'][i]:>13,} {r['seq_len'][i]:>8,} {r['batch'][i]:>8,} "
                    f"{grid.hardware[r['hardware'][i]].id:<10}"
                    + "".join(f" {r[a][i]:>8,}" for a in extra)
                    + f" {r['step_time_s'][i] * 1e3:>11.2f} {r['mfu_ceiling'][i] * 100:>5.1f}%"
                    + "".join(f" {r[f'{c}_time_share'][i] * 100:>{max(len(c), 7) - 1}.2f}%"
                              for c in sweep.categories))
            lines.append(line)
    if out:
        lines.append(f"wrote {len(grid):,} rows to {out}")
    return "\n".join(lines)
