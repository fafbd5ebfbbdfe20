"""`opgraph validate`: predict published (or your own) runs and print the error of each."""

from __future__ import annotations

from .args import json_text
from .common import add_cost_args

IN_SAMPLE = ("in-sample: the shipped efficiencies were fitted to these runs "
             "(`opgraph calibrate --fit`); runs they were not fitted to are the real test")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "validate", help="predict published multi-GPU runs and compare with what was measured",
        description="Predict each run of a case file (default: the 21 published runs shipped "
                    "with opgraph: Korthikanti et al. 2022 Table 5, Narayanan et al. 2021 "
                    "Table 1, torchtitan's Llama 3.1 8B table) and print measured and predicted "
                    "step time, the error of each, the mean absolute error and the worst case.")
    p.add_argument("--cases", metavar="FILE.json",
                   help="a case file of your own runs (the format of opgraph/data/"
                        "validation.json)")
    add_cost_args(p, default="calibrated")
    p.add_argument("--select", metavar="TEXT",
                   help="only the cases whose id contains TEXT (e.g. narayanan)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..cases import load_cases, select
    from ..validate import format_report, validate
    from .common import cost_model

    cost = cost_model(args)
    report = validate(select(load_cases(args.cases), args.select), cost)
    # the shipped efficiencies were fitted to the shipped runs: say so beside their errors
    in_sample = args.cost == "calibrated" and args.calibration is None and args.cases is None
    if args.json:
        print(json_text(report.to_json() | {"cost": args.cost, "in_sample": in_sample}))
    else:
        print(format_report(report, args.cost, IN_SAMPLE if in_sample else ""))
    return 0
