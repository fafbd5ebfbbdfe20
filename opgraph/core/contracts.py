"""What a pass needs of the graph it is given, declared beside the pass, checked by the driver.

A pass is a pure function Graph -> Graph; some only make sense at one point of the pipeline:
`replicate` reduces the gradients the optimizer reads (before `attach_adamw` there are none, and
the step would verify with no gradient collective at all), `apply_precision` casts the matmuls
a recomputation copies (after `recompute` the re-run ones would keep BF16). Each such pass
declares it with `@contract`, in its own file, as facts about its input graph that it
`requires` or `forbids`. The facts are read off the graph itself (`FACTS`), not from a record
of which passes ran, so a pass of the user's, and any order, is judged by what the graph holds:

    @contract(requires=("optimizer",), forbids=("replicated",))
    def replicate(graph, layout): ...

`check(run, graph)` raises a one-line OpgraphError naming the pass, the fact and the pass that
establishes it; `opgraph.core.pipeline.run_passes` calls it before each pass. A pass with no
contract (a user's, `fuse_elementwise`) runs wherever it is put.

Where a built-in pass runs in the step is declared beside it too, with `@step_pass`: its
position (`FORWARD` ... `REPLICATE`), which of the step's options (`StepOptions`) bind its
arguments, and which of an argument's fields decide the ops it makes. `opgraph.core.pipeline`
finds every pass so declared in the modules of `opgraph.passes` and runs them in position
order, so a new pass is one new file, and `profile`, `plan` and every other command run it:

    @step_pass(at=LAYOUT + 3, bind=lambda o: o.layout and {"layout": o.layout},
               structure={"layout": lambda p: (p.zero,)})
    @contract(requires=("backward",))
    def my_pass(graph, layout): ...
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from .errors import OpgraphError
from .ir import Graph, Phase


def _has_phase(phase: Phase) -> Callable[[Graph], bool]:
    return lambda graph: any(op.phase is phase for op in graph.ops())


def _replicated(graph: Graph) -> bool:
    return any(sym.name == "dp" for sym in graph.dims)


# Each fact: how to read it off a graph, what it is in words, and the pass that makes it.
FACTS: dict[str, tuple[Callable[[Graph], bool], str, str]] = {
    "backward": (_has_phase(Phase.BACKWARD), "a backward", "derive_backward"),
    "recomputed": (_has_phase(Phase.RECOMPUTE), "a recomputation", "recompute"),
    "optimizer": (_has_phase(Phase.OPTIMIZER), "an optimizer", "attach_adamw"),
    "replicated": (_replicated, "data-parallel replicas", "replicate"),
}


@attrs.frozen
class Contract:
    """Facts (`FACTS`) a pass's input graph must hold and must not."""

    requires: tuple[str, ...] = ()
    forbids: tuple[str, ...] = ()

    def __attrs_post_init__(self):
        unknown = [f for f in (*self.requires, *self.forbids) if f not in FACTS]
        if unknown:
            raise ValueError(f"unknown facts {unknown}; choose from {', '.join(FACTS)}")


def contract(*, requires: tuple[str, ...] = (), forbids: tuple[str, ...] = ()) -> Callable:
    """Declare a pass's contract; the pass is returned as it is, the contract on it."""
    def declare(func: Callable) -> Callable:
        func.contract = Contract(tuple(requires), tuple(forbids))
        return func
    return declare


def contract_of(run: Callable) -> Contract | None:
    """The contract of a pass, or of the function a `functools.partial` binds; None if none."""
    return getattr(getattr(run, "func", run), "contract", None)


def name_of(run: Callable) -> str:
    func = getattr(run, "func", run)
    return getattr(func, "__name__", repr(func))


def check(run: Callable, graph: Graph) -> None:
    """Raise a one-line OpgraphError if `graph` breaks `run`'s contract (see the module)."""
    c = contract_of(run)
    if c is None:
        return
    for fact in c.requires:
        holds, words, maker = FACTS[fact]
        if not holds(graph):
            raise OpgraphError(f"pass {name_of(run)} needs a graph with {words}; "
                               f"run {maker} before it")
    for fact in c.forbids:
        holds, words, maker = FACTS[fact]
        if holds(graph):
            raise OpgraphError(f"pass {name_of(run)} runs on a graph without {words}; "
                               f"run it before {maker}")


# --- where a built-in pass runs -----------------------------------------------------------------

# Positions in the step, in order: the forward graph's rewrites, its sharding over GPUs, the
# backward, precision, recomputation, the optimizer, the layout's framework passes, the
# data-parallel replicas. A pass between two takes a number between them.
FORWARD, SHARD, BACKWARD, PRECISION, RECOMPUTE, OPTIMIZER, LAYOUT, REPLICATE = (
    10, 20, 30, 40, 50, 60, 70, 90)


@attrs.frozen
class StepOptions:
    """What a step is compiled with (`opgraph.core.pipeline.step_passes`' arguments): attention
    fusion, AdamW (None: `attach_adamw`'s default), the recomputation policy, the precision,
    the layout over GPUs (None: one GPU) and whether its data-parallel replicas are made."""

    fused_attention: bool = True
    adamw: object = None
    recompute: object = "none"
    precision: str = "bf16"
    layout: object = None
    replicated: bool = True


@attrs.frozen
class Placement:
    """Where a built-in pass runs (`step_pass`): its position; `bind(options)`, the keyword
    arguments it is called with, or None (or {} for none) where it does not run; and per
    argument, a function of the argument's value giving what of it decides the ops the pass
    makes (`opgraph.core.pipeline.pass_key`; an argument not named counts whole)."""

    at: float
    bind: Callable
    structure: tuple = ()  # ((argument, reads), ...)

    def arguments(self, options: StepOptions) -> dict | None:
        found = self.bind(options)
        return None if found is None or found is False else dict(found)


def _always(options: StepOptions) -> dict:
    return {}


def step_pass(*, at: float, bind: Callable = _always,
              structure: dict[str, Callable] | None = None) -> Callable:
    """Declare where a built-in pass runs (see the module); the pass is returned as it is."""
    def declare(func: Callable) -> Callable:
        func.placement = Placement(at, bind, tuple(sorted((structure or {}).items())))
        return func
    return declare


def placement_of(run: Callable) -> Placement | None:
    """The placement of a pass, or of the function a `functools.partial` binds; None if none."""
    return getattr(getattr(run, "func", run), "placement", None)
