"""The standard pipeline: a forward graph in, one training step's graph out.

    step = compile_step(preset("llama3-8b"))           # fused attention, backward, AdamW
    step = compile_step(forward, fused_attention=False)
    step = compile_step(forward, recompute="full", precision="fp8")
    step = compile_step(forward, extra_passes=[fuse_elementwise])  # run after the built-in ones

It is a plain list of passes; each is a pure function Graph -> Graph. Each built-in pass
declares, in its own file, where it runs and which options bind it (`@step_pass`,
`opgraph.core.contracts`); `builtin_passes` finds them in the modules of `opgraph.passes`, so a pass
added as a new file runs in `profile`, `plan` and every command with no edit elsewhere.
`run_passes` drives them: before each pass it checks the pass's contract (`opgraph.core.contracts`:
what its input must hold, declared in the pass's own file), and after it the graph
(`opgraph.core.verify`: every op of every phase against its kind's shape rule), so a broken order or
a broken pass is named where it happens.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable, Sequence

from . import contracts
from .contracts import StepOptions
from .errors import OpgraphError
from .ir import Graph
from .verify import VerifyError, check_dims, verify


@functools.cache
def builtin_passes() -> tuple[Callable, ...]:
    """Every pass of `opgraph.passes` that declares its place (`contracts.step_pass`), in the
    order they run: by position, then name. Found once a process, by importing each module of
    the package (what is installed does not change while it runs)."""
    from .. import passes

    found = {}
    for info in sorted(pkgutil.iter_modules(passes.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{passes.__name__}.{info.name}")
        for value in vars(module).values():
            if (callable(value) and getattr(value, "__module__", None) == module.__name__
                    and contracts.placement_of(value) is not None):
                found[value.__name__] = value
    return tuple(sorted(found.values(), key=lambda f: (contracts.placement_of(f).at,
                                                       f.__name__)))


def step_passes(*, fused_attention: bool = True, adamw=None, recompute="none",
                precision: str = "bf16", layout=None, replicated: bool = True,
                extra_passes: Sequence[Callable[[Graph], Graph]] = ()) -> list:
    """The passes `compile_step` runs, in order: every built-in pass (`builtin_passes`) that
    these options bind (`contracts.StepOptions`), each with its arguments, then
    `extra_passes`, each a function Graph -> Graph (e.g.
    `opgraph.passes.fuse_elementwise.fuse_elementwise`).

    `recompute` names a policy of `passes.recompute.POLICIES` (or is a predicate over ops),
    `precision` one of `passes.precision.PRECISIONS` (their defaults add no pass); `layout` (a
    `Parallel`) shards the forward over GPUs before the backward is derived and adds its
    framework's passes and, where `replicated`, the data-parallel replicas after the optimizer.
    """
    options = StepOptions(fused_attention, adamw, recompute, precision, layout, replicated)
    passes = []
    for run in builtin_passes():
        arguments = contracts.placement_of(run).arguments(options)
        if arguments is not None:
            passes.append(functools.partial(run, **arguments) if arguments else run)
    return [*passes, *extra_passes]


def pass_key(run: Callable) -> tuple:
    """What a pass of `step_passes` computes its result from besides its input graph, as a
    hashable key, for caches of pass results (`opgraph.parallel.search` shares a prefix of passes
    between structures): its function and its bound arguments, each through what the pass's
    placement declares decides its ops (`contracts.step_pass`'s `structure`), where it does.
    A pass added to `opgraph.passes` needs no entry anywhere else.

        pass_key(functools.partial(apply_precision, precision="fp8"))
        # (apply_precision, (), (("precision", "fp8"),))
    """
    func = getattr(run, "func", run)
    if run is func:
        return (func, (), ())
    placement = contracts.placement_of(run)
    reads = dict(placement.structure) if placement is not None else {}
    return (func, tuple(run.args), tuple((k, reads[k](v) if k in reads else v)
                                         for k, v in sorted(run.keywords.items())))


def fusion_passes(policy: str | None) -> list:
    """The extra passes a fusion policy's name asks for (`opgraph.core.fusion.POLICIES`; None or
    "none": none): `compile_step(g, extra_passes=fusion_passes("elementwise"))`."""
    if policy in (None, "none"):
        return []
    from ..passes.fuse_elementwise import fuse_elementwise
    from .fusion import POLICIES

    return [functools.partial(fuse_elementwise, policy=POLICIES[policy])]


def run_passes(graph: Graph, passes: Sequence[Callable[[Graph], Graph]], *,
               check: bool = True) -> Graph:
    """Run `passes` in order over `graph`: each pass's contract checked on its input
    (`contracts.check`: an order that breaks it is a one-line OpgraphError naming the pass),
    its dimensions as it returns (a pass such as `shard` or `replicate` binds new ones: a value
    out of range is a VerifyError, not a profile of negative bytes), and with `check` the graph
    it returns (`verify`, a few milliseconds; a malformed graph is a VerifyError naming the
    pass that made it)."""
    graph = check_dims(graph)
    for run in passes:
        contracts.check(run, graph)
        out = run(graph)
        if not isinstance(out, Graph):
            raise OpgraphError(f"pass {contracts.name_of(run)} returned {type(out).__name__}, "
                               "not a Graph; a pass returns the graph it makes")
        graph = check_dims(out)
        if check:
            try:
                verify(graph)
            except VerifyError as e:
                raise VerifyError(f"after pass {contracts.name_of(run)}: {e}") from None
    return graph


def compile_step(forward: Graph, *, check: bool = True, **options) -> Graph:
    """Run `step_passes(**options)` over `forward` (`run_passes`: contracts checked, and with
    `check` the graph verified after each pass; `check=False` to skip, it is cheap). How the
    step's ops cost is the cost model's business, when it is evaluated
    (`opgraph.cost.costmodel`)."""
    if check:
        verify(forward)
    return run_passes(forward, step_passes(**options), check=check)
