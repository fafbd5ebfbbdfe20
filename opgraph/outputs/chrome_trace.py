"""A Profile as a predicted timeline: the Chrome trace JSON that Perfetto and chrome://tracing open.

    trace = chrome_trace(evaluate(step, hardware.get("h100-sxm")))
    write_chrome_trace(profile, "step.json")       # then ui.perfetto.dev, "Open trace file"

Invariants: one complete event (`ph: "X"`) per kernel instance on the GPU-stream track, back to
back in execution order, so the kernel events number the sum of the ops' counts and their
durations sum to the step time (ops do not overlap in the roofline). Forward, backward and
optimizer ranges enclose them on a track of their own.

The graph holds a layer stack once, with multiplicity `count`; the timeline runs it `count`
times. `blocks` recovers the stacks from the profile's op order (which is the graph's topological
order: forward, then backward, then optimizer): a block is a run of consecutive ops of one phase
with the same count (> 1) and the same scope, the leading component of the name (`layers` in
`layers.q_proj`; for an optimizer update `adamw.layers.q_proj.weight`, the scope of the weight it
updates, `adamw.layers`). A block is expanded layer by layer, every op of layer i before any of
layer i+1: forward and optimizer from layer 0 up, backward from the last layer down. An op with
count 1 is a block of its own. The instance index goes after the scope, as PyTorch names modules:
`layers.3.q_proj`, `layers.3.q_proj.dA`, `adamw.layers.3.q_proj.weight`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import attrs

from ..profile import OpCost, Profile
from .atomic import write_atomic

PID = 1  # the one "GPU" process
STREAM_TID = 7  # the kernels' track (CUDA's default stream is 7 in PyTorch's traces)
PHASE_TID = 1  # the forward / backward / optimizer ranges
OPTIMIZER_PREFIX = "adamw"  # attach_adamw names each update `adamw.<weight>`


@attrs.frozen
class Block:
    """Consecutive ops run `count` times, layer by layer; `reverse` for the backward."""

    ops: tuple[OpCost, ...]
    count: int
    scope: str
    reverse: bool = False


@attrs.frozen
class Kernel:
    """One kernel instance on the timeline; `index` is its layer (None outside a stack)."""

    op: OpCost
    index: int | None
    name: str
    dur_us: float


def scope(name: str) -> str:
    """The stack an op belongs to: `scope("layers.q_proj.dA") == "layers"`,
    `scope("adamw.layers.q_proj.weight") == "adamw.layers"`."""
    parts = name.split(".")
    n = 2 if parts[0] == OPTIMIZER_PREFIX and len(parts) > 2 else 1
    return ".".join(parts[:n])


def blocks(ops: tuple[OpCost, ...] | list[OpCost]) -> list[Block]:
    """Group consecutive ops of one phase, count (> 1) and scope into blocks, in order."""
    out: list[Block] = []
    for op in ops:
        key = (op.phase, op.count, scope(op.name))
        last = out[-1] if out else None
        if (op.count > 1 and last is not None and last.count == op.count
                and (last.ops[-1].phase, last.count, last.scope) == key):
            out[-1] = attrs.evolve(last, ops=(*last.ops, op))
        else:
            out.append(Block((op,), op.count, key[2], reverse=op.phase == "backward"))
    return out


def instance_name(op: OpCost, index: int | None) -> str:
    """`layers.q_proj` with index 3 -> `layers.3.q_proj`; an op outside a stack keeps its name."""
    if index is None:
        return op.name
    head = scope(op.name)
    rest = op.name[len(head):]
    return f"{head}.{index}{rest}" if rest.startswith(".") else f"{op.name} [{index}]"


def kernels(profile: Profile) -> Iterator[Kernel]:
    """Every kernel instance of the step, in execution order."""
    for block in blocks(profile.ops):
        if block.count == 1:
            op = block.ops[0]
            yield Kernel(op, None, op.name, op.time_s * 1e6)
            continue
        layers = range(block.count - 1, -1, -1) if block.reverse else range(block.count)
        for i in layers:
            for op in block.ops:
                yield Kernel(op, i, instance_name(op, i), op.time_s / op.count * 1e6)


def _metadata(name: str, tid: int, value: str, sort: int | None = None) -> list[dict]:
    out = [{"ph": "M", "pid": PID, "tid": tid, "name": name, "args": {"name": value}}]
    if sort is not None:
        out.append({"ph": "M", "pid": PID, "tid": tid, "name": "thread_sort_index",
                    "args": {"sort_index": sort}})
    return out


def chrome_trace(profile: Profile) -> dict:
    """The step as `{"traceEvents": [...], "displayTimeUnit": "ms", ...}`; times in µs."""
    batch = profile.tokens // profile.seq_len
    events = [
        *_metadata("process_name", PHASE_TID, f"opgraph roofline: {profile.model} on "
                                         f"{profile.hardware.name}"),
        *_metadata("thread_name", PHASE_TID, "phases", sort=0),
        *_metadata("thread_name", STREAM_TID, "GPU stream (predicted kernels)", sort=1),
    ]
    phases: list[list] = []  # [phase, start, end]
    t = 0.0
    for k in kernels(profile):
        op = k.op
        per = op.count
        events.append({
            "ph": "X", "pid": PID, "tid": STREAM_TID, "name": k.name, "cat": op.category,
            "ts": t, "dur": k.dur_us,
            "args": {"flops": op.flops / per, "bytes": op.bytes / per, "bound": op.bound,
                     "category": op.category, "kind": op.kind, "phase": op.phase,
                     "op": op.name, "layer": k.index},
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
            "source": "opgraph roofline prediction (no overlap: kernels back to back)",
            "model": profile.model, "hardware": profile.hardware.name,
            "tokens": profile.tokens, "batch": batch, "seq_len": profile.seq_len,
            "fused_attention": profile.fused_attention,
            "step_time_s": profile.step_time_s, "mfu_ceiling": profile.mfu_ceiling,
        },
    }


def write_chrome_trace(profile: Profile, path: str | os.PathLike) -> None:
    """Write `chrome_trace(profile)` to `path` (atomically)."""
    trace = chrome_trace(profile)

    def dump(f) -> None:
        json.dump(trace, f)

    write_atomic(path, dump)
