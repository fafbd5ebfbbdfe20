"""Plan a run: every parallel layout of a model on a number of GPUs, ranked by tokens per second
per GPU (`opgraph plan`).

    from opgraph import hardware
    from opgraph.models import preset
    from opgraph.search import Space, search
    found = search(preset("llama3-8b"), hardware.get("h100-sxm"), Space(gpus=64, batch=256))
    found.best[0].layout, found.best[0].step_time_s

**The space** (`Space`, `rows`): tensor parallelism within a node (powers of two that the heads
and widths divide); context parallelism (powers of two whose two ring-attention chunks per GPU
divide the sequence, while a GPU keeps `MIN_CP_TOKENS` of it); expert parallelism for a mixture
of experts (powers of two dividing the experts and dp x cp); pipeline stages that split the
layers evenly or, as Llama 3 405B did, with one layer fewer on the first and the last stage;
data parallelism takes the GPUs left, and must divide the batch. Then every ZeRO stage (where
there is data parallelism), micro-batch (the divisors of each rank's sequences, up to
`max_micro_batch`), interleaving (even stages only, micro-batches a multiple of the stages, as
Megatron-LM requires), recomputation policy, sequence parallelism (with tensor parallelism) and
precision (FP8 where the part has an FP8 peak). Constraints fix or bound any of them. A layout
is a `Row` while searched (tens of thousands are), a `Candidate` (a `Parallel` and the step's
options) when returned.

**Compiled once per structure, evaluated as arrays.** Which degrees exceed 1, sequence
parallelism, the ZeRO stage, recomputation, precision and whether there are one, two or more
pipeline stages decide which ops and collectives the step has (its *structure*); the degrees'
values, the split and the micro-batch only change numbers. Each structure is compiled once, by
the passes `profile` runs (`pipeline.step_passes`; a pass shared by several structures runs
once), its stages cut by `split_stages` with the stack's trip count a symbol (`LAYERS`), and
every op's count, FLOPs, bytes and message, every tensor's size and count in the liveness
analysis and the resident memory kept as formulas of `DEGREES`. Over all of a structure's rows
at once, those formulas are evaluated on numpy arrays (`_Program`), and from them:

- memory per GPU: each stage's liveness peak (`Liveness.copy_matrices`: each op's live bytes as
  a matrix product over the lives), its activations times the micro-batches in flight
  (`distributed.in_flight`), the fullest stage's; rows that do not fit are dropped;
- a lower bound of the step (`_step_bound`): from lower bounds of each stage's plain and last
  micro-batch — its compute plus the communication the stream surely waits for (`_waits`: a
  chain of tensor- or expert-parallel collectives from one op of a layer to another, less the
  ops that run between them; a mixture of experts' all-gather and all-to-all), the
  optimizer in the last, and each communication stream's collectives after the compute that
  releases them (`_released`) — through the pipeline span and the tail, as
  `distributed.step_figures` combines them. For the fastest layouts of Llama 3 8B on 64 GPUs
  and of Llama 3.1 405B on 16,384 it is 2.2% and 1.1% below the step.

**A bound before compiling.** A structure's compile costs about 50 ms on this machine's core
and a large space has hundreds of structures (four ZeRO stages x four recomputation policies x
two precisions x ...), most of which cannot hold the best layout. So every row first gets a
bound from far less (`_compute_bound`): the step before `replicate` and `split_stages`, one per
*compute key* (`compute_key`: the structure less the ZeRO stage, data parallelism and the
pipeline depth, which leave every forward and backward op as it is), costed once per key. A
stage's micro-batch takes at least its layer stack's compute ops times its layers, its ends'
ops and the stack's surely-waited collectives, and at least what ZeRO-2/3 move on a
data-parallel stream every micro-batch (`_moved`: each weight gathered once per phase that
reads it, each gradient reduce-scattered), through the same `_step_bound`; and a stage
holds at least its layers' weights, gradients and optimizer states as the ZeRO stage shards
them, and the activations they save (`_held`): a row that surely does not fit is out. Both read
a subset of what the compiled structure's arrays read (a test checks them below those, on
every row of random structures).

**Exact figures by branch and bound.** Structures, at their rows' least compute bound, and the
fitting rows of the structures evaluated, at their bound, are taken best first: a structure is
compiled and evaluated when it comes up, and a row is scheduled exactly, by the critical path
`opgraph profile` runs (`distributed.step_figures`, `schedule.simulate`) on the numbers the
arrays gave, with its memory made whole as `memory.figures` makes it, until nothing left has
a bound below the K-th best step found. So the layouts returned carry `profile`'s figures (a
test compares random layouts of many structures with `profile` itself, relative 1e-9, and
another the top K with every layout of a small space scheduled), every layout not returned is
no faster than the last one returned, and only the structures that might hold a better one are
compiled: 5 of 512 for Llama 3.1 405B on 16,384 GPUs. Ties are broken by the order the space
lists the rows, so the answer does not depend on what was pruned.

**Where a layout ranks** (`--rank`, `Searcher.faster_than`) counts the layouts faster than it.
A row whose upper bound is below its step is counted unscheduled: every op of each micro-batch
run one at a time (the critical path never leaves every stream idle while an op is left, so
it is no longer than that), through the pipeline span, the longest tail and the overlap
slowdown on all the communication (`_step_upper`). Only the rows between the two bounds are
scheduled exactly: for the README's Llama 3 layout 414 of the 568 faster are counted under
their upper bound, and 280 scheduled, against 694 without it.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import time
from typing import NamedTuple

import attrs
import numpy as np
import sympy

from . import cluster as clusters
from . import contracts, pipeline
from .costmodel import DEFAULT, CostModel
from .distributed import (Job, ParallelResult, Stage, StageOp, check_layout,
                          step_figures, unequal_chunks)
from .errors import OpgraphError
from .frameworks import FRAMEWORKS, Traits, bucket_share, end_split, own_split, run_zero
from .hardware import Hardware
from .ir import DTYPES, Graph, Phase
from .limits import MAX_MICRO_BATCHES
from .memory import RESIDENT, Memory, liveness, resident_tensors, saved
from .outputs.progress import progress, progressed
from .parallel import ZERO_STAGES, Parallel, cp, dp, edp, ep, pp, stage_layers, tp
from .passes.evaluate import mfu_parameters, resolve
from .passes.precision import PRECISIONS
from .passes.recompute import POLICIES
from .passes.replicate import GROUPS
from .passes.replicate import group_of as replicate_group
from .passes.split_stages import FIRST as FIRST_END
from .passes.split_stages import LAST as LAST_END
from .passes.split_stages import STACK, ends, layer_stack, split_stages
from .rules import COLLECTIVE_KINDS
from .schedule import once_per_step, plan
from .symbols import B

# Context parallelism is searched while each GPU keeps this many tokens of a sequence (ring
# attention on shorter blocks is latency-bound); --max-cp lifts it.
MIN_CP_TOKENS = 1024
RECOMPUTE = tuple(POLICIES)
# The layers a pipeline stage holds: its graph's layer stack counts this many, so one compiled
# stage serves every split (even, or Llama 3's uneven ends).
LAYERS = sympy.Symbol("stage_layers", positive=True, integer=True)
DEGREES = (tp, cp, ep, dp, edp, LAYERS, B)


@attrs.frozen(kw_only=True)
class Space:
    """What to search: `gpus` and the global batch in sequences (`batch`), with constraints.
    A degree set to a value is fixed (`tp=8`), None leaves it free, `max_*` bound the free
    ones; `recompute` and `precision` are the choices to try (None: every recomputation policy;
    BF16, and FP8 where the part has an FP8 peak)."""

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
    framework: str | None = None  # whose behaviour every layout follows (`opgraph.frameworks`)
    grad_reduce_dtype: str | None = None

    def __attrs_post_init__(self):
        for name in ("gpus", "batch", "max_micro_batch", "max_virtual_stages"):
            if getattr(self, name) < 1:
                raise OpgraphError(f"--{name.replace('_', '-')} must be 1 or more")
        for name in ("tp", "cp", "pp"):
            fixed, bound = getattr(self, name), getattr(self, f"max_{name}")
            if fixed is not None and bound is not None and fixed > bound:
                raise OpgraphError(f"--{name} {fixed} contradicts --max-{name} {bound}; "
                                   "give one of them")
        if self.micro_batch is not None and self.micro_batch > self.max_micro_batch:
            raise OpgraphError(f"--micro-batch {self.micro_batch} contradicts "
                               f"--max-micro-batch {self.max_micro_batch}; give one of them")
        if self.sequence_parallel and self.tp == 1:
            raise OpgraphError("--sequence-parallel contradicts --tp 1: it needs tensor "
                               "parallelism")
        if self.async_tp and self.tp == 1:
            raise OpgraphError("--async-tp contradicts --tp 1: it needs tensor parallelism")
        if self.virtual_stages not in (None, 1) and self.pp == 1:
            raise OpgraphError(f"--virtual-stages {self.virtual_stages} contradicts --pp 1: "
                               "interleaving needs pipeline stages")
        if self.zero is not None and self.zero not in ZERO_STAGES:
            raise OpgraphError(f"--zero {self.zero}: give 0, 1, 2 or 3")
        # the framework's names and its combinations, checked as a layout checks them
        Parallel(framework=self.framework, grad_reduce_dtype=self.grad_reduce_dtype)
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
    searched: int  # layouts bounded (by their compute bound at least): the whole space
    fit: int  # of the evaluated structures' layouts, those that fit in memory
    scheduled: int  # of those, the ones scheduled exactly (branch and bound)
    structures: int  # distinct structures
    evaluated: int  # of them, those whose rows were evaluated (the rest bounded out)
    compile_s: float
    evaluate_s: float  # everything else: enumerating, the bounds, the arrays, the exact ones
    smallest_memory: float  # bytes per GPU: the least any layout needs

    @property
    def layouts_per_s(self) -> float:
        return self.searched / self.evaluate_s if self.evaluate_s > 0 else float("inf")


# --- the space ----------------------------------------------------------------------------------

class Row(NamedTuple):
    """A candidate before it is one (`Candidate`): the search holds tens of thousands."""

    tp: int
    cp: int
    ep: int
    pp: int
    dp: int
    micro_batch: int
    virtual_stages: int
    zero: int
    sequence_parallel: bool
    first: int | None
    last: int | None
    recompute: str
    precision: str
    batch: int
    async_tp: bool
    framework: str | None = None
    grad_reduce_dtype: str | None = None

    def layout(self) -> Parallel:
        return Parallel(tp=self.tp, cp=self.cp, ep=self.ep, pp=self.pp, dp=self.dp,
                        micro_batch=self.micro_batch, global_batch=self.batch,
                        virtual_stages=self.virtual_stages, zero=self.zero,
                        sequence_parallel=self.sequence_parallel, async_tp=self.async_tp,
                        first_stage_layers=self.first, last_stage_layers=self.last,
                        framework=self.framework, grad_reduce_dtype=self.grad_reduce_dtype)

    @property
    def traits(self) -> Traits:
        return FRAMEWORKS[self.framework]

    @property
    def zero_run(self) -> int:
        """The ZeRO stage the job runs (`frameworks.sharding`)."""
        return run_zero(self.zero, self.pp, self.framework)

    @property
    def wire(self) -> str:
        """The dtype gradients are reduced in (`frameworks.reduce_dtype`)."""
        return self.grad_reduce_dtype or self.traits.grad_reduce_dtype

    def candidate(self) -> Candidate:
        return Candidate(self.layout(), self.recompute, self.precision)

    @property
    def dp_group(self) -> int:  # `Parallel.size("dp")`: the ranks holding the same weights
        return self.dp * self.cp

    @property
    def edp_group(self) -> int:  # `Parallel.size("edp")`
        return self.dp * self.cp // self.ep

    @property
    def micro_batches(self) -> int:
        return self.batch // (self.dp * self.micro_batch)


def row_of(c: Candidate) -> Row:
    lay = c.layout
    return Row(lay.tp, lay.cp, lay.ep, lay.pp, lay.dp_degree, lay.micro_batch,
               lay.virtual_stages, lay.zero, lay.sequence_parallel, lay.first_stage_layers,
               lay.last_stage_layers, c.recompute, c.precision, lay.batch, lay.async_tp,
               lay.framework, lay.grad_reduce_dtype)


def _layers(forward: Graph) -> int | None:
    """The layers of the layer stack pipeline parallelism splits (`split_stages.layer_stack`:
    DeepSeek's L - k expert layers beside its fixed ones, Gemma 2's L / 2 pairs); None where
    no stack splits."""
    try:
        region = layer_stack(forward)
    except OpgraphError:
        return None
    if len(sympy.sympify(region.count).free_symbols) != 1:
        return None
    return int(sympy.sympify(region.count).xreplace(forward.dims))


def _powers(limit: int) -> list[int]:
    return [2 ** k for k in range(limit.bit_length()) if 2 ** k <= limit]


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def _splits(layers: int, stages: int, forward: Graph | None = None,
            framework: str | None = None) -> list[tuple[int | None, int | None]]:
    """The pipeline splits tried for `stages` stages: the framework's own where it makes one
    (`frameworks.own_split`, as `distributed.framework_split` gives `profile`), none where
    that needs every stage's layers said (`Parallel.stage_layers`, which the search's first,
    middle and last stages cannot hold); else even, or (where that does not divide) one layer
    fewer on each end stage, as Llama 3 405B's 126 layers on 16 stages (7, 8 x 14, 7)."""
    own = None if forward is None else own_split(forward, stages, framework)
    if own is not None:
        ends = end_split(own)
        return [] if ends is None else [ends]
    if stages == 1 or layers % stages == 0:
        return [(None, None)]
    if stages > 2 and (layers + 2) % stages == 0 and (layers + 2) // stages > 1:
        end = (layers + 2) // stages - 1
        return [(end, end)]
    return []


def _pipelines(space: Space, layers: int | None) -> list[int]:
    """The pipeline degrees `space` tries for a stack of `layers` (None: no stack to split)."""
    if space.pp:
        return [space.pp]
    return [1] if layers is None else list(range(1, min(space.max_pp or layers, layers) + 1))


def unsplit_degrees(forward: Graph, space: Space) -> dict[int, tuple[int, ...]]:
    """The pipeline degrees of `space` that `rows` cannot hold because the framework's own
    split of them needs every stage's count said (`_splits`), each with that split: what
    `rows` refuses where `space` names the degree, and `plan` warns of where it does not."""
    layers = _layers(forward)
    if layers is None:
        return {}
    out = {}
    for p in _pipelines(space, layers):
        own = own_split(forward, p, space.framework) if space.gpus % p == 0 else None
        if own is not None and end_split(own) is None:
            out[p] = own
    return out


def rows(forward: Graph, hardware: Hardware, space: Space, seq_len: int,
         cluster: clusters.Cluster) -> list[Row]:
    """Every layout of `space` that divides the model (see the module), in a fixed order."""
    dims = {s.name: int(v) for s, v in forward.dims.items()}
    layers, node = _layers(forward), cluster.gpus_per_node
    experts = dims.get("E")
    tps = [space.tp] if space.tp else _powers(min(space.max_tp or node, space.gpus))
    cps = [space.cp] if space.cp else _powers(min(space.max_cp or max(1, seq_len // MIN_CP_TOKENS),
                                                  space.gpus))
    eps = [space.ep] if space.ep else (_powers(experts) if experts else [1])
    if layers is None and (space.pp or 1) > 1:
        region = layer_stack(forward)  # says why, in one line, where no stack splits
        raise OpgraphError(f"{forward.name}'s layer stack {region.name} runs {region.count} "
                           "times, not a count of one dimension; pipeline parallelism needs "
                           "one (leave out --pp)")
    pps = _pipelines(space, layers)
    zeros = [space.zero] if space.zero is not None else ZERO_STAGES
    recompute = space.recompute or RECOMPUTE
    precision = space.precision or tuple(p for p in PRECISIONS
                                         if p != "fp8" or hardware.fp8_flops)
    if "fp8" in precision and not hardware.fp8_flops:
        raise OpgraphError(f"--precision fp8: {hardware.id} has no dense FP8 peak; give a part "
                           "that has one, or leave it out")
    options = list(itertools.product(zeros, recompute, precision))
    alone = [o for o in options if o[0] == min(zeros)]  # no data parallelism: nothing to shard
    out: list[Row] = []
    checked: dict = {}
    # each stage count's splits once (a framework's own weighs the model's blocks)
    splits = {p: _splits(layers, p, forward, space.framework) for p in pps}
    own = unsplit_degrees(forward, space).get(space.pp) if space.pp else None
    if own is not None:
        raise OpgraphError(
            f"--framework {space.framework} splits {forward.name}'s {layers} layers over "
            f"{space.pp} stages as {'/'.join(map(str, own))}, which plan's first, middle and "
            f"last stages cannot hold; profile that layout (opgraph profile --pp "
            f"{space.pp} --framework {space.framework}), or plan another --pp")
    for t, c, p in itertools.product(tps, cps, pps):
        if space.gpus % (t * c * p):
            continue
        d = space.gpus // (t * c * p)
        if (space.dp is not None and d != space.dp) or space.batch % d:
            continue
        per_rank = space.batch // d
        for (first, last), sp_ in itertools.product(splits[p], _sp(space, t)):
            for e in eps:
                if (d * c) % e or not _divides(forward, seq_len, t, c, e, p, sp_, first,
                                               last, checked, space.framework):
                    continue
                for mb in ([space.micro_batch] if space.micro_batch else
                           _divisors(per_rank, space.max_micro_batch)):
                    if per_rank % mb or per_rank // mb > MAX_MICRO_BATCHES:  # `Parallel`'s bound
                        continue
                    for v in _virtual(space, layers, p, first, last, per_rank // mb):
                        out += [Row(t, c, e, p, d, mb, v, z, sp_, first, last, r, pr,
                                    space.batch, space.async_tp and t > 1, space.framework,
                                    space.grad_reduce_dtype)
                                for z, r, pr in (options if d * c > 1 else alone)
                                if not _refused(space, p, z)]
    return out


def _refused(space: Space, stages: int, zero: int) -> bool:
    """Whether the framework cannot run ZeRO stage `zero` on `stages` pipeline stages (as
    `Parallel` checks it: DeepSpeed's pipeline engine takes ZeRO 0 and 1 only)."""
    return space.framework == "deepspeed" and stages > 1 and zero >= 2


def _divides(forward: Graph, seq: int, t, c, e, p, sp_, first, last, cache: dict,
             framework: str | None = None) -> bool:
    """Whether the model divides over the degrees as `profile` checks it
    (`distributed.check_layout`, at its own sequence length and the one searched; the
    framework's, which may pad the vocabulary)."""
    key = (t, c, e, p, sp_, first, last)
    if key not in cache:
        # dp = ep: any data-parallel degree the experts divide (checked by the caller)
        layout = Parallel(tp=t, cp=c, ep=e, pp=p, dp=e, sequence_parallel=sp_,
                          first_stage_layers=first, last_stage_layers=last,
                          framework=framework)
        try:
            check_layout(forward, layout, seq)
            cache[key] = True
        except OpgraphError:
            cache[key] = False
    return cache[key]


def _sp(space: Space, t: int) -> list[bool]:
    """Sequence parallelism's choices at tensor-parallel degree `t` (none without it, so
    `--sequence-parallel` leaves out the layouts without tensor parallelism)."""
    if t == 1:
        return [] if space.sequence_parallel else [False]
    return [space.sequence_parallel] if space.sequence_parallel is not None else [False, True]


def _virtual(space: Space, layers: int, p: int, first, last, m: int) -> list[int]:
    """Virtual stages per GPU: the divisors of a stage's layers (with uneven ends, of a middle
    stage's: the end stages' outer chunks hold one layer fewer, as `chunk_layers` cuts them,
    Llama 3 405B's schedule; two uneven stages have no middle one, and do not interleave)."""
    uneven = first is not None or last is not None
    if p == 1 or (p == 2 and uneven):
        return [1] if space.virtual_stages in (None, 1) else []
    # a middle stage's layers, as `chunk_layers` splits what the end stages leave
    ends = (first is not None) + (last is not None)
    each = (layers - (first or 0) - (last or 0)) // (p - ends) if p > ends else 0
    options = [v for v in _divisors(each, space.max_virtual_stages)
               if (v == 1 or m % p == 0)  # Megatron: interleaving needs m a multiple of pp
               and all(n is None or each // v * (v - 1) <= n <= each  # an end stage's outer
                       for n in (first, last))]  # chunk holds what it lacks of v chunks
    if space.virtual_stages is not None:
        return [space.virtual_stages] if space.virtual_stages in options else []
    return options


# --- structures ---------------------------------------------------------------------------------

def structure(r: Row) -> tuple:
    """What decides a row's ops and collectives (see the module); rows of one structure
    differ only in numbers."""
    return (r.tp > 1, r.cp > 1, r.ep > 1, r.dp_group > 1, r.edp_group > 1, r.sequence_parallel,
            r.async_tp, r.zero, r.recompute, r.precision, min(r.pp, 3), r.framework,
            r.grad_reduce_dtype)


FIRST, MIDDLE, LAST = ROLES = "first", "middle", "last"


def _roles(stages: int) -> list[tuple[str, int]]:
    """The distinct stages `distributed.prepare` evaluates, with their indices: the first, a
    middle one (standing for all of them), the last; one for a single stage."""
    if stages == 1:
        return [(FIRST, 0)]
    return [(FIRST, 0), *([(MIDDLE, 1)] if stages > 2 else []), (LAST, stages - 1)]


@attrs.frozen
class _StageFormulas:
    """One stage of a structure: its graph, its ops' fixed facts, and the formulas of every
    number that varies, over `DEGREES`."""

    graph: Graph
    layers: int | None  # the model's (None: several stacks, one stage)
    names: tuple[str, ...]
    kinds: tuple[str, ...]
    groups: tuple[str | None, ...]
    once: tuple[bool, ...]
    peaks: tuple[float, ...]
    exprs: tuple  # counts, FLOPs, bytes, messages per op; sizes, counts per life; resident;
    # grids; calls and launches per op
    tape: _Tape  # the exprs as one program over arrays
    n_ops: int
    n_lives: int
    one: np.ndarray  # (ops, lives): 1 a life counted once at op i, -1 its count less one
    many: np.ndarray  # (ops, lives): 1 where every copy of a life counts at op i
    saved: np.ndarray  # (lives,) bool: a saved activation (else transient)
    moments: tuple[tuple[str, str], ...]  # each op's (name, phase), where a peak may happen
    busy_rows: tuple[int, ...]  # the compute ops of every micro-batch
    optimizer_rows: tuple[int, ...]  # the compute ops of the last one only (the optimizer)
    releases: tuple  # (plain, last): each one's `_Releases`
    waits: tuple[_Waits, ...]  # where the stream must wait for communication (`_waits`)
    plans: dict = attrs.field(factory=dict, eq=False)  # layers -> (plain, last)


def _compile_stage(graph: Graph, hardware: Hardware, cost: CostModel, values: dict,
                   zero: int, layers: int, costs: dict, fixed_memo: dict,
                   program: _Program) -> _StageFormulas:
    missing = [op for op in graph.ops() if op.name not in costs]
    if missing:
        costs = costs | {op.name: cost.op_cost(graph, op) for op in missing}
    # the stack's count (L / pp) becomes the stage's layers; the other dimensions numbers
    fixed = {s: v for s, v in resolve(graph, values).items() if s not in DEGREES and s != pp}
    fixed[pp] = sympy.Integer(layers or 1) / LAYERS
    ops = graph.ops()
    collective = [op.kind in COLLECTIVE_KINDS for op in ops]
    live = liveness(graph)
    formulas = ([op.count for op in ops] + [costs[op.name].flops * op.count for op in ops]
                + [costs[op.name].bytes * op.count for op in ops]
                + [costs[op.name].message if c else 0 for op, c in zip(ops, collective)]
                + [life.tensor.nbytes for life in live.lives]
                + [life.tensor.count for life in live.lives]
                + [live.resident[name] for name in RESIDENT]
                + _grids(ops, costs)
                + [costs[op.name].calls if c else 1 for op, c in zip(ops, collective)]
                + [costs[op.name].launches for op in ops])
    exprs = tuple(_fixed(e, fixed, fixed_memo) for e in formulas)
    one, many = live.copy_matrices()
    once = tuple(op.phase is Phase.OPTIMIZER or once_per_step(op, zero) for op in ops)
    return _StageFormulas(
        graph, layers, tuple(op.name for op in ops), tuple(op.kind for op in ops),
        tuple(op.param("group") if c else None for op, c in zip(ops, collective)), once,
        tuple(cost.peak(hardware, costs[op.name].compute) for op in ops), exprs,
        program.tape(exprs),
        len(ops),
        len(live.lives), one, many, np.array([life.saved for life in live.lives], dtype=bool),
        tuple((op.name, op.phase.value) for op in live.ops),
        tuple(i for i in range(len(ops)) if not collective[i] and not once[i]),
        tuple(i for i in range(len(ops)) if not collective[i] and once[i]),
        (_releases(graph, ops, collective, [not o for o in once]),
         _releases(graph, ops, collective, [True] * len(ops))),
        _waits(graph, ops, collective, once))


def _grids(ops: list, costs: dict) -> list:
    """Each op's matrix-multiply grid (`Cost.grid`: GEMMs, M, N), three rows of formulas, the
    last of a stage's: zeros for an op that is none."""
    grids = [costs[op.name].grid or (0, 0, 0) for op in ops]
    return [g[i] for i in range(3) for g in grids]


def _fixed(expr, fixed: dict, memo: dict):
    """`expr` with the fixed dimensions substituted, once per distinct formula (the
    structures share most of theirs; `fixed` is the same for all of a model's)."""
    if expr not in memo:
        memo[expr] = sympy.sympify(expr).xreplace(fixed)
    return memo[expr]


# The groups whose collectives `_waits` counts: tensor and expert parallelism (context
# parallelism's run under their readers, `schedule.overlapped`; data parallelism's are not
# read by the next op).
_WAITED = ("tp", "ep")


@attrs.frozen
class _Waits:
    """A run of consecutive compute ops of one region and count (none once per step), and
    where in it the stream surely waits (`_waits`): `targets` are (a reader's position in
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
        if (c is None or c.kind not in COLLECTIVE_KINDS or c.param("group") not in _WAITED
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


def _waits(graph: Graph, ops: list, collective: list, once: tuple) -> tuple[_Waits, ...]:
    """Where the compute stream surely waits for communication, every micro-batch: a compute
    op that reads a chain of collectives of a group that does not overlap its reader
    (`schedule.overlapped`; tensor parallelism's without --async-tp, checked per row), the
    first reading what compute ops of the same run wrote (the same region and count; the
    optimizer's ops count as compute, so a run is the same in the last micro-batch). The chain
    starts no earlier than the first of those writers ends (`schedule.simulate` starts a
    collective when one input is written) and each collective no earlier than the one before it
    ends, so the reader starts no earlier than that writer's end plus the chain; the ops between
    them run in the meantime. `_waited_time` takes the longest path through a run's ops with
    these edges. Returns the runs with a wait."""
    index = {op.name: i for i, op in enumerate(ops)}
    runs: list[list[int]] = []
    for i, op in enumerate(ops):
        if collective[i]:
            continue
        last = ops[runs[-1][-1]] if runs else None
        if (last is not None and not once[i] and not once[runs[-1][-1]]
                and last.region == op.region and last.count == op.count):
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
            out.append(_Waits(tuple(run), tuple(targets)))
    return tuple(out)


def _comm_times(f: _StageFormulas, nums: _Numbers, group: list, line) -> dict[int, np.ndarray]:
    """Each collective's seconds per instance over the rows, as `distributed._times` gives
    them: each algorithm NCCL may run takes a time affine in the message, so `line(kind,
    group, layout)` gives their intercepts and slopes (`CostModel.comm_lines`) once per kind
    and layout, and a collective takes the least of them over the rows' messages."""
    lines = _over_rows(group, line)
    out = {}
    for k in range(f.n_ops):
        if f.groups[k] is not None:
            base, slope = lines(f.kinds[k], f.groups[k])
            out[k] = (base * nums.calls[k] + slope * nums.messages[k]).min(axis=0)
    return out


def _over_rows(rows_: list, line):
    """`line` over the rows: `lines(kind, group)` gives each algorithm's intercept and slope
    (a row each) over the rows (a column each), each distinct layout's read once."""
    index: dict = {}
    where = np.array([index.setdefault((r.tp, r.cp, r.ep, r.pp, r.dp), len(index))
                      for r in rows_])

    @functools.lru_cache(maxsize=None)
    def lines(kind: str, group: str) -> tuple[np.ndarray, np.ndarray]:
        found = [line(kind, group, degrees) for degrees in index]
        most = max(map(len, found))  # a group of one has one line: repeat it
        pairs = np.array([pairs + pairs[-1:] * (most - len(pairs)) for pairs in found])
        return pairs[where, :, 0].T, pairs[where, :, 1].T
    return lines


def _comm_line(cost: CostModel, cluster, hardware: Hardware):
    """`_comm_times`'s `line`: each algorithm's time at no message and seconds per byte
    (`CostModel.comm_lines`), over the group `group` names in the layout of `degrees` (tp,
    cp, ep, pp, dp), each distinct group size and stride read once."""

    @functools.lru_cache(maxsize=None)
    def affine(kind: str, size: int, stride: int, gpus: int) -> tuple[tuple[float, float], ...]:
        return cost.comm_lines(kind, size, cluster.for_job(gpus), stride, hardware)

    @functools.lru_cache(maxsize=None)
    def layout(degrees: tuple) -> Parallel:
        t, c, e, p, d = degrees
        return Parallel(tp=t, cp=c, ep=e, pp=p, dp=d)

    def line(kind: str, group: str, degrees: tuple) -> tuple[tuple[float, float], ...]:
        lay = layout(degrees)
        return affine(kind, lay.size(group), lay.stride(group), lay.world)
    return line


def _waited_time(f: _StageFormulas | _ComputeFormulas, nums: _Numbers, times: dict,
                 compute: np.ndarray, group: list) -> np.ndarray:
    """Each row's time the stage surely waits on communication per micro-batch (`_waits`):
    in each run, the longest path through one instance of its ops (each op after the one
    before it, a chain's reader after the chain's writer and the chain), less the ops' own
    time, times the instances."""
    total = np.zeros(nums.flops.shape[1])
    if not f.waits:
        return total
    overlapped_tp = np.array([r.async_tp for r in group])
    overlapping = overlapped_tp.any()
    for run in f.waits:
        instances = nums.counts[run.ops[0]]
        ends = np.cumsum(compute[list(run.ops)], axis=0) / np.maximum(instances, 1)
        idle = np.zeros_like(total)  # the stream's idle time before the reader, one instance
        before: list[np.ndarray] = []  # that of each reader
        for j, chains in run.targets:
            start = idle
            for first, chain, last in chains:
                t = sum(times[c] for c in chain)
                if overlapping and any(f.groups[c] == "tp" for c in chain):
                    t = np.where(overlapped_tp, 0.0, t)
                path = (before[last] if last >= 0 else 0.0) + t
                if first < j - 1:  # the ops between run meanwhile
                    path = path - (ends[j - 1] - ends[first])
                start = np.maximum(start, path)
            idle = start
            before.append(idle)
        total += instances * idle
    return total * (1 - 1e-6)


@attrs.frozen
class _Releases:
    """A micro-batch's compute ops cut into segments as `schedule.plan` cuts them (a run of
    one region's ops, repeated, or one op outside any), and the segment from which each of
    its collectives can start: its input's writer's, or (a weight's) the first."""

    compute: tuple  # (ops, (segments, ops)): the plan's compute ops, 1 where in a segment
    comm: tuple  # per group (ops, (segments, ops)): its collectives, 1 where released


def _releases(graph: Graph, ops: list, collective: list, planned: list) -> _Releases:
    """The `_Releases` of the micro-batch that runs the `planned` ops."""
    segment: dict[int, int] = {}
    index = {op.name: i for i, op in enumerate(ops)}
    n, region = -1, None
    for i, op in enumerate(ops):
        if collective[i] or not planned[i]:
            continue
        if n < 0 or op.region is None or op.region != region:
            n += 1
        region, segment[i] = op.region, n
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
    return _Releases(matrix(segment), tuple(matrix(g) for g in groups.values()))


def _released(r: _Releases, compute: np.ndarray, comm: np.ndarray) -> np.ndarray:
    """A lower bound of the micro-batch's span from its communication streams: a collective
    starts no earlier than the compute stream reaches the segment that releases it (every op
    of the segments before has run), and each group's run one after another on its stream, so
    the span is at least, for every segment and group, the compute before the segment plus
    the group's collectives released there or later (`schedule.simulate`'s tail takes in the
    last of them). `compute` and `comm` are each op's time over the rows (a row per op).
    Gradient reductions are never deferred here: a searched layout overlaps them
    (`Parallel.overlap_grad_reduce`'s default)."""
    out = np.zeros(compute.shape[1])
    ops, segments = r.compute
    if not r.comm or not len(ops):
        return out
    before = np.cumsum(segments @ compute[ops], axis=0)
    before = np.vstack([np.zeros((1, before.shape[1])), before[:-1]])  # each segment's start
    for ops, segments in r.comm:
        later = np.cumsum((segments @ comm[ops])[::-1], axis=0)[::-1]  # released there or later
        out = np.maximum(out, (before + later).max(axis=0))
    return out * (1 - 1e-6)


@attrs.frozen
class _Structure:
    key: tuple
    stages: dict  # role -> _StageFormulas


def _representative(r: Row, layers: int) -> Parallel:
    """A layout of `r`'s structure with an even pipeline split (its stages' graphs count L /
    pp layers, which `LAYERS` replaces): any split of the same stage count reads the same."""
    stages = r.pp if r.pp < 3 else next(p for p in range(3, layers + 1) if layers % p == 0)
    return Parallel(tp=r.tp, cp=r.cp, ep=r.ep, pp=stages, dp=r.dp,
                    sequence_parallel=r.sequence_parallel, zero=r.zero, async_tp=r.async_tp,
                    framework=r.framework, grad_reduce_dtype=r.grad_reduce_dtype)


def _step(forward: Graph, r: Row, layout: Parallel, memo: dict, replicated: bool = True
          ) -> Graph:
    """`distributed.compile_parallel`'s step for `r`'s structure, each pass's result kept in
    `memo` for the structures that share the passes before it (passes are pure functions);
    the checks ran when the row was enumerated, the verifier when `profile` compiles it.
    Not `replicated`: the passes before `replicate` (a compute key's ops, `compute_key`)."""
    graph, key = forward, ()
    for run in _passes(r, layout, replicated):
        key += (pipeline.pass_key(run),)  # the pipeline's own declaration of what it reads
        if key not in memo:
            contracts.check(run, graph)  # as `pipeline.run_passes` drives them
            memo[key] = run(graph)
        graph = memo[key]
    return graph


def _passes(r: Row, layout: Parallel, replicated: bool = True) -> list:
    """`distributed.compile_parallel`'s passes for `r`'s structure (`pipeline.step_passes`)."""
    return pipeline.step_passes(recompute=r.recompute, precision=r.precision, layout=layout,
                                replicated=replicated)


def _compile_structure(forward: Graph, layers: int | None, hardware: Hardware, r: Row,
                       values: dict, cost: CostModel, passes: dict, formulas: dict,
                       program: _Program) -> _Structure:
    layout = _representative(r, layers)
    step = _step(forward, r, layout, passes)
    costs = cost.op_costs(step)
    return _Structure(structure(r), {
        role: _compile_stage(split_stages(step, layout, i), hardware, cost, values, r.zero_run,
                             layers, costs, formulas, program)
        for role, i in _roles(layout.pp)})


# --- the bound before compiling -----------------------------------------------------------------

def compute_key(r: Row, layers: int | None) -> tuple:
    """What decides a row's compute ops: the passes before `replicate` for its structure, each
    by what its placement declares decides its ops (`pipeline.pass_key`), so a pass added to
    the pipeline is in the key with no word here; and what the bound reads of the framework
    beside them (`_moved`: re-gathers in the recomputation, bucketed reductions, the dtype
    they are reduced in). Data parallelism, the ZeRO stage and the pipeline stages are not in
    it: they add collectives, shard the optimizer and the resident memory, and cut the same
    ops apart. Rows of one `structure` share it (`Searcher` computes it once a structure)."""
    passes = _passes(r, _representative(r, layers), replicated=False)
    return (*map(pipeline.pass_key, passes), r.traits.regather_in_recompute,
            r.traits.buckets_grads, r.wire)


@attrs.frozen
class _ComputeFormulas:
    """A compute key's forward and backward ops over `DEGREES`, before the step is split into
    stages or replicated: the compute ops and the collectives `_waits` pairs with them (in
    `_StageFormulas`' layout: counts, FLOPs, bytes, messages), and where each op runs: a stack
    op on every stage, `LAYERS` times; an end op on the first or the last stage (or both).
    After them the bytes `_held` gives: what one layer of the stack holds, then the ends."""

    kinds: tuple[str, ...]
    groups: tuple[str | None, ...]
    peaks: tuple[float, ...]
    tape: _Tape
    n_ops: int
    places: tuple[np.ndarray, ...]  # the stack, the first end, the last: (ops,) 1 where it runs
    waits: tuple[_Waits, ...]  # `_waits` of the stack's ops


def _compile_compute(graph: Graph, hardware: Hardware, cost: CostModel, values: dict,
                     layers: int | None, fixed_memo: dict, program: _Program, r: Row
                     ) -> _ComputeFormulas:
    """`graph` is a compute key's step before `replicate` (`r` one of its rows); `fixed_memo`
    is kept apart from the stages' (here the stack's count, not its share per stage, becomes
    `LAYERS`)."""
    fixed = {s: v for s, v in resolve(graph, values).items() if s not in DEGREES}
    side = None
    if layers is not None:
        fixed[layer_stack(graph).count] = LAYERS
        side = ends(graph)
    costs = cost.op_costs(graph)
    # a micro-batch's ops: not the optimizer's, nor the FP8 weight casts run once a step
    # (`passes.cache_fp8_weights`), which a bound may leave out
    ops = [op for op in graph.ops() if op.phase is not Phase.OPTIMIZER
           and not op.param("cached")]
    collective = [op.kind in COLLECTIVE_KINDS for op in ops]
    once = (False,) * len(ops)
    waits = _waits(graph, ops, collective, once)
    if side is not None:  # a run counts on every stage only where all its ops are the stack's
        waits = tuple(w for w in waits if all(side[ops[k].name] == {STACK} for k in w.ops))
    formulas = ([op.count for op in ops] + [costs[op.name].flops * op.count for op in ops]
                + [costs[op.name].bytes * op.count for op in ops]
                + [costs[op.name].message if c else 0 for op, c in zip(ops, collective)])
    # where each compute op runs; with no one stack, all on the one stage
    runs = [side[op.name] if side is not None else {FIRST_END} for op in ops]
    places = tuple(np.array([not c and place in where for where, c in zip(runs, collective)],
                            dtype=float) for place in (STACK, FIRST_END, LAST_END))
    stack = layer_stack(graph).count if layers is not None else None
    formulas += (_held(graph, stack) + _moved(graph, stack, r.traits.regather_in_recompute,
                                              r.traits.buckets_grads,
                                              DTYPES[r.wire].itemsize) + _grids(ops, costs)
                 + [costs[op.name].launches for op in ops])
    exprs = tuple(_fixed(e, fixed, fixed_memo) for e in formulas)
    return _ComputeFormulas(
        tuple(op.kind for op in ops),
        tuple(op.param("group") if c else None for op, c in zip(ops, collective)),
        tuple(cost.peak(hardware, costs[op.name].compute) for op in ops),
        program.tape(exprs), len(ops), places, waits)


def _held(graph: Graph, stack) -> list:
    """The bytes a stage surely holds, as formulas: for the layer stack (the tensors counted by
    its trip count `stack`, here one layer) and then for the ends, each resident part's
    tensors (`memory.resident_tensors`) whose copies the data-parallel group and the expert
    data-parallel group hold (`replicate.group_of`), and the saved activations
    (`memory.saved`: all live at the backward's first op), but the carried ones."""
    parts = resident_tensors(graph)
    # a tensor a stack carries from layer to layer is one buffer handed on, not a copy per
    # layer, and a stage sends its last one on: left out
    carried = {n for r in graph.regions() for pair in r.carries for n in pair}
    chosen = [[t for t in parts[name] if replicate_group(t) == group]
              for name in RESIDENT for group in ("dp", "edp")]
    chosen.append([t for t in saved(graph) if t.name not in carried])
    out = []
    for in_stack in (True, False):
        for tensors in chosen:
            out.append(sympy.Add(*(t.nbytes * t.count for t in tensors
                                   if (stack in t.count.free_symbols) == in_stack)))
    return out


def _moved(graph: Graph, stack, regather: bool = True, buckets: bool = False,
           wire: int = 4) -> list:
    """What ZeRO-3 and ZeRO-2 move every micro-batch, as formulas (`replicate`): for the layer
    stack (one layer) and then the ends, per group (data-parallel, expert data-parallel), the
    all-gathers of each weight, one per phase that reads it (the recomputation's served by the
    backward's unless the framework `regather`s; gathered bytes, collectives), then the
    reduce-scatters of each gradient the update reads, `wire` bytes an element (bytes,
    collectives: each its share of a bucket's call where the framework `buckets` them,
    `frameworks.bucket_share`, as `replicate` charges it)."""
    out = []
    for in_stack in (True, False):
        for group in ("dp", "edp"):
            gathered, gathers, reduced, reductions = [], [], [], []
            for update in graph.ops():
                if update.kind != "adamw":
                    continue
                grad = graph.tensor(update.inputs[0])
                w = graph.tensor(grad.grad_of)
                if replicate_group(w) != group or (stack in w.count.free_symbols) != in_stack:
                    continue
                merged = {} if regather else {Phase.RECOMPUTE: Phase.BACKWARD}
                phases = len({merged.get(op.phase, op.phase) for op in graph.consumers(w.name)
                              if op.phase is not Phase.OPTIMIZER})
                gathered.append(w.nbytes * w.count * phases)
                gathers.append(w.count * phases)
                reduced.append(grad.numel * wire * update.count)
                reductions.append(update.count * (bucket_share(grad.numel, GROUPS[group])
                                                  if buckets else 1))
            out += [sympy.Add(*terms) for terms in (gathered, gathers, reduced, reductions)]
    return out


def _moving(moved: np.ndarray, zero: np.ndarray, lines) -> np.ndarray:
    """The seconds each data-parallel stream (a row each: dp, edp) takes per micro-batch for
    `_moved`'s part (a row per formula, over the layouts): the all-gathers under ZeRO-3, the
    reduce-scatters under ZeRO-2 and 3; `lines(kind, group)` gives each algorithm's intercept
    and slope over the layouts. Each collective takes at least the least intercept plus the
    least slope times its message, so their sum is a bound whatever algorithm each runs."""
    out = np.zeros((2, len(zero)))
    for j, group in enumerate(("dp", "edp")):
        gathered, gathers, reduced, reductions = moved[4 * j:4 * j + 4]
        for kind, size, count, least in (("all_gather", gathered, gathers, 3),
                                         ("reduce_scatter", reduced, reductions, 2)):
            if count.any():
                base, slope = (part.min(axis=0) for part in lines(kind, group))
                out[j] += np.where(zero >= least, count * base + slope * size, 0.0)
    return out * (1 - 2e-6)  # below `_released`'s, the same sums in another order


def _held_bytes(held: np.ndarray, cols: _Columns) -> np.ndarray:
    """`_held`'s parts (a row each, over the layouts) summed as the ZeRO stage shards them
    (`replicate`: ZeRO-1 the optimizer states, ZeRO-2 the gradients too, ZeRO-3 the weights
    too, over each group)."""
    zero, groups = cols.zero, (cols.env[dp], cols.env[edp])
    total = held[-1].copy()
    for i, least in enumerate((3, 2, 1)):  # the ZeRO stage that shards each part
        for j, size in enumerate(groups):
            total += held[2 * i + j] / np.where(zero >= least, size, 1.0)
    return total


def _compute_bound(f: _ComputeFormulas, rows_: list[Row], layers: int | None,
                   hardware: Hardware, cost: CostModel, line) -> tuple[np.ndarray, np.ndarray]:
    """Lower bounds of each row's step and memory from its compute key alone. Each stage's
    micro-batch takes at least its stack's ops, `LAYERS` times, its ends' ops and the stack's
    surely-waited collectives, and at least its ZeRO-2/3 collectives on one stream
    (`_moving`); `_step_bound` combines them (with no optimizer: the last micro-batch at least
    a plain one). It reads a subset of the ops, waits and streams `_evaluate`'s bound reads,
    so it is at most that bound. The fullest stage holds at least what its layers hold
    (`_held`; the ends too where one stage holds all). Neither needs a stage compiled."""
    n = len(rows_)
    cols = _columns(rows_, layers)
    p = cols.p
    values = f.tape.run(cols.env | {LAYERS: np.ones(n)}, n)  # every count at one layer
    k = f.n_ops
    grids = values[len(values) - 4 * k:len(values) - k].reshape(3, k, n)
    # before `replicate` no collective shares a call (`Cost.calls`): the data-parallel ones
    # that do are not there yet
    nums = _Numbers(np.rint(values[:k]), values[k:2 * k], values[2 * k:3 * k],
                    values[3 * k:4 * k], *(np.zeros((0, n)),) * 3, grids, np.ones((k, n)),
                    values[len(values) - k:])
    held, moved = values[4 * k:4 * k + 14], values[4 * k + 14:len(values) - 4 * k]
    parts = len(held) // 2
    times = _comm_times(f, nums, rows_, line)
    compute = _op_times(f, nums, hardware, cost)
    stack, first, last = (place @ compute for place in f.places)
    stack = stack + _waited_time(f, nums, times, compute, rows_)
    plain = {role: stack * cols.layers[role] for role in ROLES}
    plain[FIRST] = plain[FIRST] + first + np.where(p == 1, last, 0.0)
    plain[LAST] = np.where(p > 1, plain[LAST] + last, 0.0)
    plain[MIDDLE] = np.where(p > 2, plain[MIDDLE], 0.0)
    # ZeRO-2/3's collectives of a micro-batch run one after another on their stream, which
    # ends no earlier than the last of them: its layers' (and where one stage holds all, the
    # ends')
    lines = _over_rows(rows_, line)
    per_layer, ends_ = _moving(moved[:8], cols.zero, lines), _moving(moved[8:], cols.zero, lines)
    for role in ROLES:
        streams = cols.layers[role] * per_layer + np.where(p == 1, ends_, 0.0)  # each its own
        plain[role] = np.maximum(plain[role], np.where(plain[role] > 0, streams.max(axis=0),
                                                       0.0))
    most = np.max(np.stack(list(cols.layers.values())), axis=0)  # the fullest stage's layers
    memory = most * _held_bytes(held[:parts], cols) + np.where(
        p == 1, _held_bytes(held[parts:], cols), 0.0)
    return (_step_bound(plain, plain, p, cols.m, cols.v, cols.chunked) * (1 - 1e-9),
            memory * (1 - 1e-9))


def _plans(f: _StageFormulas, layers: int, zero: int, values: dict):
    """The schedule's plans of the stage holding `layers` layers."""
    if layers not in f.plans:
        subs = resolve(f.graph, values)
        if f.layers is not None:  # the stack's L / pp is this stage's layers
            subs[pp] = sympy.Rational(f.layers, layers)
        ordered = f.graph.ops()
        per_micro = [op for op in ordered if op.phase is not Phase.OPTIMIZER
                     and not once_per_step(op, zero)]
        f.plans[layers] = (plan(f.graph, per_micro, subs), plan(f.graph, ordered, subs))
    return f.plans[layers]


# --- the arrays ---------------------------------------------------------------------------------

_CONST, _SYMBOL, _ADD, _MUL, _POW, _CALL = range(6)


class _Program:
    """Formulas flattened into steps over numpy arrays, each distinct subexpression one step:
    sums, products and integer powers on numpy, anything else (a ceiling, a maximum) numpy's
    own through sympy. A searcher keeps one, its structures' formulas sharing their steps; a
    step's number is above its operands', so steps in numbered order run operands first."""

    def __init__(self):
        self.number: dict = {}  # subexpression -> its step
        self.steps: list[tuple] = []  # (code, operands or value)

    def step(self, expr) -> int:
        found = self.number.get(expr)
        if found is not None:
            return found
        if expr.is_Number:
            step = (_CONST, float(expr))
        elif expr.is_Symbol:
            step = (_SYMBOL, expr)
        elif expr.is_Add:
            step = (_ADD, tuple(self.step(a) for a in expr.args))
        elif expr.is_Mul:
            step = (_MUL, tuple(self.step(a) for a in expr.args))
        elif expr.is_Pow and expr.exp.is_Integer:
            step = (_POW, (self.step(expr.base), int(expr.exp)))
        else:
            step = (_CALL, sympy.lambdify(DEGREES, expr, "numpy"))
        self.steps.append(step)
        self.number[expr] = len(self.steps) - 1
        return self.number[expr]

    def tape(self, exprs) -> _Tape:
        """The steps `exprs` need, renumbered from 0, and which step gives each."""
        roots = [self.step(e) for e in exprs]
        needed, todo = set(), list(roots)
        while todo:
            i = todo.pop()
            if i in needed:
                continue
            needed.add(i)
            code, arg = self.steps[i]
            if code in (_ADD, _MUL):
                todo.extend(arg)
            elif code == _POW:
                todo.append(arg[0])
        order = sorted(needed)
        local = {g: k for k, g in enumerate(order)}
        steps = []
        for g in order:
            code, arg = self.steps[g]
            if code in (_ADD, _MUL):
                arg = tuple(local[a] for a in arg)
            elif code == _POW:
                arg = (local[arg[0]], arg[1])
            steps.append((code, arg))
        return _Tape(tuple(steps), tuple(local[r] for r in roots))


@attrs.frozen
class _Tape:
    steps: tuple
    roots: tuple[int, ...]

    def run(self, env: dict, n: int) -> np.ndarray:
        """Every formula at the arrays `env` gives the symbols: a row per formula."""
        values: list = []
        for code, arg in self.steps:
            if code == _CONST or code == _SYMBOL:
                values.append(arg if code == _CONST else env[arg])
            elif code == _ADD:
                values.append(functools.reduce(np.add, [values[a] for a in arg]))
            elif code == _MUL:
                values.append(functools.reduce(np.multiply, [values[a] for a in arg]))
            elif code == _POW:
                base, exp = values[arg[0]], arg[1]
                values.append(base ** exp if exp > 0 else 1.0 / base ** -exp)
            else:
                values.append(arg(*(env[s] for s in DEGREES)))
        out = np.empty((len(self.roots), n))
        for i, r in enumerate(self.roots):
            out[i] = values[r]
        return out


@attrs.frozen
class _Columns:
    """Rows' numbers as arrays, a column per layout: the degrees (`DEGREES` but `LAYERS`),
    the stages, micro-batches, virtual stages and ZeRO stage, each role's stage's layers."""

    env: dict
    p: np.ndarray
    m: np.ndarray
    v: np.ndarray
    zero: np.ndarray
    layers: dict  # role -> layers (0 where the row has no such stage)
    # 1 where interleaved chunks differ in size (uneven ends, `distributed.interleaved_span`)
    chunked: np.ndarray


def _columns(rows_: list[Row], layers: int | None) -> _Columns:
    def column(values):
        return np.array(values, dtype=float)

    env = dict(zip((tp, cp, ep, dp, edp, B), (
        column([r.tp for r in rows_]), column([r.cp for r in rows_]),
        column([r.ep for r in rows_]), column([r.dp_group for r in rows_]),
        column([r.edp_group for r in rows_]), column([r.micro_batch for r in rows_]))))
    per_row = [_stage_layers(r, layers) for r in rows_]
    return _Columns(env, column([r.pp for r in rows_]), column([r.micro_batches for r in rows_]),
                    column([r.virtual_stages for r in rows_]),
                    column([r.zero_run for r in rows_]),
                    {role: column([x.get(role, 0) for x in per_row]) for role in ROLES},
                    column([r.virtual_stages > 1 and (r.first, r.last) != (None, None)
                            for r in rows_]))


@attrs.frozen
class _Numbers:
    """A stage's numbers over a structure's rows: a row per op (or life), a column per
    layout."""

    counts: np.ndarray
    flops: np.ndarray
    bytes: np.ndarray
    messages: np.ndarray
    sizes: np.ndarray
    life_counts: np.ndarray
    resident: np.ndarray  # (3, candidates): weights, gradients, optimizer
    grids: np.ndarray  # (3, ops, candidates): each op's GEMMs, M, N (`Cost.grid`; 0: none)
    calls: np.ndarray  # each collective's share of one NCCL call (`Cost.calls`; 1: its own)
    launches: np.ndarray  # the kernels one instance of each op launches (`Cost.launches`)


def _numbers(f: _StageFormulas, env: dict, n: int) -> _Numbers:
    values = f.tape.run(env, n)
    k, m = f.n_ops, f.n_lives
    # counts and sizes are whole numbers: rounded, their sums carry no rounding error; the
    # resident parts may not be (a ZeRO shard is 1/dp of a buffer), and for the memory filter
    # a byte either way does not matter (the layouts returned are made whole exactly)
    whole = np.rint
    end = 4 * k + 2 * m + len(RESIDENT)
    return _Numbers(whole(values[:k]), values[k:2 * k], values[2 * k:3 * k],
                    values[3 * k:4 * k], whole(values[4 * k:4 * k + m]),
                    whole(values[4 * k + m:4 * k + 2 * m]), whole(values[4 * k + 2 * m:end]),
                    values[end:end + 3 * k].reshape(3, k, n), values[end + 3 * k:end + 4 * k],
                    values[end + 4 * k:])


@attrs.frozen
class _Peak:
    """A stage's liveness peak over a structure's rows (`memory.peak`, `figures`): the op it
    happens at, and each part."""

    at: np.ndarray
    weights: np.ndarray
    gradients: np.ndarray
    optimizer: np.ndarray
    activations: np.ndarray  # for one micro-batch
    transient: np.ndarray

    def memory(self, f: _StageFormulas, col: int, degrees: dict, held: float,
               capacity) -> Memory:
        """Column `col`'s peak as `figures` gives it: each part summed exactly (its formulas
        at `degrees`), then made whole, at the op the arrays found."""
        at = int(self.at[col])
        k, m = f.n_ops, f.n_lives

        def exact(expr):
            return sympy.sympify(expr).xreplace(degrees)

        parts = {True: [], False: []}
        live = (f.one[at] != 0) | (f.many[at] != 0) if f.moments else ()
        for j in np.flatnonzero(live):  # the lives live then
            size = exact(f.exprs[4 * k + j])
            count = exact(f.exprs[4 * k + m + j]) if f.many[at, j] else 0
            parts[bool(f.saved[j])].append(int(f.one[at, j]) * size + count * size)
        resident = f.exprs[4 * k + 2 * m:4 * k + 2 * m + len(RESIDENT)]
        w, g, o = (int(exact(e)) for e in resident)
        name, phase = f.moments[at] if f.moments else ("", "")
        return Memory(name, phase, w, g, o, int(int(sympy.Add(*parts[True])) * held),
                      int(sympy.Add(*parts[False])),
                      capacity=int(capacity) if capacity else None)


def _peak(f: _StageFormulas, nums: _Numbers) -> _Peak:
    n = nums.sizes.shape[1]
    w, g, o = nums.resident
    if not f.moments:
        zero = np.zeros(n)
        return _Peak(np.zeros(n, dtype=int), w, g, o, zero, zero)
    sizes, counted = nums.sizes, nums.sizes * nums.life_counts
    live = np.hstack([f.one, f.many]) @ np.vstack([sizes, counted])  # (ops, rows)
    at = np.argmax(live, axis=0)  # the first op where the most is live
    each = f.one[at] * sizes.T + f.many[at] * counted.T  # (rows, lives) there
    acts = each[:, f.saved].sum(axis=1)
    return _Peak(at, w, g, o, acts, each[:, ~f.saved].sum(axis=1))


def _in_flight(p: np.ndarray, v: np.ndarray, m: np.ndarray, stage) -> np.ndarray:
    """`distributed.in_flight` over arrays."""
    held = np.minimum(p - stage, m)
    out = np.where(v > 1, held * (1 + (p - 1) / (p * v)), held)
    return np.where(p == 1, 1.0, out)


def _op_times(f: _StageFormulas, nums: _Numbers, hardware: Hardware, cost: CostModel
              ) -> np.ndarray:
    """Each compute op's time on the stage under `cost`, every instance (a row per op, 0 for
    the collectives), over the rows."""
    rows_ = [i for i in range(f.n_ops) if f.groups[i] is None]
    out = np.zeros_like(nums.flops)
    if not rows_:
        return out
    peaks = np.array([f.peaks[i] for i in rows_])[:, None]
    out[rows_] = cost.op_times(hardware, [f.kinds[i] for i in rows_], nums.flops[rows_],
                               nums.bytes[rows_], nums.counts[rows_], peaks,
                               nums.grids[:, rows_], nums.launches[rows_])
    return out


def _grid(values: np.ndarray) -> tuple:
    """An op's grid as `distributed.StageOp` holds it: () for none (zeros)."""
    return tuple(float(v) for v in values) if values.any() else ()


def _stage_layers(r: Row, layers: int) -> dict[str, int]:
    """The layers on each role's stage."""
    return _split_layers(layers, r.pp, r.first, r.last)


@functools.lru_cache(maxsize=4096)
def _split_layers(layers: int, stages: int, first, last) -> dict[str, int]:  # read, not changed
    if stages == 1:
        return {FIRST: layers or 1}  # the whole stack (its count is no symbol then)
    each = stage_layers(layers, Parallel(pp=stages, first_stage_layers=first,
                                         last_stage_layers=last))
    return {FIRST: each[0], MIDDLE: each[1], LAST: each[-1]}


@attrs.frozen
class _Group:
    """A structure's rows evaluated as arrays."""

    structure: _Structure
    rows: list
    numbers: dict  # role -> _Numbers
    peaks: dict  # role -> _Peak
    held: dict  # role -> in-flight micro-batches per row
    bound: np.ndarray  # a lower bound of each row's step time
    upper: np.ndarray  # an upper bound of it (`_step_upper`)
    fullest: np.ndarray  # each row's memory per GPU (its fullest stage's)


def _evaluate(s: _Structure, group: list[Row], layers: int, hardware: Hardware,
              cost: CostModel, line) -> _Group:
    n = len(group)
    cols = _columns(group, layers)
    p, m, v = cols.p, cols.m, cols.v
    numbers, plain, last, serial, serial_last = {}, {}, {}, {}, {}
    communicated = np.zeros(n)  # the first stage's communication over the step
    for role, f in s.stages.items():
        nums = numbers[role] = _numbers(f, cols.env | {LAYERS: cols.layers[role]}, n)
        times = _comm_times(f, nums, group, line)
        compute = _op_times(f, nums, hardware, cost)
        comm = np.zeros_like(compute)
        for k, t in times.items():
            comm[k] = nums.counts[k] * t
        busy = compute[list(f.busy_rows)].sum(axis=0) + _waited_time(f, nums, times, compute,
                                                                     group)
        # a micro-batch takes at least its compute and surely-waited communication, and at
        # least what its streams run after the compute that releases it; the last one adds
        # the optimizer and what runs once per step
        plain[role] = np.maximum(busy, _released(f.releases[0], compute, comm))
        last[role] = np.maximum(busy + compute[list(f.optimizer_rows)].sum(axis=0),
                                _released(f.releases[1], compute, comm))
        once = np.array(f.once)
        serial[role] = (compute + comm)[~once].sum(axis=0)
        serial_last[role] = serial[role] + (compute + comm)[once].sum(axis=0)
        if role == FIRST:
            communicated = (comm * np.where(once[:, None], 1, m)).sum(axis=0)
    bound = _step_bound(plain, last, p, m, v, cols.chunked)
    upper = (_step_upper(serial, serial_last, plain, p, m, v, cols.chunked)
             + cost.slowdown(hardware) * communicated)
    peaks = {role: _peak(f, numbers[role]) for role, f in s.stages.items()}
    index = {FIRST: 0.0, MIDDLE: 1.0, LAST: p - 1}
    held = {role: _in_flight(p, v, m, index[role]) for role in s.stages}
    totals = np.stack([pk.weights + pk.gradients + pk.optimizer
                       + np.floor(pk.activations * held[role]) + pk.transient
                       for role, pk in peaks.items()])
    return _Group(s, group, numbers, peaks, held, bound * (1 - 1e-9), upper * (1 + 1e-9),
                  totals.max(axis=0))


def _step_bound(plain: dict, last: dict, p, m, v, chunked) -> np.ndarray:
    """A lower bound of the step from lower bounds of each role's plain and last
    micro-batch (`distributed._schedule`: the pipeline span of the plain micro-batches plus
    the longest tail, last less plain). The span `m x max + (sum - max) / v` is at least
    `m x T_j + (sum - T_j) / v` for every stage j (m >= 1 >= 1 / v), and the tail at least
    stage j's; so the step is at least `(m - 1) x T_j + last_j + (sum - T_j) / v` for each j,
    every term growing with the times it reads. Where interleaved chunks differ in size
    (`chunked`: the schedule is simulated, `schedule.interleaved_span`, which the formula can
    overstate) the bubble term is the fill and drain through chunk 0 instead: stage j's first
    forward waits for micro-batch 0's through chunk 0 of every stage before it, and after its
    last backward (chunk 0's, the chunks running backward in reverse) the stages before it run
    chunk 0's backward of that micro-batch; a middle stage's chunk is T_middle / v, the first
    stage's chunk 0 (the embedding's) taken as nothing. So the span is at least m x T_j plus
    (j - 1) middle chunks: (p - 3) before the last middle stage, (p - 2) before the last."""
    total = plain[FIRST] + plain.get(LAST, 0.0) + (p - 2) * plain.get(MIDDLE, 0.0)
    middle_chunk = plain.get(MIDDLE, 0.0) / v
    before = {FIRST: 0.0, MIDDLE: np.maximum(p - 3, 0) * middle_chunk,
              LAST: np.maximum(p - 2, 0) * middle_chunk}
    return np.max(np.stack([(m - 1) * plain[role] + last[role]
                            + np.where(chunked, before[role], (total - plain[role]) / v)
                            for role in plain]), axis=0)


def _step_upper(serial: dict, serial_last: dict, plain: dict, p, m, v, chunked) -> np.ndarray:
    """An upper bound of the step (`distributed._schedule`) from each role's micro-batches
    run one op at a time, `serial` and `serial_last` (`simulate` never leaves every stream
    idle while an op is left: each waits only for what runs), and the lower bounds of the
    plain ones (the tail is last less plain): the pipeline span grows with every stage's
    time. Where interleaved chunks differ in size (`chunked`) the span is taken as 1F1B's
    without interleaving, `m x max + (sum - max)`: the simulated interleaved schedule
    (`schedule.interleaved_span`) came out at most that in every one of 7,200 random trials
    (stage times, Llama 3's and other uneven splits, 1 to 4 micro-batches per stage; the
    largest ratio 1 + 4e-15), where the interleaved formula can overstate it by 12%. The caller
    adds what the overlap slowdown can add (all the communication)."""
    total = serial[FIRST] + serial.get(LAST, 0.0) + (p - 2) * serial.get(MIDDLE, 0.0)
    slowest = np.max(np.stack(list(serial.values())), axis=0)
    tail = np.max(np.stack([serial_last[role] - plain[role] for role in serial]), axis=0)
    return m * slowest + (total - slowest) / np.where(chunked, 1.0, v) + tail


def _job(g: _Group, col: int, forward: Graph, hardware: Hardware, cluster, tokens: int,
         n_mfu: int, values: dict, layers: int) -> Job:
    """Row `col` of a group as `distributed.prepare` compiles it, from the arrays' numbers."""
    r = g.rows[col]
    layout = r.layout()
    capacity = hardware.memory_bytes
    counts = _stage_layers(r, layers)
    stages = []
    for role, index in _roles(r.pp):
        f, nums = g.structure.stages[role], g.numbers[role]
        ops = tuple(StageOp(f.names[k], f.kinds[k], int(nums.counts[k, col]),
                            float(nums.flops[k, col]), float(nums.bytes[k, col]), f.peaks[k],
                            f.groups[k], float(nums.messages[k, col]), f.once[k],
                            _grid(nums.grids[:, k, col]), float(nums.calls[k, col]),
                            float(nums.launches[k, col]))
                    for k in range(f.n_ops))
        plain, last = _plans(f, counts[role], r.zero_run, values)
        degrees = dict(zip(DEGREES, map(sympy.Integer, (
            r.tp, r.cp, r.ep, r.dp_group, r.edp_group, counts[role], r.micro_batch))))
        memory = g.peaks[role].memory(f, col, degrees, float(g.held[role][col]), capacity)
        stages.append(Stage(None, ops, plain, last, None, memory, index))
    distinct = [index for _, index in _roles(r.pp)]
    kinds = [min(i, 1) if i < r.pp - 1 else i for i in range(r.pp)]
    return Job(forward, hardware, cluster.for_job(layout.world), layout, tuple(stages),
               tuple(distinct.index(k) for k in kinds), tokens, n_mfu,
               unequal_chunks(forward, layout))


# --- the search ---------------------------------------------------------------------------------

@attrs.define
class _Pending:
    """A space under search: its rows, each structure's (indices into them), each row's
    compute bound, and the structures evaluated so far (index -> `_Group`)."""

    space: Space
    rows: list[Row]
    members: list[np.ndarray]
    floor: np.ndarray
    groups: dict = attrs.field(factory=dict)


class Searcher:
    """One model on one part and cluster under one cost model, its structures compiled as
    the searches need them and kept (a scaling curve's sizes share them)."""

    def __init__(self, forward: Graph, hardware: Hardware, *, seq_len: int | None = None,
                 cluster: clusters.Cluster | None = None, cost: CostModel = DEFAULT):
        self.forward, self.hardware, self.cost = forward, hardware, cost
        self.seq = seq_len or forward.seq_len
        if self.seq is None:
            raise OpgraphError(f"{forward.name} has no default sequence length; give --seq-len")
        self.cluster = cluster or clusters.for_hardware(hardware)
        self._line = _comm_line(cost, self.cluster, hardware)
        self.values = {"S": self.seq}
        self.layers = _layers(forward)
        self.structures: dict[tuple, _Structure] = {}
        self.computes: dict[tuple, _ComputeFormulas] = {}
        self.compute_keys: dict[tuple, tuple] = {}  # structure -> compute key
        self.compute_formulas: dict = {}  # as `formulas`, for `_compile_compute`
        self.passes: dict = {}  # pass prefixes -> graphs
        self.formulas: dict = {}  # formulas -> with the fixed dimensions substituted
        self.program = _Program()  # the formulas' steps over arrays, shared by the structures
        self._last: _Pending | None = None  # the last space searched
        self.n_mfu = int(mfu_parameters(forward).xreplace(resolve(forward, self.values)))
        self.compile_s = 0.0

    def compute(self, r: Row) -> _ComputeFormulas:
        """The compute formulas of `r`'s compute key (`compute_key`), compiled once."""
        key = self.compute_key(r)
        if key not in self.computes:
            t0 = time.perf_counter()
            graph = _step(self.forward, r, _representative(r, self.layers), self.passes,
                          replicated=False)
            self.computes[key] = _compile_compute(graph, self.hardware, self.cost, self.values,
                                                  self.layers, self.compute_formulas,
                                                  self.program, r)
            self.compile_s += time.perf_counter() - t0
        return self.computes[key]

    def compute_key(self, r: Row) -> tuple:
        """`compute_key(r)`, once a structure (rows of one share it)."""
        key = structure(r)
        if key not in self.compute_keys:
            self.compute_keys[key] = compute_key(r, self.layers)
        return self.compute_keys[key]

    def structure(self, r: Row) -> _Structure:
        key = structure(r)
        if key not in self.structures:
            t0 = time.perf_counter()
            self.structures[key] = _compile_structure(
                self.forward, self.layers, self.hardware, r, self.values, self.cost,
                self.passes, self.formulas, self.program)
            self.compile_s += time.perf_counter() - t0
        return self.structures[key]

    def forget(self) -> None:
        """Drop the last space's arrays (`_space`), keeping the compiled structures."""
        self._last = None

    def evaluate(self, group: list[Row]) -> _Group:
        """A structure's rows as arrays (they must share one structure)."""
        return _evaluate(self.structure(group[0]), group, self.layers, self.hardware, self.cost,
                         self._line)

    def exact(self, g: _Group, col: int) -> Ranked:
        """Row `col` of a group, scheduled as `profile` schedules it."""
        return Ranked(g.rows[col].candidate(), step_figures(self._job_of(g, col), self.cost))

    def _job_of(self, g: _Group, col: int) -> Job:
        return _job(g, col, self.forward, self.hardware, self.cluster,
                    g.rows[col].batch * self.seq, self.n_mfu, self.values, self.layers)

    def job(self, candidate: Candidate) -> Job:
        """The job `exact` schedules for `candidate`: `distributed.step_figures(job, cost)`
        schedules it under another cost model of the same backward convention without
        compiling again (`opgraph.explain.sensitivity`)."""
        return self._job_of(self.evaluate([row_of(candidate)]), 0)

    def one(self, candidate: Candidate) -> Ranked:
        """One candidate by the search's path, fit or not: what a test compares with
        `profile`."""
        return self.exact(self.evaluate([row_of(candidate)]), 0)

    def _space(self, space: Space) -> _Pending:
        """`space`'s rows, grouped by structure, with each row's compute bound; the last
        space's are kept, with the structures evaluated so far (`faster_than` after `search`
        of one space evaluates each once)."""
        if self._last is not None and self._last.space == space:
            return self._last
        found = rows(self.forward, self.hardware, space, self.seq, self.cluster)
        if not found:
            raise OpgraphError(f"no layout of {self.forward.name} divides {space.gpus:,} GPUs "
                               f"and {space.batch:,} sequences per step within the "
                               f"constraints (at most {MAX_MICRO_BATCHES:,} micro-batches per "
                               "rank); change --gpus, the batch or the constraints")
        by_key: dict[tuple, list[int]] = {}
        by_compute: dict[tuple, list[int]] = {}
        for i, r in enumerate(found):
            by_key.setdefault(structure(r), []).append(i)
            by_compute.setdefault(self.compute_key(r), []).append(i)
        floor = np.empty(len(found))
        capacity = self.hardware.memory_bytes
        for members in progressed(list(by_compute.values()), "plan: bounding layouts",
                                  unit="key"):
            group = [found[i] for i in members]
            step, memory = _compute_bound(self.compute(group[0]), group, self.layers,
                                          self.hardware, self.cost, self._line)
            # a row that surely does not fit cannot be among the best
            floor[members] = np.where(memory > capacity, np.inf, step) if capacity else step
        self._last = _Pending(space, found, [np.array(m) for m in by_key.values()], floor)
        return self._last

    def _group(self, pending: _Pending, si: int) -> _Group:
        if si not in pending.groups:
            pending.groups[si] = self.evaluate([pending.rows[i] for i in pending.members[si]])
        return pending.groups[si]

    def _fits(self, g: _Group) -> np.ndarray:
        capacity = self.hardware.memory_bytes
        return np.flatnonzero(g.fullest <= capacity) if capacity else np.arange(len(g.rows))

    def search(self, space: Space, top: int = 10) -> Found:
        """The `top` fastest layouts of `space` (see the module), with the search's counts."""
        if top < 1:
            raise OpgraphError("--top must be 1 or more")
        t0, compiled = time.perf_counter(), self.compile_s
        pending = self._space(space)
        # best first over two kinds of entry: a structure not yet evaluated, at its rows' least
        # compute bound (col -1), and a fitting row of one evaluated, at its bound
        heap = [(float(pending.floor[m].min()), si, -1) for si, m in enumerate(pending.members)]
        heapq.heapify(heap)
        best: list[tuple[float, int, Ranked]] = []
        scheduled = 0
        bar = progress("plan: structures compiled", total=len(pending.members),
                       unit="structure")
        while heap:
            bound, si, col = heapq.heappop(heap)
            if len(best) >= top and bound >= best[-1][0]:
                break  # nothing left can beat the K-th best
            g = self._group(pending, si)
            if col < 0:
                members = pending.members[si]
                for c in self._fits(g):
                    heapq.heappush(heap, (max(float(g.bound[c]),
                                              float(pending.floor[members[c]])), si, int(c)))
                bar.update()
                continue
            ranked = self.exact(g, col)
            scheduled += 1
            bar.set_postfix_str(f"{scheduled:,} layouts scheduled", refresh=False)
            best.append((ranked.step_time_s, int(pending.members[si][col]), ranked))
            best.sort(key=lambda item: item[:2])  # ties: in the order the space lists them
            del best[top:]
        bar.close()
        elapsed = time.perf_counter() - t0
        spent = self.compile_s - compiled
        groups = pending.groups.values()
        return Found(tuple(r for _, _, r in best), len(pending.rows),
                     sum(len(self._fits(g)) for g in groups), scheduled,
                     len(pending.members), len(pending.groups), spent, elapsed - spent,
                     min(float(g.fullest.min()) for g in groups))

    def faster_than(self, space: Space, step_time_s: float) -> int:
        """How many layouts of `space` that fit run a step faster than `step_time_s` (where a
        layout of one's own ranks): each whose upper bound is below it surely does; each other
        whose bounds are below it is scheduled exactly."""
        pending = self._space(space)
        faster = 0
        for si, members in progressed(list(enumerate(pending.members)), "plan: ranking",
                                      unit="structure"):
            if pending.floor[members].min() >= step_time_s:
                continue
            g = self._group(pending, si)
            for col in self._fits(g):
                if g.upper[col] < step_time_s:
                    faster += 1  # surely
                elif max(g.bound[col], pending.floor[members[col]]) < step_time_s:
                    faster += self.exact(g, col).step_time_s < step_time_s
        return faster

    def fitting(self, space: Space) -> int:
        """How many layouts of `space` fit in memory: every structure evaluated that has a
        layout whose memory floor fits (a search evaluates only those its bounds cannot rule
        out)."""
        pending = self._space(space)
        return sum(len(self._fits(self._group(pending, si)))
                   for si, members in enumerate(pending.members)
                   if np.isfinite(pending.floor[members]).any())


def search(forward: Graph, hardware: Hardware, space: Space, *, top: int = 10,
           **options) -> Found:
    """The `top` fastest layouts of `space` (see the module); `options` are `Searcher`'s."""
    return Searcher(forward, hardware, **options).search(space, top)
