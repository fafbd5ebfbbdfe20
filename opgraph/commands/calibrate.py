"""`opgraph calibrate`: fit the calibrated cost model's efficiencies, to published runs
(`--fit CASES.json`) or to a real profiler trace of a known model (`TRACE.json --model ...`)."""

from __future__ import annotations

import argparse
import sys

from ..limits import MAX_FIT_CASES
from ..outputs.atomic import outputs
from .args import check_command_outputs, json_text, positive_int
from .options import add_model_args
from .trace_breakdown import add_trace_args

SHIPPED_COMMAND = "opgraph calibrate --fit shipped --out opgraph/calibration.toml"
SHIPPED_CASES = "shipped"  # `--fit shipped`: the published runs installed with the package


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "calibrate", help="fit the calibrated cost model's efficiencies to runs or a trace",
        description="--fit CASES.json: fit the efficiencies the calibration file marks as "
                    "fitted (one value per name, shared by the generations that fit it) to the "
                    "cases' measured step times (least squares on the log error, each family "
                    "weighted equally; the errors printed are in-sample). TRACE: fit "
                    "matmul, attention and HBM bandwidth efficiencies of the part's generation "
                    "from a PyTorch profiler trace of the --model step. The shipped efficiencies "
                    f"are rebuilt by `{SHIPPED_COMMAND}`.")
    p.add_argument("trace", nargs="?", metavar="TRACE",
                   help="a Kineto trace (.json or .json.gz) of the step --model describes")
    p.add_argument("--fit", metavar="CASES.json",
                   help="fit to the runs of a case file; `--fit shipped`: the published runs "
                        "installed with opgraph (opgraph/data/validation.json), from any "
                        f"directory; at most {MAX_FIT_CASES} cases")
    p.add_argument("--select", metavar="TEXT",
                   help="with --fit: only the cases whose id contains TEXT (fit on some runs, "
                        "validate on the others)")
    p.add_argument("--out", metavar="FILE.toml",
                   help="write the calibration file (use it with --cost calibrated "
                        "--calibration FILE.toml)")
    add_model_args(p)
    p.add_argument("--steps", type=positive_int, default=1,
                   help="with TRACE: training steps the trace holds (default 1)")
    add_trace_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args) -> int:
    from .. import calibration
    from ..errors import OpgraphError

    if (args.trace is None) == (args.fit is None):
        raise OpgraphError("give a trace to fit, or --fit CASES.json, not both or neither")
    check_command_outputs(args, {"--out": args.out}, {"--out": (".toml",)})
    base = calibration.load(args.calibration) if args.calibration else calibration.catalog()
    source = args.calibration or str(calibration.CATALOG)
    if args.fit is not None:
        table, text, report = _fit_cases(args, base)
    else:
        table, text, report = _fit_trace(args, base)
    if args.out:
        from ..fit import to_toml
        from ..outputs.atomic import write_atomic

        toml = to_toml(table, calibration.header(source))
        with outputs():
            write_atomic(args.out, lambda f: f.write(toml))
    print(json_text(report) if args.json else text)
    if args.out and not args.json:
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _fit_cases(args, base):
    from ..cases import load_cases, select
    from ..fit import fit

    path = None if args.fit == SHIPPED_CASES else args.fit
    cases = load_cases(path, most=(MAX_FIT_CASES, "a fit"), pattern=args.select)
    result = fit(select(cases, args.select), base)
    errors = [e for _, _, e in result.errors]
    mape = sum(map(abs, errors)) / len(errors)
    lines = ["fitted (in-sample: the errors below are on the runs the fit used)"]
    for generation, e in result.table.items():
        if e.fitted and any(g == generation for _, g, _ in result.errors):
            values = ", ".join(f"{n} = {getattr(e, n):.6g}" for n in e.fitted)
            lines.append(f"  {generation}: {values}")
    lines += ["", f"{'case':<40} {'generation':<10} {'error':>8}"]
    lines += [f"{cid:<40} {g:<10} {err * 100:>+7.1f}%" for cid, g, err in result.errors]
    worst = max(result.errors, key=lambda row: abs(row[2]))
    lines += ["", (f"mean absolute error {mape * 100:.1f}% in-sample over {len(errors)} cases; "
                  f"worst {worst[2] * 100:+.1f}% ({worst[0]})")]
    report = {"fitted": {g: {n: getattr(e, n) for n in e.fitted}
                         for g, e in result.table.items() if e.fitted},
              "cases": [{"id": c, "generation": g, "error": err} for c, g, err in result.errors],
              "mape": mape, "max_error": abs(worst[2]), "in_sample": True}
    return result.table, "\n".join(lines), report


def _fit_trace(args, base):
    """The part's generation's matmul, attention and bandwidth efficiencies from the trace of
    the step the model options describe (profiled on the roofline: the fit's reference)."""
    from .. import calibration
    from ..passes.evaluate import evaluate
    from ..traces.calibrate import fit_trace, format_trace_fit
    from ..traces.compare import compare
    from .common import setup
    from .trace_breakdown import read_breakdown

    args = argparse.Namespace(**{**vars(args), "cost": "roofline", "calibration": None})
    s = setup(args)  # bad model options fail before a large trace is read
    generation = calibration.for_hardware(s.hardware, base)
    measured = read_breakdown(args)
    roofline = evaluate(s.step, s.hardware, s.values, cost=s.cost)
    result = fit_trace(compare(measured, roofline, steps=args.steps, trace=args.trace),
                       generation)
    table = {**base, generation.generation: result.efficiencies}
    report = {"generation": generation.generation,
              "efficiencies": {n: getattr(result.efficiencies, n)
                               for n in result.efficiencies.fitted},
              "categories": [{"category": c, "roofline_s": r, "measured_s": m}
                             for c, r, m in result.per_category],
              "notes": list(result.notes)}
    return table, format_trace_fit(result), report
