"""`opgraph formula`: the closed form of an op's, a category's or the step's cost."""

from __future__ import annotations

import json

from ..core.errors import OpgraphError
from .layout import add_sharding_args, given_layout
from .options import add_model_args

UNITS = {"flops": "FLOPs", "bytes": "bytes", "time": "s"}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "formula", help="an op's, a category's or the step's cost as a formula",
        description="FLOPs, HBM bytes or roofline time (per op max(flops/peak, bytes/bandwidth), "
                    "summed) of one training step, as a sympy expression of the model's "
                    "dimensions. Time keeps the hardware as the symbols peak (FLOP/s) and "
                    "bandwidth (bytes/s) unless --numeric-hardware. The value printed beside it "
                    "puts in the preset's dimensions and the part's figures. With --cost "
                    "calibrated, time is each kernel's launch plus its roofline at the part's "
                    "efficiencies, which needs --numeric-hardware.")
    add_model_args(p)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--op", metavar="NAME", help="one op, e.g. layers.q_proj (see "
                       "`opgraph profile --ops`)")
    which.add_argument("--category", metavar="ID", help="a category, e.g. matmul or optimizer")
    which.add_argument("--step", action="store_true", help="the whole step (the default)")
    p.add_argument("--quantity", choices=("flops", "bytes", "time"), default="flops",
                   help="what to give the formula of (default flops)")
    p.add_argument("--numeric-hardware", action="store_true",
                   help="for time: put in the part's peak and bandwidth instead of symbols")
    g = p.add_argument_group(
        "sharded over GPUs", "one GPU's share of a sharded step, its degrees as symbols (tp, "
        "cp, ep, dp) in the formula; collectives' network time is profile's, not counted here")
    add_sharding_args(g)
    p.add_argument("--latex", action="store_true", help="print the formula as LaTeX")
    p.add_argument("--json", action="store_true",
                   help="print {expression, latex, symbols, value, ...} as one JSON object")
    p.set_defaults(func=run)


def run(args) -> int:
    from opgraph.passes.evaluate import resolve

    from ..cost import formula as fm
    from .common import setup

    s = setup(args, layout=_layout(args))  # a calibrated time: the library decides
    numeric = args.quantity == "time" and args.numeric_hardware
    expr = fm.formula(s.step, args.quantity, op=args.op, category=args.category,
                      hardware=s.hardware if numeric else None, cost=s.cost)
    dims = resolve(s.step, s.values)
    hardware = s.hardware if args.quantity == "time" else None
    value = fm.value(expr, dims, hardware)
    what = (f"op {args.op}" if args.op else f"category {args.category}" if args.category
            else "the step")
    if args.json:
        print(json.dumps({
            "model": s.step.name, "hardware": s.hardware.id if hardware else None,
            "of": what, "quantity": args.quantity, "unit": UNITS[args.quantity],
            "expression": str(expr), "latex": fm.latex(expr),
            "symbols": fm.symbol_values(expr, dims, hardware), "value": value,
        }, indent=2))
    elif args.latex:
        print(fm.latex(expr))
    else:
        values = fm.symbol_values(expr, dims, hardware)
        shown = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                          for k, v in values.items())
        number = f"{value:,}" if isinstance(value, int) else f"{value:.6g}"
        print(f"{s.step.name}, {what}: {args.quantity} per training step")
        print(f"  {expr}")
        where = f" at {shown}" if shown else ""
        where += f" on {s.hardware.id}" if hardware else ""
        print(f"  = {number} {UNITS[args.quantity]}{where}")
    return 0


def _layout(args):
    """The sharding the flags ask for (None: one GPU), as `Parallel`."""
    from ..parallel.parallel import Parallel

    given = given_layout(args)
    if not given:
        return None
    if given.get("zero") and not given.get("dp"):
        raise OpgraphError("--zero shards over the data-parallel ranks: give --dp too")
    return Parallel(**given)
