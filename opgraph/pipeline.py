"""The standard pipeline: a forward graph in, one training step's graph out.

    step = compile_step(preset("llama3-8b"))           # fused attention, backward, AdamW
    step = compile_step(forward, fused_attention=False)
    step = compile_step(forward, recompute="full", precision="fp8")
    step = compile_step(forward, extra_passes=[fuse_elementwise])  # run after the built-in ones

It is a plain list of passes; each is a pure function Graph -> Graph. `run_passes` drives
them: before each pass it checks the pass's contract (`opgraph.contracts`: what its input must
hold, declared in the pass's own file), and after it the graph (`opgraph.verify`: every op of
every phase against its kind's shape rule), so a broken order or a broken pass is named where
it happens.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from . import contracts
from .frameworks import reduce_dtype, sharding, traits
from .ir import Graph
from .passes.attach_adamw import AdamW, attach_adamw
from .passes.cache_fp8_weights import cache_fp8_weights
from .passes.decompose import decompose
from .passes.derive_backward import derive_backward
from .passes.fuse_attention import fuse_attention
from .passes.precision import apply_precision
from .passes.recompute import recompute as recompute_pass
from .passes.regather_inputs import regather_inputs
from .passes.replicate import replicate
from .passes.shard import shard as shard_pass
from .verify import VerifyError, check_dims, verify

DEFAULT_ADAMW = AdamW()


def step_passes(*, fused_attention: bool = True, adamw: AdamW = DEFAULT_ADAMW,
                recompute: str = "none", precision: str = "bf16",
                shard: Callable[[Graph], Graph] | None = None,
                extra_passes: Sequence[Callable[[Graph], Graph]] = ()) -> list:
    """The passes `compile_step` runs, in order: `recompute` names a policy of
    `passes.recompute.POLICIES` (or is a predicate over ops), `precision` one of
    `passes.precision.PRECISIONS` (their defaults add no pass); `shard` splits the forward over
    GPUs before the backward is derived (`passes.shard.shard` with a layout); then
    `extra_passes`, each a function Graph -> Graph (e.g.
    `opgraph.passes.fuse_elementwise.fuse_elementwise`)."""
    passes = [fuse_attention] if fused_attention else []
    if shard is not None:
        passes.append(shard)
    passes.append(derive_backward)
    if precision != "bf16":
        passes.append(functools.partial(apply_precision, precision=precision))
    if recompute != "none":
        passes.append(functools.partial(recompute_pass, policy=recompute))
    passes.append(functools.partial(attach_adamw, adamw=adamw))
    passes.extend(extra_passes)
    return passes


# What of its arguments decides the ops and tensors a pass makes (its structure), where that is
# less than the argument itself: a sharded or replicated graph holds the degrees as symbols, so
# the layout's values change only the dimensions' values (which a search replaces), not the
# graph. Every other argument counts whole (`pass_key`).
STRUCTURE: dict[Callable, dict[str, Callable]] = {
    shard_pass: {"layout": lambda p: (p.tp > 1, p.cp > 1, p.ep > 1, p.sequence_parallel)},
    # the framework's traits (`opgraph.frameworks`) decide what the layout passes insert
    regather_inputs: {"layout": lambda p: (p.sequence_parallel and traits(p).sp_saves_shard,)},
    decompose: {"layout": lambda p: (traits(p).eager, traits(p).compiles_blocks_only)},
    cache_fp8_weights: {"layout": lambda p: (traits(p).caches_fp8_weights,)},
    replicate: {"layout": lambda p: (sharding(p), p.size("dp") > 1, p.size("edp") > 1,
                                     reduce_dtype(p), traits(p).regather_in_recompute)},
}


def pass_key(run: Callable) -> tuple:
    """What a pass of `step_passes` computes its result from besides its input graph, as a
    hashable key, for caches of pass results (`opgraph.search` shares a prefix of passes
    between structures): its function and its bound arguments, each through `STRUCTURE` where
    declared. A pass added to the list needs no entry anywhere else.

        pass_key(functools.partial(apply_precision, precision="fp8"))
        # (apply_precision, (), (("precision", "fp8"),))
    """
    func = getattr(run, "func", run)
    if run is func:
        return (func, (), ())
    reads = STRUCTURE.get(func, {})
    return (func, tuple(run.args), tuple((k, reads[k](v) if k in reads else v)
                                         for k, v in sorted(run.keywords.items())))


def fusion_passes(policy: str | None) -> list:
    """The extra passes a fusion policy's name asks for (`opgraph.fusion.POLICIES`; None or
    "none": none): `compile_step(g, extra_passes=fusion_passes("elementwise"))`."""
    if policy in (None, "none"):
        return []
    from .fusion import POLICIES
    from .passes.fuse_elementwise import fuse_elementwise

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
        graph = check_dims(run(graph))
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
    (`opgraph.costmodel`)."""
    if check:
        verify(forward)
    return run_passes(forward, step_passes(**options), check=check)
