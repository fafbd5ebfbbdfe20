"""What the options every model-facing subcommand shares (`opgraph.commands.options`) resolve
to: the model, the hardware, the cost model, the compiled step. A command imports this module
when it runs, never when its parser is built: it loads sympy and the passes."""

from __future__ import annotations

import attrs

from ..core.errors import OpgraphError
from ..core.ir import Graph
from ..core.pipeline import compile_step, fusion_passes
from ..cost import hardware as hw
from ..cost.costmodel import DEFAULT, CostModel
from ..cost.costmodel import cost_model as make_cost_model
from ..cost.hardware import Hardware
from ..passes.attach_adamw import AdamW


@attrs.frozen
class Setup:
    forward: Graph
    step: Graph
    hardware: Hardware
    values: dict  # dimension name -> value
    cost: CostModel = DEFAULT


def load_forward(args) -> Graph:
    """The forward graph `--model` or `--config` names: a preset, a config.json, or a user's
    model, `--model path/to/file.py:build` (a function of no arguments returning a Graph; the
    name defaults to `build`). The file is imported with importlib, never eval'ed. Then the
    user's forward passes, `--pass path/to/file.py:function` each, in order
    (`forward_passes`)."""
    return forward_passes(_model(args), getattr(args, "forward_passes", None) or ())


def _model(args) -> Graph:
    config = getattr(args, "config", None)
    if config is not None:
        if args.model is not None:
            raise OpgraphError("give --model or --config, not both")
        from opgraph.models.hf import from_config

        return from_config(config)
    model = args.model or "llama3-8b"
    path, function = _file_and_function(model)
    if path.endswith(".py"):
        return _user_model(path, function or "build")
    if function:
        raise OpgraphError(f"--model {model}: a user's model is a .py file and a function in "
                           "it, e.g. --model models/mine.py:build")
    from opgraph.models import preset

    return preset(model)


def _file_and_function(text: str) -> tuple[str, str]:
    path, _, function = text.rpartition(":")
    if text.endswith(".py") or not path:  # no function named (a path may hold a colon)
        return text, ""
    return path, function


def forward_passes(forward: Graph, specs) -> Graph:
    """`forward` through the user's passes, `path/to/file.py:function` each (a function Graph
    -> Graph), by the pipeline's driver (`pipeline.run_passes`: contracts checked, the graph
    verified after each): what `profile`, `plan` and every command then compile, so each runs
    them alike. Every failure is one line."""
    if not specs:
        return forward
    from ..core.pipeline import run_passes
    from ..core.verify import VerifyError, check_model

    for spec in specs:
        path, function = _file_and_function(spec)
        where = f"--pass {spec}"
        if not path.endswith(".py") or not function:
            raise OpgraphError(f"{where}: give a .py file and the pass in it, e.g. --pass "
                               "passes/mine.py:widen")
        run = _load_function(path, function, where)
        try:
            out = run_passes(forward, [run])
        except (VerifyError, OpgraphError) as e:
            raise OpgraphError(f"{where}: {_one_line(e)}") from None
        except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's code, in one line
            raise OpgraphError(f"{where}: {function}() raised {_one_line(e)}") from None
        try:
            check_model(out)
        except VerifyError as e:
            raise OpgraphError(f"{where}: the graph it returns cannot be profiled: "
                               f"{_one_line(e)}") from None
        forward = out
    return forward


def _load_function(path: str, function: str, where: str):
    """Import `path` as a module and return its `function`; every failure is one line."""
    import importlib.util
    import sys
    from hashlib import sha1
    from pathlib import Path

    file = Path(path)
    if not file.is_file():
        raise OpgraphError(f"{where}: no such file {path!r}; give the path of a .py file that "
                           f"defines {function}(), relative to this directory or absolute")
    name = f"opgraph_user_{sha1(str(file.resolve()).encode()).hexdigest()[:12]}"
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and attrs in the file look their module up
    # The user's code: any error is theirs, in one line; so is a `sys.exit()` in it, which
    # must not end opgraph silently. Ctrl-C (KeyboardInterrupt) still stops the program.
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # noqa: BLE001
        del sys.modules[name]
        raise OpgraphError(f"{where}: importing {path} failed: {_one_line(e)}") from None
    found = getattr(module, function, None)
    if not callable(found):
        defined = sorted(k for k, v in vars(module).items()
                         if callable(v) and getattr(v, "__module__", None) == name)
        have = f"; it defines {', '.join(defined)}" if defined else ""
        raise OpgraphError(f"{where}: {path} has no function {function!r}{have}")
    return found


def _user_model(path: str, function: str) -> Graph:
    """Call `function` of the file at `path`; every failure is one line."""
    from ..core.verify import VerifyError, check_model

    where = f"--model {path}:{function}"
    build = _load_function(path, function, where)
    try:
        graph = build()
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's code, in one line
        raise OpgraphError(f"{where}: {function}() raised {_one_line(e)}") from None
    if not isinstance(graph, Graph):
        raise OpgraphError(f"{where}: {function}() returned {type(graph).__name__}, not a "
                           "forward Graph; end it with `return g.build()` on an "
                           "opgraph.GraphBuilder")
    try:
        check_model(graph)  # after build(): its dims may have changed since the builder's check
    except VerifyError as e:
        raise OpgraphError(f"{where}: the graph cannot be profiled: {_one_line(e)}") from None
    from ..core.symbols import S

    if graph.seq_len is None and S in graph.dims:  # its S is its default length
        graph = graph.copy()
        graph.seq_len = int(graph.dims[S])
    return graph


def _one_line(e: BaseException) -> str:
    if isinstance(e, SystemExit):  # its str() is the bare exit status
        return f"SystemExit({e.code!r}): a model file must not exit the program"
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


DEFAULT_PART = "h100-sxm"  # `--hardware` where neither it nor a --case names one


def load_hardware(args, default=None) -> Hardware:
    """The part `--hardware` names (else `default`, a Hardware, else DEFAULT_PART), with
    `--peak-tflops` and `--bandwidth-tbs` over its figures."""
    part = hw.get(args.hardware) if args.hardware else default or hw.get(DEFAULT_PART)
    changes = {}
    if getattr(args, "peak_tflops", None) is not None:  # `plan` has neither override
        changes["peak_flops"] = args.peak_tflops * 1e12
    if getattr(args, "bandwidth_tbs", None) is not None:
        changes["bandwidth"] = args.bandwidth_tbs * 1e12
    if changes:
        part = attrs.evolve(part, id=f"{part.id}-custom", name=f"{part.name} (custom)", **changes)
    return part


def token_values(forward: Graph, tokens: int | None, seq_len: int | None) -> dict:
    """`{"S": seq_len, "B": batch}` from tokens per step and sequence length, checked as the
    library checks them (`opgraph.passes.evaluate.resolve`)."""
    from ..core.symbols import B, S
    from ..passes.evaluate import resolve

    seq = seq_len or forward.seq_len
    if seq is None:
        raise OpgraphError(f"{forward.name} has no default sequence length; give --seq-len")
    subs = resolve(forward, {"S": seq, "tokens": tokens or seq})
    return {"S": int(subs[S]), "B": int(subs[B])}


def default_cost(args) -> str:
    """The cost model a command that leaves `--cost` to the job (`options.add_cost_args`:
    None) uses: calibrated for a job over many GPUs (`layout.is_job`), as `plan` and
    `validate` cost one, roofline for one GPU's step."""
    from .layout import is_job

    return "calibrated" if is_job(args) else "roofline"


def cost_name(args) -> str:
    """`--cost`, or where the command leaves it to the job, `default_cost`."""
    name = getattr(args, "cost", "roofline")
    return default_cost(args) if name is None else name


def cost_model(args, calibrated: bool = True) -> CostModel:
    """The cost model the options ask for: `--cost` (roofline or calibrated, with
    `--calibration`'s file), `--backward-traffic` its backward convention. Commands whose
    engines are the roofline's formulas alone (solve) pass `calibrated=False`: a calibrated
    model is then refused as the library refuses it (`formula.roofline_only`)."""
    name = cost_name(args)
    path = getattr(args, "calibration", None)
    if path is not None and name != "calibrated":
        raise OpgraphError("--calibration gives efficiencies for --cost calibrated; add it")
    table = None
    if path is not None:
        from ..cost import calibration

        table = calibration.load(path)
    cost = make_cost_model(name, getattr(args, "backward_traffic", "plate"), table)
    if not calibrated:
        from ..cost.formula import roofline_only

        roofline_only(cost, f"opgraph {args.command}")
    return cost


def extra_passes(args) -> list:
    """The passes the options add after the built-in ones: `--fuse POLICY` runs
    `fuse_elementwise` with that policy (`opgraph.core.fusion.POLICIES`)."""
    return fusion_passes(getattr(args, "fuse", None))


def setup(args, calibrated: bool = True, layout=None) -> Setup:
    """The step the options describe; with `layout` (a `Parallel`) one GPU's share of it
    sharded (`distributed.compile_parallel`), its degrees symbols of the graph."""
    cost = cost_model(args, calibrated)
    forward = load_forward(args)
    part = load_hardware(args)
    values = token_values(forward, getattr(args, "tokens", None), getattr(args, "seq_len", None))
    if layout is None:
        step = compile_step(forward, **step_options(args))
    else:
        from ..parallel.distributed import compile_parallel

        step = compile_parallel(forward, layout, seq=values["S"], **step_options(args))
    cost.figures(part)  # what the cost model reads of the part: a gap said now
    return Setup(forward, step, part, values, cost)


def step_options(args) -> dict:
    """`compile_step`'s options from the command line: attention fusion, recomputation,
    precision, AdamW's precisions and the extra passes (`--fuse`) (`pipeline.step_passes`)."""
    options = {"fused_attention": not args.no_fused_attention,
               "extra_passes": extra_passes(args)}
    for name, default in (("recompute", "none"), ("precision", "bf16")):
        if getattr(args, name, default) != default:
            options[name] = getattr(args, name)
    adamw = getattr(args, "adamw", "mixed")
    if adamw != "mixed":
        options["adamw"] = AdamW.named(adamw)
    return options


STEP_OPTIONS = (("recompute", "none"), ("precision", "bf16"), ("adamw", "mixed"),
                ("cost", "roofline"))


def echoed(args) -> dict:
    """The step options `--json` echoes back, each with its value (`echoed(None)`: the
    defaults)."""
    return {name: getattr(args, name, default) for name, default in STEP_OPTIONS}


@attrs.frozen
class ParallelSetup:
    forward: Graph
    profile: object  # a Profile with `.parallel`
    hardware: Hardware
    echo: dict  # the step options used, as `echoed` names them
    warnings: tuple[str, ...] = ()  # options the layout makes do nothing (`layout_warnings`)


def parallel_setup(args) -> ParallelSetup:
    """The many-GPU profile the options ask for: the layout from the flags over what
    `--torchtitan` or `--megatron-args` said (`opgraph.io.launch`) or a case file's run
    (`--case`), on `--cluster` (default: the case's, else the part's), with `--trace-rank`'s
    timeline."""
    from ..parallel.job import JobSpec
    from .layout import layout_from, layout_warnings

    base = None
    # the step's options: each flag given, else the launch config's, else the job's default
    defaults = {f.name: f.default for f in attrs.fields(JobSpec)
                if f.name in ("recompute", "precision", "fuse")}
    given = {name: getattr(args, name) for name, default in defaults.items()
             if getattr(args, name, default) != default}
    case = _case(args)  # first: it refuses a launch config beside it
    launch = _launch(args)
    if case is not None:
        base = case.parallel
        given = {"recompute": case.recompute, "precision": case.precision,
                 "fuse": None if case.fuse == "none" else case.fuse} | given
        forward = case.forward() if args.model is None and args.config is None \
            else load_forward(args)
        seq = args.seq_len or case.seq_len
    elif launch is not None:
        for note in launch.unknown:
            import sys

            print(f"opgraph: warning: {launch.source}: {note} is not modelled; ignored",
                  file=sys.stderr)
        forward = launch.forward() if args.model is None and args.config is None \
            else load_forward(args)
        base = launch.parallel
        given = {"recompute": launch.recompute, "precision": launch.precision,
                 "fuse": launch.fuse} | given
        seq = args.seq_len or launch.seq_len or forward.seq_len
    else:
        forward = load_forward(args)
        seq = args.seq_len or forward.seq_len
    if seq is None:
        raise OpgraphError(f"{forward.name} has no default sequence length; give --seq-len")
    layout = layout_from(args, seq, base)
    part = load_hardware(args, case and case.part())
    job = JobSpec(forward=forward, hardware=part, layout=layout, seq_len=seq,
                  cluster=job_cluster(args, part, case),
                  cost=cost_model(args),
                  fused_attention=not args.no_fused_attention and (case is None
                                                                  or case.fused_attention),
                  adamw=getattr(args, "adamw", "mixed"), **given)
    profile = job.profile(rank=args.trace_rank)
    echo = echoed(args) | {k: given[k] for k in ("recompute", "precision") if k in given}
    return ParallelSetup(forward, profile, part, echo, tuple(layout_warnings(layout)))


def job_cluster(args, part: Hardware, case=None):
    """The job's cluster: `--cluster`'s, else the case's where `--hardware` kept its part,
    else the part's own."""
    from ..parallel import cluster as clusters

    if args.cluster:
        return clusters.get(args.cluster)
    if case is not None and not args.hardware:
        return case.resolved_cluster()
    return clusters.for_hardware(part)


def _case(args):
    """The case `--case FILE:ID` names (`opgraph.io.cases`), else None."""
    given = getattr(args, "case", None)
    if not given:
        return None
    if args.torchtitan or args.megatron_args:
        raise OpgraphError("give --case or a launch config (--torchtitan, --megatron-args), "
                           "not both")
    return load_case(given)


def load_case(given: str):
    """The case `FILE:ID` names: a run of a case file (a path, or dev, holdout,
    playbook-sweep) by its id; one OpgraphError line for a malformed name or a missing id."""
    from ..io.cases import load_cases

    file, sep, case_id = given.rpartition(":")
    if not sep or not file or not case_id:
        raise OpgraphError(f"--case {given!r}: give FILE:ID, a case file (or dev, holdout, "
                           "playbook-sweep) and a case's id, e.g. holdout:torchtitan_t3_fsdp_128gpu")
    found = [c for c in load_cases(file) if c.id == case_id]
    if not found:
        raise OpgraphError(f"--case: {file} has no case {case_id!r}; `opgraph validate --cases "
                           f"{file}` lists its ids")
    return found[0]


def _launch(args):
    if args.torchtitan and args.megatron_args:
        raise OpgraphError("give --torchtitan or --megatron-args, not both")
    if not (args.torchtitan or args.megatron_args):
        return None
    from ..io import launch

    if args.torchtitan:
        return launch.read_torchtitan(args.torchtitan, gpus=args.gpus)
    return launch.read_megatron(args.megatron_args, gpus=args.gpus)
