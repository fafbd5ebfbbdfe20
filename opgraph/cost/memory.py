"""The step's HBM footprint, derived from the graph's tensors: who they are and who reads them.

At the start of the backward pass everything below is resident at once, so their sum is the
step's peak need (one device, no sharding, no activation checkpointing):

- weights: every weight tensor, in its own dtype (BF16 by default);
- gradients: one buffer per weight, in its gradient's dtype (FP32 by default: the buffer
  gradients accumulate in); the partial gradients of a weight read twice are that same buffer;
- optimizer: the optimizer states the update reads (FP32 master weights and AdamW's two
  moments by default, 12 bytes per parameter); what it writes updates them in place;
- activations: the forward tensors a backward kernel reads (activations and the step's inputs,
  deduplicated), times their multiplicity, so `L` layers keep `L` copies.

Transient buffers (activation gradients, a kernel's workspace) are not counted: they live for
a layer or a kernel at a time, and allocators reuse them.

    fp = footprint(compile_step(preset("llama3-8b")))
    fp.total  # a sympy expression of the dimensions

Saved activations are the tensors the forward makes (or the step is fed) that a backward kernel
or a re-run op (`passes.recompute`) reads; a re-run op's outputs are not saved, they live from
the re-run to their last reader.

The sum above is what every part holds at once at the start of the backward. The step's peak
is a liveness computation (`liveness`, `peak`): the ops run in the graph's execution order, a
layer region's body once per iteration (all forwards, then all backwards, last layer first), and
at each op the bytes live are the weights, gradient buffers and optimizer states (resident all
step), the saved activations of every layer that has run its forward and not yet its backward
(a layer region's saved tensor counts `count` copies inside its lifetime, `count - 1` elsewhere
in the region: the other layers'), and the transient working set: every other tensor from the
op that writes it to the last op that reads it, one copy (one layer at a time); a partial
gradient ends where the kernel that accumulates into it begins (the sum is written in its
buffer: one copy, as the resident gradient buffers count the partials of a weight), and, while an
op its framework runs eagerly runs (or its backward), the tensors its kernels write beside its own
(`workspace`: the eager loss's FP32 copies of the logits); and what an eager op's autograd keeps
beyond a fused kernel's inputs (`rules.eager_saved`), saved from the op to its backward as its
inputs are, or from its re-run where it is recomputed. The peak is the op where that is largest;
each part there stays a formula.

That peak is what PyTorch's `max_memory_allocated` reports. `Memory.total` is what the caching
allocator reserves (`max_memory_reserved`): the same, but where a framework gathers the updated
weights through packed buffers after the backward (`buffer_tensors`), which the allocator keeps
in segments of their own on top of the peak while the part has room (see `Memory`).
"""

from __future__ import annotations

import attrs
import sympy

from ..core import rules
from ..core.ir import DTYPES, Graph, Op, Phase, Role, Tensor

PARTS = ("weights", "gradients", "optimizer", "activations")
RESIDENT = PARTS[:3]  # the parts resident all step (`resident_tensors`)


@attrs.frozen
class Footprint:
    """Bytes resident at the step's peak, per part, as expressions of the dimensions."""

    weights: sympy.Expr
    gradients: sympy.Expr
    optimizer: sympy.Expr
    activations: sympy.Expr

    @property
    def total(self) -> sympy.Expr:
        return self.weights + self.gradients + self.optimizer + self.activations

    def parts(self) -> dict[str, sympy.Expr]:
        return {name: getattr(self, name) for name in PARTS}


def _resident(tensors: list[Tensor]) -> sympy.Expr:
    return sympy.Add(*(t.nbytes * t.count for t in tensors))


def footprint(graph: Graph) -> Footprint:
    """The HBM footprint of a step graph (a forward graph has no gradients, states or saved
    activations): `footprint(step).total`."""
    return Footprint(**resident_bytes(graph), activations=_resident(saved(graph)))


def resident_bytes(graph: Graph) -> dict[str, sympy.Expr]:
    """The bytes of each part resident all step (`RESIDENT`: weights, gradients, optimizer), as
    formulas: `resident_tensors`' sizes summed."""
    held = resident_tensors(graph)
    return {name: _resident(held[name]) for name in RESIDENT}


def resident_tensors(graph: Graph) -> dict[str, list[Tensor]]:
    """The tensors resident all step, by part: the weights (and the FP8 copies of those a
    framework casts once a step, `passes.cache_fp8_weights`), one gradient buffer per weight
    (and the copy a DDP bucket keeps of what an all-reduce reduces, in its `bucket` dtype:
    `frameworks.Traits.ddp_buckets`), the optimizer states."""
    weights = graph.weights()
    cached = [graph.tensor(n) for op in graph.ops() if op.param("cached") for n in op.outputs]
    names = {w.name for w in weights}
    grads: dict[str, Tensor] = {}
    for t in graph.tensors():  # one buffer per weight, however many partials write it
        if t.role is Role.GRADIENT and t.grad_of in names:
            grads.setdefault(t.grad_of, t)
    buckets = [attrs.evolve(graph.tensor(op.inputs[0]), name=f"{op.name}.bucket",
                            dtype=DTYPES[op.param("bucket")], grad_of=None)
               for op in graph.ops() if op.param("bucket")]
    states: dict[str, Tensor] = {}
    for op in graph.ops():
        if op.phase is not Phase.OPTIMIZER or op.kind in rules.COLLECTIVE_KINDS:
            continue  # a gather reads the update
        for name in op.inputs:
            t = graph.tensor(name)
            if t.role is Role.OPTIMIZER_STATE:
                states.setdefault(name, t)
    return dict(zip(RESIDENT, (list(weights) + cached, list(grads.values()) + buckets,
                               list(states.values()))))


def buffer_tensors(graph: Graph) -> list[Tensor]:
    """The flat buffers of the optimizer's gathers of the updated weights where a framework
    packs them (an all-gather marked `flat`, `frameworks.Traits.flattens_gathers`): each
    weight's shard in the packed input, and the whole weight twice, in the packed per-rank
    outputs and in the process group's flat output."""
    return [attrs.evolve(graph.tensor(name), name=f"{op.name}.flat{i}", grad_of=None)
            for op in graph.ops() if op.param("flat")
            for i, name in enumerate((op.inputs[0], op.outputs[0], op.outputs[0]))]


def buffer_bytes(graph: Graph) -> sympy.Expr:
    """The bytes of `buffer_tensors`, a formula."""
    return _resident(buffer_tensors(graph))


def _made_by_forward(graph: Graph, name: str) -> bool:
    op = graph.producer(name)
    return op is None or op.phase is Phase.FORWARD


def _reads_data(op: Op, name: str, graph: Graph) -> bool:
    """Whether `op` reads tensor `name`'s data: not a view's backward kernel reading a forward
    tensor for its shape (`rules.SHAPE_ONLY_BACKWARD`: PyTorch keeps a reshape's, slice's,
    split's, concatenation's or expand's sizes, not its input)."""
    return not (op.kind in rules.SHAPE_ONLY_BACKWARD and op.phase is Phase.BACKWARD
                and graph.tensor(name).role is not Role.GRADIENT)


def saved(graph: Graph) -> list[Tensor]:
    """The activations saved for the backward, in the order the graph first reads them there:
    forward-made tensors (and the step's inputs) that a backward kernel or a re-run op reads
    (`_reads_data`)."""
    out: dict[str, Tensor] = {}
    for op in graph.ops():
        if op.phase not in (Phase.BACKWARD, Phase.RECOMPUTE):
            continue
        for name in op.inputs:
            if not _reads_data(op, name, graph):
                continue
            t = graph.tensor(name)
            if t.role in (Role.ACTIVATION, Role.INPUT) and _made_by_forward(graph, name):
                out.setdefault(name, t)
    return list(out.values())


# --- the peak: liveness over the step's execution order ---------------------------------------

PEAK_PARTS = ("weights", "gradients", "optimizer", "activations", "transient")


@attrs.frozen
class Moment:
    """The bytes live while op `op` runs, per part, as formulas of the dimensions: the
    persistent parts, the saved activations live then (`activations`) and the rest of the
    working set (`transient`)."""

    op: str
    phase: str
    weights: sympy.Expr
    gradients: sympy.Expr
    optimizer: sympy.Expr
    activations: sympy.Expr
    transient: sympy.Expr
    # not part of the peak: the saved activations one micro-batch holds from the end of its
    # forward to the start of its backward (`Liveness.resting`), in the layer stacks, before
    # them and after them, what each further micro-batch a pipeline stage holds in flight adds
    # to it (`distributed.stage_in_flight`)
    resting: sympy.Expr = sympy.Integer(0)
    resting_before: sympy.Expr = sympy.Integer(0)
    resting_after: sympy.Expr = sympy.Integer(0)
    # not part of the liveness peak: the optimizer's packed gather buffers (`buffer_bytes`),
    # which `Memory` stacks on it as the caching allocator keeps them
    buffers: sympy.Expr = sympy.Integer(0)

    @property
    def total(self) -> sympy.Expr:
        return sympy.Add(*(getattr(self, name) for name in PEAK_PARTS))

    def parts(self) -> dict[str, sympy.Expr]:
        return {name: getattr(self, name) for name in PEAK_PARTS}


@attrs.frozen
class _Life:
    """One non-resident tensor's lifetime: the positions of its writer and last reader."""

    tensor: Tensor
    start: int
    end: int
    saved: bool
    region: str | None


class Liveness:
    """What is live at each op of `graph`'s execution order (`liveness(graph)`)."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.ops = graph.ops()
        self.resident = resident_bytes(graph)
        self.buffers = buffer_bytes(graph)
        at = {op.name: i for i, op in enumerate(self.ops)}
        kept = {t.name for t in saved(graph)}
        read_by: dict[str, list] = {}  # each tensor's consumers, in the order they run
        writers = {}  # each tensor's producer (`graph.producer`), indexed once
        for op in self.ops:
            for name in dict.fromkeys(op.inputs):
                if _reads_data(op, name, graph):
                    read_by.setdefault(name, []).append(op)
            for name in op.outputs:
                writers.setdefault(name, op)
        self.lives: list[_Life] = []
        for t in graph.tensors():
            writer = writers.get(t.name)
            if _resident_tensor(graph, t, writer):
                continue
            consumers = read_by.get(t.name, [])
            readers = [at[op.name] for op in consumers]
            # a kernel that accumulates into a partial gradient writes the sum in its buffer:
            # the partial ends where that kernel begins, and its output is the one copy there
            ends = [at[op.name] - 1 if t.name in _partials(op) else at[op.name]
                    for op in consumers]
            if writer is not None:
                start = at[writer.name]
            else:  # fed to the step; the loss's seed gradient only when the backward starts
                start = min(readers, default=0) if t.role is Role.GRADIENT else 0
            end = max([start, *ends]) if writer is not None or not ends else max(ends)
            if end >= start:  # else a partial fed to the step and only accumulated into
                self.lives.append(_Life(t, start, end, t.name in kept, t.region))
        for i, op in enumerate(self.ops):  # an eager op's kernels' own tensors, while it runs
            self.lives.extend(_Life(t, i, i, False, t.region) for t in workspace(graph, op))
        self.lives.extend(_eager_kept(graph, self.ops, at))

    def copies(self, life: _Life, i: int, count=None):
        """How many instances of `life`'s tensor are live while op `i` runs: a saved tensor
        all its region's `count` inside its lifetime and `count - 1` elsewhere in the region
        (the other layers' copies, made and not yet used); any other tensor one, inside its
        lifetime. `count` is the tensor's count, or a number standing for it."""
        inside = life.start <= i <= life.end
        if not life.saved:
            return 1 if inside else 0
        count = life.tensor.count if count is None else count
        if inside:
            return count
        if life.region is not None and self.graph.within(self.ops[i].region, life.region):
            return count - 1
        return 0

    def copy_matrices(self):
        """`copies` at every op and life at once: two int8 arrays (ops x lives), `one` and `many`,
        such that the copies of life j live while op i runs are `one[i, j] + many[i, j] x`
        its count (a saved tensor's whole count inside its lifetime, the count less one
        elsewhere in its region; any other tensor one, inside its lifetime)."""
        import numpy as np

        at = np.arange(len(self.ops))[:, None]
        start = np.array([life.start for life in self.lives])
        end = np.array([life.end for life in self.lives])
        saved = np.array([life.saved for life in self.lives], dtype=bool)
        inside = (start <= at) & (at <= end)
        # whether each op is within each life's region: worked out once per distinct pair of
        # an op's region and a life's (a step has a few), then spread over ops and lives
        op_keys: dict = {}
        life_keys: dict = {}
        op_at = np.array([op_keys.setdefault(op.region, len(op_keys)) for op in self.ops],
                         dtype=int)
        life_at = np.array([life_keys.setdefault(life.region, len(life_keys))
                            for life in self.lives], dtype=int)
        within = np.array([[r is not None and self.graph.within(o, r) for r in life_keys]
                           for o in op_keys], dtype=bool).reshape(len(op_keys), len(life_keys))
        in_region = within[op_at][:, life_at]
        elsewhere = saved & in_region & ~inside
        many = (saved & inside) | elsewhere
        # small whole numbers, held as bytes: a search keeps a pair per compiled stage
        one = (~saved & inside).astype(np.int8) - elsewhere
        return one, many.astype(np.int8)

    def moment(self, i: int) -> Moment:
        """The bytes live while the `i`-th op runs."""
        parts = {"activations": [], "transient": []}
        for life in self.lives:
            n = self.copies(life, i)
            if n != 0:
                parts["activations" if life.saved else "transient"].append(
                    n * life.tensor.nbytes)
        op = self.ops[i]
        return Moment(op.name, op.phase.value, **self.resident,
                      **{k: sympy.Add(*v) for k, v in parts.items()}, buffers=self.buffers)

    @property
    def backward_start(self) -> int | None:
        """The position of the backward's first kernel (or re-run op): where a micro-batch
        holds every activation it saved and nothing its backward made (None where there is no
        backward). Collectives are passed over: a gather the backward issues early, a stage's
        receive of its gradient, a send of the forward's output run apart from it."""
        return next((i for i, op in enumerate(self.ops)
                     if op.phase in (Phase.BACKWARD, Phase.RECOMPUTE)
                     and op.kind not in rules.COLLECTIVE_KINDS), None)

    def resting(self) -> tuple[sympy.Expr, sympy.Expr, sympy.Expr]:
        """The saved activations live at the backward's start (`backward_start`): what one
        micro-batch holds from its forward to its backward, as a pipeline stage holds each of
        the micro-batches in flight that it is not running; those of the layer stacks'
        regions, then those outside them made before the stacks (the embedding's, a stage's
        input) and after them (the head's, the loss's), by `ends`."""
        at = self.backward_start
        parts: tuple[list, list, list] = ([], [], [])
        for life, where in zip(self.lives, self.ends()):
            n = self.copies(life, at) if life.saved and at is not None else 0
            if n:
                parts[where].append(n * life.tensor.nbytes)
        return tuple(sympy.Add(*terms) for terms in parts)

    def ends(self) -> list[int]:
        """Where each life is, as `resting` splits them: 0 in a region (a layer stack), 1
        outside them, made before the first op of one, 2 made after."""
        first = next((i for i, op in enumerate(self.ops) if op.region is not None), None)
        return [0 if life.region is not None else
                1 if first is None or life.start < first else 2 for life in self.lives]

    def totals(self, subs: dict) -> list[float]:
        """Each op's live bytes at the dimension values `subs` (symbols to numbers): `moment`'s
        total, counted in floats (the same `copies`) to find the peak fast."""
        sizes = [float(life.tensor.nbytes.xreplace(subs)) for life in self.lives]
        counts = [float(sympy.sympify(life.tensor.count).xreplace(subs))
                  for life in self.lives]
        resident = float(sympy.Add(*self.resident.values()).xreplace(subs))
        # life by life over only the ops it is live at (`copies` is 0 elsewhere, and adding
        # nothing changes no sum), so each op's sum takes the same terms in the same order as
        # summing over every life at every op, without the ops x lives calls of `copies`
        live = [0] * len(self.ops)
        members: dict[str, list[int]] = {}  # region -> the ops within it
        for life, size, count in zip(self.lives, sizes, counts):
            for i in range(life.start, life.end + 1):
                live[i] += size * (count if life.saved else 1)
            if life.saved and life.region is not None:
                if life.region not in members:
                    members[life.region] = [i for i, op in enumerate(self.ops)
                                            if self.graph.within(op.region, life.region)]
                for i in members[life.region]:
                    if not life.start <= i <= life.end:
                        live[i] += size * (count - 1)
        return [resident + total for total in live]


def workspace(graph: Graph, op: Op) -> list[Tensor]:
    """The tensors `op`'s eager kernels hold besides its own while they run
    (`rules.eager_workspace`), for an op its framework runs eagerly (`passes.decompose`'s mark)
    and for that op's backward kernels; none for any other. Each lives for `op` alone, one
    copy: the eager loss's FP32 copies of the logits, which a fused kernel never writes."""
    fwd = op
    if op.phase is Phase.BACKWARD:
        if op.forward is None or not graph.has_op(op.forward):
            return []
        fwd = graph.op(op.forward)
    if not fwd.param("eager"):
        return []
    specs = rules.eager_workspace(fwd.kind, [graph.tensor(n) for n in fwd.inputs],
                                  [graph.tensor(n) for n in fwd.outputs], dict(fwd.params),
                                  backward=op.phase is Phase.BACKWARD)
    return [Tensor(f"{op.name}:{name}", shape, DTYPES[dtype], region=op.region)
            for name, shape, dtype in specs]


def _eager_kept(graph: Graph, ops: list[Op], at: dict) -> list[_Life]:
    """The lives of what eager ops' autograd keeps beyond a fused kernel's saved inputs
    (`rules.eager_saved`): from the forward op to its last backward kernel, saved (every layer's
    copy, as the forward's saved tensors); from the re-run to the backward, one copy, where the
    op is recomputed (the forward's autograd then keeps nothing)."""
    backward: dict[str, int] = {}
    rerun: set[str] = set()
    for i, op in enumerate(ops):
        if op.forward is not None and op.phase is Phase.BACKWARD:
            backward[op.forward] = max(i, backward.get(op.forward, i))
        elif op.phase is Phase.RECOMPUTE and op.forward is not None:
            rerun.add(op.forward)
    out = []
    for op in ops:
        if not op.param("eager") or op.phase not in (Phase.FORWARD, Phase.RECOMPUTE):
            continue
        source = op.name if op.phase is Phase.FORWARD else op.forward
        if source not in backward or (op.phase is Phase.FORWARD and op.name in rerun):
            continue
        kept = op.phase is Phase.FORWARD
        outs = [graph.tensor(n) for n in op.outputs]
        count = outs[0].count if kept and outs else 1
        for name, shape, dtype in rules.eager_saved(op.kind, [graph.tensor(n) for n in op.inputs],
                                                    outs, dict(op.params)):
            t = Tensor(f"{op.name}:{name}", shape, DTYPES[dtype], count=count, region=op.region)
            out.append(_Life(t, at[op.name], backward[source], kept, op.region))
    return out


def _partials(op) -> tuple[str, ...]:
    """The partial gradients `op` accumulates into (`rules`: its last `accumulate` inputs)."""
    n = int(op.param("accumulate") or 0)
    return tuple(op.inputs[len(op.inputs) - n:]) if n else ()


def _resident_tensor(graph: Graph, t: Tensor, writer: Op | None) -> bool:
    """Weights, optimizer states and gradient buffers are resident all step; so are what the
    optimizer writes (the same buffers, updated in place) and a weight's FP8 copy made once a
    step. `writer` is the op that writes `t` (`graph.producer`), or None."""
    if t.role in (Role.WEIGHT, Role.OPTIMIZER_STATE):
        return True
    if t.role is Role.GRADIENT and t.grad_of is not None and graph.has_tensor(t.grad_of) \
            and graph.tensor(t.grad_of).role is Role.WEIGHT:
        return True
    return writer is not None and (writer.phase is Phase.OPTIMIZER
                                   or bool(writer.param("cached")))


def liveness(graph: Graph) -> Liveness:
    """The step's liveness: `liveness(step).moment(i)` is what is live at its i-th op."""
    return Liveness(graph)


def peak(graph: Graph, subs: dict) -> Moment:
    """The moment the most bytes are live at the dimension values `subs`, each part a
    formula: `peak(step, resolve(step)).op` names the op running then."""
    live = liveness(graph)
    if not live.ops:
        fp = footprint(graph)
        return Moment("", "", fp.weights, fp.gradients, fp.optimizer, sympy.Integer(0),
                      sympy.Integer(0), buffers=buffer_bytes(graph))
    totals = live.totals(subs)
    stack, before, after = live.resting()
    return attrs.evolve(live.moment(max(range(len(totals)), key=totals.__getitem__)),
                        resting=stack, resting_before=before, resting_after=after)


@attrs.frozen
class Memory:
    """The step's peak evaluated, in bytes, against the part's `capacity` (None if unknown):
    where it happens (`op`, its `phase`) and its parts; `fits` is None where the capacity is
    unknown.

    `total` is what PyTorch's caching allocator holds at its peak (`torch.cuda.
    max_memory_reserved`), `allocated` what is allocated at once at the most
    (`max_memory_allocated`). They differ by `buffers`, the optimizer's packed gather buffers
    (`buffer_tensors`), made after the backward has freed its activations: whole-stage buffers,
    larger than any block freed, so in segments of their own on top of what the forward and
    backward reserved, unless that would pass the capacity, where the allocator frees its
    unused cached blocks and allocates again (`c10/cuda/CUDACachingAllocator.cpp`,
    `release_cached_blocks` on a failed `cudaMalloc`): the total is then what is allocated.
    `fits` reads `allocated`: a job whose reserve would pass the capacity still runs."""

    op: str
    phase: str
    weights: int
    gradients: int
    optimizer: int
    activations: int
    transient: int
    capacity: int | None = None
    # `Moment.resting`, `resting_before` and `resting_after`, evaluated: not part of the peak
    resting: int = 0
    resting_before: int = 0
    resting_after: int = 0
    buffers: int = 0  # `Moment.buffers`, evaluated

    @property
    def allocated(self) -> int:
        """The most allocated at once: the liveness peak, or the resident parts and the
        buffers while the optimizer's gather runs."""
        return self._reserved()[0]

    @property
    def total(self) -> int:
        """The allocator's reserved peak (see the class)."""
        return self._reserved()[1]

    def _reserved(self) -> tuple[int, int]:
        return reserved(sum(getattr(self, name) for name in PEAK_PARTS),
                        self.weights + self.gradients + self.optimizer, self.buffers,
                        self.capacity)

    @property
    def fits(self) -> bool | None:
        return self.allocated <= self.capacity if self.capacity else None

    def to_json(self) -> dict:
        """The JSON `memory` object: bytes per part, the optimizer's gather `buffers`, `total`
        (the reserved peak), `allocated`, `capacity`, `fits`, and where the liveness peak
        happens (`peak_op`, `peak_phase`)."""
        return {**{name: getattr(self, name) for name in PEAK_PARTS}, "buffers": self.buffers,
                "total": self.total, "allocated": self.allocated, "capacity": self.capacity,
                "fits": self.fits, "peak_op": self.op, "peak_phase": self.phase}


def reserved(peak, resident, buffers, capacity):
    """(allocated, reserved) at the most (`Memory`): from the liveness `peak`, the
    `resident` parts and the optimizer's gather `buffers`; numbers, or numpy arrays over a
    search's layouts (`capacity` a number or None)."""
    stacked = peak + buffers
    if getattr(stacked, "ndim", 0) == 0:  # one layout's numbers
        allocated = max(peak, resident + buffers)
        return allocated, stacked if capacity is None or stacked <= capacity else allocated
    import numpy as np

    allocated = np.maximum(peak, resident + buffers)
    return allocated, stacked if capacity is None else np.where(stacked <= capacity, stacked,
                                                                allocated)


def figures(moment: Moment, subs: dict, capacity: float | None) -> Memory:
    """`moment` (the peak, `peak(graph, subs)`) evaluated at `subs` against `capacity`."""
    return Memory(moment.op, moment.phase,
                  **{name: int(sympy.sympify(expr).xreplace(subs))
                     for name, expr in moment.parts().items()},
                  capacity=int(capacity) if capacity else None,
                  **{name: int(sympy.sympify(getattr(moment, name)).xreplace(subs))
                     for name in ("resting", "resting_before", "resting_after", "buffers")})
