"""`opgraph compare TRACE`: a real profile's category times beside the roofline's."""

from __future__ import annotations

import json

from .args import positive_int
from .common import add_model_args, setup


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "compare", help="a PyTorch profiler (Kineto) trace beside the roofline profile",
        description="Reads the trace's GPU kernels (as `opgraph trace-breakdown` does), maps "
                    "their categories to the roofline's (GEMM to matmul + output_head, and so "
                    "on) and gives measured over roofline per category, and the measured MFU "
                    "against the ceiling. Give --model, --tokens and --seq-len as in the run "
                    "that was traced.")
    p.add_argument("trace", metavar="TRACE", help="a Kineto trace, .json or .json.gz")
    add_model_args(p)
    p.add_argument("--steps", type=positive_int, default=1,
                   help="training steps the trace holds; its times are divided by this "
                        "(default 1)")
    p.add_argument("--rules", metavar="FILE",
                   help="extra kernel rules, as for `opgraph trace-breakdown --rules`")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args) -> int:
    from opgraph.passes.evaluate import evaluate

    from ..traces.compare import compare, format_comparison
    from ..traces.kineto import KERNEL_RULES, breakdown, load_rules, read_trace

    rules = load_rules(args.rules) if args.rules else KERNEL_RULES
    measured = breakdown(read_trace(args.trace), rules)
    s = setup(args)
    result = compare(measured, evaluate(s.step, s.hardware, s.values, cost=s.cost), steps=args.steps,
                     trace=args.trace)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(format_comparison(result))
    return 0
