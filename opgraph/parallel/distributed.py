"""A training job over many GPUs: compile the step one GPU runs, schedule it, report it.

    from opgraph import hardware
    from opgraph.parallel import cluster
    from opgraph.models import preset
    from opgraph.parallel.parallel import Parallel
    from opgraph.parallel.distributed import profile_parallel
    p = profile_parallel(preset("llama3-70b"), hardware.get("h100-sxm"),
                         Parallel(tp=8, pp=4, gpus=256, micro_batch=1, global_batch=512))
    p.parallel.step_time_s, p.parallel.mfu, p.parallel.memory.total

The passes: `fuse_attention`, then `shard` (tensor, sequence, context, expert parallel) on the
forward, `derive_backward`, precision and recomputation, `attach_adamw`, `regather_inputs` (a
framework's sequence-parallel re-gathers), `replicate` (data parallel, ZeRO), then
`split_stages` for each pipeline stage. Each stage's step is evaluated op by op (the roofline,
collectives on the cluster's tiers: `CostModel.comm_time`) and scheduled
(`opgraph.parallel.schedule`): the micro-batches, the pipeline's span and its bubble, what the
communication hides and exposes. The profile returned is the first stage's (rank 0's), over one
optimizer step; `Profile.parallel` holds the job's figures. `profile_parallel` is `prepare`
(compile once: a `Job`) then `schedule` (cost and schedule it under a cost model), which a fit
(`opgraph.analysis.fit`) calls many times without compiling again.

Memory per GPU is the largest over the stages (`memory_stage` says which) of each stage's
liveness peak for one micro-batch, plus, for each further micro-batch it holds at once, the
activations a micro-batch saves for its backward (all of them, live from its forward's end to
its backward's start): 1F1B's stage i keeps up to `p - i` in flight; the interleaved schedule
keeps each model chunk's own count (`chunk_in_flight`: Megatron-LM's warm-up), `(2 (p - i - 1)
+ (v - 1) p + 1) / v` on average over equal chunks (for the first stage Korthikanti et al.
2022, section 4.2.3, `p (1 + (p - 1) / (p v))`), and what runs before the layers (the
embedding) and after them (the head) as many as the stage's first and last chunk.

MFU follows the plate's convention per GPU: 6 N tokens per step / (step time x peak x GPUs),
N the whole model's (not a shard's) MFU parameters. HFU is the first stage's FLOPs over one
step, each weighted as `evaluate` weighs it (`CostModel.busy_flops`: an FP8 FLOP as BF16 peak /
FP8 peak of one), / (step time x peak), by the cost model's one definition (`CostModel.hfu`).
"""

from __future__ import annotations

import attrs
import sympy

from ..core.errors import OpgraphError
from ..core.ir import Graph, Phase
from ..core.limits import MAX_LAYERS
from ..core.parameters import mfu_parameters
from ..core.pipeline import compile_step
from ..core.symbols import S
from ..core.verify import check_dims
from ..cost.costmodel import DEFAULT, CostModel
from ..cost.hardware import Hardware
from ..cost.lowered import OpValues, lower
from ..cost.memory import Memory
from ..cost.profile import OpCost, Profile
from ..passes.evaluate import category_costs, interpret, resolve
from ..passes.shard import check_divides
from ..passes.split_stages import layer_stack, layers_before, other_stacks, split_stages
from . import cluster as clusters
from .frameworks import (attention_library, check_precision, deferred_groups, end_split,
                         own_split, sharding, traits)
from .parallel import Parallel, chunk_layers, stage_layers
from .schedule import (
    GROUPS,
    Event,
    Plan,
    Run,
    interleaved_span,
    once_per_step,
    pipeline_span,
    plan,
    prefetched_gathers,
    simulate,
)


@attrs.frozen
class Transfer:
    """One collective of the first stage, over one optimizer step: its message per GPU per
    instance (`bytes`), the instances the step runs (`count`), their time, the part of it the
    compute stream waited for (`exposed_s`, at most `time_s`) and how long the compute stream
    waited for it before it began (`queued_s`: behind other collectives on its stream, or the
    one its input comes from; `opgraph.parallel.schedule`)."""

    name: str
    collective: str
    group: str
    group_size: int
    bytes: float
    count: int
    time_s: float
    exposed_s: float
    tier: str
    queued_s: float = 0.0

    def to_json(self) -> dict:
        return {"name": self.name, "collective": self.collective.replace("_", "-"),
                "group": self.group, "group_size": self.group_size, "bytes": self.bytes,
                "count": self.count, "time_s": self.time_s, "exposed_s": self.exposed_s,
                "queued_s": self.queued_s, "tier": self.tier}


@attrs.frozen
class ParallelResult:
    """The job's figures (see the module)."""

    layout: Parallel
    cluster: clusters.Cluster
    step_time_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    bubble_s: float
    exposed_communication_s: float
    communication: tuple[Transfer, ...]
    memory: Memory
    stage_times_s: tuple[float, ...]  # each stage's time per micro-batch
    in_flight: float  # micro-batches of activations `memory_stage` holds at once
    memory_stage: int = 0  # the pipeline stage whose GPUs need the most memory (`memory`)
    events: tuple[Event, ...] = ()  # the timeline of the rank asked for
    cost: str = "roofline"  # the cost model's name
    hfu: float = 0.0  # the first stage's, `CostModel.hfu` (FP8 FLOPs weighted as `evaluate`)
    # of the exposed communication, the part waited before the awaited collective began
    queued_communication_s: float = 0.0
    # and the part a later pipeline stage's last micro-batch runs on after rank 0's (its
    # gradient reductions, its optimizer), which the step waits for
    later_stage_tail_s: float = 0.0
    # rank 0's compute stream over the step: its ops' time, every micro-batch
    compute_s: float = 0.0
    # what the compute stream waited for, per group (exposed and queued), GROUPS' order
    waited_by_group: tuple[tuple[str, float], ...] = ()
    # the cost model's slowdown of compute beside the communication it hid
    overlap_slowdown_s: float = 0.0

    def parts(self) -> dict[str, float]:
        """The step split as the schedule runs rank 0: its compute, the pipeline bubble, the
        wait for each group's collectives, a later stage's longer tail and the overlap
        slowdown, in seconds. They add up to the step: a micro-batch's span on a stage is its
        compute plus its waits (`schedule.simulate`: the stream only runs or waits), the
        pipeline's span is m of rank 0's micro-batches plus the bubble, and the step adds the
        longest tail (rank 0's last micro-batch's, and the later stage's excess) and the
        slowdown.

            r.step_time_s == sum(r.parts().values())   # to rounding
        """
        return {"compute": self.compute_s, "bubble": self.bubble_s,
                **{f"{group}_exposed": s for group, s in self.waited_by_group},
                "later_stage_tail": self.later_stage_tail_s,
                "overlap_slowdown": self.overlap_slowdown_s}

    @property
    def attention_library(self) -> str:
        """The attention kernels the job runs (`frameworks.attention_library`)."""
        return attention_library(self.layout)

    def to_json(self) -> dict:
        return {"cost": self.cost, "gpus": self.layout.world, "cluster": self.cluster.id,
                "parallel": self.layout.to_json(), "step_time_s": self.step_time_s,
                "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "mfu": self.mfu,
                "bubble_s": self.bubble_s,
                "exposed_communication_s": self.exposed_communication_s,
                "queued_communication_s": self.queued_communication_s,
                "later_stage_tail_s": self.later_stage_tail_s,
                "stage_times_s": list(self.stage_times_s),
                "activations_in_flight": self.in_flight, "memory_stage": self.memory_stage,
                "communication": [t.to_json() for t in self.communication]}


def check_layout(forward: Graph, layout: Parallel, seq: int | None = None) -> None:
    """One-line errors for a layout the model does not divide (heads, layers, sequence): at
    the model's own sequence length, as `shard` checks it, and at `seq` where one is given."""
    check_layers(forward)
    check_divides(forward, layout)
    if seq is not None and seq != forward.dims.get(S):
        check_divides(forward, layout, seq)
    check_pipeline(forward, layout)


def check_layers(forward: Graph) -> None:
    """A one-line error where the model's layer stacks hold more than `MAX_LAYERS` layers, which
    the many-GPU schedule may run one by one (`opgraph.core.limits`)."""
    counts = [sympy.sympify(sympy.sympify(r.count).xreplace(forward.dims))
              for r in forward.regions() if r.parent is None]
    layers = sum(int(c) for c in counts if c.is_Integer)
    if layers > MAX_LAYERS:
        raise OpgraphError(f"{forward.name} has {layers:,} layers, more than opgraph's many-GPU "
                           f"schedule takes ({MAX_LAYERS:,}; the deepest model trained has "
                           "1,000); give fewer, or profile it on one GPU")


def check_pipeline(forward: Graph, layout: Parallel) -> None:
    """A one-line error where the layout's pipeline does not split the layer stack it splits
    (`layer_stack`: the one a dimension counts, where the model has several): uneven stages
    that do not add up to it, an even split it does not divide."""
    if layout.pp == 1:
        return
    region = layer_stack(forward)
    layers = int(sympy.sympify(region.count).xreplace(forward.dims))
    layout = framework_split(forward, layout)  # nanotron's own split where none is named
    try:
        stage_layers(layers, layout)
    except OpgraphError as err:
        hint = ""
        said = (layout.first_stage_layers, layout.last_stage_layers, layout.stage_layers)
        ends = uneven_ends(layers, layout.pp, layers_before(forward))
        if said == (None, None, None) and layout.virtual_stages == 1 and ends is not None:
            hint = (f"; --first-stage-layers {ends[0]} --last-stage-layers {ends[1]} splits it "
                    "as plan would")
        raise OpgraphError(f"{err}{_outside_stack(forward, region)}{hint}") from None


def uneven_ends(layers: int, stages: int, before: int = 0) -> tuple[int, int] | None:
    """(first, last) stage layers of a stack of `layers` over `stages` stages that an even
    split does not divide, or None. Two stages: the last, which holds the head, one layer
    fewer (Gemma 2's 13 pairs of layers: 7 and 6). Three or more: for a model with `before`
    layers ahead of the stack on the first stage (`split_stages.layers_before`: DeepSeek's
    dense ones), the decoder layers balanced, c = ceil((layers + before) / stages) on each
    middle stage, c less `before` on the first, the rest on the last (Megatron-Bridge's
    DeepSeek-V3 layouts, `recipes/deepseek/deepseek_v3.py` layout_map: 61 layers on 16 stages
    as 4 with the 3 dense, 4 x 14, 1); else one layer fewer on each end stage (Llama 3 405B's
    126 on 16: 7, 8 x 14, 7).

        >>> uneven_ends(58, 16, before=3), uneven_ends(126, 16), uneven_ends(13, 2)
        ((1, 1), (7, 7), (7, 6))
    """
    if stages == 2:
        first = -(-(layers + before) // 2) - before  # the stack's share beside `before`
        return (first, layers - first) if 1 <= layers - first <= first else None
    if stages < 3:
        return None
    if before:
        each = -(-(layers + before) // stages)
        first, last = each - before, layers - (each - before) - (stages - 2) * each
        if 1 <= first and 1 <= last <= each:
            return first, last
    if (layers + 2) % stages == 0 and (layers + 2) // stages > 1:
        end = (layers + 2) // stages - 1
        return end, end
    return None


def _outside_stack(forward: Graph, region) -> str:
    """What a pipeline error adds where the model has layers outside the stack it splits
    (DeepSeek's dense-first layers): that the counts are the stack's, and where the rest run."""
    others = other_stacks(forward)
    if not others:
        return ""
    fixed = sum(int(sympy.sympify(r.count).xreplace(forward.dims)) for r in others)
    layers = "1 other layer" if fixed == 1 else f"{fixed} other layers"
    verb = "runs" if fixed == 1 else "run"
    return (f" (the pipeline splits {forward.name}'s stack {region.name!r}; its {layers} "
            f"({', '.join(r.name for r in others)}) {verb} on the end stages beside it, "
            "and the layer counts of --stage-layers, --first-stage-layers and "
            "--last-stage-layers are the stack's)")


def compile_parallel(forward: Graph, layout: Parallel, *, seq: int | None = None,
                     **options) -> Graph:
    """The step one data-parallel rank of `layout` runs, every stage together (`split_stages`
    cuts it per stage), checked at sequence length `seq` too (`check_layout`); `options`
    are `compile_step`'s. The layout binds the passes that declare it (`pipeline.step_passes`):
    `shard` before the backward; after the optimizer, its framework's (those placed at
    `contracts.LAYOUT`) and the data-parallel replicas (`replicate`)."""
    check_layout(forward, layout, seq)
    check_precision(layout.framework, options.get("precision", "bf16"))
    return compile_step(forward, layout=layout, **options)


def in_flight(layout: Parallel, stage: int = 0, chunks=None) -> float:
    """Micro-batches of the layer stack's activations pipeline stage `stage` holds at once
    (see the module): `stage_in_flight`'s first figure."""
    return stage_in_flight(layout.pp, layout.virtual_stages, layout.micro_batches, stage,
                           chunks)[0]


def stage_in_flight(p: int, v: int, m: int, stage: int, chunks=None
                    ) -> tuple[float, float, float]:
    """Micro-batches in flight on stage `stage` of `p` in `v` model chunks running `m`: the
    layer stack's (each chunk's, `chunk_in_flight`, weighted by its layers, `chunks`, the
    stage's `parallel.chunk_layers`; None: equal chunks), then the first chunk's and the last
    chunk's, which hold what a stage runs before the stack (the embedding, its input) and
    after it (the head, the loss)."""
    counts = chunk_in_flight(p, v, m, stage)
    sizes = chunks if chunks and sum(chunks) else [1] * len(counts)
    stack = sum(n * c for n, c in zip(sizes, counts)) / sum(sizes)
    return stack, float(counts[0]), float(counts[-1])


def chunk_in_flight(p: int, v: int, m: int, stage: int) -> list[int]:
    """The micro-batches each model chunk of stage `stage` holds at its fullest, when its
    warm-up's forwards are done and one more has run, no backward yet (Megatron-LM's
    `max_outstanding_backprops`, `megatron/core/pipeline_parallel/schedules.py`).

    1F1B's stage i warms up with p - i - 1. The interleaved schedule's with
    2 (p - i - 1) + (v - 1) p (`get_pp_rank_microbatches`), at most all m v, in the order of
    `get_schedule_table`: p micro-batches (or what is left) through chunk 0, the same through
    chunk 1, ..., then the next p. So stage 0's first chunk holds 2p - 1 and the others p
    (Korthikanti et al. 2022, section 4.2.3: p (1 + (p - 1) / (p v)) on average), and the last
    stage's last chunk, which runs the head, holds one."""
    if p == 1:
        return [1] * v
    if v == 1:
        return [min(p - stage, m)]
    forwards = min(2 * (p - stage - 1) + (v - 1) * p + 1, m * v)
    group = min(p, m)
    if forwards <= v * group:
        return [min(group, max(0, forwards - c * group)) for c in range(v)]
    rest, second = forwards - v * group, min(p, m - group)
    return [group + min(second, max(0, rest - c * second)) for c in range(v)]


@attrs.frozen
class StageOp(OpValues):
    """One op of a stage at the job's point (`lowered.OpValues`: its count, FLOPs and bytes
    over the count, a collective's message and share of a call, a matrix multiply's grid and
    the kernels it launches) and what the schedule reads beside: the peak its arithmetic runs
    at, and whether it runs once a step (the optimizer, ZeRO-0/1's reductions) rather than
    every micro-batch."""

    peak: float
    once: bool


@attrs.frozen
class Stage:
    """A pipeline stage's step, compiled and lowered once: its graph, its ops as numbers (the
    lowered step at the job's point, `Lowered.at`), the schedule's plans of a micro-batch
    (`plain`) and of the last one with the optimizer (`last`), its profile (the rows a report
    prints, which `schedule` re-times over the step) and its memory. With
    `overlap_param_gather`, `first` plans the step's first micro-batch (the last, where it is
    the only one) with the updated weights' gathers in front of it, each feeding its layer's
    forward; `last` then leaves them out."""

    graph: Graph | None  # None where built from compiled formulas (`opgraph.parallel.search`)
    ops: tuple[StageOp, ...]
    plain: Plan
    last: Plan
    profile: Profile | None  # the rows a report prints; None as `graph`
    memory: Memory  # its peak per GPU, its in-flight micro-batches' activations included
    index: int  # which stage (a middle one stands for all the middle ones)
    first: Plan | None = None


@attrs.frozen
class Job:
    """A layout compiled for a part and a cluster (`prepare`); `schedule` costs it under any
    cost model of the same backward convention without compiling again (a fit's loop)."""

    forward: Graph
    hardware: Hardware
    cluster: clusters.Cluster
    layout: Parallel
    stages: tuple[Stage, ...]  # the distinct ones: first, a middle one, last
    kinds: tuple[int, ...]  # stage index -> index into `stages`
    tokens: int
    mfu_parameters: int
    # layers in each stage's model chunks where interleaved chunks differ in size (uneven end
    # stages, `parallel.chunk_layers`); None: the span's formula holds
    chunks: tuple[tuple[int, ...], ...] | None = None


def prepare(forward: Graph, hardware: Hardware, layout: Parallel, *,
            cluster: clusters.Cluster | None = None, values: dict | None = None,
            cost: CostModel = DEFAULT, rank: int | None = None, **options) -> Job:
    """Compile `layout`'s step and each distinct pipeline stage (see the module); `rank`'s
    stage is kept apart so that its timeline can be drawn."""
    values = dict(values or {})
    if "tokens" in values or "B" in values:
        raise OpgraphError("give the batch as the layout's micro and global batch, not tokens")
    cluster = (cluster or clusters.for_hardware(hardware)).for_job(layout.world)
    values["B"] = layout.micro_batch
    layout = framework_split(forward, layout)
    step = compile_parallel(forward, layout, seq=values.get("S"), **options)
    kinds = stage_kinds(forward, layout)
    drawn = None if rank is None else layout.rank_stage(rank)
    if drawn is not None:
        kinds[drawn] = drawn
    distinct = sorted(set(kinds))
    # split_stages binds pp among the dimensions: checked as every pipeline pass is
    chunks = unequal_chunks(forward, layout)
    stages = tuple(_prepare_stage(check_dims(split_stages(step, layout, i)), hardware, layout,
                                  values, cost, i, chunks and chunks[i]) for i in distinct)
    subs = resolve(forward, {k: v for k, v in values.items() if k != "B"})
    return Job(forward, hardware, cluster, layout, stages,
               tuple(distinct.index(k) for k in kinds), layout.batch * int(subs[S]),
               int(mfu_parameters(forward).xreplace(subs)), chunks)


def stage_kinds(forward: Graph, layout: Parallel) -> list[int]:
    """For each pipeline stage, the stage that stands for it: the first that holds as many
    layers and the same ends (the embedding, the head), so the middle stages of an even split
    are one; it holds the most micro-batches in flight of them (`in_flight`)."""
    if layout.pp == 1:
        return [0]
    counts = stage_layers(int(sympy.sympify(layer_stack(forward).count).xreplace(forward.dims)),
                          layout)
    first: dict = {}
    return [first.setdefault((n, i == 0, i == layout.pp - 1), i) for i, n in enumerate(counts)]


def framework_split(forward: Graph, layout: Parallel) -> Parallel:
    """`layout` with its pipeline split as its framework makes it where the layout names none
    (`frameworks.own_split`: nanotron balances its blocks' costs): its end stages where a
    layout's first and last stages can say it, else every stage's layers (`stage_layers`); an
    even split interleaved."""
    if (layout.pp == 1 or layout.virtual_stages > 1 or layout.first_stage_layers is not None
            or layout.last_stage_layers is not None or layout.stage_layers is not None):
        return layout
    own = own_split(forward, layout.pp, layout.framework)
    if own is None:
        return layout
    ends = end_split(own)
    if ends is None:
        return attrs.evolve(layout, stage_layers=own)
    return attrs.evolve(layout, first_stage_layers=ends[0], last_stage_layers=ends[1])


def unequal_chunks(forward: Graph, layout: Parallel):
    """`chunk_layers` where interleaving cuts stages into chunks of unequal size, else None."""
    if layout.virtual_stages == 1 or layout.pp < 3:  # before `layer_stack`: one stack or more
        return None
    return chunks_of(int(sympy.sympify(layer_stack(forward).count).xreplace(forward.dims)),
                     layout)


def chunks_of(layers: int, layout: Parallel):
    """`unequal_chunks` of a stack of `layers` layers."""
    if layout.virtual_stages == 1 or layout.pp < 3:  # two stages: no middle one to time a layer
        return None
    chunks = chunk_layers(layers, layout)
    if len({n for stage in chunks for n in stage}) == 1:
        return None
    return tuple(map(tuple, chunks))


def chunk_times(stage_times: list[float], chunks) -> list[list[float]]:
    """Each chunk's time per micro-batch from its stage's (`stage_times`) and its layers: a
    layer takes what a middle stage's layer takes (a middle stage runs layers alone), and what
    an end stage takes beyond its layers (the embedding; the head and the loss) runs in its
    outer chunk, where `chunk_layers` puts it."""
    p = len(chunks)
    middle = p // 2  # `chunk_layers` gives uneven interleaving a middle stage
    per_layer = stage_times[middle] / sum(chunks[middle])
    out = [[per_layer * n for n in stage] for stage in chunks]
    out[0][0] += stage_times[0] - per_layer * sum(chunks[0])
    out[-1][-1] += stage_times[-1] - per_layer * sum(chunks[-1])
    return out


def _prepare_stage(graph: Graph, hardware: Hardware, layout: Parallel, values: dict,
                   cost: CostModel, index: int, chunks=None) -> Stage:
    low = lower(graph, cost)
    subs = resolve(graph, values)
    at = low.at(subs)
    profile = interpret(low, hardware, subs, at)
    ops = tuple(StageOp(*attrs.astuple(o, recurse=False), cost.peak(hardware, o.compute),
                        o.phase is Phase.OPTIMIZER or once_per_step(graph.op(o.name),
                                                                    sharding(layout)))
                for o in at)
    ordered = graph.ops()
    per_micro = [op for op in ordered if op.phase is not Phase.OPTIMIZER
                 and not once_per_step(op, sharding(layout))]
    gathers = prefetched_gathers(graph) if layout.overlap_param_gather else {}
    last = [op for op in ordered if op.name not in gathers]
    first = None
    if gathers:
        ahead = [op for op in ordered if op.name in gathers]
        first = plan(graph, ahead + (per_micro if layout.micro_batches > 1 else last), subs,
                     writes=gathers)
    return Stage(graph, ops, plan(graph, per_micro, subs), plan(graph, last, subs),
                 profile, _memory(profile.memory, layout, index, chunks), index, first)


def _times(stage: Stage, job: Job, cost: CostModel) -> dict[str, float]:
    """One instance's seconds of each op of `stage` under `cost`."""
    layout, out = job.layout, {}
    compute = [o for o in stage.ops if o.group is None]
    times = cost.op_time_list(job.hardware, [o.kind for o in compute],
                              [o.flops for o in compute], [o.bytes for o in compute],
                              [o.count for o in compute], [o.peak for o in compute],
                              [o.grid for o in compute], [o.launches for o in compute],
                              [o.efficiency for o in compute])
    for o, time in zip(compute, times, strict=True):
        out[o.name] = time / o.count if o.count else 0.0
    for o in stage.ops:
        if o.group is not None:
            out[o.name] = cost.comm_time(o.kind, o.message, layout.size(o.group), job.cluster,
                                         layout.stride(o.group), job.hardware, o.calls,
                                         o.launches)
    return out


@attrs.frozen
class _Timed:
    stage: Stage
    times: dict
    plain: Run
    last: Run
    drawn: Run | None = None  # a plain micro-batch again with its events, for a timeline
    # the first micro-batch where it differs (`Stage.first`), and the run it stands in for:
    # a plain one, or the last where it is the only one
    first: Run | None = None
    replaced: Run | None = None

    @property
    def delay_s(self) -> float:
        """What the first micro-batch takes beyond the run it stands in for: its waits for the
        weights gathered under its forward (`Stage.first`); 0 without."""
        return 0.0 if self.first is None else self.first.time_s - self.replaced.time_s


def schedule(job: Job, cost: CostModel = DEFAULT, *, rank: int | None = None
             ) -> tuple[ParallelResult, list[OpCost]]:
    """The job's figures under `cost`, and the first stage's ops over one step (see the
    module); `rank` draws that GPU's timeline."""
    result, first = _schedule(job, cost, rank)
    return result, _rows(first, job.layout.micro_batches)


def step_figures(job: Job, cost: CostModel = DEFAULT, runs: dict | None = None
                 ) -> ParallelResult:
    """The job's figures under `cost` alone: `schedule` without the rows of a report, for a
    job whose stages carry no profile (`opgraph.parallel.search` builds them from compiled
    formulas). `runs`, a dict the caller keeps, holds each micro-batch simulated, for the
    next job that runs the same plan with the same op times and options (a search's layouts
    that differ only in their micro-batch or virtual-stage counts)."""
    return _schedule(job, cost, None, runs)[0]


def _schedule(job: Job, cost: CostModel, rank: int | None, runs: dict | None = None
              ) -> tuple[ParallelResult, _Timed]:
    layout = job.layout
    options = dict(async_tp=layout.async_tp, deferred=deferred_groups(layout),
                   prefetch=not traits(layout).syncs_before_gather,
                   chunks=(("tp", layout.tp), ("cp", layout.cp)))

    def run(plan, times, keep_events=True):
        if runs is None:
            return simulate(plan, times, keep_events=keep_events, **options)
        # `simulate` is a function of the plan, the times and the options alone; the entry
        # holds the plan, so its id is not reused while the entry lives
        key = (id(plan), keep_events, *options.values(), *times.items())
        found = runs.get(key)
        if found is None or found[0] is not plan:
            found = runs[key] = (plan, simulate(plan, times, keep_events=keep_events,
                                                **options))
        return found[1]
    drawn = None if rank is None else layout.rank_stage(rank)
    timed = []
    for i, stage in enumerate(job.stages):
        times = _times(stage, job, cost)
        keep = drawn is not None and job.kinds[drawn] == i
        # the figures from runs that add a layer stack's steady layers at once; a drawn stage's
        # plain micro-batch is run once more, every op on its own, for its events
        plain = run(stage.plain, times, keep_events=False)
        last = run(stage.last, times, keep_events=keep)
        first = None if stage.first is None else run(stage.first, times, keep_events=keep)
        timed.append(_Timed(stage, times, plain, last,
                            run(stage.plain, times) if keep else None,
                            first, None if first is None
                            else plain if layout.micro_batches > 1 else last))
    per_stage = [timed[k] for k in job.kinds]
    m, v = layout.micro_batches, layout.virtual_stages
    per_micro = [t.plain.time_s for t in per_stage]
    span = pipeline_span(per_micro, m, v)
    if job.chunks is not None:  # interleaved chunks of unequal size: the schedule simulated
        span = interleaved_span(chunk_times(per_micro, job.chunks), m) or span
    tails = [t.last.time_s - t.plain.time_s for t in per_stage]
    first = per_stage[0]
    # the first stage's wait for weights gathered under its first forward holds back the whole
    # pipeline; a later stage's first micro-batch arrives after the fill, its gathers done
    step_time = span + max(tails) + first.delay_s
    bubble = max(0.0, span - m * per_micro[0])
    waited = _waited(first, m)
    transfers = tuple(_transfers(first, job, m, waited))
    # what the compute stream waited for, while a collective ran or before it began (a
    # zero-time one too: Megatron's f waits its turn on the tensor-parallel stream)
    exposed = sum(e + q for e, q in waited.values())
    by_group: dict[str, float] = {}
    for o in first.stage.ops:
        if o.name in waited:
            by_group[o.group] = by_group.get(o.group, 0.0) + sum(waited[o.name])
    by_group = {group: by_group[group] for group in GROUPS if group in by_group}
    # the slowdown's share is the time the compute stream did not wait through (as it was
    # before exposed and queued time were told apart: calibrated steps and fits unchanged)
    hidden = sum(t.time_s - min(t.exposed_s + t.queued_s, t.time_s) for t in transfers)
    slowdown = cost.slowdown(job.hardware) * hidden  # compute slowed beside communication
    step_time += slowdown
    fullest = max(job.stages, key=lambda st: st.memory.total)  # the GPU closest to its limit
    peak = job.hardware.peak_flops
    mfu = cost.mfu(job.mfu_parameters, job.tokens, step_time, peak) / layout.world
    busy = sum(cost.busy_flops(o.flops * (1 if o.once else m), o.peak, peak)
               for o in first.stage.ops if o.flops)
    events = ()
    if drawn is not None:
        events = _timeline(per_stage[drawn], m, max(0.0, span - m * per_micro[drawn]))
    result = ParallelResult(
        layout=layout, cluster=job.cluster, step_time_s=step_time,
        tokens_per_s_per_gpu=job.tokens / step_time / layout.world, mfu=mfu, bubble_s=bubble,
        exposed_communication_s=exposed + max(tails) - tails[0], communication=transfers,
        queued_communication_s=sum(q for _, q in waited.values()),
        later_stage_tail_s=max(tails) - tails[0],
        compute_s=(m - 1) * first.plain.compute_s + first.last.compute_s,
        waited_by_group=tuple(by_group.items()), overlap_slowdown_s=slowdown,
        memory=fullest.memory, memory_stage=fullest.index, stage_times_s=tuple(per_micro),
        in_flight=in_flight(layout, fullest.index, job.chunks and job.chunks[fullest.index]),
        events=events, cost=cost.name, hfu=cost.hfu(busy, step_time, peak))
    return result, first


def _rows(first: _Timed, m: int) -> list[OpCost]:
    """Each op of the first stage over the step: micro-batch ops x m, once-per-step ones x 1."""
    out = []
    for r, o in zip(first.stage.profile.ops, first.stage.ops, strict=True):
        k = 1 if o.once else m
        bound = "network" if o.group is not None else r.bound
        out.append(attrs.evolve(r, count=r.count * k, flops=r.flops * k, bytes=r.bytes * k,
                                time_s=first.times[o.name] * r.count * k, bound=bound))
    return out


def profile_parallel(forward: Graph, hardware: Hardware, layout: Parallel, *,
                     cluster: clusters.Cluster | None = None, values: dict | None = None,
                     cost: CostModel = DEFAULT, rank: int | None = None,
                     **options) -> Profile:
    """The first stage's profile over one optimizer step of `layout`, with the job's figures
    in `.parallel` (see the module). `values` may set the sequence length (`S`); the batch is
    the layout's micro-batch. `rank`: also lay out that GPU's timeline (`.parallel.events`)."""
    job = prepare(forward, hardware, layout, cluster=cluster, values=values, cost=cost,
                  rank=rank, **options)
    result, rows = schedule(job, cost, rank=rank)
    total = sum(r.time_s for r in rows)
    flops = sum(r.flops for r in rows)
    categories = tuple(attrs.evolve(c, bound="network") if c.name == "communication" else c
                       for c in category_costs(rows, total, flops))
    return attrs.evolve(
        job.stages[0].profile, ops=tuple(rows), categories=categories,
        step_time_s=result.step_time_s, flops=flops, bytes=sum(r.bytes for r in rows),
        tokens=job.tokens, mfu_parameters=job.mfu_parameters, mfu_ceiling=result.mfu,
        hfu_ceiling=result.hfu,
        memory=result.memory, parallel=result, cost=cost.name)


def _waited(first: _Timed, m: int) -> dict[str, tuple[float, float]]:
    """Each collective's exposed and queued seconds over the step (`opgraph.parallel.schedule`): the
    last micro-batch's, and m - 1 plain ones' unless it runs once per step; where the first
    micro-batch differs (`Stage.first`), its own in place of the run it stands in for."""
    out = {}
    for o in first.stage.ops:
        if o.group is None:
            continue
        plain = 0 if o.once else m - 1
        out[o.name] = tuple(getattr(first.last, f).get(o.name, 0.0)
                            + plain * getattr(first.plain, f).get(o.name, 0.0)
                            + (0.0 if first.first is None
                               else getattr(first.first, f).get(o.name, 0.0)
                               - getattr(first.replaced, f).get(o.name, 0.0))
                            for f in ("exposed_s", "queued_s"))
    return out


def _transfers(first: _Timed, job: Job, m: int, waited: dict):
    layout, cluster = job.layout, job.cluster
    for o in first.stage.ops:
        if o.group is None or o.kind == "identity":
            continue
        k = 1 if o.once else m
        size = layout.size(o.group)
        tier = cluster.tier_for(size, layout.stride(o.group)).name if size > 1 else "none"
        exposed, queued = waited[o.name]
        yield Transfer(o.name, o.kind, o.group, size, o.message, o.count * k,
                       first.times[o.name] * o.count * k, exposed, tier, queued)


def _memory(one: Memory, layout: Parallel, stage: int, chunks=None) -> Memory:
    """A stage's peak: one micro-batch's (`one`, the liveness's) and, for each further
    micro-batch it holds at once, what a micro-batch holds between its forward and its
    backward (`Memory.resting`: in the layer stack, before it and after it), each part by
    its own count (`stage_in_flight`): the others wait whole while the peak's runs."""
    held = stage_in_flight(layout.pp, layout.virtual_stages, layout.micro_batches, stage,
                           chunks)
    resting = (one.resting, one.resting_before, one.resting_after)
    return attrs.evolve(one, activations=int(held_activations(one.activations, resting, held)))


def held_activations(running, resting, held):
    """The saved activations of a stage's peak (`_memory`), before they are made whole: the
    running micro-batch's, and for each part of what a waiting one keeps (`resting`: in the
    layer stack, before it, after it) its count in flight (`held`) less one (numbers, or numpy
    arrays over a search's layouts)."""
    total = running
    for part, count in zip(resting, held, strict=True):
        total = total + (count - 1) * part
    return total


def _timeline(first: _Timed, m: int, bubble: float) -> tuple[Event, ...]:
    """The drawn rank's step: the pipeline's fill as one bubble, then its micro-batches, each
    as the schedule ran it (the plain one's events, without what runs once per step: ZeRO-0/1's
    gradient reductions, the optimizer), the last with the optimizer, then the drain; the first
    as its own run where it differs (`Stage.first`: the gathers under its forward). So each
    track's events add up to the step's figures: the compute stream to the ops' time and the
    bubble, each group's stream to its collectives' time."""
    out: list[Event] = []
    t = bubble / 2 if bubble else 0.0
    if bubble:
        out.append(Event("bubble (fill)", "compute", 0.0, t, "bubble", "bubble"))
    for i in range(m):
        last = i == m - 1
        run, took = (first.last, first.last) if last else (first.drawn, first.plain)
        if i == 0 and first.first is not None:
            run = took = first.first
        # each event made anew rather than by attrs.evolve, which inspects the class on every
        # call: a timeline is events x micro-batches, over a million for a 405B job
        out.extend(Event(f"{e.name} [mb {i}]", e.track, e.start_s + t, e.end_s + t, e.phase,
                         e.kind) for e in run.events)
        t += took.time_s
        if bubble and i == m - 1:
            out.append(Event("bubble (drain)", "compute", t, t + bubble / 2, "bubble", "bubble"))
    return tuple(out)
