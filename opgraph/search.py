"""Plan a run: every parallel layout of a model on a number of GPUs, ranked by tokens per second
per GPU (`opgraph plan`).

    from opgraph import hardware
    from opgraph.models import preset
    from opgraph.search import Space, search
    found = search(preset("llama3-70b"), hardware.get("h100-sxm"), Space(gpus=256, batch=512))
    found.best[0].layout, found.best[0].step_time_s

**The space** (`Space`, `candidates`): tensor parallelism up to a node (powers of two that the
heads and widths divide), context parallelism (powers of two, ring attention's two chunks per
GPU dividing the sequence), expert parallelism for a mixture of experts (powers of two that
divide the experts and dp x cp), pipeline stages that split the layers evenly or, as Llama 3
did, with one layer fewer on the first and the last stage; data parallelism takes the GPUs
left; every ZeRO stage, micro-batch (the divisors of the sequences each data-parallel rank runs,
up to `max_micro_batch`), interleaved virtual stages (even stages, micro-batches a multiple of
the stages, as Megatron-LM requires), recomputation policy, sequence parallelism (with tensor
parallelism) and precision (FP8 where the part has an FP8 peak). Constraints fix or bound any of
them.

**Compiled once, evaluated as arrays.** Layouts fall into *structures*: which degrees exceed 1,
the ZeRO stage, sequence parallelism, recomputation, precision and the pipeline split decide
which ops and collectives the step has; the degree values and the micro-batch only change the
numbers. Each structure is compiled once (`distributed.compile_parallel`, `split_stages`), its
degrees left as symbols (`opgraph.parallel`), and every op's FLOPs, bytes, count and message,
and every tensor's size in the liveness analysis, lambdified into one numpy function of the
degrees and the micro-batch. Over all of a structure's layouts at once, as arrays:

- memory per GPU: the liveness peak of each stage (`opgraph.memory`: each op's live bytes as a
  matrix over the tensors' lives), its activations times the micro-batches in flight, the
  fullest stage's; layouts that do not fit are dropped;
- a lower bound of the step: the pipeline span (`schedule.pipeline_span`) of each stage's
  compute alone, every op at the cost model's time; no exposed communication, no tail.

**Exact figures by branch and bound.** The layouts that fit are taken in order of their bound;
each is scheduled exactly, by the same critical path `opgraph profile` runs
(`distributed.step_figures`, `schedule.simulate`) on the numbers the arrays gave, until the
bound of the next one is no better than the K-th best step found. So the layouts returned carry
`profile`'s figures (a test checks them on a random sample against `profile` itself, relative
1e-9), and every layout not returned is provably no faster than the last one returned.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable

import attrs
import numpy as np
import sympy

from . import cluster as clusters
from .costmodel import DEFAULT, EFFICIENCY, CostModel
from .distributed import (
    Job,
    ParallelResult,
    Stage,
    StageOp,
    check_layout,
    compile_parallel,
    in_flight,
    step_figures,
)
from .errors import OpgraphError
from .hardware import Hardware
from .ir import Graph, Phase
from .memory import PEAK_PARTS, Memory, liveness
from .parallel import Parallel, cp, dp, edp, ep, pp, tp
from .passes.evaluate import mfu_parameters, resolve
from .passes.precision import PRECISIONS
from .passes.recompute import POLICIES
from .passes.split_stages import layer_stack, split_stages
from .rules import COLLECTIVE_KINDS
from .schedule import once_per_step, plan
from .symbols import B, E, S

ZERO = (0, 1, 2, 3)
RECOMPUTE = tuple(POLICIES)
DEGREES = (tp, cp, ep, dp, edp, pp, B)  # the arguments of every compiled function


@attrs.frozen(kw_only=True)
class Space:
    """What to search: `gpus` and the global batch in sequences (`batch`), with constraints.
    A field set to a value fixes it (`tp=8`); None leaves it free; `max_*` bound the free ones.
    `recompute` and `precision` are tuples of the choices to try (None: all; FP8 only where
    the part has an FP8 peak)."""

    gpus: int
    batch: int
    tp: int | None = None
    cp: int | None = None
    ep: int | None = None
    pp: int | None = None
    dp: int | None = None
    zero: int | None = None
    micro_batch: int | None = None
    virtual_stages: int | None = None
    sequence_parallel: bool | None = None
    recompute: tuple[str, ...] | None = None
    precision: tuple[str, ...] | None = None
    max_tp: int | None = None
    max_cp: int | None = None
    max_pp: int | None = None
    max_micro_batch: int = 16
    max_virtual_stages: int = 8
    async_tp: bool = False

    def __attrs_post_init__(self):
        for name in ("gpus", "batch"):
            if getattr(self, name) < 1:
                raise OpgraphError(f"--{name} must be 1 or more")
        for name in ("tp", "cp", "pp"):
            fixed, bound = getattr(self, name), getattr(self, f"max_{name}")
            if fixed is not None and bound is not None and fixed > bound:
                raise OpgraphError(f"--{name} {fixed} contradicts --max-{name} {bound}; "
                                   "give one of them")
        if self.micro_batch is not None and self.micro_batch > self.max_micro_batch:
            object.__setattr__(self, "max_micro_batch", self.micro_batch)
        if self.sequence_parallel and self.tp == 1:
            raise OpgraphError("--sequence-parallel contradicts --tp 1: it needs tensor "
                               "parallelism")
        if self.async_tp and self.tp == 1:
            raise OpgraphError("--async-tp contradicts --tp 1: it needs tensor parallelism")
        if self.virtual_stages not in (None, 1) and self.pp == 1:
            raise OpgraphError(f"--virtual-stages {self.virtual_stages} contradicts --pp 1: "
                               "interleaving needs pipeline stages")
        for name, allowed in (("recompute", RECOMPUTE), ("precision", PRECISIONS)):
            for value in getattr(self, name) or ():
                if value not in allowed:
                    raise OpgraphError(f"--{name} {value!r}: choose from {', '.join(allowed)}")


@attrs.frozen
class Candidate:
    """One point of the space: a layout and the step's options."""

    layout: Parallel
    recompute: str = "none"
    precision: str = "bf16"

    def to_json(self) -> dict:
        """The degrees and options as `profile --json` names them."""
        return {"gpus": self.layout.world, **self.layout.to_json(), "recompute": self.recompute,
                "precision": self.precision}


@attrs.frozen
class Ranked:
    """A layout scheduled exactly: its figures as `profile` gives them."""

    candidate: Candidate
    result: ParallelResult

    @property
    def layout(self) -> Parallel:
        return self.candidate.layout

    @property
    def step_time_s(self) -> float:
        return self.result.step_time_s

    def to_json(self) -> dict:
        r = self.result
        return {**self.candidate.to_json(), "step_time_s": r.step_time_s,
                "tokens_per_s_per_gpu": r.tokens_per_s_per_gpu, "mfu": r.mfu,
                "memory": r.memory.to_json(), "memory_stage": r.memory_stage,
                "bubble_s": r.bubble_s, "exposed_communication_s": r.exposed_communication_s}


@attrs.frozen
class Found:
    """A search's answer: the best layouts, best first, and what it took."""

    best: tuple[Ranked, ...]
    searched: int  # layouts evaluated (memory and bound), every one of the space
    fit: int  # of them, those that fit in memory
    scheduled: int  # of those, the ones scheduled exactly (branch and bound)
    structures: int  # distinct structures compiled
    compile_s: float
    evaluate_s: float
    smallest_memory: float = float("nan")  # bytes: the least any layout needs (when none fit)

    @property
    def layouts_per_s(self) -> float:
        return self.searched / self.evaluate_s if self.evaluate_s > 0 else float("inf")


# --- the space ----------------------------------------------------------------------------------

def _dims(forward: Graph) -> dict[str, int]:
    return {s.name: int(v) for s, v in forward.dims.items()}


def _layers(forward: Graph) -> int:
    return int(sympy.sympify(layer_stack(forward).count).xreplace(forward.dims))


def _powers(limit: int) -> list[int]:
    return [2 ** k for k in range(limit.bit_length()) if 2 ** k <= limit]


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def _splits(layers: int, pp_: int) -> list[tuple[int | None, int | None]]:
    """The pipeline splits tried for `pp_` stages: even, or (where that does not divide) one
    layer fewer on each end stage, as Llama 3 405B's 126 layers on 16 stages (7, 8 x 14, 7)."""
    if pp_ == 1 or layers % pp_ == 0:
        return [(None, None)]
    if pp_ > 2 and (layers + 2) % pp_ == 0 and (layers + 2) // pp_ > 1:
        end = (layers + 2) // pp_ - 1
        return [(end, end)]
    return []


def candidates(forward: Graph, hardware: Hardware, space: Space, seq_len: int,
               cluster: clusters.Cluster) -> list[Candidate]:
    """Every layout of `space` that divides the model (see the module), in a fixed order."""
    dims = _dims(forward) | {"S": seq_len}
    layers, node = _layers(forward), cluster.gpus_per_node
    experts = dims.get("E")
    tps = [space.tp] if space.tp else _powers(min(space.max_tp or node, space.gpus))
    cps = [space.cp] if space.cp else _powers(min(space.max_cp or space.gpus, space.gpus))
    eps = [space.ep] if space.ep else (_powers(experts) if experts else [1])
    pps = [space.pp] if space.pp else range(1, min(space.max_pp or layers, layers) + 1)
    zeros = [space.zero] if space.zero is not None else ZERO
    recompute = space.recompute or RECOMPUTE
    precision = space.precision or tuple(p for p in PRECISIONS
                                         if p != "fp8" or hardware.fp8_flops)
    out = []
    for t, c, p in itertools.product(tps, cps, pps):
        if space.gpus % (t * c * p):
            continue
        d = space.gpus // (t * c * p)
        if space.dp is not None and d != space.dp:
            continue
        if space.batch % d:
            continue
        per_rank = space.batch // d
        for (first, last), sp_ in itertools.product(_splits(layers, p), _sp(space, t)):
            for e in eps:
                if (d * c) % e:
                    continue
                layout = Parallel(tp=t, cp=c, ep=e, pp=p, dp=d, global_batch=space.batch,
                                  sequence_parallel=sp_, async_tp=space.async_tp and t > 1,
                                  first_stage_layers=first, last_stage_layers=last)
                if not _divides(forward, layout, seq_len):
                    continue
                for mb in ([space.micro_batch] if space.micro_batch else
                           _divisors(per_rank, space.max_micro_batch)):
                    if per_rank % mb:
                        continue
                    m = per_rank // mb
                    for v in _virtual(space, layers, p, first, m):
                        for z, r, pr in itertools.product(zeros, recompute, precision):
                            out.append(Candidate(attrs.evolve(layout, micro_batch=mb,
                                                              virtual_stages=v, zero=z), r, pr))
    return out


def _divides(forward: Graph, layout: Parallel, seq_len: int) -> bool:
    """Whether the model (and the sequence length searched) divides over `layout`, as
    `profile` checks it."""
    split = 2 * layout.cp if layout.cp > 1 else layout.tp if layout.sequence_parallel else 1
    if seq_len % split:
        return False
    try:
        check_layout(forward, layout)
    except OpgraphError:
        return False
    return True


def _sp(space: Space, t: int) -> list[bool]:
    if t == 1:
        return [False]
    return [space.sequence_parallel] if space.sequence_parallel is not None else [False, True]


def _virtual(space: Space, layers: int, p: int, first, m: int) -> list[int]:
    if p == 1 or first is not None:
        return [1] if space.virtual_stages in (None, 1) else []
    chunks = layers // p
    options = [v for v in _divisors(chunks, space.max_virtual_stages)
               if v == 1 or m % p == 0]  # Megatron: interleaving needs m a multiple of pp
    if space.virtual_stages is not None:
        return [space.virtual_stages] if space.virtual_stages in options else []
    return options


# --- structures ---------------------------------------------------------------------------------

def structure(c: Candidate) -> tuple:
    """What decides a candidate's ops and collectives (see the module); layouts of one
    structure differ only in numbers."""
    lay = c.layout
    split = ("one",) if lay.pp == 1 else ("even", lay.pp > 2) if lay.first_stage_layers is None \
        else ("uneven", lay.pp, lay.first_stage_layers, lay.last_stage_layers)
    return (lay.tp > 1, lay.cp > 1, lay.ep > 1, lay.size("dp") > 1, lay.size("edp") > 1,
            lay.sequence_parallel, lay.async_tp, lay.zero, c.recompute, c.precision, split)


FIRST, MIDDLE, LAST = "first", "middle", "last"


def _roles(layout: Parallel) -> list[tuple[str, int]]:
    """The distinct stages `distributed.prepare` evaluates, each with its role: the first, a
    middle one (standing for all of them), the last; one stage for pp 1."""
    if layout.pp == 1:
        return [(FIRST, 0)]
    middle = [(MIDDLE, 1)] if layout.pp > 2 else []
    return [(FIRST, 0), *middle, (LAST, layout.pp - 1)]


@attrs.frozen
class _StageFormulas:
    """One stage of a structure: its graph, its ops' fixed facts, and one numpy function of
    the degrees giving every number that varies (see `_compile_stage`)."""

    graph: Graph
    names: tuple[str, ...]
    kinds: tuple[str, ...]
    groups: tuple[str | None, ...]
    once: tuple[bool, ...]
    peaks: tuple[float, ...]
    rates: tuple[str, ...]
    function: object  # (*DEGREES) -> counts, FLOPs, bytes, messages, life sizes and counts
    n_ops: int
    n_lives: int
    one: np.ndarray  # (ops, lives): 1 a life counted once at op i, -1 with its count less one
    many: np.ndarray  # (ops, lives): 1 where every copy of a life counts at op i
    saved: np.ndarray  # (lives,) bool: a saved activation (else transient)
    moments: tuple[tuple[str, str], ...]  # each op's (name, phase), where a peak may happen
    busy_rows: tuple[int, ...]  # the compute ops of every micro-batch
    plans: dict = attrs.field(factory=dict, eq=False)  # pp -> (plain, last)


def _compile_stage(graph: Graph, hardware: Hardware, cost: CostModel, values: dict,
                   zero: int) -> _StageFormulas:
    costs = cost.op_costs(graph)
    fixed = {s: v for s, v in resolve(graph, values).items() if s not in DEGREES}
    ops = graph.ops()
    collective = [op.kind in COLLECTIVE_KINDS for op in ops]
    live = liveness(graph)
    rows = ([op.count for op in ops] + [costs[op.name].flops * op.count for op in ops]
            + [costs[op.name].bytes * op.count for op in ops]
            + [costs[op.name].message if c else 0 for op, c in zip(ops, collective)]
            + [life.tensor.nbytes for life in live.lives]
            + [life.tensor.count for life in live.lives]
            + [live.resident[name] for name in ("weights", "gradients", "optimizer")])
    exprs = [sympy.sympify(e).xreplace(fixed) for e in rows]
    function = sympy.lambdify(DEGREES, exprs, "numpy", cse=True)
    one = np.zeros((len(live.ops), len(live.lives)))
    many = np.zeros_like(one)
    for i in range(len(live.ops)):
        for j, life in enumerate(live.lives):
            n = live.copies(life, i, _COUNT)
            if n is _COUNT:
                many[i, j] = 1
            elif n is _COUNT_LESS_ONE:
                many[i, j], one[i, j] = 1, -1
            else:
                one[i, j] = n
    once = tuple(op.phase is Phase.OPTIMIZER or once_per_step(op, zero) for op in ops)
    return _StageFormulas(
        graph, tuple(op.name for op in ops), tuple(op.kind for op in ops),
        tuple(op.param("group") if c else None for op, c in zip(ops, collective)), once,
        tuple(cost.peak(hardware, costs[op.name].compute) for op in ops),
        tuple(EFFICIENCY.get(op.kind, "matmul") for op in ops), function, len(ops),
        len(live.lives), one, many, np.array([life.saved for life in live.lives], dtype=bool),
        tuple((op.name, op.phase.value) for op in live.ops),
        tuple(i for i in range(len(ops)) if not collective[i] and not once[i]))


class _Count:
    """Stands for a life's count in `Liveness.copies`, to read which of its answers it gave:
    the count, the count less one, or a number."""

    def __sub__(self, other):
        assert other == 1
        return _COUNT_LESS_ONE


_COUNT, _COUNT_LESS_ONE = _Count(), object()


@attrs.frozen
class _Structure:
    key: tuple
    stages: dict  # role -> _StageFormulas


def _compile_structure(forward: Graph, hardware: Hardware, c: Candidate, values: dict,
                       cost: CostModel) -> _Structure:
    layout = c.layout
    step = compile_parallel(forward, layout, recompute=c.recompute, precision=c.precision)
    return _Structure(structure(c), {
        role: _compile_stage(split_stages(step, layout, i), hardware, cost, values, layout.zero)
        for role, i in _roles(layout)})


def _plans(f: _StageFormulas, layout: Parallel, values: dict):
    """The schedule's plans of the stage for `layout`'s stage count (its layers' trip count)."""
    if layout.pp not in f.plans:
        subs = resolve(f.graph, values) | {pp: sympy.Integer(layout.pp)}
        ordered = f.graph.ops()
        per_micro = [op for op in ordered if op.phase is not Phase.OPTIMIZER
                     and not once_per_step(op, layout.zero)]
        f.plans[layout.pp] = (plan(f.graph, per_micro, subs), plan(f.graph, ordered, subs))
    return f.plans[layout.pp]


@attrs.frozen
class _Numbers:
    """A stage's numbers over a structure's candidates: a row per op (or life), a column per
    candidate."""

    counts: np.ndarray
    flops: np.ndarray
    bytes: np.ndarray
    messages: np.ndarray
    sizes: np.ndarray
    life_counts: np.ndarray
    resident: np.ndarray  # (3, candidates): weights, gradients, optimizer


def _numbers(f: _StageFormulas, args: list[np.ndarray]) -> _Numbers:
    out = f.function(*args)
    rows = np.empty((len(out), len(args[0])))
    for i, v in enumerate(out):
        rows[i] = v  # constants broadcast
    k, m = f.n_ops, f.n_lives
    return _Numbers(rows[:k], rows[k:2 * k], rows[2 * k:3 * k], rows[3 * k:4 * k],
                    rows[4 * k:4 * k + m], rows[4 * k + m:4 * k + 2 * m], rows[4 * k + 2 * m:])


def _arguments(layouts: list[Parallel]) -> list[np.ndarray]:
    """Each layout's degrees, as `DEGREES` orders them ("dp" and "edp" are group sizes, as
    `passes.replicate` names them)."""
    def column(values):
        return np.array(values, dtype=float)

    return [column([x.tp for x in layouts]), column([x.cp for x in layouts]),
            column([x.ep for x in layouts]), column([x.size("dp") for x in layouts]),
            column([x.size("edp") for x in layouts]), column([x.pp for x in layouts]),
            column([x.micro_batch for x in layouts])]


@attrs.frozen
class _Peak:
    """A stage's liveness peak over a structure's candidates (`memory.peak`, `figures`): the
    op it happens at, and each part."""

    at: np.ndarray
    weights: np.ndarray
    gradients: np.ndarray
    optimizer: np.ndarray
    activations: np.ndarray  # for one micro-batch
    transient: np.ndarray

    def memory(self, f: _StageFormulas, col: int, held: float, capacity) -> Memory:
        name, phase = f.moments[self.at[col]] if f.moments else ("", "")
        return Memory(name, phase, int(self.weights[col]), int(self.gradients[col]),
                      int(self.optimizer[col]), int(int(self.activations[col]) * held),
                      int(self.transient[col]), capacity=int(capacity) if capacity else None)


def _peak(f: _StageFormulas, nums: _Numbers) -> _Peak:
    n = nums.sizes.shape[1]
    w, g, o = nums.resident
    if not f.moments:
        zero = np.zeros(n)
        return _Peak(np.zeros(n, dtype=int), w, g, o, zero, zero)
    sizes, counted = nums.sizes, nums.sizes * nums.life_counts
    saved = f.saved[:, None]
    acts = f.one @ (sizes * saved) + f.many @ (counted * saved)
    trans = f.one @ (sizes * ~saved) + f.many @ (counted * ~saved)
    at = np.argmax(acts + trans, axis=0)  # the first op where the most is live
    cols = np.arange(n)
    return _Peak(at, w, g, o, acts[at, cols], trans[at, cols])


def _in_flight(p: np.ndarray, v: np.ndarray, m: np.ndarray, stage) -> np.ndarray:
    """`distributed.in_flight` over arrays."""
    held = np.minimum(p - stage, m)
    out = np.where(v > 1, held * (1 + (p - 1) / (p * v)), held)
    return np.where(p == 1, 1.0, out)


def _compute_time(f: _StageFormulas, nums: _Numbers, hardware: Hardware, cost: CostModel
                  ) -> np.ndarray:
    """Each candidate's compute on the stage per micro-batch, communication left out: its
    per-micro-batch ops' times under `cost`, summed."""
    rows = list(f.busy_rows)
    if not rows:
        return np.zeros(nums.flops.shape[1])
    flops, nbytes, counts = nums.flops[rows], nums.bytes[rows], nums.counts[rows]
    peaks = np.array([f.peaks[i] for i in rows])[:, None]
    if cost.name == "calibrated":
        e = cost.efficiencies(hardware)
        rate = np.array([getattr(e, f.rates[i]) for i in rows])[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            t = cost.scaled_time(flops, nbytes, counts, peaks, hardware.bandwidth, rate=rate,
                                 half=e.matmul_half_flops, bandwidth_share=e.bandwidth,
                                 launch=e.launch_s, maximum=np.maximum)
        t = np.where(counts > 0, t, 0.0)
    else:
        t = cost.time(flops, nbytes, peaks, hardware.bandwidth, np.maximum)
    return t.sum(axis=0)


# --- the search ---------------------------------------------------------------------------------

@attrs.frozen
class _Group:
    """A structure's candidates evaluated as arrays."""

    structure: _Structure
    candidates: list
    numbers: dict  # role -> _Numbers
    peaks: dict  # role -> _Peak
    held: dict  # role -> in-flight micro-batches per candidate
    bound: np.ndarray  # a lower bound of each candidate's step time
    fullest: np.ndarray  # each candidate's memory per GPU (its fullest stage's)


def _evaluate(s: _Structure, group: list[Candidate], hardware: Hardware,
              cost: CostModel) -> _Group:
    lay = [c.layout for c in group]
    args = _arguments(lay)
    p, m, v = (np.array([getattr(x, a) for x in lay], dtype=float)
               for a in ("pp", "micro_batches", "virtual_stages"))
    numbers = {r: _numbers(f, args) for r, f in s.stages.items()}
    busy = {r: _compute_time(f, numbers[r], hardware, cost) for r, f in s.stages.items()}
    # the pipeline span of compute alone: m x slowest + (sum - slowest) / v
    slowest = np.max(np.stack(list(busy.values())), axis=0)
    total = busy[FIRST] + busy.get(LAST, 0.0) + (p - 2) * busy.get(MIDDLE, 0.0)
    bound = m * slowest + (total - slowest) / v
    peaks = {r: _peak(f, numbers[r]) for r, f in s.stages.items()}
    index = {FIRST: 0.0, MIDDLE: 1.0, LAST: p - 1}
    held = {r: _in_flight(p, v, m, index[r]) for r in s.stages}
    totals = np.stack([pk.weights + pk.gradients + pk.optimizer
                       + np.floor(np.floor(pk.activations) * held[r]) + pk.transient
                       for r, pk in peaks.items()])
    return _Group(s, group, numbers, peaks, held, bound * (1 - 1e-9), totals.max(axis=0))


def _job(g: _Group, col: int, forward: Graph, hardware: Hardware, cluster, tokens: int,
         n_mfu: int, values: dict) -> Job:
    """Candidate `col` of a group as `distributed.prepare` would compile it, from the
    arrays' numbers."""
    layout = g.candidates[col].layout
    capacity = hardware.memory_bytes
    stages = []
    for role, index in _roles(layout):
        f, nums = g.structure.stages[role], g.numbers[role]
        ops = tuple(StageOp(f.names[k], f.kinds[k], int(round(nums.counts[k, col])),
                            float(nums.flops[k, col]), float(nums.bytes[k, col]), f.peaks[k],
                            f.groups[k], float(nums.messages[k, col]), f.once[k])
                    for k in range(f.n_ops))
        plain, last = _plans(f, layout, values)
        memory = g.peaks[role].memory(f, col, float(g.held[role][col]), capacity)
        stages.append(Stage(None, ops, plain, last, None, memory, index))
    distinct = [index for _, index in _roles(layout)]
    kinds = [min(i, 1) if i < layout.pp - 1 else i for i in range(layout.pp)]
    return Job(forward, hardware, cluster, layout, tuple(stages),
               tuple(distinct.index(k) for k in kinds), tokens, n_mfu)


def search(forward: Graph, hardware: Hardware, space: Space, *, seq_len: int | None = None,
           cluster: clusters.Cluster | None = None, cost: CostModel = DEFAULT, top: int = 10,
           cache: dict | None = None) -> Found:
    """The `top` fastest layouts of `space` (see the module), with the search's counts.
    `cache` (a dict) keeps compiled structures between calls: a scaling curve's sizes share
    them."""
    seq = seq_len or forward.seq_len
    if seq is None:
        raise OpgraphError(f"{forward.name} has no default sequence length; give --seq-len")
    if top < 1:
        raise OpgraphError("--top must be 1 or more")
    cluster = cluster or clusters.for_hardware(hardware)
    cache = {} if cache is None else cache
    t0 = time.perf_counter()
    found = candidates(forward, hardware, space, seq, cluster)
    if not found:
        raise OpgraphError(f"no layout of {forward.name} divides {space.gpus:,} GPUs and "
                           f"{space.batch:,} sequences per step within the constraints; "
                           "change --gpus, the batch or the constraints")
    values = {"S": seq}
    by_key: dict[tuple, list[Candidate]] = {}
    for c in found:
        by_key.setdefault(structure(c), []).append(c)
    compile_s = 0.0
    groups = []
    for key, group in by_key.items():
        if key not in cache:
            t1 = time.perf_counter()
            cache[key] = _compile_structure(forward, hardware, group[0], values, cost)
            compile_s += time.perf_counter() - t1
        groups.append(_evaluate(cache[key], group, hardware, cost))
    capacity = hardware.memory_bytes
    fits = [(float(g.bound[col]), gi, col) for gi, g in enumerate(groups)
            for col in np.flatnonzero(g.fullest <= capacity if capacity else
                                      np.ones(len(g.candidates), bool))]
    smallest = min(float(g.fullest.min()) for g in groups)
    tokens = space.batch * seq
    n_mfu = int(mfu_parameters(forward).xreplace(resolve(forward, values)))
    fits.sort()
    best: list[tuple[float, int, Ranked]] = []
    scheduled = 0
    for order, (bound, gi, col) in enumerate(fits):
        if len(best) >= top and bound >= best[-1][0]:
            break  # nothing left can beat the K-th best
        g = groups[gi]
        result = step_figures(_job(g, col, forward, hardware, cluster, tokens, n_mfu, values),
                              cost)
        scheduled += 1
        best.append((result.step_time_s, order, Ranked(g.candidates[col], result)))
        best.sort(key=lambda item: item[:2])
        del best[top:]
    elapsed = time.perf_counter() - t0
    return Found(tuple(r for _, _, r in best), len(found), len(fits), scheduled, len(by_key),
                 compile_s, elapsed - compile_s, smallest)


def evaluate_one(forward: Graph, hardware: Hardware, candidate: Candidate, *,
                 seq_len: int | None = None, cluster: clusters.Cluster | None = None,
                 cost: CostModel = DEFAULT, cache: dict | None = None) -> Ranked:
    """One candidate's figures by the search's path (its structure's compiled formulas, then
    the schedule), fit or not: what a test compares with `profile`."""
    seq = seq_len or forward.seq_len
    cluster = cluster or clusters.for_hardware(hardware)
    cache = {} if cache is None else cache
    values = {"S": seq}
    key = structure(candidate)
    if key not in cache:
        cache[key] = _compile_structure(forward, hardware, candidate, values, cost)
    g = _evaluate(cache[key], [candidate], hardware, cost)
    n_mfu = int(mfu_parameters(forward).xreplace(resolve(forward, values)))
    job = _job(g, 0, forward, hardware, cluster, candidate.layout.batch * seq, n_mfu, values)
    return Ranked(candidate, step_figures(job, cost))
