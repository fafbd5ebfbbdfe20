"""How a training job is spread over GPUs: the parallel degrees, batch and sharding, as a record.

    layout = Parallel(tp=8, pp=4, micro_batch=2, global_batch=512, gpus=1024)
    layout.dp             # 32: N / (tp x pp x cp)
    layout.micro_batches  # 8: global batch / (dp x micro batch), per optimizer step

The degrees multiply to the GPUs of the job: `gpus = tp x cp x pp x dp`. Expert parallelism
borrows its GPUs from the data-parallel (and context-parallel) ranks, as Megatron-LM's expert
data-parallel groups and torchtitan's do, so `ep` divides `dp x cp` and adds none; with
`expert_tp` 1 (Megatron-Core's expert-parallel folding) the experts are not split by tensor
parallelism and `ep` borrows the tensor-parallel ranks too, dividing `tp x dp x cp`.

Ranks are ordered as Megatron-LM orders them (`--order tp-cp-ep-dp-pp`): tensor parallelism
innermost (its groups are consecutive ranks, inside one node), then context, data, pipeline.
`stride` gives how many ranks apart a group's members sit, which decides the tier of the fabric
its collectives cross (`opgraph.parallel.cluster.Cluster.tier_for`).

`check` raises a one-line OpgraphError naming the first constraint a layout breaks.

A layout written out is the compact form `plan` prints (`outputs.report.layout_text`):
`tp8 cp1 pp16(7/.../7) dp64 mb1 v1 zero1 sp full bf16`; `parse_layout` reads it back.
"""

from __future__ import annotations

import operator
import re

import attrs

from ..core.choices import (ATTENTION_LIBRARIES, CP_COMMS, DEEPSPEED, FRAMEWORKS,
                            GRAD_REDUCE_DTYPES, ZERO_STAGES)
from ..core.errors import OpgraphError
from ..core.limits import MAX_DIM, MAX_MICRO_BATCHES, check_whole

SCHEDULES = ("1f1b", "interleaved")
# The fields that say how the job's framework runs it rather than how the job is laid out: the
# planner holds them fixed while it searches layouts (`Parallel.settings`, `search.Space`).
FRAMEWORK_FIELDS = ("framework", "grad_reduce_dtype", "attention_library", "cp_comm",
                    "expert_tp")
# The ZeRO stage from which each resident part is a 1/group shard (Rajbhandari et al. 2020:
# P_os, P_os+g, P_os+g+p): the optimizer states from ZeRO-1, the gradients from ZeRO-2 (the
# full gradient a per-layer transient, reduced as soon as it is made, every micro-batch), the
# weights from ZeRO-3 (gathered for their readers). `passes.replicate` follows it, and so do
# the schedule (`schedule.once_per_step`) and the planner's bound (`search.bounds`).
SHARDED_FROM = {"optimizer": 1, "gradients": 2, "weights": 3}
_SETTINGS = operator.attrgetter(*FRAMEWORK_FIELDS)
# ZERO_STAGES, FRAMEWORKS (the training framework the passes follow) and GRAD_REDUCE_DTYPES are
# the command line's names, in `opgraph.core.choices`.


def _whole(value, name):
    return check_whole(value, name, MAX_DIM) if value is not None else None


def _stage_list(value):
    """`stage_layers` as a tuple of whole numbers from 0 (a stage may hold no layer), or None."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise OpgraphError(f"stage layers {value!r}: give one whole number per pipeline stage")
    out = tuple(value)
    for n in out:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0 or n > MAX_DIM:
            raise OpgraphError(f"stage layers {list(out)!r}: each stage's layers must be a "
                               f"whole number from 0 to {MAX_DIM:,}, not {n!r}")
    return out


class LayoutFields:
    """What a layout's fields give: its data-parallel degree, GPUs, batch, micro-batches, the
    groups' sizes and strides. `Parallel` takes it, and so does the planner's `search.Row`,
    which holds the same fields unchecked (the search holds tens of thousands)."""

    __slots__ = ()

    @property
    def dp_degree(self) -> int:
        if self.dp is not None:
            return self.dp
        return self.gpus // (self.tp * self.cp * self.pp) if self.gpus else 1

    @property
    def world(self) -> int:
        """GPUs in the job: tp x cp x pp x dp."""
        return self.tp * self.cp * self.pp * self.dp_degree

    @property
    def batch(self) -> int:
        """Sequences per optimizer step over the whole job."""
        return self.global_batch or self.dp_degree * self.micro_batch

    @property
    def micro_batches(self) -> int:
        """Micro-batches each data-parallel rank runs per optimizer step."""
        return self.batch // (self.dp_degree * self.micro_batch)

    @property
    def is_single(self) -> bool:
        """One GPU and one micro-batch: the plate's step, which no parallel pass touches."""
        return self.world == 1 and self.micro_batches == 1

    def rank_stage(self, rank: int) -> int | None:
        """The pipeline stage GPU `rank` runs (pipeline parallelism is outermost), or None if
        the job has no such rank."""
        if not 0 <= rank < self.world:
            return None
        return rank // (self.tp * self.cp * self.dp_degree)

    @property
    def folds_experts(self) -> bool:
        """Whether the experts are left whole under tensor parallelism and expert parallelism
        takes in its ranks (`expert_tp` 1 beside TP: Megatron-Core's expert-parallel folding,
        `--expert-tensor-parallel-size 1`). Over the planner's columns, a column of them."""
        return self.expert_tp == 1

    @property
    def expert_ranks(self) -> int:
        """The ranks of a pipeline stage that expert parallelism spreads the experts over, each
        group of `ep` holding them once: dp x cp, and tp's too where it folds them (written as
        arithmetic on `folds_experts`, so that a column of rows reads it too)."""
        return self.dp_degree * self.cp * (1 + (self.tp - 1) * self.folds_experts)

    def stride(self, group: str) -> int:
        """Ranks between consecutive members of a group (Megatron's order tp-cp-ep-dp-pp).
        The gradient-reduction groups ("dp", "edp") take in the context-parallel ranks, which
        hold the same weights; so they start at stride tp. HSDP's replicas ("dpr") are the
        outer part of those ranks: consecutive shard groups (torchtitan's mesh order
        dp_replicate, dp_shard, cp, tp; Megatron-LM's intra- and inter-instance groups).
        The experts' ranks have an order of their own, tp-ep-dp-pp with the experts' TP degree
        (`expert_decoder_rank_generator`, megatron/core/parallel_state.py, whose expert grid has
        no CP: expert parallelism takes in the context-parallel ranks): an expert-parallel
        group's members are `tp` ranks apart, consecutive where the experts are folded (their TP
        1), its expert data-parallel group tp x ep apart, or ep folded."""
        if group in ("ep", "edp"):  # as arithmetic on `folds_experts`, for columns too
            split, folded = (self.tp, 1) if group == "ep" else (self.tp * self.ep, self.ep)
            return split + (folded - split) * self.folds_experts
        inner = {"tp": 1, "cp": self.tp, "dp": self.tp,
                 "pp": self.tp * self.cp * self.dp_degree,
                 "dpr": self.tp * self.dp_degree * self.cp // self.replicate}
        return inner[group]

    def size(self, group: str) -> int:
        """GPUs in one group: "dp" is the ranks a weight's gradients are reduced over and its
        sharded parts split over (dp x cp, as Megatron-LM reduces gradients over data and
        context parallel ranks together; under HSDP, one replica's dp x cp / replicate),
        "dpr" the replicas that hold the same shard (`replicate`), "edp" the ranks that hold
        the same experts (`expert_ranks` / ep: dp x cp / ep, tp x dp x cp / ep folded). (The
        planner asks this of every row several times: a chain of comparisons, not a dict
        built each call.)"""
        if group == "dp":
            return self.dp_degree * self.cp // self.replicate
        if group == "edp":
            return self.expert_ranks // self.ep
        if group in ("tp", "cp", "ep", "pp"):
            return getattr(self, group)  # the degree itself
        if group == "dpr":
            return self.replicate
        raise KeyError(group)

    def settings(self) -> tuple:
        """Its `FRAMEWORK_FIELDS`' values, in that order."""
        return _SETTINGS(self)


@attrs.frozen(kw_only=True)
class Parallel(LayoutFields):
    """One layout. `micro_batch` and `global_batch` are in sequences; `dp` None means
    gpus / (tp x cp x pp); `global_batch` None means one micro-batch per data-parallel rank.

    `zero` is the data-parallel sharding: 0 plain (gradients all-reduced), 1 optimizer states
    sharded (Megatron's distributed optimizer), 2 and gradients, 3 and parameters (FSDP,
    torchtitan's default); gradients are reduced in `grad_reduce_dtype`, else the framework's
    default (`opgraph.parallel.frameworks.reduce_dtype`: FP32 but for DeepSpeed's BF16).
    `replicate` > 1 is HSDP (hybrid sharding): the dp x cp ranks that hold the same weights
    form `replicate` replicas, each sharding what `zero` shards over its own dp x cp /
    replicate ranks (the "dp" group); a gradient is reduce-scattered within a replica and its
    shard then all-reduced across the replicas (the "dpr" group). torchtitan's
    `data_parallel_replicate_degree` with FSDP (ZeRO-3); Megatron-LM's
    `--num-distributed-optimizer-instances` with its distributed optimizer (ZeRO-1).
    `first_stage_layers` / `last_stage_layers` make the end stages uneven (Megatron's
    `--decoder-first-pipeline-num-layers`), the rest split evenly over the middle stages, and
    with virtual stages into chunks as `chunk_layers` cuts them. `stage_layers` names every
    stage's layers instead, first to last, any of them 0 (nanotron's cost-balanced split of the
    playbook's 1B on four stages: 6, 5, 5 and 0, the last stage holding the head alone).
    `overlap_grad_reduce` runs the gradient reduction under the backward (PyTorch DDP, FSDP,
    Megatron-LM's `--overlap-grad-reduce`); without it the reduction waits for the backward to
    end (Megatron-LM's default; DeepSpeed's pipeline engine's whatever this says).
    `overlap_param_gather` gathers the updated weights of ZeRO-1/2 under the next step's first
    forward, each layer's just before it runs, rather than after the update (Megatron-LM's
    `--overlap-param-gather`, with its distributed optimizer).
    `framework` names whose behaviour the passes follow where frameworks differ
    (`opgraph.parallel.frameworks`: FSDP2's gathers, Megatron's sequence-parallel inputs, ...);
    `attention_library` the attention kernels the job runs, else the framework's
    (`frameworks.attention_library`). `cp_comm` is how context parallelism moves the
    attention's inputs (`passes.shard`): "ring" (ring attention, every framework's default) or
    "a2a" (DeepSpeed-Ulysses' all-to-all; Megatron-LM's `--cp-comm-type a2a`).
    `expert_tp` is the experts' tensor-parallel degree: None (or `tp`) splits them as tensor
    parallelism splits the rest, 1 leaves them whole and spreads them over the tensor-parallel
    ranks too (Megatron-Core's `--expert-tensor-parallel-size 1`, "MoE parallel folding":
    each rank dispatches its sequence shard, so it needs sequence parallelism under TP).
    """

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int | None = None
    gpus: int | None = None
    micro_batch: int = 1
    global_batch: int | None = None
    virtual_stages: int = 1
    sequence_parallel: bool = False
    zero: int = 0
    replicate: int = 1
    async_tp: bool = False
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    stage_layers: tuple[int, ...] | None = attrs.field(default=None, converter=_stage_list)
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = False
    framework: str | None = None
    grad_reduce_dtype: str | None = None
    attention_library: str | None = None
    cp_comm: str = "ring"
    expert_tp: int | None = None

    def __attrs_post_init__(self):
        for name in ("tp", "pp", "cp", "ep", "dp", "gpus", "micro_batch", "global_batch",
                     "virtual_stages", "first_stage_layers", "last_stage_layers", "replicate"):
            _whole(getattr(self, name), name.replace("_", "-"))
        if self.zero not in ZERO_STAGES:
            raise OpgraphError(f"zero {self.zero!r}: give 0, 1, 2 or 3")
        if self.framework is not None and self.framework not in FRAMEWORKS:
            raise OpgraphError(f"framework {self.framework!r}: choose one of "
                               f"{', '.join(FRAMEWORKS)}")
        if self.grad_reduce_dtype is not None and self.grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
            raise OpgraphError(f"gradient-reduction dtype {self.grad_reduce_dtype!r}: choose one "
                               f"of {', '.join(GRAD_REDUCE_DTYPES)}")
        if (self.attention_library is not None
                and self.attention_library not in ATTENTION_LIBRARIES):
            raise OpgraphError(f"attention library {self.attention_library!r}: choose one of "
                               f"{', '.join(ATTENTION_LIBRARIES)}")
        if self.cp_comm not in CP_COMMS:
            raise OpgraphError(f"context-parallel communication {self.cp_comm!r}: choose one of "
                               f"{', '.join(CP_COMMS)}")
        if self.cp > 1 and self.cp_comm != "ring":
            from .frameworks import traits  # frameworks reads this module

            if self.cp_comm not in traits(self).cp_comms:
                raise OpgraphError(f"--framework {self.framework} runs context parallelism as "
                                   "ring attention only; give --cp-comm ring")
        model = self.tp * self.cp * self.pp
        if self.gpus is not None:
            if self.gpus % model:
                raise OpgraphError(f"--gpus {self.gpus} is not divisible by tp x cp x pp = "
                                   f"{self.tp} x {self.cp} x {self.pp} = {model}")
            if self.dp is not None and self.dp * model != self.gpus:
                raise OpgraphError(f"--gpus {self.gpus} is not tp x cp x pp x dp = "
                                   f"{self.tp} x {self.cp} x {self.pp} x {self.dp} = "
                                   f"{model * self.dp}; leave out --dp or --gpus")
        if self.expert_tp is not None:
            self._check_expert_tp()
        if self.expert_ranks % self.ep:
            if self.folds_experts:
                raise OpgraphError(f"--ep {self.ep} must divide tp x dp x cp = "
                                   f"{self.expert_ranks} (folded experts are spread over the "
                                   "tensor- and data-parallel ranks)")
            raise OpgraphError(f"--ep {self.ep} must divide dp x cp = {self.dp_degree * self.cp} "
                               "(experts are spread over the data-parallel ranks; --expert-tp 1 "
                               "spreads them over the tensor-parallel ranks too)")
        if self.replicate > 1:
            self._check_replicas()
        if self.global_batch is not None and self.global_batch % (self.dp_degree * self.micro_batch):
            raise OpgraphError(f"global batch {self.global_batch} is not divisible by dp x "
                               f"micro-batch = {self.dp_degree} x {self.micro_batch}; give a "
                               f"multiple of {self.dp_degree * self.micro_batch}")
        if self.micro_batches > MAX_MICRO_BATCHES:
            raise OpgraphError(f"global batch {self.batch:,} is {self.micro_batches:,} "
                               f"micro-batches per data-parallel rank (dp {self.dp_degree:,} x "
                               f"micro-batch {self.micro_batch:,}), more than opgraph's bound of "
                               f"{MAX_MICRO_BATCHES:,}; give a smaller global batch, a larger "
                               "micro-batch or more data parallelism")
        if self.virtual_stages > 1 and self.pp == 1:
            raise OpgraphError("--virtual-stages needs pipeline parallelism (--pp 2 or more)")
        if self.sequence_parallel and self.tp == 1:
            raise OpgraphError("--sequence-parallel needs tensor parallelism (--tp 2 or more)")
        if self.async_tp and self.tp == 1:
            raise OpgraphError("--async-tp needs tensor parallelism (--tp 2 or more)")
        if self.overlap_param_gather and self.zero not in (1, 2):
            raise OpgraphError(f"--overlap-param-gather needs sharded optimizer states (--zero 1 "
                               f"or 2, Megatron-LM's distributed optimizer), not ZeRO-{self.zero}")
        if (self.first_stage_layers or self.last_stage_layers) and self.pp == 1:
            raise OpgraphError("uneven first or last stages need --pp 2 or more")
        if self.stage_layers is not None:
            if self.pp == 1:
                raise OpgraphError("stage layers split a pipeline: they need --pp 2 or more")
            if len(self.stage_layers) != self.pp:
                raise OpgraphError(f"stage layers {list(self.stage_layers)}: give one count per "
                                   f"pipeline stage, {self.pp} for --pp {self.pp}")
            if self.first_stage_layers is not None or self.last_stage_layers is not None:
                raise OpgraphError("stage layers name every stage's layers: leave out the "
                                   "first and last stages' own counts")
            if self.virtual_stages > 1:
                raise OpgraphError("stage layers with --virtual-stages: opgraph interleaves "
                                   "even stages, or uneven end stages only; leave one out")
            if self.stage_layers[0] == 0:
                raise OpgraphError("the first pipeline stage holds no layer in stage layers "
                                   f"{list(self.stage_layers)}; give it one or more")
        if self.framework in DEEPSPEED and self.pp > 1 and self.zero >= 2:
            # deepspeed/runtime/pipe/engine.py asserts it: "ZeRO-2 and ZeRO-3 are incompatible
            # with pipeline parallelism"
            raise OpgraphError(f"--framework {self.framework} runs --pp {self.pp} with ZeRO 0 "
                               f"or 1 only (its pipeline engine refuses ZeRO-{self.zero}); give "
                               "--zero 0 or 1")
        if self.framework in DEEPSPEED and self.virtual_stages > 1:
            # deepspeed/runtime/pipe/schedule.py: TrainSchedule runs one model chunk per stage
            # (1F1B, no interleaved schedule)
            raise OpgraphError(f"--framework {self.framework}'s pipeline engine runs one chunk "
                               "of layers per stage (no interleaving); give --virtual-stages 1")

    def _check_expert_tp(self) -> None:
        if isinstance(self.expert_tp, bool) or self.expert_tp not in (1, self.tp):
            raise OpgraphError(f"--expert-tp {self.expert_tp!r}: give 1 (the experts whole, "
                               "expert parallelism over the tensor-parallel ranks too) or the "
                               f"tensor-parallel degree, {self.tp}")
        if self.folds_experts and self.tp > 1:
            if self.ep == 1:
                raise OpgraphError("--expert-tp 1 folds expert parallelism into the "
                                   "tensor-parallel ranks; give --ep 2 or more")
            if not self.sequence_parallel:
                raise OpgraphError("--expert-tp 1 with --tp dispatches each rank's sequence "
                                   "shard to the experts; add --sequence-parallel (Megatron-LM "
                                   "requires it of a mixture of experts under TP)")

    def _check_replicas(self) -> None:
        problem = replicas_problem(self.replicate, self.dp_degree * self.cp, self.zero,
                                   self.ep, self.framework)
        if problem is not None:
            raise OpgraphError(problem)

    def to_json(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep,
                "dp": self.dp_degree, "micro_batch": self.micro_batch,
                "global_batch": self.batch, "micro_batches": self.micro_batches,
                "virtual_stages": self.virtual_stages, "zero": self.zero,
                "replicate": self.replicate,
                "sequence_parallel": self.sequence_parallel, "async_tp": self.async_tp,
                "first_stage_layers": self.first_stage_layers,
                "last_stage_layers": self.last_stage_layers,
                "stage_layers": None if self.stage_layers is None else list(self.stage_layers),
                "overlap_grad_reduce": self.overlap_grad_reduce,
                "overlap_param_gather": self.overlap_param_gather,
                "framework": self.framework, "grad_reduce_dtype": self.grad_reduce_dtype,
                "attention_library": self.attention_library, "cp_comm": self.cp_comm,
                "expert_tp": self.expert_tp}


def replicas_problem(replicate: int, ranks: int, zero: int, ep: int,
                     framework: str | None) -> str | None:
    """Why HSDP's `replicate` replicas of `ranks` = dp x cp ranks cannot run at ZeRO stage
    `zero` with expert degree `ep` under `framework`, in one line; None where they can (and
    for one replica): whole shard groups of two ranks or more, a sharded part to replicate,
    no experts, a framework that runs replicas at this stage (`Traits.replicates_at`). The
    layout checks it, and the planner enumerates only the counts it allows."""
    from .frameworks import FRAMEWORKS  # frameworks reads this module

    if replicate == 1:
        return None
    if ranks % replicate or ranks // replicate < 2:
        return (f"--replicate {replicate} must divide dp x cp = {ranks} into shard groups of 2 "
                "ranks or more (with shard groups of one, give --zero 0: plain data "
                "parallelism)")
    if zero == 0:
        return (f"--replicate {replicate} replicates sharded states: give --zero 1, 2 or 3 "
                "(HSDP is --zero 3)")
    if ep > 1:
        return (f"--replicate {replicate} with --ep {ep}: opgraph does not model replicated "
                "expert shards; leave one out")
    traits = FRAMEWORKS.get(framework)
    if traits is not None and zero not in traits.replicates_at:
        stages = ", ".join(f"ZeRO-{z}" for z in sorted(traits.replicates_at))
        return (f"--framework {framework} runs no replicated shards at ZeRO-{zero}"
                + (f" (only at {stages})" if stages else "") + "; leave out --replicate"
                + (f" or give --zero {min(traits.replicates_at)}" if stages else ""))
    return None


# Every field of a layout, in `Parallel`'s order (the planner's rows hold the same).
LAYOUT_FIELDS = tuple(f.name for f in attrs.fields(Parallel))


def stage_layers(layers: int, layout: Parallel) -> list[int]:
    """Layers on each pipeline stage (all its virtual stages together), first to last.

    Even: `layers / pp` each, and `layers` must divide by pp x virtual stages. Uneven ends take
    `first_stage_layers` / `last_stage_layers`; the middle stages split the rest evenly (with
    virtual stages, as `chunk_layers` cuts them). Every stage holds at least one layer (as
    Megatron-LM asks of its middle stages).

        >>> stage_layers(126, Parallel(pp=16, first_stage_layers=7, last_stage_layers=7))[:3]
        [7, 8, 8]
    """
    return [sum(chunks) for chunks in chunk_layers(layers, layout)]


def chunk_layers(layers: int, layout: Parallel) -> list[list[int]]:
    """Layers in each model chunk (virtual stage) of each pipeline stage, first to last.

    Even: `layers / (pp x v)` in every chunk. With uneven ends and v virtual stages (the Llama 3
    paper, section 3.3.2: 126 layers on 16 stages, one layer fewer on the first and the last,
    interleaved): the middle stages' chunks hold `c = middle / v` layers each, and an end
    stage's outer chunk (the first stage's first, where the embedding runs; the last stage's
    last, where the head and the loss run) holds what the end stage lacks of `v c`, down to
    none ("the first model chunk on the first stage has only the embedding").

        >>> chunk_layers(126, Parallel(pp=16, virtual_stages=8, first_stage_layers=7,
        ...                            last_stage_layers=7))[0]
        [0, 1, 1, 1, 1, 1, 1, 1]
    """
    p, v = layout.pp, layout.virtual_stages
    first, last = layout.first_stage_layers, layout.last_stage_layers
    if layout.stage_layers is not None:
        if sum(layout.stage_layers) != layers or not any(layout.stage_layers):
            raise OpgraphError(f"stage layers {list(layout.stage_layers)} add up to "
                               f"{sum(layout.stage_layers)}; the layer stack has {layers}")
        return [[n] for n in layout.stage_layers]
    if first is None and last is None:
        if layers % (p * v):
            raise OpgraphError(f"{layers} layers do not divide into pp x virtual stages = "
                               f"{p} x {v} = {p * v} equal chunks; pick degrees that divide it")
        return [[layers // (p * v)] * v for _ in range(p)]
    ends = (first or 0) + (last or 0)
    middle = p - (first is not None) - (last is not None)
    rest = layers - ends
    ends_take = {(True, True): "the first and last stages take",
                 (True, False): "the first stage takes",
                 (False, True): "the last stage takes"}[first is not None, last is not None]
    if rest < 0 or (middle and rest % middle) or (not middle and rest):
        raise OpgraphError(f"{layers} layers: {ends_take} {ends}, and the {rest} left do not "
                           f"split evenly over {middle} middle stages")
    each = rest // middle if middle else 0
    if middle and each < 1:  # the ends are whole numbers from 1 (`Parallel` checks them)
        raise OpgraphError(f"{layers} layers over {p} pipeline stages: {ends_take} {ends}, "
                           f"leaving {rest} for {middle} middle stage{'s' * (middle != 1)}; "
                           "every stage needs at least one layer")
    if v == 1:
        return [[n] for n in ([first] if first is not None else []) + [each] * middle + (
            [last] if last is not None else [])]
    if not middle or each % v:
        raise OpgraphError(f"uneven end stages with --virtual-stages {v}: the middle stages' "
                           f"{each} layers must split into {v} equal chunks (and a middle "
                           "stage must exist); pick virtual stages that divide them")
    chunk = each // v
    for name, n in (("first", first), ("last", last)):
        if n is not None and not chunk * (v - 1) <= n <= chunk * v:
            raise OpgraphError(f"the {name} stage's {n} layers with --virtual-stages {v}: its "
                               f"outer chunk takes what it lacks of {v} x {chunk}, so give "
                               f"{chunk * (v - 1)} to {chunk * v} layers")
    out = [[chunk] * v for _ in range(p)]
    if first is not None:
        out[0][0] = first - chunk * (v - 1)
    if last is not None:
        out[-1][-1] = last - chunk * (v - 1)
    return out


# The compact form's words (`parse_layout`): a degree's word and its number (tp8), and the
# `Parallel` field it sets.
LAYOUT_WORDS = {"tp": "tp", "cp": "cp", "ep": "ep", "pp": "pp", "dp": "dp", "mb": "micro_batch",
                "v": "virtual_stages", "zero": "zero", "rep": "replicate", "etp": "expert_tp"}
_NUMBERED = re.compile(r"([a-z]+)([0-9]{1,12})(?:\(([0-9]{1,12}|-)/\.\.\./([0-9]{1,12}|-)\))?")
MAX_LAYOUT_TEXT = 400  # characters: a layout is a few dozen


def parse_layout(text: str) -> tuple[dict, dict]:
    """The `Parallel` fields and the step's options (`recompute`, `precision`) a layout written
    as `plan` prints it names: `tp8 cp1 pp16(7/.../7) dp64 mb1 v1 zero1 sp full bf16`, words
    apart by spaces or commas (`tp8,pp16,dp64,mb1,zero1`), pp's uneven end stages in brackets
    (first/.../last, - for an even end), `sp` sequence parallelism, `etp1` the experts' own
    tensor-parallel degree, context parallelism's communication by name (`a2a`, `ring`:
    `CP_COMMS`), a recomputation policy and a precision by name. A word left out sets nothing
    (dp: the GPUs left); `Parallel` checks what the fields make.

        >>> parse_layout("tp8,pp4 zero1 full")
        ({'tp': 8, 'pp': 4, 'zero': 1}, {'recompute': 'full'})
    """
    from ..core.choices import SELECTIVE, recompute_policy
    from ..passes.precision import PRECISIONS
    from ..passes.recompute import POLICIES

    shown = text if len(text) <= 60 else text[:57] + "..."
    words = text.replace(",", " ").split()
    if not words or len(text) > MAX_LAYOUT_TEXT:
        raise OpgraphError(f"layout {shown!r}: write it as plan prints one, e.g. "
                           "tp8,pp16,dp64,mb1,zero1")
    fields: dict = {}
    options: dict = {}

    def put(into: dict, key: str, value, word: str) -> None:
        if key in into:
            raise OpgraphError(f"layout {shown!r} says {key.replace('_', '-')} twice "
                               f"({word!r}); give it once")
        into[key] = value

    for word in words:
        found = _NUMBERED.fullmatch(word)
        if found and found[1] in LAYOUT_WORDS and (found[3] is None or found[1] == "pp"):
            put(fields, LAYOUT_WORDS[found[1]], int(found[2]), word)
            for key, end in (("first_stage_layers", found[3]), ("last_stage_layers", found[4])):
                if end not in (None, "-"):
                    fields[key] = int(end)
        elif word == "sp":
            put(fields, "sequence_parallel", True, word)
        elif word in CP_COMMS:
            put(fields, "cp_comm", word, word)
        elif word in POLICIES or word.startswith(SELECTIVE):
            put(options, "recompute", recompute_policy(word), word)
        elif word in PRECISIONS:
            put(options, "precision", word, word)
        else:
            raise OpgraphError(
                f"layout {shown!r}: {word[:20]!r} is not a layout word; write a degree and "
                f"its number ({', '.join(LAYOUT_WORDS)}: tp8, mb2), pp16(7/.../7) for uneven "
                f"end stages, sp, {' or '.join(CP_COMMS)} (context parallelism's "
                f"communication), a recomputation ({', '.join(POLICIES)}, or selective: and "
                "Megatron-Core's modules) or a precision "
                f"({', '.join(PRECISIONS)})")
    return fields, options
