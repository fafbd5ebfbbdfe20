"""The space `opgraph plan` searches: its constraints (`Space`), the records of a layout
(`Row` while searched, `Candidate`, `Ranked` and `Found` when returned), and every layout of a
job (`rows`)."""

from __future__ import annotations

import itertools
from collections import namedtuple

import attrs
import sympy

from ...core.choices import CP_COMMS, DEEPSPEED, SEARCHED_PRECISIONS, check_recompute
from ...core.errors import OpgraphError
from ...core.ir import Graph
from ...core.limits import MAX_MICRO_BATCHES
from ...core.symbols import B, cp, dp, edp, ep, tp
from ...cost.hardware import Hardware
from ...passes.precision import PRECISIONS
from ...passes.recompute import POLICIES
from ...passes.split_stages import layer_stack, layers_before
from .. import cluster as clusters
from ..distributed import ParallelResult, check_layers, check_layout, uneven_ends
from ..frameworks import FRAMEWORKS, check_precision, end_split, own_split
from ..parallel import (FRAMEWORK_FIELDS, LAYOUT_FIELDS, ZERO_STAGES, LayoutFields, Parallel,
                        replicas_problem)

# `Space.expert_tp` that searches the experts split and folded at every tensor-parallel degree
EXPERT_TP_BOTH = "both"
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
    replicate: int | None = None
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
    # whose behaviour every layout follows (`opgraph.parallel.frameworks`)
    framework: str | None = None
    grad_reduce_dtype: str | None = None
    attention_library: str | None = None
    # how context parallelism moves the attention's inputs (`Parallel.cp_comm`); None: both, the
    # ring and the all-to-all, at every context-parallel degree the heads allow
    cp_comm: str | None = "ring"
    # the experts' tensor-parallel degree (`Parallel.expert_tp`): None, split as TP splits the
    # rest; 1, whole, expert parallelism folded into the tensor-parallel ranks; "both", each
    # at every tensor-parallel degree
    expert_tp: int | str | None = None

    def __attrs_post_init__(self):
        if self.expert_tp not in (None, 1, EXPERT_TP_BOTH) and self.expert_tp != self.tp:
            raise OpgraphError(f"--expert-tp {self.expert_tp!r}: plan gives 1 (experts whole, "
                               f"over the tensor-parallel ranks too), {EXPERT_TP_BOTH} (each "
                               "way) or leaves it out (experts split as tensor parallelism "
                               "splits the rest)")
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
        if self.replicate is not None and self.replicate < 1:
            raise OpgraphError("--replicate must be 1 or more")
        if (self.replicate or 1) > 1:
            if self.zero == 0:
                raise OpgraphError(f"--replicate {self.replicate} contradicts --zero 0: "
                                   "replicas hold sharded states (HSDP is --zero 3)")
            at = FRAMEWORKS.get(self.framework)
            if at is not None and not at.replicates_at & ({self.zero} if self.zero else
                                                          {1, 2, 3}):
                stages = ", ".join(f"--zero {z}" for z in sorted(at.replicates_at))
                raise OpgraphError(f"--framework {self.framework} runs no replicated shards"
                                   + (f" at --zero {self.zero} (only {stages})" if stages
                                      else "") + "; leave out --replicate")
        at = FRAMEWORKS.get(self.framework, FRAMEWORKS[None])
        if at.tp_shards_sequence and self.sequence_parallel is False and (self.tp or 2) > 1:
            raise OpgraphError(f"--framework {self.framework}'s tensor parallelism always shards "
                               "the sequence: leave out --no-sequence-parallel, or give --tp 1")
        if self.zero is not None and self.zero not in at.zero_stages:
            raise OpgraphError(f"--framework {self.framework} runs no ZeRO-{self.zero}: give "
                               f"--zero {' or '.join(map(str, sorted(at.zero_stages)))}")
        # the framework's names and its combinations, checked as a layout checks them (at CP 2
        # where the space fixes none: the context-parallel communication speaks of CP; folded
        # experts at the degrees that check nothing else)
        Parallel(**self.framework_settings() | {"expert_tp": self.expert_tp and 1},
                 cp=self.cp or 2)
        for value in self.recompute or ():
            check_recompute(value, "--")
        for value in self.precision or ():
            if value not in PRECISIONS:
                raise OpgraphError(f"--precision {value!r}: choose from {', '.join(PRECISIONS)}")
            check_precision(self.framework, value)

    def expert_tps(self, t: int) -> list:
        """The experts' tensor-parallel degrees the space tries at tensor-parallel degree `t`:
        its own, or both (split, folded) where it says so and `t` > 1 (at 1 they are one)."""
        if self.expert_tp == EXPERT_TP_BOTH:
            return [None, 1] if t > 1 else [None]
        return [self.expert_tp]

    def framework_settings(self) -> dict:
        """The `FRAMEWORK_FIELDS` every layout of the space takes, by name (where the search
        tries both context-parallel communications, ring attention's unless a layout says)."""
        settings = {name: getattr(self, name) for name in FRAMEWORK_FIELDS}
        return settings | {"cp_comm": self.cp_comm or "ring",
                           "expert_tp": None if self.expert_tp == EXPERT_TP_BOTH
                           else self.expert_tp}


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
    # structures and compute keys this search compiled, and those it read from the cache
    # (`opgraph.parallel.search.cache`) instead
    compiled: int = 0
    read: int = 0

    @property
    def layouts_per_s(self) -> float:
        return self.searched / self.evaluate_s if self.evaluate_s > 0 else float("inf")


# --- the space ----------------------------------------------------------------------------------

class Row(LayoutFields, namedtuple("_RowFields", (*LAYOUT_FIELDS, "recompute", "precision"))):
    """A candidate before it is one (`Candidate`): a `Parallel`'s fields (`LAYOUT_FIELDS`),
    unchecked, and the step's options; the search holds tens of thousands. It reads as a layout
    does (`LayoutFields`), so the frameworks' rules take it as they take a layout."""

    __slots__ = ()

    def layout(self) -> Parallel:
        return Parallel(**{name: getattr(self, name) for name in LAYOUT_FIELDS})

    def candidate(self) -> Candidate:
        return Candidate(self.layout(), self.recompute, self.precision)


def row_of(c: Candidate) -> Row:
    """The row of a candidate, written as the search writes its rows: dp and the global batch
    explicit, the GPUs left to them."""
    lay = c.layout
    resolved = {"dp": lay.dp_degree, "gpus": None, "global_batch": lay.batch}
    return Row(*(resolved.get(name, getattr(lay, name)) for name in LAYOUT_FIELDS),
               c.recompute, c.precision)


def structure(r: Row) -> tuple:
    """What decides a row's ops and collectives (see the package); rows of one structure
    differ only in numbers: not in the micro-batch size nor the virtual stages, which `rows`
    varies innermost."""
    return (r.tp > 1, r.cp > 1, r.ep > 1, r.size("dp") > 1, r.size("edp") > 1, r.replicate > 1,
            r.sequence_parallel, r.async_tp, r.zero, r.recompute, r.precision, min(r.pp, 3),
            r.settings())


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
            framework: str | None = None,
            before: int | None = None) -> list[tuple[int | None, int | None]]:
    """The pipeline splits tried for `stages` stages: the framework's own where it makes one
    (`frameworks.own_split`, as `distributed.framework_split` gives `profile`), none where
    that needs every stage's layers said (`Parallel.stage_layers`, which the search's first,
    middle and last stages cannot hold); else even, or (where that does not divide) the uneven
    ends `distributed.uneven_ends` gives, which `profile`'s error suggests too. `before`:
    `split_stages.layers_before(forward)`, where the caller has it."""
    own = None if forward is None else own_split(forward, stages, framework)
    if own is not None:
        ends = end_split(own)
        return [] if ends is None else [ends]
    if stages == 1 or layers % stages == 0:
        return [(None, None)]
    if before is None:
        before = 0 if forward is None or stages < 3 else layers_before(forward)
    ends = uneven_ends(layers, stages, before)
    return [] if ends is None else [ends]


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
         cluster: clusters.Cluster, groups: dict[tuple, list[int]] | None = None) -> list[Row]:
    """Every layout of `space` that divides the model (see the module), in a fixed order.
    `groups`, where given, gets each `structure` the rows have, in the order of its first row,
    with its rows' indices (worked out once for the rows that differ only in their micro-batch
    size and virtual stages)."""
    check_layers(forward)  # a model too deep for any layout, refused as such
    dims = {s.name: int(v) for s, v in forward.dims.items()}
    layers, node = _layers(forward), cluster.gpus_per_node
    experts = dims.get("E")
    if space.expert_tp in (1, EXPERT_TP_BOTH) and not experts:
        raise OpgraphError(f"--expert-tp {space.expert_tp} folds a mixture of experts' experts "
                           f"into the tensor-parallel ranks, and {forward.name} has none; leave "
                           "it out")
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
    precision = space.precision or tuple(p for p in SEARCHED_PRECISIONS
                                         if p == "bf16" or hardware.fp8_flops)
    fp8 = [p for p in precision if p != "bf16"]
    if fp8 and not hardware.fp8_flops:
        raise OpgraphError(f"--precision {fp8[0]}: {hardware.id} has no dense FP8 peak; give a "
                           "part that has one, or leave it out")
    options = list(itertools.product(zeros, recompute, precision))
    alone = [o for o in options if o[0] == min(zeros)]  # no data parallelism: nothing to shard
    out: list[Row] = []
    checked: dict = {}
    # each stage count's splits once (a framework's own weighs the model's blocks)
    before = layers_before(forward) if layers is not None and max(pps) > 2 else 0
    splits = {p: _splits(layers, p, forward, space.framework, before) for p in pps}
    own = unsplit_degrees(forward, space).get(space.pp) if space.pp else None
    if own is not None:
        raise OpgraphError(
            f"--framework {space.framework} splits {forward.name}'s {layers} layers over "
            f"{space.pp} stages as {'/'.join(map(str, own))}, which plan's first, middle and "
            f"last stages cannot hold; profile that layout (opgraph profile --pp "
            f"{space.pp} --framework {space.framework}), or plan another --pp")
    # the fields the search does not vary: the space's framework settings, else the defaults
    fixed = ({f.name: f.default for f in attrs.fields(Parallel)} | space.framework_settings()
             | {"zero": None})
    for t, c, p in itertools.product(tps, cps, pps):
        if space.gpus % (t * c * p):
            continue
        d = space.gpus // (t * c * p)
        if (space.dp is not None and d != space.dp) or space.batch % d:
            continue
        per_rank = space.batch // d
        for (first, last), sp_, comm in itertools.product(splits[p], _sp(space, t),
                                                         _cp_comms(space, c)):
            for e, etp in itertools.product(eps, space.expert_tps(t)):
                # folded, the experts spread over tp x dp x cp and each rank dispatches its
                # sequence shard (`Parallel._check_expert_tp`)
                folded = etp == 1
                if folded and t > 1 and (e == 1 or not sp_):
                    continue
                if (d * c * (t if folded else 1)) % e or not _divides(
                        forward, seq_len, t, c, e, p, sp_, first, last, checked,
                        space.framework, comm):
                    continue
                # the step options and replicas each micro-batch size and virtual stage count
                # takes, with the list of their structure's rows (once they have a row)
                steps = [[z, n, r, pr, None]
                         for z, r, pr in (options if d * c > 1 else alone)
                         if not _refused(space, p, z, c, d * c)
                         for n in _replicas(space, z, d * c, t, e, node)]
                for mb in ([space.micro_batch] if space.micro_batch else
                           _divisors(per_rank, space.max_micro_batch)):
                    if per_rank % mb or per_rank // mb > MAX_MICRO_BATCHES:  # `Parallel`'s bound
                        continue
                    for v in _virtual(space, layers, p, first, last, per_rank // mb):
                        row = [*Row(**{**fixed, "tp": t, "cp": c, "ep": e, "pp": p, "dp": d,
                                       "micro_batch": mb, "global_batch": space.batch,
                                       "virtual_stages": v, "sequence_parallel": sp_,
                                       "first_stage_layers": first, "last_stage_layers": last,
                                       "async_tp": space.async_tp and t > 1, "cp_comm": comm,
                                       "expert_tp": etp},
                                    recompute=None, precision=None)]
                        for step in steps:
                            row[ZERO], row[REPLICAS_AT], row[RECOMPUTE_AT], row[PRECISION_AT] = \
                                step[:4]
                            made = Row._make(row)
                            if groups is not None:
                                if step[4] is None:
                                    step[4] = groups.setdefault(structure(made), [])
                                step[4].append(len(out))
                            out.append(made)
    if groups is not None:  # in the order of each structure's first row
        ordered = sorted(groups.items(), key=lambda item: item[1][0])
        groups.clear()
        groups.update(ordered)
    return out


# where a row's ZeRO stage, replicas and step options sit, which `rows` sets last
ZERO, REPLICAS_AT, RECOMPUTE_AT, PRECISION_AT = (
    Row._fields.index(name) for name in ("zero", "replicate", "recompute", "precision"))


def _replicas(space: Space, zero: int, ranks: int, t: int, e: int, node: int) -> list[int]:
    """HSDP's replica counts tried at ZeRO stage `zero` over `ranks` = dp x cp ranks that hold
    the same weights, at tensor-parallel degree `t` and expert degree `e` (as `Parallel`
    checks them: `parallel.replicas_problem`). The space's count where it names one; else none (1), and at ZeRO-3 also the
    replicas whose shard groups each fill one node (torchtitan's HSDP: FSDP inside a node,
    replicas across nodes), where there are two or more."""
    def valid(n: int) -> bool:
        return replicas_problem(n, ranks, zero, e, space.framework) is None

    if space.replicate is not None:
        return [space.replicate] if valid(space.replicate) else []
    shard = node // t  # the ranks of one replica in a node
    n = ranks // shard if shard >= 2 and ranks % shard == 0 else 1
    return [1, n] if zero == 3 and n > 1 and valid(n) else [1]


def _refused(space: Space, stages: int, zero: int, cp: int, ranks: int) -> bool:
    """Whether the framework cannot run ZeRO stage `zero` on `stages` pipeline stages, at
    context-parallel degree `cp` over `ranks` = dp x cp ranks (as `Parallel` checks it:
    DeepSpeed's pipeline engine takes ZeRO 0 and 1 only; and the stages the framework runs,
    `frameworks.Traits.zero_stages`, under context parallelism `zero_stages_under_cp`)."""
    if space.framework in DEEPSPEED and stages > 1 and zero >= 2:
        return True
    at = FRAMEWORKS[space.framework]
    runs = at.zero_stages & at.zero_stages_under_cp if cp > 1 else at.zero_stages
    return ranks > 1 and zero not in runs


def _divides(forward: Graph, seq: int, t, c, e, p, sp_, first, last, cache: dict,
             framework: str | None = None, cp_comm: str = "ring") -> bool:
    """Whether the model divides over the degrees as `profile` checks it
    (`distributed.check_layout`, at its own sequence length and the one searched; the
    framework's, which may pad the vocabulary; the context-parallel communication's, the
    all-to-all's head shards)."""
    key = (t, c, e, p, sp_, first, last, cp_comm)
    if key not in cache:
        # dp = ep: any data-parallel degree the experts divide (checked by the caller)
        layout = Parallel(tp=t, cp=c, ep=e, pp=p, dp=e, sequence_parallel=sp_,
                          first_stage_layers=first, last_stage_layers=last,
                          framework=framework, cp_comm=cp_comm)
        try:
            check_layout(forward, layout, seq)
            cache[key] = True
        except OpgraphError:
            cache[key] = False
    return cache[key]


def _cp_comms(space: Space, c: int) -> list[str]:
    """Context parallelism's communications tried at degree `c`: the space's, or both where it
    names none (`Space.cp_comm` None); without context parallelism, the default (nothing moves:
    one structure, whatever the space names)."""
    if c == 1:
        return ["ring"]
    if space.cp_comm is not None:
        return [space.cp_comm]
    runs = FRAMEWORKS[space.framework].cp_comms  # the framework's (`Traits.cp_comms`)
    return [comm for comm in CP_COMMS if comm in runs]


def _sp(space: Space, t: int) -> list[bool]:
    """Sequence parallelism's choices at tensor-parallel degree `t` (none without it, so
    `--sequence-parallel` leaves out the layouts without tensor parallelism; with it alone
    where the framework's tensor parallelism always shards the sequence,
    `Traits.tp_shards_sequence`)."""
    if t == 1:
        return [] if space.sequence_parallel else [False]
    if space.sequence_parallel is not None:
        return [space.sequence_parallel]
    return [True] if FRAMEWORKS[space.framework].tp_shards_sequence else [False, True]


def _virtual(space: Space, layers: int, p: int, first, last, m: int) -> list[int]:
    """Virtual stages per GPU: the divisors of a stage's layers (with uneven ends, of a middle
    stage's: the end stages' outer chunks hold one layer fewer, as `chunk_layers` cuts them,
    Llama 3 405B's schedule; two uneven stages have no middle one, and do not interleave)."""
    uneven = first is not None or last is not None
    # DeepSpeed's pipeline engine does not interleave (as `Parallel` checks it)
    if p == 1 or (p == 2 and uneven) or space.framework in DEEPSPEED:
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
