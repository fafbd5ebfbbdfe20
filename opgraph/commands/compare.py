"""`opgraph compare TRACE`: a real profile's category times beside the roofline's."""

from __future__ import annotations

from .args import json_text, positive_int
from .options import add_model_args
from .trace_breakdown import add_trace_args, read_breakdown


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "compare", help="a PyTorch profiler (Kineto) trace beside the roofline profile",
        description="Reads the trace's GPU kernels (as `opgraph trace-breakdown` does), sets "
                    "each kernel category beside the roofline categories it implements (matmul "
                    "kernels beside matmul + output_head, the others beside the category of the "
                    "same name) and gives measured over roofline per category, and the measured "
                    "MFU against the ceiling. Give --model, --tokens and --seq-len as in the run "
                    "that was traced.")
    p.add_argument("trace", metavar="TRACE", help="a Kineto trace, .json or .json.gz")
    add_model_args(p)
    p.add_argument("--steps", type=positive_int, default=1,
                   help="training steps the trace holds; its times are divided by this "
                        "(default 1)")
    add_trace_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args) -> int:
    from opgraph.passes.evaluate import evaluate

    from ..analysis.traces.compare import compare, format_comparison
    from .common import setup

    s = setup(args)  # bad model options fail before a large trace is read
    measured = read_breakdown(args)
    result = compare(measured, evaluate(s.step, s.hardware, s.values, cost=s.cost), steps=args.steps,
                     trace=args.trace)
    print(json_text(result.to_json()) if args.json else format_comparison(result))
    return 0
