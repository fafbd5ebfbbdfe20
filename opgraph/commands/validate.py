"""`opgraph validate`: predict published (or your own) runs and print the error of each; leave
one family out (`--cv family`); judge the layouts it would choose (`--rank`)."""

from __future__ import annotations

from .args import json_text
from .options import add_cost_args

IN_SAMPLE = ("in-sample: the shipped efficiencies were fitted to these runs "
             "(`opgraph calibrate --fit dev`); `--cv family` gives the error on families left "
             "out of the fit, the real test")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "validate", help="predict published multi-GPU runs and compare with what was measured",
        description="Predict each run of a case file (default `dev`: the 80 published runs "
                    "shipped with opgraph, from Megatron-LM, DeepSpeed, torchtitan, nanotron and "
                    "SimuMax's B200 runs; `playbook-sweep`: the Ultrascale Playbook's 656 "
                    "measured layouts; `holdout`: the 300 published runs of torchtitan, "
                    "Megatron-Bridge, NeMo, NeMo AutoModel, LLM Foundry and Megatron-DeepSpeed that "
                    "no fit reads) "
                    "and print measured and predicted step time, the error "
                    "of each, each family's mean absolute error, and the runs opgraph cannot "
                    "model, with the reason.")
    p.add_argument("--cases", metavar="FILE.json",
                   help="a case file of your own runs (the format of opgraph/data/"
                        "validation.json; a part or a cluster the catalog lacks may be given "
                        "inline: docs/calibration.md, 'Your own runs'), or a shipped one by "
                        "name: dev (the default), playbook-sweep, holdout")
    add_cost_args(p, default="calibrated")
    p.add_argument("--select", metavar="TEXT",
                   help="only the cases whose id contains TEXT (e.g. narayanan)")
    p.add_argument("--cv", choices=("family",),
                   help="family: for each family of runs, refit the calibrated model's fitted "
                        "parameters on all the other families and predict the one left out; "
                        "prints in-sample and left-out error side by side (minutes: every fit "
                        "re-schedules every run dozens of times)")
    p.add_argument("--rank", action="store_true",
                   help="group the runs by model and GPU count; per group, the Spearman "
                        "correlation of predicted and measured throughput and the regret of "
                        "opgraph's first choice (how much slower its measured run is than the "
                        "measured best); use with --cases playbook-sweep")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..analysis.validate import (
        cross_validate,
        cross_validation_summary,
        format_cross_validation,
        format_rank,
        format_report,
        rank,
        rank_summary,
        validate,
    )
    from ..core.errors import OpgraphError
    from ..cost import calibration
    from ..io.cases import load_cases, load_unmodelled, select
    from ..io.outputs.progress import progress
    from .common import cost_model

    if args.cv and args.rank:
        raise OpgraphError("--cv and --rank answer different questions; give one of them")
    if args.cv and args.cost != "calibrated":
        raise OpgraphError("--cv family refits the calibrated model; leave out --cost roofline")
    cases = select(load_cases(args.cases), args.select)
    if args.cv:
        table = calibration.load(args.calibration) if args.calibration else calibration.catalog()
        families = len({c.family or c.id for c in cases})
        with progress("validate --cv: fits", total=families + 1, unit="fit") as bar:
            scores = cross_validate(cases, table, progress=bar.update)
        print(json_text(cross_validation_summary(scores)) if args.json
              else format_cross_validation(scores))
        return 0
    cost = cost_model(args)
    unmodelled = [] if args.select else load_unmodelled(args.cases)
    with progress("validate: cases", total=len(cases), unit="case") as bar:
        report = validate(cases, cost, unmodelled, progress=bar.update)
    if args.rank:
        capacity = {c.part_id: c.part().memory_bytes for c in cases if c.part().memory_bytes}
        scores = rank(report, capacity)
        print(json_text(rank_summary(scores)) if args.json else format_rank(scores))
        return 0
    # the shipped efficiencies were fitted to the shipped runs: say so beside their errors
    in_sample = args.cost == "calibrated" and args.calibration is None and args.cases in (
        None, "dev")
    if args.json:
        print(json_text(report.to_json() | {"cost": args.cost, "in_sample": in_sample}))
    else:
        print(format_report(report, args.cost, IN_SAMPLE if in_sample else ""))
    return 0
