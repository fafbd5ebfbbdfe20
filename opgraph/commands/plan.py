"""`opgraph plan`: search every parallel layout of a model on N GPUs, rank them by tokens per
second per GPU, and hand back the best as the config a run launches with."""

from __future__ import annotations

import math
import sys

from ..core.choices import PRECISIONS, SEARCHED_PRECISIONS, TORCHTITAN
from ..core.choices import ZERO_STAGES as ZERO
from ..core.errors import OpgraphError
from ..core.limits import MAX_COMPARED, MAX_DIM, MAX_PLAN_SIZES, MAX_TOKENS
from .args import check_command_outputs, json_text, non_negative_float, recompute, whole

# The formats --emit writes, each with the framework rows it can say (torchtitan's writer names
# the loss it leaves uncompiled, `io.launch.torchtitan._tt_framework`); the first its own
EMITTED = {"torchtitan": TORCHTITAN, "megatron": ("megatron",)}
EMITS = tuple(EMITTED)
# The degrees a constraint fixes (--tp 8) or bounds (--max-tp 4), as the help names them.
FIXED = {"tp": "tensor-parallel degree", "cp": "context-parallel degree",
         "ep": "expert-parallel degree", "pp": "pipeline-parallel degree",
         "dp": "data-parallel degree"}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plan", help="search every parallel layout and print the fastest, or its launch config",
        description="Enumerate every layout (TP, CP, EP, PP and its split, DP, ZeRO stage, "
                    "micro-batch, virtual stages, recomputation, sequence parallelism, FP8 or "
                    "not), keep those that divide the model and fit in memory, and rank them "
                    "by tokens per second per GPU. Each layout's memory and a lower bound of "
                    "its step are evaluated as arrays over formulas compiled once per "
                    "structure; the best are scheduled exactly, as `opgraph profile` schedules "
                    "them, until no layout left can beat the K-th. Constraints (--tp 8, "
                    "--max-pp 16, --zero 1, ...) narrow the search.")
    g = p.add_argument_group("model, hardware and job")
    g.add_argument("--model", help="a preset (see `opgraph models`; default llama3-8b), or "
                                   "path/to/file.py:build")
    g.add_argument("--config", metavar="CONFIG_JSON", help="a Hugging Face config.json, "
                                                            "instead of --model")
    from .options import add_cost_args, add_pass_arg

    add_pass_arg(g)
    g.add_argument("--hardware", help="a catalog part or a .toml file (default h100-sxm, or "
                                      "the --case's part)")
    g.add_argument("--cluster", metavar="NAME|FILE",
                   help="the cluster (default: the part's; see `opgraph hardware --clusters`)")
    g.add_argument("--case", metavar="FILE:ID",
                   help="plan the job of a run of a case file (FILE.json, or dev, holdout, "
                        "playbook-sweep) by its id: its model, part, cluster, sequence, GPUs, "
                        "batch, framework and precision (flags beside it change them), its "
                        "own layout compared with the plan's first choices")
    g.add_argument("--gpus", metavar="N|RANGE",
                   help="GPUs in the job; a range (8:16384:x2) searches each size and prints "
                        f"the scaling curve (at most {MAX_PLAN_SIZES} sizes)")
    batch = g.add_mutually_exclusive_group()
    batch.add_argument("--global-batch", type=whole(MAX_DIM), metavar="SEQUENCES",
                       help="sequences per optimizer step")
    batch.add_argument("--tokens", type=whole(MAX_TOKENS),
                       help="tokens per optimizer step (a multiple of --seq-len)")
    g.add_argument("--seq-len", type=whole(MAX_DIM),
                   help="sequence length (default: the model's)")
    add_cost_args(g, default="calibrated")
    c = p.add_argument_group("constraints", "fix a degree or an option, or bound one")
    for flag, text in FIXED.items():
        c.add_argument(f"--{flag}", type=whole(MAX_DIM), metavar="N",
                       help=f"only layouts with this {text} (default: every one that divides)")
    for flag, text in FIXED.items():
        if flag in ("tp", "cp", "pp"):
            c.add_argument(f"--max-{flag}", type=whole(MAX_DIM), metavar="N",
                           help=f"the largest {text} tried")
    c.add_argument("--max-micro-batch", type=whole(MAX_DIM), default=16, metavar="N",
                   help="largest micro-batch tried (default 16)")
    c.add_argument("--max-virtual-stages", type=whole(MAX_DIM), default=8, metavar="N",
                   help="most interleaved chunks per GPU tried (default 8)")
    c.add_argument("--zero", type=int, choices=ZERO, metavar="{0,1,2,3}",
                   help="only this data-parallel sharding: 0 none, 1 optimizer states, 2 and "
                        "gradients, 3 and parameters (FSDP) (default: every one)")
    c.add_argument("--replicate", type=whole(MAX_DIM), metavar="N",
                   help="only layouts with N HSDP replicas (each sharding over dp x cp / N "
                        "ranks; 1: none) (default: none, and at ZeRO-3 also one replica per "
                        "node's shard group where the framework runs HSDP)")
    c.add_argument("--micro-batch", type=whole(MAX_DIM), metavar="N",
                   help="only this micro-batch, in sequences (default: up to "
                        "--max-micro-batch)")
    c.add_argument("--virtual-stages", type=whole(MAX_DIM), metavar="N",
                   help="only this many interleaved pipeline chunks per GPU (default: up to "
                        "--max-virtual-stages)")
    sp = c.add_mutually_exclusive_group()
    sp.add_argument("--sequence-parallel", action="store_true", default=None,
                    help="only layouts with sequence parallelism")
    sp.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false",
                    help="only layouts without it")
    c.add_argument("--recompute", type=recompute, action="append", metavar="POLICY",
                   help="only this recomputation policy (repeatable; default: none, selective, "
                        "selective-op and full; selective:MODULE+... for Megatron-Core's "
                        "--recompute-modules)")
    c.add_argument("--precision", choices=PRECISIONS, action="append",
                   help="only this precision (repeatable; default: bf16, and fp8 where the "
                        "part has an FP8 peak)")
    c.add_argument("--headroom", type=non_negative_float, metavar="GB",
                   help="keep GB of each GPU's memory free: a layout fits where its live "
                        "tensors fit in the rest (the CUDA context, NCCL's buffers and the "
                        "caching allocator's freed blocks take memory they do not count) "
                        "(default 0)")
    c.add_argument("--async-tp", action="store_true",
                   help="overlap tensor-parallel communication with its matmul")
    from .layout import add_framework_args

    add_framework_args(c, search=True)
    o = p.add_argument_group("output")
    o.add_argument("--top", type=whole(10_000), default=10, metavar="K",
                   help="how many layouts to print (default 10)")
    o.add_argument("--json", action="store_true", help="print one JSON object")
    o.add_argument("--emit", choices=EMITS,
                   help="print the best layout as a torchtitan job TOML or Megatron-LM "
                        "arguments (the best that format can express, ranked as that framework "
                        "runs it: --framework torchtitan or megatron) instead of the table")
    o.add_argument("--rank", action="store_true",
                   help="also say where the best layout under the constraints ranks among every "
                        "layout (the fixed degrees, ZeRO stage, micro-batch, virtual stages, "
                        "sequence parallelism and recomputation lifted; the precision and the "
                        "--max-* bounds kept), and how far it is from the best of them")
    o.add_argument("--no-cache", action="store_true",
                   help="compile every structure and keep none for the next run (by default "
                        "plan keeps them in $OPGRAPH_CACHE_DIR, else ~/.cache/opgraph, and "
                        "reads them back when the model, part, cost model and code are the "
                        "same; OPGRAPH_CACHE_DIR=off turns that off)")
    o.add_argument("--plot", metavar="FILE",
                   help="with a range of --gpus: draw tokens/s per GPU and MFU against GPUs "
                        "(.png or .svg)")
    w = p.add_argument_group("why this layout, and how sure (opgraph.analysis.explain)")
    w.add_argument("--compare", action="append", metavar="LAYOUT[;LAYOUT...]",
                   help="also print the first and second layouts beside this one, written as "
                        "the table prints a layout (tp8,pp16,dp64,mb1,zero1 full; repeatable): "
                        "each step split into compute, pipeline bubble, exposed communication "
                        "per group, a later stage's tail and the overlap slowdown, and memory "
                        "per GPU beside its headroom; a layout the job cannot run gives why "
                        f"(at most {MAX_COMPARED} layouts with --compare-config's)")
    w.add_argument("--compare-config", action="append", metavar="PATH",
                   help="compare a launch config's layout so: a torchtitan job .toml, or a "
                        "file of Megatron-LM arguments (repeatable)")
    w.add_argument("--sensitivity", nargs="?", const=10, type=whole(1000), metavar="K",
                   help="schedule the top K layouts (default 10) again with the calibrated "
                        "model's kernel efficiencies, then its collective bandwidths, moved "
                        "down and up by its left-out error (opgraph validate --cv family), and "
                        "say where the first choice ranks under each")
    p.set_defaults(func=run)


def _space(args, gpus: int, batch: int):
    from ..parallel.search import Space

    return Space(gpus=gpus, batch=batch, tp=args.tp, cp=args.cp, ep=args.ep, pp=args.pp,
                 dp=args.dp, zero=args.zero, replicate=args.replicate,
                 micro_batch=args.micro_batch,
                 virtual_stages=args.virtual_stages, sequence_parallel=args.sequence_parallel,
                 recompute=tuple(args.recompute) if args.recompute else None,
                 precision=tuple(args.precision) if args.precision else None,
                 max_tp=args.max_tp, max_cp=args.max_cp, max_pp=args.max_pp,
                 max_micro_batch=args.max_micro_batch,
                 max_virtual_stages=args.max_virtual_stages, async_tp=args.async_tp,
                 framework=args.framework, grad_reduce_dtype=args.grad_reduce_dtype,
                 attention_library=args.attention_library,
                 cp_comm=None if args.cp_comm == "both" else args.cp_comm or "ring",
                 expert_tp=args.expert_tp)


def _sizes(text: str) -> list[int]:
    from ..analysis.sweep.ranges import parse_range

    return [int(n) for n in parse_range(text, "--gpus", points=MAX_PLAN_SIZES)]


def run(args) -> int:
    if not args.case:  # asked for before anything heavy is imported, as argparse would
        if args.gpus is None:
            raise OpgraphError("give --gpus N (or a range, 8:1024:x2), or --case FILE:ID")
        if args.global_batch is None and args.tokens is None:
            raise OpgraphError("give --global-batch or --tokens, or --case FILE:ID")
    from ..parallel.search import Searcher
    from .common import cost_model, job_cluster, load_case, load_forward, load_hardware

    case = load_case(args.case) if args.case else None
    if case is not None:  # the run's job, where no flag says otherwise
        args.gpus = args.gpus or str(case.gpus)
        if args.global_batch is None and args.tokens is None:
            args.global_batch = case.parallel.batch
        args.seq_len = args.seq_len or case.seq_len
        args.framework = args.framework or case.parallel.framework
        args.precision = args.precision or [case.precision]
    sizes = _sizes(args.gpus)
    check_command_outputs(args, {"--plot": args.plot}, {"--plot": (".png", ".svg")})
    if args.plot and len(sizes) == 1:
        raise OpgraphError("--plot draws a scaling curve: give a range of --gpus, e.g. "
                           "8:1024:x2")
    if args.emit and args.json:
        raise OpgraphError("--emit prints the config alone; give --emit or --json, not both")
    if args.emit and args.rank:
        raise OpgraphError("--emit prints the config alone; give --emit or --rank, not both")
    if args.emit and args.framework not in (None, *EMITTED[args.emit]):
        raise OpgraphError(f"--emit {args.emit} writes a {args.emit} config, but the layouts "
                           f"follow --framework {args.framework}; give "
                           f"{' or '.join(EMITTED[args.emit])}, or leave it out")
    if args.emit and len(sizes) > 1:
        raise OpgraphError("--emit writes one job's config: give one --gpus")
    if args.emit:  # the layouts ranked as the framework they are written for runs them
        args.framework = args.framework or args.emit
    if args.rank and len(sizes) > 1:
        raise OpgraphError("--rank places one job's layout: give one --gpus")
    explained = [flag for flag, given in (("--compare", args.compare),
                                          ("--compare-config", args.compare_config),
                                          ("--case", args.case),
                                          ("--sensitivity", args.sensitivity)) if given]
    if explained and len(sizes) > 1:
        raise OpgraphError(f"{explained[0]} explains one job's layout: give one --gpus")
    if explained and args.emit:
        raise OpgraphError(f"--emit prints the config alone; give --emit or {explained[0]}, "
                           "not both")
    if args.sensitivity and args.cost != "calibrated":
        raise OpgraphError("--sensitivity moves the calibrated model's efficiencies by its "
                           "error; give --cost calibrated (plan's default)")
    from ..cost import hardware as hw

    part = load_hardware(args, case and case.part())
    if args.headroom is not None:
        part = hw.with_headroom(part, args.headroom)
    if part.memory_bytes is None:
        # Warned, not refused: the ranking by speed still holds, and a part's sheet may give no
        # memory (a what-if of a future part); but nothing is ruled out for its size.
        print(f"opgraph: warning: {part.id} gives no memory_gb, so memory is unchecked: every "
              "layout counts as fitting; add memory_gb to its file to rule out those that do "
              "not", file=sys.stderr)
    forward = (case.forward() if case is not None and args.model is None and args.config is None
               else load_forward(args))
    if args.emit:
        from ..io.launch import check_emittable

        check_emittable(forward.name, args.emit)  # before the search, not after it
    seq = args.seq_len or forward.seq_len
    if seq is None:
        raise OpgraphError(f"{forward.name} has no default sequence length; give --seq-len")
    if args.tokens is not None and args.tokens % seq:
        raise OpgraphError(f"--tokens {args.tokens:,} is not a multiple of the sequence length "
                           f"{seq:,}")
    batch = args.global_batch or args.tokens // seq
    cost = cost_model(args)
    cost.figures(part)  # what the cost model reads of the part: a gap said now
    cluster = job_cluster(args, part, case)
    spaces = [_space(args, n, batch) for n in sizes]  # every constraint checked up front
    resident = _resident_bytes(forward, seq, spaces[0])
    hopeless = {n: _hopeless(resident, n, part) for n in sizes}
    from ..parallel.search import cache

    searcher = Searcher(forward, part, seq_len=seq, cluster=cluster, cost=cost,
                        cache=None if args.no_cache else cache.folder())
    code = _searched(args, searcher, sizes, spaces, hopeless, resident, forward, part,
                     cluster, seq, batch, case)
    searcher.save()  # for the next run (`opgraph.parallel.search.cache`)
    return code


def _searched(args, searcher, sizes, spaces, hopeless, resident, forward, part, cluster,
              seq: int, batch: int, case=None) -> int:
    """The search of one size, or of each size of a curve, and its report."""
    if len(sizes) == 1:
        if hopeless[sizes[0]]:
            raise OpgraphError(f"no layout of {forward.name} on {sizes[0]:,} x {part.id} fits "
                               f"in memory: {hopeless[sizes[0]]}")
        names = _named(args, spaces[0], forward.name, seq)  # a text that is no layout: now
        if case is not None:
            from ..analysis.explain import from_case

            names.append(from_case(args.case, case, spaces[0], seq))
        deep = max(args.top, 2 if names else 1, args.sensitivity or 1)
        found = searcher.search(spaces[0], deep)
        _no_fit(found, forward, part, sizes[0])
        ranking = _ranking(searcher, spaces[0], found) if args.rank else None
        if args.emit:
            return _emit(args, found, forward, seq, searcher, spaces[0])
        why = _why(args, searcher, found, names)
        import attrs

        found = attrs.evolve(found, best=found.best[:args.top])  # as deep as --top asks
        _warn_unsplit(forward, spaces[0])
        return _one(args, found, forward, part, cluster, seq, batch, ranking, why)
    from ..io.outputs.progress import progressed

    curve = []
    for n, space in progressed(list(zip(sizes, spaces)), "plan: sizes", unit="size"):
        if hopeless[n]:  # a gap in the curve, found without a search
            curve.append((n, f"none fits: weights, gradients and optimizer states alone "
                             f"need {resident / n / 1e9:,.1f} GB per GPU"))
            continue
        try:
            curve.append((n, searcher.search(space, args.top)))
        except OpgraphError as e:  # a size no layout divides: a gap in the curve
            curve.append((n, str(e)))
    if all(isinstance(f, str) or not f.best for _, f in curve):
        raise OpgraphError(f"no layout of {forward.name} fits or divides at any of "
                           f"{args.gpus} GPUs; add GPUs, recompute or shard further")
    return _curve(args, curve, forward, part, cluster, seq, batch)


def _resident_bytes(forward, seq: int, space) -> float | None:
    """The bytes of the model's weights, gradients and optimizer states, unsharded: the least
    over the precisions the search tries (a step compiled on one GPU, as `profile` compiles it;
    recomputation changes none of them); None where a model of one's own leaves them a
    formula of more than the sequence length (the search then finds what fits)."""
    import sympy

    from ..core.pipeline import compile_step
    from ..cost.memory import RESIDENT, footprint
    from ..passes.evaluate import resolve

    least = None
    for precision in space.precision or SEARCHED_PRECISIONS:
        step = compile_step(forward, check=False, precision=precision)
        parts = footprint(step).parts()
        values = resolve(step, {"S": seq})
        total = sympy.sympify(sum(parts[name] for name in RESIDENT)).xreplace(values)
        if not total.is_number:
            return None
        total = float(total)
        least = total if least is None else min(least, total)
    return least


def _hopeless(resident: float | None, gpus: int, part) -> str | None:
    """Why no layout on `gpus` GPUs can fit, before any is searched, or None: the resident
    parts sharded over every GPU (tp x pp x cp x dp, ZeRO-3) are a floor under each GPU's
    memory, as every byte of them is held somewhere."""
    capacity = part.memory_bytes
    if not capacity or resident is None or resident / gpus <= capacity:
        return None
    return (f"its weights, gradients and optimizer states alone are {resident / 1e9:,.1f} GB, "
            f"{resident / gpus / 1e9:,.1f} GB per GPU even sharded over all {gpus:,} GPUs "
            f"(ZeRO-3), of {capacity / 1e9:,.1f} GB; add GPUs (at least "
            f"{math.ceil(resident / capacity):,} to hold them)")


def _no_fit(found, forward, part, gpus: int) -> None:
    if not found.best:
        raise OpgraphError(
            f"no layout of {forward.name} on {gpus:,} x {part.id} fits in memory: the "
            f"smallest of {found.searched:,} needs {found.smallest_memory / 1e9:,.1f} GB per "
            f"GPU of {part.memory_bytes / 1e9:,.1f} GB; add GPUs, or allow more recomputation "
            "or sharding")


def _warn_unsplit(forward, space) -> None:
    """Say which pipeline degrees the search left out for its framework's split (see
    `search.unsplit_degrees`), on stderr."""
    from ..parallel.search import unsplit_degrees

    left = unsplit_degrees(forward, space)
    if left:
        shown = ", ".join(f"pp {p} ({'/'.join(map(str, split))})" for p, split in left.items())
        print(f"opgraph: warning: not searched: {shown}: --framework {space.framework}'s own "
              "split of those, which plan's first, middle and last stages cannot hold; "
              "`opgraph profile --pp P` runs one", file=sys.stderr)


def _header(forward, part, cluster, seq: int, batch: int, cost: str,
            attention: str | None = None, headroom: float | None = None) -> str:
    """The search's first line; `attention`, the layout's attention library where one is
    given (`--attention-library`), named as the profile's report names it; `headroom`, the
    GB kept free (`--headroom`: `part` holds the rest)."""
    from ..cost.profile import LIBRARY_NAMES

    kernels = f"; attention: {LIBRARY_NAMES[attention]}" if attention else ""
    kept = (f"; layouts fit in {part.memory_bytes / 1e9:,.1f} GB, {headroom:g} GB of each "
            "GPU's kept free" if headroom else "")
    return (f"{forward.name} on {part.name}, cluster {cluster.id}: {batch:,} sequences x "
            f"{seq:,} tokens per step; {cost} cost model{kernels}{kept}")


def _counts(found) -> str:
    read = (f" ({found.read:,} of {found.read + found.compiled:,} read from the cache)"
            if found.read else "")
    return (f"searched {found.searched:,} layouts over {found.structures} structures, "
            f"{found.evaluated} of them evaluated ({found.fit:,} of their layouts fit in memory, "
            f"{found.scheduled:,} scheduled exactly); compiled in {found.compile_s:.2f} s{read}, "
            f"evaluated in {found.evaluate_s:.2f} s ({found.layouts_per_s:,.0f} layouts/s)")


# The constraints that fix the layout; --rank lifts them. The precision (a choice of numerics,
# not of layout) and the --max-* bounds stay.
FIXING = ("tp", "cp", "ep", "pp", "dp", "zero", "replicate", "micro_batch", "virtual_stages",
          "sequence_parallel", "recompute")


def _ranking(searcher, space, found) -> dict:
    """Where `found`'s best ranks in `space` with its fixing constraints lifted: its rank,
    among how many, and the best of them (a `search.Ranked`)."""
    import attrs

    lifted = attrs.evolve(space, **dict.fromkeys(FIXING))
    whole = searcher.search(lifted, 1)
    mine = found.best[0]
    return {"rank": searcher.faster_than(lifted, mine.step_time_s) + 1,
            "of": searcher.fitting(lifted),
            "searched": whole.searched,
            "slower_than_best": mine.step_time_s / whole.best[0].step_time_s - 1,
            "best": whole.best[0]}


def _named(args, space, model: str, seq: int) -> list:
    """The layouts --compare and --compare-config name (`explain.Named`), read before the
    search; a config's keys opgraph does not model are warned of, as `profile` warns."""
    if not (args.compare or args.compare_config):
        return []
    from ..analysis.explain import from_config, named

    texts = [text.strip() for given in args.compare or () for text in given.split(";")
             if text.strip()]
    if len(texts) + len(args.compare_config or ()) > MAX_COMPARED:
        raise OpgraphError(f"--compare and --compare-config name more than {MAX_COMPARED} "
                           "layouts, each profiled on its own; name fewer")
    out = [named(text, space) for text in texts]
    for path in args.compare_config or ():
        layout, notes = from_config(path, space, model, seq)
        for note in notes:
            print(f"opgraph: warning: {note} is not modelled; ignored", file=sys.stderr)
        runs = dict(layout.fields).get("framework")
        if runs != space.framework:  # a config is its framework's job (`opgraph.io.launch`)
            print(f"opgraph: note: {path} runs {runs}'s behaviour, the plan's layouts "
                  f"{space.framework or 'the generic model'}'s; give --framework {runs} to "
                  "rank them as it runs them", file=sys.stderr)
        out.append(layout)
    return out


def _why(args, searcher, found, names) -> dict:
    """--compare's rows and --sensitivity's moved models (`opgraph.analysis.explain`)."""
    why = {}
    if names:
        from ..analysis.explain import compare

        why["compare"] = compare(searcher, found.best, names)
    if args.sensitivity:
        from ..analysis.explain import sensitivity
        from ..analysis.validate import LEFT_OUT_ERROR

        best = found.best[:args.sensitivity]
        why["sensitivity"] = (best, sensitivity(searcher, best, LEFT_OUT_ERROR), LEFT_OUT_ERROR)
    return why


def _one(args, found, forward, part, cluster, seq, batch, ranking=None, why=None) -> int:
    why = why or {}
    if args.json:
        out = _json(found, part, cluster, seq, args.cost)
        if ranking is not None:
            out["ranking"] = ranking | {"best": ranking["best"].to_json()}
        if "compare" in why:
            out["compare"] = [row.to_json() for row in why["compare"]]
        if "sensitivity" in why:
            best, moved, error = why["sensitivity"]
            out["sensitivity"] = {"error": error, "top": len(best),
                                  "models": [p.to_json(best) for p in moved]}
        print(json_text(out))
        return 0
    from ..io.outputs.report import format_plan, layout_text
    from .layout import layout_warnings

    print(_header(forward, part, cluster, seq, batch, args.cost, args.attention_library,
                  args.headroom))
    print(_counts(found))
    print()
    print(format_plan(found.best, near=args.headroom is None))
    if ranking is not None:
        b = ranking["best"]
        print(f"\nthe best layout above ranks #{ranking['rank']:,} of the {ranking['of']:,} that "
              f"fit among all {ranking['searched']:,} (the layout's constraints lifted); it is "
              f"{ranking['slower_than_best'] * 100:.1f}% slower than the best, "
              f"{layout_text(b.layout, b.candidate.recompute, b.candidate.precision)} at "
              f"{b.step_time_s:.3f} s per step")
    if "compare" in why:
        from ..io.outputs.report import format_compare

        print()
        print(format_compare(why["compare"]))
    if "sensitivity" in why:
        from ..io.outputs.report import format_sensitivity

        best, moved, error = why["sensitivity"]
        print()
        print(format_sensitivity(moved, best, error))
    for line in layout_warnings(found.best[0].layout):  # what the constraints made idle
        print(f"opgraph: warning: #1: {line}", file=sys.stderr)
    return 0


def _json(found, part, cluster, seq, cost) -> dict:
    return {"gpus": found.best[0].layout.world if found.best else None,
            "hardware": part.id, "cluster": cluster.id, "seq_len": seq, "cost": cost,
            "searched": found.searched, "fit": found.fit, "scheduled": found.scheduled,
            "structures": found.structures, "evaluated": found.evaluated,
            "compile_s": found.compile_s, "compiled": found.compiled, "read": found.read,
            "evaluate_s": found.evaluate_s, "layouts_per_s": found.layouts_per_s,
            "layouts": [r.to_json() for r in found.best]}


def _launch(ranked, forward, seq: int):
    from ..io.launch import Launch

    return Launch(model=forward.name, seq_len=seq, parallel=ranked.layout,
                  recompute=ranked.candidate.recompute, precision=ranked.candidate.precision)


EMIT_TOP = 1000  # how far down the ranking --emit looks for a layout its format can express


def _emit(args, found, forward, seq: int, searcher, space) -> int:
    """The best layout `--emit`'s format can express, as that format: the search goes on down
    the ranking (ten times deeper each time, to EMIT_TOP) until one can be written."""
    from ..io.launch import to_megatron, to_torchtitan

    write = to_torchtitan if args.emit == "torchtitan" else to_megatron
    reasons, tried, top = [], 0, args.top
    while True:
        for rank, ranked in enumerate(found.best[tried:], tried + 1):
            try:
                text = write(_launch(ranked, forward, seq))
            except OpgraphError as e:
                reasons.append(f"#{rank}: {e}")
                continue
            if rank > 1:
                print(f"opgraph: note: the best {rank - 1} layouts cannot be written for "
                      f"{args.emit} ({reasons[0]}); this is #{rank}", file=sys.stderr)
            print(f"opgraph: wrote layout #{rank} for {args.emit}: {_figures(ranked)}",
                  file=sys.stderr)
            print(text)
            return 0
        tried = len(found.best)
        if top >= EMIT_TOP or tried < top:  # the whole ranking seen
            break
        top = min(EMIT_TOP, top * 10)
        found = searcher.search(space, top)
    raise OpgraphError(f"none of the best {tried:,} layouts can be written for {args.emit} "
                       f"({reasons[0]}); constrain the search to what {args.emit} runs")


def _figures(ranked) -> str:
    """A layout and its figures in one line, as the plan's table gives them (GB = 1e9 bytes)."""
    from ..io.outputs.report import layout_text

    r = ranked.result
    return (f"{layout_text(ranked.layout, ranked.candidate.recompute, ranked.candidate.precision)}"
            f", step {r.step_time_s:.4f} s, {r.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, "
            f"MFU {r.mfu * 100:.1f}%, {r.memory.total / 1e9:.1f} GB per GPU")


def _curve(args, curve, forward, part, cluster, seq, batch) -> int:
    if args.plot:
        from ..io.outputs.plot import plot_scaling

        plot_scaling([(n, f.best[0]) for n, f in curve if not isinstance(f, str) and f.best],
                     f"{forward.name} on {part.id}, {batch:,} x {seq:,} tokens per step; "
                     f"{args.cost} cost model",
                     args.plot)
    if args.json:
        print(json_text({"hardware": part.id, "cluster": cluster.id, "seq_len": seq,
                         "cost": args.cost, "sizes": [
                             {"gpus": n, "error": f} if isinstance(f, str) else
                             _json(f, part, cluster, seq, args.cost) | {"gpus": n}
                             for n, f in curve]}))
        return 0
    from ..io.outputs.report import format_curve

    print(_header(forward, part, cluster, seq, batch, args.cost, args.attention_library,
                  args.headroom))
    print(format_curve(curve))
    return 0
