"""`opgraph solve`: the smallest tokens per step (or seq_len) at which a condition holds."""

from __future__ import annotations

from ..core.limits import MAX_DIM
from .args import json_text, positive_float, whole
from .options import add_model_args


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "solve", help="the tokens per step (or seq_len) from which, or up to which, a condition "
                      "holds",
        description="Solves the step's cost formulas exactly (each op's time is the max of two "
                    "polynomials, so the condition is piecewise polynomial), then checks the "
                    "answer numerically. --max-share X: the fewest whole sequences per step "
                    "(--dim tokens, at --seq-len) or the shortest sequence (--dim seq_len, at "
                    "--batch) at which the category or op takes at most X of the step's time; where the "
                    "share rises instead (attention's, with seq_len), the largest value up to "
                    "which it holds (--json: holds is \"from\" or \"up_to\"). "
                    "--ridge: the tokens per step (or seq_len) above which the op is "
                    "compute-bound.")
    add_model_args(p)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--category", metavar="ID", help="a category, e.g. optimizer")
    which.add_argument("--op", metavar="NAME", help="one op, e.g. layers.q_proj")
    ask = p.add_mutually_exclusive_group(required=True)
    ask.add_argument("--max-share", type=positive_float, metavar="X",
                     help="a fraction of the step's time, e.g. 0.02")
    ask.add_argument("--ridge", action="store_true",
                     help="where the op turns from memory- to compute-bound (with --op)")
    p.add_argument("--dim", choices=("tokens", "seq_len"), default="tokens",
                   help="what to solve for (default tokens per step, at the model's seq_len)")
    p.add_argument("--batch", type=whole(MAX_DIM),
                   help="sequences per step held fixed with --dim seq_len (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..analysis.solve import max_share, ridge
    from ..core.errors import OpgraphError
    from .common import setup

    if args.tokens is not None:
        raise OpgraphError("--tokens is what solve looks for; fix --seq-len (or, with "
                           "--dim seq_len, --batch) instead")
    if args.dim == "tokens" and args.batch is not None:
        raise OpgraphError("--batch is solved for with --dim tokens; give --seq-len instead")
    if args.dim == "seq_len" and args.seq_len is not None:
        raise OpgraphError("--seq-len is solved for with --dim seq_len; give --batch instead")
    if args.ridge and args.op is None:
        raise OpgraphError("--ridge is a property of one op: give --op NAME")
    s = setup(args, calibrated=False)
    values = dict(s.values)
    if args.dim == "seq_len":
        values["B"] = args.batch or 1
    head = f"{s.step.name} on {s.hardware.id}"
    if args.ridge:
        answer = ridge(s.step, s.hardware, args.op, dim=args.dim, values=values, cost=s.cost)
        print(json_text({"model": s.step.name, "hardware": s.hardware.id, **answer.to_json()})
              if args.json else f"{head}: {_ridge_line(answer, values)}")
        return 0
    answer = max_share(s.step, s.hardware, args.category, args.max_share, op=args.op,
                       dim=args.dim, values=values, cost=s.cost)
    if args.json:
        print(json_text({"model": s.step.name, "hardware": s.hardware.id, **answer.to_json()}))
    else:
        print(f"{head}: {_share_line(answer, values)}")
    return 0


def _pct(x: float, digits: int = 3, apart_from: float | None = None) -> str:
    """`x` as a percentage; with `apart_from`, with the digits it takes not to read as that
    value (10.035% is not "10%" beside a 10% cap)."""
    text = f"{x * 100:.{digits}g}%"
    while apart_from is not None and x != apart_from and digits < 12 \
            and text == f"{apart_from * 100:.{digits}g}%":
        digits += 1
        text = f"{x * 100:.{digits}g}%"
    return text


def _share_line(a, values: dict) -> str:
    what = f"op {a.of}" if a.kind == "op" else f"{a.of} category"
    cap = _pct(a.max_share, 4)
    if a.tokens is None:
        held, grows = ((f"at seq_len {values['S']:,}", "tokens per step grow")
                       if a.dim == "tokens" else (f"at batch {values['B']:,}", "seq_len grows"))
        tends = _pct(a.limit) if a.limit is not None else "more"
        return (f"{what} never drops to {cap} of the step's time {held}: its share tends to "
                f"{tends} as {grows}")
    tokens = a.dim == "tokens"
    digits = 3 if tokens else 6
    point = (f"{a.tokens:,} tokens per step ({a.batch:,} x {a.seq_len:,})" if tokens
             else f"seq_len {a.seq_len:,} (batch {a.batch:,})")
    def pct(x):
        return _pct(x, digits, a.max_share)

    fewer = (f"; with one sequence fewer it is {pct(a.share_one_fewer)}" if tokens
             else f"; one token shorter it is {pct(a.share_one_fewer)}"
             ) if a.share_one_fewer is not None else ""
    more = (f"; with one sequence more it is {pct(a.share_one_more)}" if tokens
            else f"; one token longer it is {pct(a.share_one_more)}"
            ) if a.share_one_more is not None else ""
    again = (f"; it holds again from {a.again_from:,}" + (" tokens per step" if tokens else "")
             if a.again_from is not None else "")
    unit = " tokens per step" if tokens else ""
    if a.holds == "up_to":
        grows = "tokens per step" if tokens else "seq_len"
        return (f"{what} is at most {cap} of the step's time up to {point}: "
                f"{_pct(a.share, digits)}{more}; its share rises with {grows}, through {cap} "
                f"at {a.crossing:,.1f}{unit}{again}")
    if a.holds == "between":
        return (f"{what} is at most {cap} of the step's time from {point} up to "
                f"{'seq_len ' if not tokens else ''}{a.last:,}{unit}: "
                f"{_pct(a.share, digits)}{fewer}{more}{again}")
    return (f"{what} is at most {cap} of the step's time from {point}: "
            f"{_pct(a.share, digits)}{fewer}")


def _ridge_line(a, values: dict) -> str:
    held = (f" at seq_len {values['S']:,}" if a.dim == "tokens" else f" at batch {values['B']:,}")
    held = held if set(a.depends_on) & {"B", "S"} else ""  # tokens alone set this op's cost
    every = "tokens per step" if a.dim == "tokens" else "seq_len"
    if a.bound is not None:
        level = (f"its intensity tends to {a.intensity_limit:.4g} FLOP/byte"
                 if a.intensity_limit is not None else "its intensity grows without bound")
        side = "under" if a.bound == "memory" else "over"
        return (f"{a.op} is {a.bound}-bound at every {every}{held} ({level}, {side} the "
                f"part's ridge of {a.ridge_intensity:.4g}): it never turns")
    where = (f"{a.value:,.2f} tokens per step{held}" if a.dim == "tokens"
             else f"seq_len {a.value:,.2f}{held}")
    formula = f"; {'T' if a.dim == 'tokens' else 'S'} = {a.expression}" if a.expression else ""
    return f"{a.op} turns compute-bound at {where} ({a.smallest_whole:,} and up){formula}"
