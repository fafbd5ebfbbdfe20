"""A training job over many GPUs: compile the step one GPU runs, schedule it, report it.

    from opgraph import cluster, hardware
    from opgraph.models import preset
    from opgraph.parallel import Parallel
    from opgraph.distributed import profile_parallel
    p = profile_parallel(preset("llama3-70b"), hardware.get("h100-sxm"),
                         Parallel(tp=8, pp=4, gpus=256, micro_batch=1, global_batch=512))
    p.parallel.step_time_s, p.parallel.mfu, p.parallel.memory.total

The passes: `fuse_attention`, then `shard` (tensor, sequence, context, expert parallel) on the
forward, `derive_backward`, precision and recomputation, `attach_adamw`, `replicate` (data
parallel, ZeRO), then `split_stages` for each pipeline stage. Each stage's step is evaluated
op by op (the roofline, collectives on the cluster's tiers: `CostModel.comm_time`) and
scheduled (`opgraph.schedule`): the micro-batches, the pipeline's span and its bubble, what the
communication hides and exposes. The profile returned is the first stage's (rank 0's), over one
optimizer step; `Profile.parallel` holds the job's figures.

Memory per GPU is the first stage's liveness peak for one micro-batch, with its activations
times the micro-batches it holds at once: 1F1B keeps up to `p` in flight on the first stage, the
interleaved schedule `p (1 + (p - 1) / (p v))` (Korthikanti et al. 2022, section 4.2.3).

MFU follows the plate's convention per GPU: 6 N tokens per step / (step time x peak x GPUs),
N the whole model's (not a shard's) MFU parameters.
"""

from __future__ import annotations

import functools

import attrs
import sympy

from . import cluster as clusters
from .costmodel import DEFAULT, CostModel
from .errors import OpgraphError
from .hardware import Hardware
from .ir import Graph, Phase
from .memory import Memory, figures, peak
from .parallel import Parallel, stage_layers
from .passes.evaluate import category_costs, evaluate, mfu_parameters, resolve
from .passes.replicate import replicate
from .passes.shard import check_divides, shard
from .passes.split_stages import layer_stack, split_stages
from .pipeline import compile_step
from .profile import OpCost, Profile
from .rules import COLLECTIVE_KINDS
from .schedule import Event, once_per_step, pipeline_span, simulate
from .symbols import S


@attrs.frozen
class Transfer:
    """One collective of the first stage, over one optimizer step: its message per GPU per
    instance (`bytes`), the instances the step runs (`count`), their time and the part of it the
    compute stream waited for (`exposed_s`)."""

    name: str
    collective: str
    group: str
    group_size: int
    bytes: float
    count: int
    time_s: float
    exposed_s: float
    tier: str

    def to_json(self) -> dict:
        return {"name": self.name, "collective": self.collective.replace("_", "-"),
                "group": self.group, "group_size": self.group_size, "bytes": self.bytes,
                "count": self.count, "time_s": self.time_s, "exposed_s": self.exposed_s,
                "tier": self.tier}


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
    in_flight: float  # micro-batches of activations the first stage holds at once
    events: tuple[Event, ...] = ()  # rank 0's timeline

    def to_json(self) -> dict:
        return {"gpus": self.layout.world, "cluster": self.cluster.id,
                "parallel": self.layout.to_json(), "step_time_s": self.step_time_s,
                "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "mfu": self.mfu,
                "bubble_s": self.bubble_s,
                "exposed_communication_s": self.exposed_communication_s,
                "stage_times_s": list(self.stage_times_s),
                "activations_in_flight": self.in_flight,
                "communication": [t.to_json() for t in self.communication]}


def check_layout(forward: Graph, layout: Parallel) -> None:
    """One-line errors for a layout the model does not divide (heads, layers, sequence)."""
    check_divides(forward, layout)
    if layout.pp > 1:
        region = layer_stack(forward)
        stage_layers(int(sympy.sympify(region.count).xreplace(forward.dims)), layout)


def compile_parallel(forward: Graph, layout: Parallel, **options) -> Graph:
    """The step one data-parallel rank of `layout` runs, every stage together (`split_stages`
    cuts it per stage); `options` are `compile_step`'s."""
    check_layout(forward, layout)
    extra = list(options.pop("extra_passes", ()))
    return compile_step(forward, shard=functools.partial(shard, layout=layout),
                        extra_passes=[functools.partial(replicate, layout=layout), *extra],
                        **options)


def in_flight(layout: Parallel) -> float:
    """Micro-batches of activations the first stage holds at once (see the module)."""
    p, v, m = layout.pp, layout.virtual_stages, layout.micro_batches
    if p == 1:
        return 1.0
    held = min(p, m)
    return held * (1 + (p - 1) / (p * v)) if v > 1 else float(held)


def profile_parallel(forward: Graph, hardware: Hardware, layout: Parallel, *,
                     cluster: clusters.Cluster | None = None, values: dict | None = None,
                     cost: CostModel = DEFAULT, rank: int | None = None,
                     **options) -> Profile:
    """The first stage's profile over one optimizer step of `layout`, with the job's figures
    in `.parallel` (see the module). `values` may set the sequence length (`S`); the batch is
    the layout's micro-batch. `rank`: also lay out that GPU's timeline (`.parallel.events`)."""
    values = dict(values or {})
    if "tokens" in values or "B" in values:
        raise OpgraphError("give the batch as the layout's micro and global batch, not tokens")
    cluster = cluster or clusters.for_hardware(hardware)
    values["B"] = layout.micro_batch
    step = compile_parallel(forward, layout, **options)
    drawn = None if rank is None else layout.rank_stage(rank)
    # the middle stages hold the same layers and nothing else: one stands for them all
    kinds = {i: min(i, 1) if i < layout.pp - 1 else i for i in range(layout.pp)}
    if drawn is not None:
        kinds[drawn] = drawn
    timed = {i: _stage(split_stages(step, layout, i), hardware, cluster, layout, values, cost,
                       i == drawn) for i in sorted(set(kinds.values()))}
    timings = [timed[kinds[i]] for i in range(layout.pp)]
    m, v = layout.micro_batches, layout.virtual_stages
    per_micro = [t.plain.time_s for t in timings]
    span = pipeline_span(per_micro, m, v)
    tails = [t.last.time_s - t.plain.time_s for t in timings]
    step_time = span + max(tails)
    first = timings[0]
    bubble = max(0.0, span - m * per_micro[0])
    exposed = sum((m - 1) * first.plain.exposed_s.get(n, 0.0) + first.last.exposed_s[n]
                  for n in first.last.exposed_s)
    exposed_total = exposed + max(tails) - tails[0]
    subs = resolve(forward, {k: v for k, v in values.items() if k != "B"})
    seq = int(subs[S])
    tokens = layout.batch * seq
    n_params = int(mfu_parameters(forward).xreplace(subs))
    transfers = tuple(_transfers(first, layout, cluster, m))
    hidden = sum(t.time_s - min(t.exposed_s, t.time_s) for t in transfers)
    step_time += cost.overlap_slowdown * hidden  # compute slowed while they ran beside it
    mfu = cost.mfu(n_params, tokens, step_time, hardware.peak_flops) / layout.world
    memory = _memory(first.graph, first.subs, hardware, layout)
    rows, profile = first.rows(m, layout.zero), first.profile
    total = sum(r.time_s for r in rows)
    result = ParallelResult(
        layout=layout, cluster=cluster, step_time_s=step_time,
        tokens_per_s_per_gpu=tokens / step_time / layout.world, mfu=mfu, bubble_s=bubble,
        exposed_communication_s=exposed_total, communication=transfers, memory=memory,
        stage_times_s=tuple(per_micro), in_flight=in_flight(layout),
        events=() if drawn is None else _timeline(timings[drawn], m,
                                                  max(0.0, span - m * per_micro[drawn])))
    categories = tuple(attrs.evolve(c, bound="network") if c.name == "communication" else c
                       for c in category_costs(rows, total, sum(r.flops for r in rows)))
    return attrs.evolve(
        profile, ops=tuple(rows), categories=categories,
        step_time_s=step_time, flops=sum(r.flops for r in rows),
        bytes=sum(r.bytes for r in rows), tokens=tokens, mfu_parameters=n_params,
        mfu_ceiling=mfu, hfu_ceiling=min(1.0, sum(r.flops for r in rows)
                                         / (step_time * hardware.peak_flops)),
        memory=memory, parallel=result)


@attrs.frozen
class _StageTiming:
    graph: Graph
    subs: dict
    profile: Profile
    times: dict  # op name -> one instance's seconds
    plain: object  # schedule.Run of a micro-batch that is not the last
    last: object  # the last micro-batch and the optimizer

    def rows(self, micro_batches: int, zero: int) -> list[OpCost]:
        """Each op over the step: micro-batch ops x m, the once-per-step ones x 1."""
        out = []
        for r in self.profile.ops:
            op = self.graph.op(r.name)
            once = op.phase is Phase.OPTIMIZER or once_per_step(op, zero)
            k = 1 if once else micro_batches
            time = self.times[r.name] * r.count * k
            bound = "network" if op.kind in COLLECTIVE_KINDS else r.bound
            out.append(attrs.evolve(r, count=r.count * k, flops=r.flops * k,
                                    bytes=r.bytes * k, time_s=time, bound=bound))
        return out


def _stage(graph: Graph, hardware: Hardware, cluster, layout: Parallel, values: dict,
           cost: CostModel, events: bool) -> _StageTiming:
    profile = evaluate(graph, hardware, values, cost=cost)
    subs = resolve(graph, values)
    costs = cost.op_costs(graph)
    times = {}
    for r in profile.ops:
        op = graph.op(r.name)
        if op.kind in COLLECTIVE_KINDS:
            group = op.param("group")
            message = float(costs[op.name].message.xreplace(subs))
            times[op.name] = cost.comm_time(op.kind, message, layout.size(group), cluster,
                                            layout.stride(group))
        else:
            times[op.name] = r.time_s / r.count if r.count else 0.0
    ops = graph.ops()
    per_micro = [op for op in ops if op.phase is not Phase.OPTIMIZER
                 and not once_per_step(op, layout.zero)]
    seconds = times.__getitem__

    def run(chosen, keep):
        return simulate(graph, chosen, lambda op: seconds(op.name), subs,
                        async_tp=layout.async_tp, keep_events=keep)

    plain = run(per_micro, False)
    last = run(ops, events)
    return _StageTiming(graph, subs, profile, times, plain, last)


def _transfers(first: _StageTiming, layout: Parallel, cluster, m: int):
    graph, subs = first.graph, first.subs
    costs = DEFAULT.op_costs(graph)
    for r in first.profile.ops:
        op = graph.op(r.name)
        if op.kind not in COLLECTIVE_KINDS or op.kind == "identity":
            continue
        group = op.param("group")
        once = op.phase is Phase.OPTIMIZER or once_per_step(op, layout.zero)
        k = 1 if once else m
        exposed = first.last.exposed_s.get(op.name, 0.0) + (
            0.0 if once else (m - 1) * first.plain.exposed_s.get(op.name, 0.0))
        tier = cluster.tier_for(layout.size(group), layout.stride(group)).name \
            if layout.size(group) > 1 else "none"
        yield Transfer(op.name, op.kind, group, layout.size(group),
                       float(costs[op.name].message.xreplace(subs)), r.count * k,
                       first.times[op.name] * r.count * k, exposed, tier)


def _memory(graph: Graph, subs: dict, hardware: Hardware, layout: Parallel) -> Memory:
    moment = peak(graph, subs)
    mem = figures(moment, subs, hardware.memory_bytes)
    extra = in_flight(layout) - 1
    return attrs.evolve(mem, activations=int(mem.activations * (1 + extra)))


def _timeline(first: _StageTiming, m: int, bubble: float) -> tuple[Event, ...]:
    """Rank 0's step: the pipeline's fill as one bubble, then its micro-batches (each as the
    simulated one), the last with the optimizer, then the drain."""
    out: list[Event] = []
    t = bubble / 2 if bubble else 0.0
    if bubble:
        out.append(Event("bubble (fill)", "compute", 0.0, t, "bubble", "bubble"))
    plain = first.last  # events were kept for the last run only; earlier ones drop its tail
    for i in range(m):
        last = i == m - 1
        for e in plain.events:
            if not last and (e.phase == "optimizer" or (e.track in ("dp", "edp")
                                                         and e.end_s > first.plain.time_s)):
                continue
            out.append(attrs.evolve(e, name=f"{e.name} [mb {i}]", start_s=e.start_s + t,
                                    end_s=e.end_s + t))
        t += first.plain.time_s if not last else first.last.time_s
        if bubble and i == m - 1:
            out.append(Event("bubble (drain)", "compute", t, t + bubble / 2, "bubble", "bubble"))
    return tuple(out)
