"""The schedule: one GPU's step as a critical path over a compute stream and communication
streams, then the pipeline over micro-batches.

**One micro-batch on one stage** (`simulate`, which runs a `Streams`). The compute ops run in
the graph's order on one stream, a layer stack's body once per layer. Each collective runs on
its group's stream (one per parallel degree: tp, cp, ep, dp, pp), in the order it becomes ready:

- a collective of something computed starts when that is written and its stream is free (a
  data-parallel gradient reduction starts as soon as its layer's backward wrote the gradient,
  and so runs under the backward of the layers after it);
- a collective of a weight (FSDP's all-gather) is prefetched one layer ahead: it may start when
  the previous layer's use of the weight begins (FSDP2's default prefetch), the first one when
  its phase begins; without `prefetch` (a framework that synchronizes the device before each
  gather, `frameworks.Traits.syncs_before_gather`) it starts when the compute stream reaches
  its reader;
- a compute op waits for the collectives it reads. Where the collective is `overlapped` with
  its reader (ring attention's K/V passing under the attention, not context parallelism's
  all-to-all; tensor-parallel communication under its matmul with `--async-tp`), the reader
  may start with it and ends no earlier than it; such a collective moves its data in blocks,
  one per rank of its group, so its reader's last block (a gather's) or its writer's first
  (a scatter's) stays outside the overlap (`Streams._fill`): max(op, collective + op / n);
- without `overlap_grad_reduce` (Megatron-LM's default) the gradient reductions wait for the
  backward to end: they start when the optimizer needs them; where a framework reduces a
  tensor-parallel input gradient after the weight gradient (`frameworks.deferred_groups`),
  that reduction starts when its reader is reached;
- with `overlap_param_gather` (Megatron-LM's flag), ZeRO-1/2's gathers of the updated weights
  run in the next step's first micro-batch, each prefetched a layer ahead as a weight's gather
  is (`prefetched_gathers`; `distributed.Stage.first`), not after the update.

A `Plan` indexes a stage's ops once; runs of ops that wait on no collective and feed none
advance the compute stream by their sum at once, and a layer stack's layers, once two run
alike, are added at once (`simulate`).

What the compute stream waits for is charged to the collective it waits for, split in two:
while that collective runs, its *exposed* time (never more than its own time); before it starts
(behind other collectives on its stream, or behind the collective its input comes from), its
*queued* time, reported on a line of its own. The rest of a collective's time ran under
compute. Communication beside compute may slow it (SMs and HBM shared): the cost model's
`overlap_slowdown` (0 for the roofline) adds that fraction of the hidden time.

**The step** (`pipeline_step`). A data-parallel rank runs `m` micro-batches and then the
optimizer. Reductions that ZeRO-0/1 run once per step (the gradient all-reduce or
reduce-scatter, the gather of updated weights) run in the last micro-batch only; ZeRO-2/3
reduce-scatter every micro-batch, since the full gradient is freed. With `p` stages, each
taking `T_i` per micro-batch (forward and backward) and `v` virtual stages per GPU, 1F1B's span
is `m x max_i T_i + (sum_i T_i - max_i T_i) / v` (Narayanan et al. 2021: for even stages the
bubble is `(p - 1) / (v m)` of the ideal `m T`); the step adds the last micro-batch's exposed
data-parallel tail and the optimizer. Where interleaved chunks differ in size (uneven end
stages with virtual stages, as Llama 3 405B ran), the span is `interleaved_span`'s, Megatron's
interleaved schedule simulated chunk by chunk (with equal chunks it is the formula above). The
bubble reported is the span less `m` x the first stage's own micro-batch time.

**What the planner may take as sure** (`sure_waits`, `releases`, `released_bound`, at the end):
facts of a micro-batch's schedule that hold whatever its ops' times, from which the planner
(`opgraph.parallel.search`) bounds a layout's step from below before it runs `Streams`.
"""

from __future__ import annotations

import functools
import itertools

import attrs

from ..core.ir import Graph, Op, Phase, Role
from ..core.rules import COLLECTIVE_KINDS
from .parallel import SHARDED_FROM

GROUPS = ("tp", "cp", "ep", "dp", "dpr", "edp", "pp")


@attrs.frozen
class Event:
    """One kernel on one track of the timeline: `track` is "compute" or a group's stream."""

    name: str
    track: str
    start_s: float
    end_s: float
    phase: str
    kind: str


@attrs.frozen
class Run:
    """A simulated micro-batch: its span, what each collective cost and hid, and its events."""

    time_s: float
    compute_s: float
    comm_s: dict  # collective op name -> seconds over the run
    exposed_s: dict  # collective op name -> seconds the compute stream waited while it ran
    events: tuple[Event, ...]
    queued_s: dict = attrs.field(factory=dict)  # name -> seconds waited before it started


# The overlapped collectives whose writer sends its blocks as it computes them (`Streams._fill`):
# a reduce-scatter, and the all-to-all of partial products that stands for one where the
# framework sums them apart (`passes.sum_tp_partials`).
SCATTERS = ("reduce_scatter", "all_to_all")


def overlapped(group: str, async_tp: bool, kind: str) -> bool:
    """Whether a collective of `group` (and `kind`) runs beside the op that reads (or writes)
    it (see the module): ring attention's passing of keys and values, and tensor parallelism's
    with `--async-tp`. Context parallelism's all-to-all (`passes.shard`, DeepSpeed-Ulysses')
    does not: the attention reads the whole of what it moved."""
    return (group == "cp" and kind != "all_to_all") or (group == "tp" and async_tp)


def same_trip(prev, op) -> bool:
    """Whether compute op `op` runs in the trip of `prev`, the compute op before it: one
    region's ops repeat together, a forward pass's apart from the backward's (its
    recomputation with it). A pipeline stage holds nothing between its layers' forward and
    backward ops, yet runs every layer forward before any backward."""
    return (prev is not None and prev.region is not None and op.region == prev.region
            and _forward(op) == _forward(prev))


def segments_of(ops: list, collective: list, planned: list) -> list[list[int]]:
    """The `planned` compute ops' indices in order, cut into segments as `plan` cuts them
    (`same_trip`): what `releases` and `cycles` read a micro-batch by."""
    out: list[list[int]] = []
    for i, op in enumerate(ops):
        if collective[i] or not planned[i]:
            continue
        if out and same_trip(ops[out[-1][-1]], op):
            out[-1].append(i)
        else:
            out.append([i])
    return out


def _forward(op) -> bool:
    phase = op.phase
    return (phase is Phase.FORWARD if isinstance(phase, Phase)
            else phase == Phase.FORWARD.value)


@attrs.frozen
class _Comm:
    name: str
    group: str
    output: str
    inputs: tuple[str, ...]
    count: int
    phase: str
    kind: str
    blocking: bool = False  # run in line on the compute stream (`blocking_anchors`)


@attrs.frozen
class _Compute:
    name: str
    region: str | None
    count: int
    phase: str
    kind: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    # what can make it wait: the inputs a collective writes (a compute op's inputs are
    # written before it starts, the stream being in order), and the collectives it feeds
    waits_on: tuple[str, ...] = ()
    feeds: tuple[str, ...] = ()


@attrs.frozen
class _Block:
    """Consecutive compute ops of one phase and count that wait on no collective and feed
    none: they run back to back, so the simulation advances by their sum at once."""

    ops: tuple[_Compute, ...]
    count: int
    phase: str


@attrs.frozen
class Plan:
    """What `simulate` needs of a graph, indexed once (a fit runs it many times): the compute
    ops in order, grouped in segments (a run of one region's ops, repeated its trip count),
    the collectives, who writes each tensor and which collectives read it."""

    segments: tuple[tuple[_Compute, ...], ...]
    comms: dict  # name -> _Comm
    writer: dict  # tensor -> op name (of the ops chosen)
    comm_readers: dict  # tensor -> names of the collectives that read it
    counts: dict  # op name -> instances
    tail: tuple[str, ...] = ()  # blocking transfers run after the last compute op


def plan(graph: Graph, ops: list[Op], subs: dict, writes: dict | None = None) -> Plan:
    """Index `ops` (a subset of `graph`'s, in its order) for `simulate`. `writes` names, for
    a collective, the tensor its output stands for in this run: a weight gathered from the
    previous step's update (`prefetched_gathers`), so it reads nothing this run writes and
    this step's forward reads what it writes."""
    writes = writes or {}
    counts = {op.name: int(op.count.xreplace(subs)) for op in ops}
    comms = {op.name: _Comm(op.name, op.param("group"), writes.get(op.name, op.outputs[0]),
                            () if op.name in writes else op.inputs, counts[op.name],
                            op.phase.value, op.kind, bool(op.param("blocking")))
             for op in ops if op.kind in COLLECTIVE_KINDS}
    writer = {n: op.name for op in ops
              for n in ((writes[op.name],) if op.name in writes else op.outputs)}
    comm_readers: dict[str, list[str]] = {}
    for c in comms.values():
        for n in c.inputs:
            comm_readers.setdefault(n, []).append(c.name)
    anchors, tail = blocking_anchors(ops, comms, writer)
    segments: list[list[_Compute]] = []
    for op in ops:
        if op.kind in COLLECTIVE_KINDS:
            continue
        item = _Compute(op.name, op.region, counts[op.name], op.phase.value, op.kind,
                        op.inputs, op.outputs,
                        tuple(n for n in op.inputs if writer.get(n) in comms)
                        + anchors.get(op.name, ()),
                        tuple(c for n in op.outputs for c in comm_readers.get(n, ())
                              if not comms[c].blocking))
        if segments and same_trip(segments[-1][-1], op):
            segments[-1].append(item)
        else:
            segments.append([item])
    return Plan(tuple(_blocks(segment) for segment in segments), comms, writer,
                {k: tuple(v) for k, v in comm_readers.items()}, counts, tail)


def blocking_anchors(ops: list[Op], comms: dict, writer: dict
                     ) -> tuple[dict[str, tuple[str, ...]], tuple[str, ...]]:
    """Where each blocking transfer (`frameworks.Traits.blocking_p2p`) runs in line: the
    compute op that waits for it, by name, with the tensors it waits on, and the transfers
    left for the end of the micro-batch. A send (`blocking` "after") runs when the compute
    stream has finished the pass that wrote what it sends (DeepSpeed's engine sends between
    passes): before the first op after its writer in another phase, else at the end. A receive
    (`blocking` "before"), and what gathers it, runs just before the op the graph places after
    it (its reader)."""
    compute = [op for op in ops if op.kind not in COLLECTIVE_KINDS]
    at = {op.name: i for i, op in enumerate(compute)}
    anchors: dict[str, list[str]] = {}
    tail: list[str] = []
    placed = 0  # compute ops before the current one in `ops`
    for op in ops:
        if op.kind not in COLLECTIVE_KINDS:
            placed += 1
            continue
        c = comms.get(op.name)
        if c is None or not c.blocking:
            continue
        written = [at[writer[n]] for n in c.inputs if writer.get(n) in at]
        if op.param("blocking") == "after" and written:
            last = max(written)
            after = next((i for i in range(last + 1, len(compute))
                          if compute[i].phase is not compute[last].phase), None)
        else:
            after = placed if placed < len(compute) else None
        if after is None:
            tail.append(c.name)
        else:
            anchors.setdefault(compute[after].name, []).append(c.output)
    return {k: tuple(v) for k, v in anchors.items()}, tuple(tail)


def prefetched_gathers(graph: Graph) -> dict[str, str]:
    """The all-gathers of updated weights after a sharded optimizer's update (ZeRO-1/2), each
    with the weight it writes back: under Megatron-LM's `--overlap-param-gather` they run in
    the next step, each layer's weights gathered just before that layer's forward. The weight
    is found through the update: without master weights it reads a view of the weight itself
    (`replicate`), else the reduced gradient shard, whose `grad_of` (ZeRO-2) or whose full
    gradient's (ZeRO-1) names it."""
    out = {}
    for op in graph.ops():
        if op.kind != "all_gather" or op.phase is not Phase.OPTIMIZER:
            continue
        update = graph.producer(op.inputs[0])
        view = graph.producer(update.inputs[1])
        if view is not None and graph.tensor(view.inputs[0]).role is Role.WEIGHT:
            out[op.name] = view.inputs[0]
            continue
        shard = graph.tensor(update.inputs[0])
        weight = shard.grad_of or graph.tensor(graph.producer(shard.name).inputs[0]).grad_of
        if weight is not None:
            out[op.name] = weight
    return out


def _blocks(segment: list[_Compute]) -> tuple:
    """A segment's ops, runs of plain ones (see `_Block`) joined."""
    out: list = []
    for op in segment:
        plain = not op.waits_on and not op.feeds
        last = out[-1] if out else None
        if plain and isinstance(last, _Block) and (last.count, last.phase) == (op.count,
                                                                                op.phase):
            out[-1] = _Block((*last.ops, op), op.count, op.phase)
        elif plain:
            out.append(_Block((op,), op.count, op.phase))
        else:
            out.append(op)
    return tuple(out)


def _instance(i: int, n: int) -> int:
    return min(i, n - 1) if n else 0


def simulate(p: Plan, seconds: dict, *, async_tp: bool = False, deferred: tuple = (),
             keep_events: bool = True, prefetch: bool = True, chunks: tuple = ()) -> Run:
    """Run a planned micro-batch once: `seconds[op]` is one instance's time. Backward
    collectives of the `deferred` groups wait for the compute that reads them rather than
    starting when their input is written (Megatron-LM without `--overlap-grad-reduce`;
    `frameworks.deferred_groups`). A weight's gather
    starts a layer ahead of its reader, or, without `prefetch`, once the compute before its
    reader has run (a framework that synchronizes the device before each gather). `chunks`,
    (group, blocks) pairs: the blocks an overlapped collective of that group moves in turn
    (`overlapped`; the tensor- and context-parallel degrees). Returns the span of the compute
    stream (with what it waited for). `Streams` does the work."""
    return Streams(p, seconds, async_tp, deferred, keep_events, prefetch, chunks).run()


class Streams:
    """One GPU's streams over a planned micro-batch (`Plan`): the compute stream, in the
    graph's order, and one stream per group (`GROUPS`) on which its collectives queue; what
    each op wrote and when (`ready`), what the compute stream waited for, each collective's
    time, and with `keep_events` every kernel as an `Event`.

    A layer stack's body runs the same ops every layer, and the streams settle into a steady
    state: without `keep_events`, once two layers in a row run alike (every op and collective
    at the same offsets from the layer's start, the streams as far ahead, the same waits;
    `_Trip`) and nothing from before the stack can still hold one back, the layers left are
    that layer shifted by its length, added at once (`_repeat`)."""

    def __init__(self, p: Plan, seconds: dict, async_tp: bool = False, deferred: tuple = (),
                 keep_events: bool = True, prefetch: bool = True, chunks: tuple = ()):
        self.plan, self.seconds = p, seconds
        self.async_tp, self.deferred, self.keep_events = async_tp, deferred, keep_events
        self.prefetch = prefetch
        self.chunks = dict(chunks)
        comms = p.comms
        self.ready: dict[tuple[str, int], tuple[float, float]] = {}  # (tensor, i) -> writer's
        self.free = dict.fromkeys(GROUPS, 0.0)  # when each group's stream is next free
        self.comm_s = dict.fromkeys(comms, 0.0)
        self.exposed = dict.fromkeys(comms, 0.0)
        self.queued = dict.fromkeys(comms, 0.0)
        self.events: list[Event] = []
        self.spans: list[tuple[str, float, float]] = []  # each collective's run
        self.started: dict[tuple[str, int], float] = {}  # (compute op, i) -> start
        self.phase_start: dict[str, float] = {}
        self.now = 0.0  # where the compute stream is
        self.busy = 0.0  # its ops' time so far
        self.log: list | None = None  # a layer's writes, while one is watched

    def _deferred(self, c: _Comm) -> bool:
        """Whether collective `c` waits for its reader: a backward collective of a `deferred`
        group (a gradient reduction held to the backward's end; a tensor-parallel input
        gradient reduced after the weight gradient, `frameworks.deferred_groups`). The gather
        of the updated weights after the optimizer's update (ZeRO-1/2) still starts when the
        update has written them, as the framework issues it then."""
        return c.group in self.deferred and c.phase == Phase.BACKWARD.value

    def run(self) -> Run:
        """The micro-batch: each segment (a layer stack's body, or ops outside one), then the
        collectives still running after the last compute op, exposed, each for the part of
        the tail it ends."""
        if self.keep_events:  # every op on its own, to draw it
            segments = [tuple(o for item in seg for o in (item.ops if isinstance(item, _Block)
                                                           else (item,)))
                        for seg in self.plan.segments]
        else:
            segments = self.plan.segments
        self.lengths = {id(b): sum(self.seconds[o.name] for o in b.ops)
                        for seg in segments for b in seg if isinstance(b, _Block)}
        for segment in segments:
            self._segment(segment)
        for name in self.plan.tail:  # blocking transfers after the last compute op, in line
            c = self.plan.comms[name]
            for i in range(c.count):
                self._comm(c, i, self.now)
        tail, t = self.now, self.now
        for name, start, end in sorted(self.spans, key=lambda span: span[2]):
            if end > t:
                self.exposed[name] += end - max(t, start)
                t = tail = end
        return Run(tail, self.busy, self.comm_s, self.exposed, tuple(self.events), self.queued)

    def _segment(self, segment: tuple) -> None:
        """A segment's trips (a layer stack's layers), until the rest repeat one."""
        trips = max(op.count for op in segment)
        # a steady state is looked for where every op runs every layer
        watch = not self.keep_events and trips > 3 and all(op.count == trips for op in segment)
        # what was written before the stack may hold a layer back until it ends
        held_until = max((end for _, end in self.ready.values()), default=0.0) if watch else 0.0
        previous = None
        i = 0
        while i < trips:
            layer_start, layer_busy, layer_spans = self.now, self.busy, len(self.spans)
            if watch:
                self.log = []
            for op in segment:
                if i < op.count:
                    self._op(op, i)
            if not watch:
                i += 1
                continue
            trip = _trip(i, layer_start, self.now, self.busy - layer_busy, self.log,
                         self.spans[layer_spans:], self.free, self.plan.comms)
            self.log = None
            # a time fixed before the two layers compared (what was written before the stack,
            # another layer's collective) may hold back a later layer only if it ends after
            # the first of them starts
            if (trip is not None and previous is not None and i + 1 < trips
                    and max(held_until, trip.fixed, previous.fixed) <= previous.start
                    and trip.repeats(previous)):
                self._repeat(trip, trips - 1 - i)
                return
            previous = trip
            i += 1

    def _op(self, op, i: int) -> None:
        """Instance `i` of a compute op (or a `_Block` of them) on the compute stream: it
        starts when the collectives it reads have written (or, overlapped with it, have begun)
        and starts the collectives of what it writes."""
        now = self.now
        self.phase_start.setdefault(op.phase, now)
        if isinstance(op, _Block):  # nothing waits: the run's sum at once
            self.busy += self.lengths[id(op)]
            self.now = now + self.lengths[id(op)]
            return
        comms = self.plan.comms
        duration = self.seconds[op.name]
        start, floor, outlasting, waited_on, began = now, 0.0, None, None, now
        for name in op.waits_on:
            s, e, comm = self._need(name, i, op)
            if comm is not None and overlapped(comms[comm].group, self.async_tp,
                                               comms[comm].kind):
                done = e + self._fill(comms[comm], ("all_gather",), duration)
                if done > floor:
                    floor, outlasting = done, comm
                e = s
            if e > start:
                start, waited_on, began = e, comm, s
        if waited_on is not None:
            self._wait(waited_on, now, start, began)
        self.started[(op.name, i)] = start
        if self.log is not None:
            self.log.append((_STARTED, (op.name, i), start, 0.0))
        end = max(start + duration, floor)
        if floor > start + duration:  # an overlapped collective outlasted its reader
            self._expose(outlasting, floor - start - duration)
        self.busy += duration
        if self.keep_events and duration > 0:
            self.events.append(Event(op.name, "compute", start, start + duration, op.phase,
                                     op.kind))
        for name in op.outputs:
            self.ready[(name, i)] = (start, end)
            if self.log is not None:
                self.log.append((_WROTE, (name, i), start, end))
        self.now = end
        for reader in op.feeds:  # collectives of what it wrote start now
            c = comms[reader]
            if not self._deferred(c):
                self._comm(c, _instance(i, c.count),
                           start + self._fill(c, SCATTERS, duration)
                           if overlapped(c.group, self.async_tp, c.kind) else end)

    def _fill(self, c: _Comm, kinds: tuple[str, ...], duration: float) -> float:
        """The part of an op's `duration` that cannot overlap collective `c` where `c` is of
        one of `kinds` and moves its data in blocks, one per rank of its group (`chunks`),
        each beside the compute of another: a gather's reader computes its last block after
        that block arrives (torch's micro-pipelined all-gather matmul; the ring's blocks of
        keys and values), a scatter's writer computes its first block before any is sent (the
        fused matmul reduce-scatter, `SCATTERS`; the ring's gradients of the keys and
        values). 0 for another kind, or a group not pipelined."""
        n = self.chunks.get(c.group, 1)
        return duration / n if c.kind in kinds and n > 1 else 0.0

    def _comm(self, c: _Comm, i: int, earliest: float) -> tuple[float, float]:
        """Instance `i` of collective `c` on its group's stream, no earlier than `earliest`,
        then the collectives that read what it wrote (a chain)."""
        key = (c.output, i)
        if key in self.ready:
            return self.ready[key]
        start = max(self.free[c.group], earliest)
        end = start + self.seconds[c.name]
        self.free[c.group] = end
        self.ready[key] = (start, end)
        self.spans.append((c.name, start, end))
        self.comm_s[c.name] += end - start
        if self.log is not None:
            self.log.append((_READY, key, start, end))
        if self.keep_events and end > start:
            self.events.append(Event(c.name, c.group, start, end, c.phase, c.kind))
        comms = self.plan.comms
        for name in self.plan.comm_readers.get(c.output, ()):
            nxt = comms[name]
            if not self._deferred(nxt):
                self._comm(nxt, _instance(i, nxt.count), end)
        return self.ready[key]

    def _need(self, name: str, i: int, reader: _Compute) -> tuple[float, float, str | None]:
        """When tensor `name` (instance i as `reader` sees it) is written: (start, end, the
        collective that wrote it, if one did)."""
        p = self.plan
        w = p.writer.get(name)
        if w is None:
            return 0.0, 0.0, None
        j = _instance(i, p.counts[w])
        if w in p.comms:
            c = p.comms[w]
            if (name, j) not in self.ready:
                deps = [self._need(n, j, reader)[1] for n in c.inputs]
                if c.blocking or any(p.writer.get(n) is not None for n in c.inputs):
                    earliest = max([self.now, *deps])  # in line, or deferred: from now
                elif self.prefetch:  # nothing computed feeds it: a weight, prefetched a
                    # layer ahead
                    prev = self.started.get((reader.name, j - 1)) if j else None
                    earliest = prev if prev is not None else self.phase_start.get(
                        reader.phase, self.now)
                else:  # a weight gathered once the compute before its reader has run
                    earliest = self.now
                self._comm(c, j, max([earliest, *deps]))
            start, end = self.ready[(name, j)]
            if self.log is not None and j != i:  # another layer's collective: a fixed time
                self.log.append((_FIXED, name, end, 0.0))
            return start, end, w
        start, end = self.ready.get((name, j), (0.0, 0.0))
        return start, end, None

    def _expose(self, name: str, seconds_: float, kind: int | None = None) -> None:
        kind = _EXPOSED if kind is None else kind
        (self.exposed if kind == _EXPOSED else self.queued)[name] += seconds_
        if self.log is not None:
            self.log.append((kind, name, seconds_, 0.0))

    def _wait(self, name: str, now: float, until: float, began: float) -> None:
        """The compute stream waited from `now` to `until` for collective `name`, which
        began at `began`: queued until it began, exposed while it ran."""
        ran = max(now, min(began, until))
        if ran > now:
            self._expose(name, ran - now, _QUEUED)
        if until > ran:
            self._expose(name, until - ran)

    def _repeat(self, trip: _Trip, left: int) -> None:
        """The `left` layers after `trip`, each `trip` shifted by its length: their
        collectives' outputs and spans recorded as the layers would have, their costs added,
        the streams moved on. (What a compute op wrote can hold nothing back, the compute
        stream running in order, nor can when an op of the stack started, once the stack is
        done: not recorded.)"""
        outputs = [(name, s, e) for kind, name, s, e in trip.log if kind == _READY]
        for k in range(1, left + 1):
            start = trip.start + k * trip.length
            instance = trip.index + k
            for name, s, e in outputs:
                self.ready[(name, instance)] = (start + s, start + e)
            self.spans.extend((name, start + s, start + e) for name, s, e in trip.spans)
        for kind, name, seconds_, _ in trip.log:
            if kind in (_EXPOSED, _QUEUED):
                (self.exposed if kind == _EXPOSED else self.queued)[name] += left * seconds_
        for name, s, e in trip.spans:
            self.comm_s[name] += left * (e - s)
        for g, _ in trip.ahead:
            self.free[g] += left * trip.length
        self.now += left * trip.length
        self.busy += left * trip.busy


# what a layer's log records: a collective's output, a compute op's, an op's start, a wait
# while a collective ran and one before it began, another layer's collective read
_READY, _WROTE, _STARTED, _EXPOSED, _QUEUED, _FIXED = range(6)


@attrs.frozen
class _Trip:
    """One layer of a stack as `simulate` ran it: its start and length, and everything it
    did as offsets from its start (what it wrote, when its ops started, what it waited, its
    collectives' spans, how far ahead it left each stream it used)."""

    index: int
    start: float
    length: float
    busy: float
    log: tuple  # (kind, name, start offset, end offset), the instance dropped (it is `index`)
    spans: tuple  # (collective, start offset, end offset)
    ahead: tuple  # (group, free - the layer's end) for the streams it used
    fixed: float  # the latest end of another layer's collective it read

    def repeats(self, other: _Trip) -> bool:
        """Whether this layer ran as `other` did, offsets equal to rounding."""
        tol = 1e-12 * max(abs(self.start + self.length), 1e-300)

        def same(a: float, b: float) -> bool:
            return abs(a - b) <= tol

        return (same(self.length, other.length) and same(self.busy, other.busy)
                and len(self.log) == len(other.log) and len(self.spans) == len(other.spans)
                and len(self.ahead) == len(other.ahead)
                and all(x[:2] == y[:2] and same(x[2], y[2]) and same(x[3], y[3])
                        for x, y in zip(self.log, other.log))
                and all(x[0] == y[0] and same(x[1], y[1]) and same(x[2], y[2])
                        for x, y in zip(self.spans, other.spans))
                and all(x[0] == y[0] and same(x[1], y[1]) for x, y in zip(self.ahead, other.ahead)))


def _trip(i: int, start: float, end: float, busy: float, log: list, spans: list, free: dict,
          comms: dict) -> _Trip | None:
    """Layer `i`'s `_Trip`, or None where it wrote an instance other than its own (a
    collective of another layer: not a layer that repeats)."""
    entries, fixed = [], 0.0
    for kind, key, s, e in log:
        if kind == _FIXED:
            fixed = max(fixed, s)
            continue
        if kind in (_EXPOSED, _QUEUED):
            entries.append((kind, key, s, 0.0))
            continue
        if key[1] != i:
            return None
        entries.append((kind, key[0], s - start, e - start if kind != _STARTED else 0.0))
    used = sorted({comms[name].group for name, _, _ in spans})
    return _Trip(i, start, end - start, busy, tuple(entries),
                 tuple((name, s - start, e - start) for name, s, e in spans),
                 tuple((g, free[g] - end) for g in used), fixed)


# the data-parallel groups: a weight's reduction and sharding group, HSDP's replicas, the
# experts' (`Parallel.size`)
DATA_GROUPS = ("dp", "dpr", "edp")


def once_per_step(op: Op, zero: int) -> bool:
    """Ops a data-parallel rank runs once per step rather than per micro-batch (see the
    module): ZeRO-0/1's gradient reduction and the gather of updated weights, and the FP8
    casts of weights a framework caches (`passes.cache_fp8_weights`)."""
    if op.param("cached"):
        return True
    if op.kind not in COLLECTIVE_KINDS or op.param("group") not in DATA_GROUPS:
        return False
    return op.phase is Phase.OPTIMIZER or (op.phase is Phase.BACKWARD
                                           and zero < SHARDED_FROM["gradients"])


def pipeline_span(stage_times: list[float], micro_batches: int, virtual: int) -> float:
    """1F1B's span over `micro_batches` for stages taking `stage_times` each per micro-batch:
    `m x max + (sum - max) / v` (see the module).

        >>> pipeline_span([1.0] * 4, 8, 1)  # (m + p - 1) T
        11.0
    """
    slowest = max(stage_times)
    return micro_batches * slowest + (sum(stage_times) - slowest) / virtual


def interleaved_span(chunks: list[list[float]], micro_batches: int,
                     forward_share: float = 1 / 3) -> float | None:
    """The span of Megatron-LM's interleaved 1F1B schedule, simulated op by op, where
    `chunks[i][k]` is one micro-batch's time (forward and backward) through model chunk k of
    stage i; None where the schedule is not defined (`micro_batches` not a multiple of the
    stages, as Megatron-LM requires for interleaving).

    Each stage runs its chunks' forwards and backwards in Megatron's order
    (`megatron/core/pipeline_parallel/schedules.py`,
    `forward_backward_pipelining_with_interleaving`): micro-batches in groups of p through
    chunk 0, then chunk 1, ...; `(p - i - 1) x 2 + (v - 1) x p` warm-up forwards on stage i
    (all of them where m = p), then one forward and one backward alternately, then the
    remaining backwards, backwards taking the chunks in reverse.
    A chunk's forward of a micro-batch waits for the previous chunk's (the previous stage's, or
    the last stage's previous chunk), its backward for the next chunk's backward; the
    point-to-point transfers take no time here (the stages' own sends are in their times). A
    chunk's forward is `forward_share` of its time (the plate's backward of twice the forward).
    With equal chunks it gives Narayanan et al. 2021's `m T + (p - 1) T / v`; with unequal ones
    (Llama 3's end stages one layer short) the fill and drain run through the chunks as they are.

        >>> round(interleaved_span([[0.5, 0.5]] * 4, 8), 9)  # m T + (p - 1) T / v
        9.5
    """
    p, v, m = len(chunks), len(chunks[0]), micro_batches
    if m % p:
        return None
    backward_share = 1 - forward_share
    free = [0.0] * p
    events = _interleaved_events(p, v, m)
    ends = [0.0] * len(events)
    for n, (i, k, forward, dep) in enumerate(events):
        start = free[i] if dep < 0 else max(free[i], ends[dep])
        free[i] = ends[n] = start + chunks[i][k] * (forward_share if forward else backward_share)
    return max(free)


@functools.lru_cache(maxsize=64)
def _interleaved_events(p: int, v: int, m: int) -> tuple[tuple[int, int, bool, int], ...]:
    """`interleaved_span`'s schedule, which depends on the shape alone: every forward and
    backward of every stage as (stage, chunk, forward, the index of the one it waits for or
    -1), in an order that puts each after what it waits for and each stage's in its own order;
    the span is then one pass over it."""
    total, width = m * v, p * v

    def chunk_of(n: int, forward: bool) -> int:
        k = (n % width) // p
        return k if forward else v - 1 - k

    def micro_of(n: int) -> int:
        return (n // width) * p + n % p

    orders = []
    for i in range(p):
        warm = total if m == p else min(total, (p - i - 1) * 2 + (v - 1) * p)
        order = [(True, n) for n in range(warm)]
        f, b = warm, 0
        while f < total:
            order += [(True, f), (False, b)]
            f, b = f + 1, b + 1
        order += [(False, n) for n in range(b, total)]
        orders.append(order)
    placed: dict[tuple[bool, int, int], int] = {}  # (forward, micro-batch, global chunk) -> index
    events: list[tuple[int, int, bool, int]] = []
    at = [0] * p
    left = sum(map(len, orders))
    while left:
        progressed = False
        for i in range(p):
            while at[i] < len(orders[i]):
                forward, n = orders[i][at[i]]
                k, j = chunk_of(n, forward), micro_of(n)
                g = k * p + i
                if forward:
                    dep = (True, j, g - 1) if g else None
                else:
                    dep = (False, j, g + 1) if g < width - 1 else (True, j, g)
                if dep is not None and dep not in placed:
                    break
                placed[(forward, j, g)] = len(events)
                events.append((i, k, forward, -1 if dep is None else placed[dep]))
                at[i] += 1
                left -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("the interleaved schedule deadlocked")  # a bug, not an input
    return tuple(events)


# --- What the planner may take as sure of a micro-batch -----------------------------------------
#
# `opgraph.parallel.search` bounds a layout's step from below before it runs `Streams`, from
# facts of the schedule above that hold whatever the ops' times: where the compute stream must
# wait on communication every micro-batch (`sure_waits`: a `_need` on a chain of collectives it
# cannot overlap), and the earliest each collective can start (`releases`: `_op`'s start of the
# collectives of what it wrote, or a weight's from the micro-batch's start, prefetched). A
# framework that starts gathers later (`prefetch` off) only lengthens the span these bound.

# The groups whose collectives `sure_waits` counts: tensor and expert parallelism (context
# parallelism's run under their readers, `overlapped`; data parallelism's are not
# read by the next op).
WAITED_GROUPS = ("tp", "ep")


@attrs.frozen
class Waits:
    """A run of consecutive compute ops of one region, pass and count (none once per step), and
    where in it the stream surely waits (`sure_waits`): `targets` are (a reader's position in
    `ops`, its chains: (the position of the first op writing the chain's input, the chain's
    collectives, first to last, and the index in `targets` of the last reader at or before
    that op, or -1)), in order."""

    ops: tuple[int, ...]  # op indices
    targets: tuple


def _chain(graph: Graph, name: str, index: dict, once: tuple):
    """The waited collectives that write `name`, first to last, each reading only the one
    before it, and the compute ops the first reads; None if they are not such a chain."""
    chain = []
    c = graph.producer(name)
    while True:
        if (c is None or c.kind not in COLLECTIVE_KINDS or c.param("group") not in WAITED_GROUPS
                or c.name not in index or once[index[c.name]]):
            return None
        chain.append(index[c.name])
        writers = {graph.producer(n) for n in c.inputs}
        if None in writers:
            return None
        if any(w.kind in COLLECTIVE_KINDS for w in writers):
            if len(writers) > 1:
                return None
            c = writers.pop()
            continue
        return tuple(reversed(chain)), writers


def sure_waits(graph: Graph, ops: list, collective: list, once: tuple) -> tuple[Waits, ...]:
    """Where the compute stream surely waits for communication, every micro-batch: a compute
    op that reads a chain of collectives of a group that does not overlap its reader
    (`overlapped`; tensor parallelism's without --async-tp, checked per row), the
    first reading what compute ops of the same run wrote (the same region and count; the
    optimizer's ops count as compute, so a run is the same in the last micro-batch). The chain
    starts no earlier than the first of those writers ends (`simulate` starts a
    collective when one input is written) and each collective no earlier than the one before it
    ends, so the reader starts no earlier than that writer's end plus the chain; the ops between
    them run in the meantime. The planner's `search.bounds._waited_time` takes the longest
    path through a run's ops with these edges. Returns the runs with a wait."""
    index = {op.name: i for i, op in enumerate(ops)}
    runs: list[list[int]] = []
    for i, op in enumerate(ops):
        if collective[i]:
            continue
        last = ops[runs[-1][-1]] if runs else None
        if (last is not None and not once[i] and not once[runs[-1][-1]]
                and last.region == op.region and _forward(last) == _forward(op)
                and last.count == op.count):
            runs[-1].append(i)
        else:
            runs.append([i])
    out = []
    for run in runs:
        where = {ops[k].name: j for j, k in enumerate(run)}
        targets = []
        for j, k in enumerate(run):
            if once[k]:
                continue
            chains = []
            for name in ops[k].inputs:
                found = _chain(graph, name, index, once)
                if found is None:
                    continue
                chain, writers = found
                first = min((where.get(w.name, -1) for w in writers), default=-1)
                if (0 <= first < j and all(w.name in where for w in writers)
                        and all(ops[c].count == ops[k].count for c in chain)):
                    chains.append((first, chain))
            if chains:
                targets.append((j, tuple(
                    (first, chain, max((t for t, (at, _) in enumerate(targets) if at <= first),
                                       default=-1))
                    for first, chain in chains)))
        if targets:
            out.append(Waits(tuple(run), tuple(targets)))
    return tuple(out)


@attrs.frozen
class Releases:
    """A micro-batch's compute ops cut into segments as `plan` cuts them (a run of
    one region's ops, repeated, or one op outside any), and the segment from which each of
    its collectives can start: its input's writer's, or (a weight's) the first."""

    compute: tuple  # (ops, (segments, ops)): the plan's compute ops, 1 where in a segment
    comm: tuple  # per group (ops, (segments, ops)): its collectives, 1 where released
    groups: tuple = ()  # the group of each of `comm`


def releases(graph: Graph, ops: list, collective: list, planned: list) -> Releases:
    """The `Releases` of the micro-batch that runs the `planned` ops."""
    import numpy as np

    segment = {i: n for n, run in enumerate(segments_of(ops, collective, planned))
               for i in run}
    n = max(segment.values(), default=-1)
    index = {op.name: i for i, op in enumerate(ops)}
    released: dict[int, int] = {}
    for i, op in enumerate(ops):  # in order: a collective's producers come before it
        if not collective[i] or not planned[i] or op.kind == "identity":
            continue
        at = 0
        for name in op.inputs:
            producer = graph.producer(name)
            if producer is None:
                continue
            k = index[producer.name]
            at = max(at, released.get(k, 0) if collective[k] else segment.get(k, 0))
        released[i] = at

    def matrix(where: dict) -> tuple:
        out = np.zeros((n + 1, len(where)))
        out[list(where.values()), np.arange(len(where))] = 1.0
        return np.array(list(where), dtype=int), out

    groups: dict[str, dict] = {}
    for i, seg in released.items():
        groups.setdefault(ops[i].param("group"), {})[i] = seg
    return Releases(matrix(segment), tuple(matrix(g) for g in groups.values()), tuple(groups))


@attrs.frozen
class Cycles:
    """Where a layer stack's trips are held back by one group's stream. In a segment of
    repeated trips, every collective of the group that reduces what an op at position `k2`
    or later writes is started in trip t once that op has run; every weight's gather first
    read at `k` or earlier is started in trip t + 1 only when its reader needs it
    (`Streams._need`), behind them all on the stream. So from `k2`'s end in one trip to its
    end in the next takes at least those reductions, those gathers and the compute from `k` to
    `k2`, for any reader `k <= k2`."""

    compute: tuple[int, ...]  # the compute ops' indices, in order (positions)
    # (first position, end position, gathers ((first reader, op), ...), reductions ((first
    # writer, op), ...)) of each segment with both, each once a trip
    segments: tuple


def cycles(graph: Graph, ops: list, collective: list, planned: list, group: str = "dp"
           ) -> Cycles:
    """The `Cycles` of `group` in the micro-batch that runs the `planned` ops (only a group
    whose collectives block their readers, as data parallelism's do)."""
    index = {op.name: i for i, op in enumerate(ops)}
    runs = segments_of(ops, collective, planned)
    positions = [i for run in runs for i in run]
    starts = [0, *itertools.accumulate(map(len, runs))]
    at = {i: row for row, i in enumerate(positions)}

    def first(ops_):  # the first of these compute ops, by position
        return min((at[index[o.name]] for o in ops_
                    if o is not None and index.get(o.name) in at), default=None)

    gathers, reductions = [], []
    for c, op in enumerate(ops):
        if not (collective[c] and planned[c] and op.param("group") == group
                and not op.param("blocking")):
            continue
        writers = [graph.producer(n) for n in op.inputs]
        if all(w is None or index.get(w.name) not in at for w in writers):
            k = first(o for n in op.outputs for o in graph.consumers(n))
            if k is not None:  # a weight's gather: started by its first reader
                gathers.append((k, c))
        elif all(w is None or w.kind not in COLLECTIVE_KINDS for w in writers):
            k2 = first(writers)  # started when its first writer has run
            if k2 is not None:
                reductions.append((k2, c))
    segments = []
    for a, b in zip(starts, starts[1:]):
        counts = {ops[positions[j]].count for j in range(a, b)}
        if len(counts) != 1:
            continue
        (trips,) = counts
        mine = [tuple(sorted((k, c) for k, c in found if a <= k < b and ops[c].count == trips))
                for found in (gathers, reductions)]
        if all(mine):
            segments.append((a, b, *mine))
    return Cycles(tuple(positions), tuple(segments))


def cycle_bound(c: Cycles, compute, comm, counts):
    """A lower bound of the micro-batch's span from `Cycles`: its compute, plus in each
    segment of T trips (T - 1) times what its longest cycle takes beyond a trip's compute.
    `compute`, `comm` are each op's time over all its instances, `counts` its instances (a row
    per op, a column per row)."""
    import numpy as np

    pos = list(c.compute)
    out = compute[pos].sum(axis=0) if pos else np.zeros(compute.shape[1])
    for a, b, gathers, reductions in c.segments:
        trips = np.maximum(counts[pos[a]], 1)
        ran = np.vstack([np.zeros((1, compute.shape[1])),
                         np.cumsum(compute[pos[a:b]] / trips, axis=0)])  # a trip's, up to each
        gathered = np.cumsum([comm[g] / np.maximum(counts[g], 1) for _, g in gathers], axis=0)
        reduced = np.cumsum([comm[r] / np.maximum(counts[r], 1)
                             for _, r in reversed(reductions)], axis=0)[::-1]
        cycle = np.zeros_like(out)
        for i, (k, _) in enumerate(gathers):  # the gathers read at k or before, and ...
            for j, (k2, _) in enumerate(reductions):  # ... the reductions from k2 on
                if k <= k2:
                    cycle = np.maximum(cycle, gathered[i] + reduced[j]
                                       + ran[k2 - a + 1] - ran[k - a])
        out = out + (trips - 1) * np.maximum(cycle - ran[-1], 0.0)
    return out * (1 - 1e-6)


def released_bound(r: Releases, compute, comm, skip: tuple = ()):
    """A lower bound of the micro-batch's span from its communication streams: a collective
    starts no earlier than the compute stream reaches the segment that releases it (every op
    of the segments before has run), and each group's run one after another on its stream, so
    the span is at least, for every segment and group, the compute before the segment plus
    the group's collectives released there or later (`simulate`'s tail takes in the
    last of them). `compute` and `comm` are each op's time over the rows (a row per op).
    The groups in `skip` are left out: those whose collectives a layout defers to their
    reader (`simulate`'s `deferred`), which a plain micro-batch may never start."""
    import numpy as np

    out = np.zeros(compute.shape[1])
    ops, segments = r.compute
    if not r.comm or not len(ops):
        return out
    before = np.cumsum(segments @ compute[ops], axis=0)
    before = np.vstack([np.zeros((1, before.shape[1])), before[:-1]])  # each segment's start
    for group, (ops, segments) in zip(r.groups, r.comm):
        if group in skip:
            continue
        later = np.cumsum((segments @ comm[ops])[::-1], axis=0)[::-1]  # released there or later
        out = np.maximum(out, (before + later).max(axis=0))
    return out * (1 - 1e-6)
