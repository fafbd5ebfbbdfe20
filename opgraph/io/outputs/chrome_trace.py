"""A Profile as a predicted timeline: the Chrome trace JSON that Perfetto and chrome://tracing open.

    trace = chrome_trace(evaluate(step, hardware.get("h100-sxm")), step)
    write_chrome_trace(profile, step, "step.json")   # then ui.perfetto.dev, "Open trace file"

Invariants: one complete event (`ph: "X"`) per kernel instance on the GPU-stream track, back to
back in execution order, so the kernel events number the sum of the ops' counts and their
durations sum to the step time (ops do not overlap in the roofline). Forward, backward and
optimizer ranges enclose them on a track of their own.

The graph holds a repeated block once, as a region (`opgraph.core.ir.Region`); the timeline runs it
its trip count times, reading each op's region from the compiled graph. A block is a run of
consecutive ops (in the profile's order, the graph's topological order) of one phase in one
region; it is expanded iteration by iteration, every op of iteration i before any of iteration
i+1: forward and optimizer from iteration 0 up, backward from the last down. Inside an
iteration, ops of a nested region form blocks of their own, expanded the same way. Two stacks of
the same depth are two regions, so one runs entirely before the other. Instances are named as
PyTorch names modules, each region's index after its name: `layers.3.q_proj`,
`layers.3.q_proj.dA`, `adamw.layers.3.q_proj.weight`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import attrs
import sympy

from ...core.ir import Graph, Region
from ...cost.profile import OpCost, Profile
from .atomic import write_atomic

PID = 1  # the one "GPU" process
STREAM_TID = 7  # the kernels' track (CUDA's default stream is 7 in PyTorch's traces)
PHASE_TID = 1  # the forward / backward / optimizer ranges


@attrs.frozen
class Block:
    """Consecutive ops of one phase run `count` times, iteration by iteration, as the body of
    `region` (None: ops outside any region at this depth, each run once); `reverse` for the
    backward."""

    ops: tuple[OpCost, ...]
    region: str | None
    count: int
    reverse: bool = False


@attrs.frozen
class Kernel:
    """One kernel instance on the timeline; `index` holds its iteration in each region around
    it, outermost first (() outside every region)."""

    op: OpCost
    index: tuple[int, ...]
    name: str
    dur_us: float


def _trip_count(region: Region, profile: Profile) -> int:
    """`region.count` with the profile's dimension values."""
    symbols = region.count.free_symbols
    missing = sorted(s.name for s in symbols if s.name not in profile.values)
    if missing:
        raise ValueError(f"region {region.name} runs {region.count} times, and the profile "
                         f"has no value for {', '.join(missing)}")
    return int(region.count.xreplace({s: sympy.Integer(profile.values[s.name])
                                      for s in symbols}))


def trip_counts(graph: Graph, profile: Profile) -> dict[str, int]:
    """Each region's trip count (per run of its parent) with the profile's values."""
    return {r.name: _trip_count(r, profile) for r in graph.regions()}


def blocks(ops: tuple[OpCost, ...] | list[OpCost], graph: Graph, profile: Profile,
           depth: int = 0) -> list[Block]:
    """Group consecutive ops of one phase by their region `depth` levels down the nest (0: the
    outermost), in order: `blocks(profile.ops, step, profile)`."""
    return _blocks(ops, graph, trip_counts(graph, profile), depth)


def _blocks(ops, graph: Graph, trips: dict[str, int], depth: int) -> list[Block]:
    out: list[Block] = []
    for op in ops:
        chain = graph.region_chain(graph.op(op.name).region)
        region = chain[depth].name if len(chain) > depth else None
        last = out[-1] if out else None
        if (region is not None and last is not None and last.region == region
                and last.ops[-1].phase == op.phase):
            out[-1] = attrs.evolve(last, ops=(*last.ops, op))
        else:
            count = trips[region] if region is not None else 1
            out.append(Block((op,), region, count, reverse=op.phase == "backward"))
    return out


def instance_name(op: str, chain: tuple[Region, ...], index: tuple[int, ...]) -> str:
    """The op's name with each region's iteration after the region's name, as PyTorch names
    module instances: `layers.q_proj` in region `layers`, iteration 3 -> `layers.3.q_proj`.
    The structure comes from the regions; the name is only decorated. A name that does not
    hold its region's name gets the indices in brackets: `w_q [3]`."""
    if not chain:
        return op
    indexed, outer = [], None
    for region, i in zip(chain, index):
        own = region.name
        if outer is not None and own.startswith(f"{outer}."):
            own = own[len(outer) + 1:]  # a nested region is named `outer.inner`
        indexed.append(f"{own}.{i}")
        outer = region.name
    plain, decorated = f"{chain[-1].name}.", ".".join(indexed) + "."
    if op.startswith(plain):
        return decorated + op[len(plain):]
    at = op.find(f".{plain}")
    if at >= 0:  # an op named after a tensor of the region: `adamw.layers.q_proj.weight`
        return f"{op[:at + 1]}{decorated}{op[at + 1 + len(plain):]}"
    return f"{op} [{', '.join(map(str, index))}]"


def kernels(profile: Profile, graph: Graph) -> Iterator[Kernel]:
    """Every kernel instance of the step, in execution order."""
    yield from _expand(list(profile.ops), graph, trip_counts(graph, profile), ())


def _expand(ops: list[OpCost], graph: Graph, trips: dict[str, int],
            index: tuple[int, ...]) -> Iterator[Kernel]:
    for block in _blocks(ops, graph, trips, len(index)):
        if block.region is not None:
            order = range(block.count - 1, -1, -1) if block.reverse else range(block.count)
            for i in order:
                yield from _expand(list(block.ops), graph, trips, (*index, i))
            continue
        op = block.ops[0]
        chain = graph.region_chain(graph.op(op.name).region)
        runs = 1
        for region in chain:
            runs *= trips[region.name]
        extra, rest = divmod(op.count, runs)  # an op held with a count but in no region
        if rest or not extra:
            raise ValueError(f"op {op.name} runs {op.count} times, but its regions "
                             f"{[r.name for r in chain]} run it {runs} times")
        name = instance_name(op.name, chain, index)
        for j in range(extra):
            yield Kernel(op, index, name if extra == 1 else f"{name} [{j}]",
                         op.time_s / op.count * 1e6)


def _metadata(name: str, tid: int, value: str, sort: int | None = None) -> list[dict]:
    out = [{"ph": "M", "pid": PID, "tid": tid, "name": name, "args": {"name": value}}]
    if sort is not None:
        out.append({"ph": "M", "pid": PID, "tid": tid, "name": "thread_sort_index",
                    "args": {"sort_index": sort}})
    return out


def chrome_trace(profile: Profile, graph: Graph) -> dict:
    """The step as `{"traceEvents": [...], "displayTimeUnit": "ms", ...}`, times in µs, from
    its profile and the compiled graph it evaluates (which holds the regions)."""
    batch = profile.tokens // profile.seq_len
    events = [
        *_metadata("process_name", PHASE_TID, f"opgraph roofline: {profile.model} on "
                                         f"{profile.hardware.name}"),
        *_metadata("thread_name", PHASE_TID, "phases", sort=0),
        *_metadata("thread_name", STREAM_TID, "GPU stream (predicted kernels)", sort=1),
    ]
    phases: list[list] = []  # [phase, start, end]
    t = 0.0
    for k in kernels(profile, graph):
        op = k.op
        per = op.count
        events.append({
            "ph": "X", "pid": PID, "tid": STREAM_TID, "name": k.name, "cat": op.category,
            "ts": t, "dur": k.dur_us,
            "args": {"flops": op.flops / per, "bytes": op.bytes / per, "bound": op.bound,
                     "category": op.category, "kind": op.kind, "phase": op.phase,
                     "op": op.name, "layer": _layer(k.index)},
        })
        if not phases or phases[-1][0] != op.phase:
            phases.append([op.phase, t, t])
        t += k.dur_us
        phases[-1][2] = t
    for phase, start, end in phases:
        events.append({"ph": "X", "pid": PID, "tid": PHASE_TID, "name": phase, "cat": "phase",
                       "ts": start, "dur": end - start, "args": {}})
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "source": f"opgraph {profile.cost} prediction (no overlap: kernels back to back)",
            "model": profile.model, "hardware": profile.hardware.name,
            "tokens": profile.tokens, "batch": batch, "seq_len": profile.seq_len,
            "fused_attention": profile.fused_attention,
            "step_time_s": profile.step_time_s, "mfu_ceiling": profile.mfu_ceiling,
        },
    }


def _layer(index: tuple[int, ...]) -> int | list[int] | None:
    """The `layer` arg: the iteration (None outside a region; a list, outermost first, in a
    nest)."""
    return None if not index else index[0] if len(index) == 1 else list(index)


def write_chrome_trace(profile: Profile, graph: Graph, path: str | os.PathLike) -> None:
    """Write `chrome_trace(profile, graph)` to `path` (atomically)."""
    trace = chrome_trace(profile, graph)

    def dump(f) -> None:
        json.dump(trace, f)

    write_atomic(path, dump)


# a many-GPU timeline's tracks, in order
TRACKS = ("compute", "tp", "cp", "ep", "dp", "dpr", "edp", "pp")


def timeline(profile: Profile, rank: int) -> dict:
    """GPU `rank`'s step of a job over many GPUs (`Profile.parallel.events`): the compute
    stream and each group's communication stream on their own tracks, micro-batches and the
    pipeline's bubble as they were scheduled (`opgraph.parallel.schedule`), times in µs. Each
    track's events add up to the report's figures: the compute stream's kernels to the ops' time,
    its bubble events to the bubble, each group's to its collectives' time."""
    r = profile.parallel
    events = [*_metadata("process_name", PID, f"opgraph: {profile.model}, rank {rank} of "
                                              f"{r.layout.world}")]
    tid = {track: i + 1 for i, track in enumerate(TRACKS)}
    for track in TRACKS:
        label = "compute stream" if track == "compute" else f"{track} communication"
        events += _metadata("thread_name", tid[track], label, sort=tid[track])
    for e in r.events:
        events.append({"ph": "X", "pid": PID, "tid": tid[e.track], "name": e.name,
                       "cat": e.track, "ts": e.start_s * 1e6,
                       "dur": (e.end_s - e.start_s) * 1e6,
                       "args": {"phase": e.phase, "kind": e.kind}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"source": f"opgraph {r.cost} prediction, scheduled over streams",
                          "model": profile.model, "rank": rank,
                          "step_time_s": r.step_time_s, "bubble_s": r.bubble_s,
                          "exposed_communication_s": r.exposed_communication_s,
                          "queued_communication_s": r.queued_communication_s,
                          "parallel": r.layout.to_json()}}


def write_timeline(profile: Profile, rank: int, path: str | os.PathLike) -> None:
    """Write `timeline(profile, rank)` to `path` (atomically)."""
    trace = timeline(profile, rank)
    write_atomic(path, lambda f: json.dump(trace, f))
