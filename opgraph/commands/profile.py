"""`opgraph profile`: the roofline breakdown of one training step."""

from __future__ import annotations

import sys

from ..io.outputs.atomic import outputs
from .args import check_command_outputs, json_text
from .layout import add_parallel_args, is_job
from .options import add_model_args


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "profile", help="the profile of one training step (the default command): one GPU's "
                        "on the roofline, a job over many GPUs on the calibrated model",
        description="Each category's share of the step's time beside its share of the FLOPs, "
                    "the step time and the best MFU the step allows.")
    add_model_args(p, cost=None)
    add_parallel_args(p)
    p.add_argument("--ops", action="store_true", help="also list every op")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", metavar="FILE",
                   help="also draw the figure (time share beside FLOP share) to a .png or .svg")
    p.add_argument("--trace", metavar="FILE",
                   help="also write the predicted timeline as a Chrome trace (open it in Perfetto)")
    p.set_defaults(func=run)


def run(args) -> int:
    from opgraph.passes.evaluate import evaluate

    from ..io.outputs.report import format_profile, memory_warning
    from .common import cost_name, default_cost, echoed, setup

    args.cost = cost_name(args)  # the job's default, said in the output as every figure's model
    check_command_outputs(args, {"--plot": args.plot, "--trace": args.trace},
                          {"--plot": (".png", ".svg")})
    if is_job(args):
        from .common import parallel_setup

        s = parallel_setup(args)
        profile = s.profile
    else:
        s = setup(args)
        profile = evaluate(s.step, s.hardware, s.values, cost=s.cost)
    with outputs():  # both files or neither
        if args.plot:
            from ..io.outputs.plot import plot_profile

            plot_profile(profile, args.plot)
        if args.trace and profile.parallel is not None:
            from ..io.outputs.chrome_trace import write_timeline

            write_timeline(profile, args.trace_rank, args.trace)
        elif args.trace:
            from ..io.outputs.chrome_trace import write_chrome_trace

            write_chrome_trace(profile, s.step, args.trace)
    warning = memory_warning(profile)
    warnings = [*getattr(s, "warnings", ()),
                *([warning.removeprefix("opgraph: warning: ")] if warning else [])]
    options = s.echo if profile.parallel is not None else echoed(args)
    if args.json:  # the JSON says it (memory.fits, warnings): stdout and stderr stay parseable
        out = profile.to_json(ops=args.ops) | options
        out["warnings"] = warnings
        print(json_text(out))
        return 0
    print(format_profile(profile, ops=args.ops))
    # what differs from the defaults, the job's cost model among them
    if options != echoed(None) | {"cost": default_cost(args)}:
        print("step options " + ", ".join(f"--{k} {v}" for k, v in options.items()))
    for line in warnings:
        print(f"opgraph: warning: {line}", file=sys.stderr)
    return 0
