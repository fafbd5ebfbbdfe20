"""Validation cases as data: published training runs, each with its model, layout, hardware and
what was measured, read from a JSON case file and checked strictly.

    cases = load_cases()                 # the shipped opgraph/data/validation.json
    case = cases[0]
    case.parallel.world                  # 8 GPUs: tp x cp x pp x dp
    case.measured_step_time_s            # 1.42 s, Korthikanti et al. 2022, Table 5
    graph = case.forward()               # the model's forward graph at the case's seq_len

A case file (issue 12) is `{"about": "...", "cases": [{...}, ...]}`; a case has the keys

    id, source, model, hardware, cluster, gpus, parallel, seq_len, recompute, precision, fuse,
    measured, notes

`model` is a preset name (`opgraph models`) or a Hugging Face config object, read as `--config`
reads a config.json (`opgraph.models.hf`). `parallel` holds the degrees tp, pp, cp, ep, dp, the
ZeRO stage `zero`, `micro_batch` and `global_batch` (sequences), `virtual_stages`,
`sequence_parallel` and `async_tp`, as `opgraph.parallel.parallel.Parallel` takes them. `measured`
holds `step_time_s` or `tokens_per_s_per_gpu` (one of the two) and optionally `peak_memory_gib`
(or `peak_memory_gb`) and `peak_memory_stage`, the pipeline stage whose GPU the memory figure was
read on, where the source says (else the prediction's fullest stage is compared).

Absent keys take the CLI's defaults (`DEFAULTS`: hardware h100-sxm, the part's own cluster,
recompute none, precision bf16, fuse none; degrees 1, ZeRO 0 as `Parallel`'s); id, source,
model, gpus, seq_len and measured are required. Hardware and cluster are catalog ids
(`opgraph hardware`, `opgraph hardware --clusters`), or, for a part or a cluster the catalog
lacks, an object with the fields of a hardware or cluster file's table and its `id`
(`hardware.from_table`, `cluster.from_table`): a case file means the same wherever it is read
from, a file path never enters it.

Every failure is one OpgraphError line naming the file, the case and the key: an unknown key
(a misspelt one would otherwise be silently left at its default), a value of the wrong type or
out of range, a duplicate id, a layout `Parallel` rejects, a model that does not build or whose
layers do not split over the pipeline stages.
"""

from __future__ import annotations

import json
import math
import re
import types
from collections.abc import Callable
from pathlib import Path

import attrs

from ..core.choices import ATTENTION_LIBRARIES, CP_COMMS, recompute_policy
from ..core.datafile import read_small
from ..core.errors import OpgraphError
from ..core.fusion import POLICIES as FUSION_POLICIES
from ..core.ir import Graph
from ..core.limits import MAX_DIM, check_whole
from ..core.symbols import S
from ..cost import hardware as parts
from ..parallel import cluster as clusters
from ..parallel.parallel import FRAMEWORKS, GRAD_REDUCE_DTYPES, Parallel
from ..passes.precision import PRECISIONS

SHIPPED = Path(__file__).parents[1] / "data" / "validation.json"
CASES_MAX_BYTES = 8 << 20  # a few hundred cases with notes; the shipped file is about 50 KiB

SWEEP = Path(__file__).parents[1] / "data" / "playbook_sweep.json"
# published runs never fitted on (`opgraph calibrate --fit` reads the development set alone)
HOLDOUT = Path(__file__).parents[1] / "data" / "holdout.json"
# Case files known by name, so a command finds them from any directory.
NAMED = {"dev": SHIPPED, "shipped": SHIPPED, "playbook-sweep": SWEEP, "holdout": HOLDOUT}
TOP_KEYS = ("about", "cases", "unmodelled")
CASE_KEYS = ("id", "family", "source", "model", "hardware", "power_limit_w", "cluster", "gpus",
             "parallel", "seq_len", "recompute", "precision", "fuse", "fused_attention",
             "measured", "notes")
REQUIRED = ("id", "source", "model", "gpus", "seq_len", "measured")
# every field of a layout but its GPUs, which the case gives beside it
PARALLEL_KEYS = tuple(f.name for f in attrs.fields(Parallel) if f.name != "gpus")
MEASURED_KEYS = ("step_time_s", "tokens_per_s_per_gpu", "peak_memory_gib", "peak_memory_gb",
                 "peak_memory_stage")
UNMODELLED_KEYS = ("id", "family", "source", "reason")
TIMINGS = ("step_time_s", "tokens_per_s_per_gpu")  # exactly one of them

# What an absent key means: the CLI's defaults. cluster None: the hardware part's own cluster.
DEFAULTS = {"hardware": "h100-sxm", "cluster": None, "recompute": "none", "precision": "bf16",
            "fuse": "none", "fused_attention": True, "notes": ""}
FUSE_CHOICES = ("none", *FUSION_POLICIES)
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _freeze(value):
    """A JSON value made read-only: objects as mapping proxies, arrays as tuples."""
    if isinstance(value, dict):
        return types.MappingProxyType({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value):
    """A frozen JSON value back as plain dicts and lists (for json.dumps and the HF reader)."""
    if isinstance(value, types.MappingProxyType | dict):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_thaw(v) for v in value]
    return value


@attrs.frozen(kw_only=True)
class Case:
    """One published run. `model` is a preset name or a Hugging Face config (read-only mapping);
    `cluster` None means the hardware part's own. `measured_step_time_s` is the published step
    time, or, where tokens per second per GPU were published, the global tokens of a step over
    the whole job's throughput: `global_batch x seq_len / (tokens_per_s_per_gpu x gpus)`."""

    id: str
    source: str
    family: str = ""  # the source the run belongs to (a paper's table, a framework's benchmark)
    model: str | types.MappingProxyType = attrs.field(converter=_freeze)
    # a catalog id, or a part given inline (a read-only mapping, `hardware.from_table`)
    hardware: str | types.MappingProxyType = attrs.field(default=DEFAULTS["hardware"],
                                                          converter=_freeze)
    power_limit_w: float | None = None  # the parts' power cap (`nvidia-smi -pl`), if below TDP
    # a catalog id, a cluster given inline (`cluster.from_table`), or None: the part's own
    cluster: str | types.MappingProxyType | None = attrs.field(default=None, converter=_freeze)
    gpus: int
    parallel: Parallel
    seq_len: int
    recompute: str = DEFAULTS["recompute"]
    precision: str = DEFAULTS["precision"]
    fuse: str = DEFAULTS["fuse"]
    fused_attention: bool = DEFAULTS["fused_attention"]  # False: the attention core unfused
    measured_step_time_s: float
    measured_tokens_per_s_per_gpu: float | None = None  # where the run published a throughput
    measured_peak_memory_gib: float | None = None
    measured_peak_memory_gb: float | None = None  # where the source gave GB (1e9 bytes)
    # the pipeline stage whose GPU the memory was read on (None: the fullest one is compared)
    measured_peak_memory_stage: int | None = None
    notes: str = ""

    @property
    def measured_peak_memory_bytes(self) -> float | None:
        """The measured peak memory per GPU in bytes, from whichever unit the source gave."""
        if self.measured_peak_memory_gib is not None:
            return self.measured_peak_memory_gib * 2**30
        if self.measured_peak_memory_gb is not None:
            return self.measured_peak_memory_gb * 1e9
        return None

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one optimizer step over the whole job: global batch x seq_len."""
        return self.parallel.batch * self.seq_len

    @property
    def part_id(self) -> str:
        """The id of the case's part: its catalog id, or the id its inline table gives."""
        return self.part().id

    def part(self):
        """The case's hardware part, power-capped where the case says so."""
        part = _resolved(self.hardware, parts.get, parts.from_table, f"case {self.id}: hardware")
        return part if self.power_limit_w is None else parts.with_power_limit(
            part, self.power_limit_w)

    def resolved_cluster(self):
        """The case's cluster: its catalog id's or inline table's, else its part's own."""
        if self.cluster is None:
            return clusters.for_hardware(self.part())
        return _resolved(self.cluster, clusters.get, clusters.from_table,
                         f"case {self.id}: cluster")

    def job(self, cost=None):
        """The run as a job (`opgraph.parallel.job.JobSpec`) under `cost` (default: the
        roofline), as `opgraph profile` runs the case's flags."""
        from ..parallel.job import JobSpec

        named = {"cluster": self.resolved_cluster()} if self.cluster else {}  # else the part's
        return JobSpec(forward=self.forward(), hardware=self.part(), layout=self.parallel,
                       seq_len=self.seq_len, recompute=self.recompute, precision=self.precision,
                       fuse=None if self.fuse == "none" else self.fuse,
                       fused_attention=self.fused_attention, **named,
                       **({} if cost is None else {"cost": cost}))

    def forward(self) -> Graph:
        """The model's forward graph, its default sequence length the case's `seq_len`."""
        return _at_seq_len(_model_graph(self.model, self.id), self)

    def to_json(self) -> dict:
        """The case in the case-file form: `load_cases` reads it back to an equal Case."""
        p = self.parallel
        out = {"id": self.id, "family": self.family, "source": self.source,
               "model": _thaw(self.model),
               "hardware": _thaw(self.hardware), "cluster": _thaw(self.cluster),
               "gpus": self.gpus,
               "parallel": {"tp": p.tp, "pp": p.pp, "cp": p.cp, "ep": p.ep, "dp": p.dp_degree,
                            "zero": p.zero, "micro_batch": p.micro_batch,
                            "global_batch": p.batch, "virtual_stages": p.virtual_stages,
                            "sequence_parallel": p.sequence_parallel, "async_tp": p.async_tp,
                            "overlap_grad_reduce": p.overlap_grad_reduce,
                            "overlap_param_gather": p.overlap_param_gather,
                            "first_stage_layers": p.first_stage_layers,
                            "last_stage_layers": p.last_stage_layers,
                            "stage_layers": (None if p.stage_layers is None
                                             else list(p.stage_layers)),
                            "framework": p.framework, "grad_reduce_dtype": p.grad_reduce_dtype,
                            "attention_library": p.attention_library},
               "seq_len": self.seq_len, "recompute": self.recompute,
               "precision": self.precision, "fuse": self.fuse,
               "fused_attention": self.fused_attention, "measured": {}, "notes": self.notes}
        if p.replicate > 1:  # HSDP's replicas: written where there are any
            out["parallel"]["replicate"] = p.replicate
        if p.cp_comm != "ring":  # context parallelism's all-to-all: written where it runs
            out["parallel"]["cp_comm"] = p.cp_comm
        if p.expert_tp is not None:  # the experts' own TP degree: written where it is given
            out["parallel"]["expert_tp"] = p.expert_tp
        if self.cluster is None:
            del out["cluster"]
        if not self.family:
            del out["family"]
        if self.power_limit_w is not None:
            out["power_limit_w"] = self.power_limit_w
        out["parallel"] = {k: v for k, v in out["parallel"].items() if v is not None}
        measured = out["measured"]
        if self.measured_tokens_per_s_per_gpu is None:
            measured["step_time_s"] = self.measured_step_time_s
        else:
            measured["tokens_per_s_per_gpu"] = self.measured_tokens_per_s_per_gpu
        if self.measured_peak_memory_gib is not None:
            measured["peak_memory_gib"] = self.measured_peak_memory_gib
        if self.measured_peak_memory_gb is not None:
            measured["peak_memory_gb"] = self.measured_peak_memory_gb
        if self.measured_peak_memory_stage is not None:
            measured["peak_memory_stage"] = self.measured_peak_memory_stage
        return out


def _model_graph(model, case_id: str) -> Graph:
    """A preset's graph, or the graph a Hugging Face config object describes, named after the
    case; either way a failure is one line naming the case."""
    from opgraph.models import preset

    if isinstance(model, str):
        return preset(model)
    from opgraph.models import hf

    return hf.from_dict(_thaw(model), f"case {case_id}: model").copy(case_id)


def _at_seq_len(graph: Graph, case: Case) -> Graph:
    """A copy of `graph` whose default sequence length is the case's, which a learned position
    table must hold."""
    longest = graph.max_seq_len
    if longest and case.seq_len > longest:
        raise OpgraphError(f"case {case.id}: seq_len {case.seq_len:,} is longer than the "
                           f"model's {longest:,} positions; give at most {longest:,}")
    graph = graph.copy()
    graph.seq_len = case.seq_len
    if S in graph.dims:
        graph.dims[S] = case.seq_len
    return graph


# --- reading one value --------------------------------------------------------------------------
def _shown(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _text(value, where: str, key: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise OpgraphError(f"{where}: {key} is {_shown(value)}; give a non-empty string")
    return value


def _case_id(value, where: str, key: str) -> str:
    """An id names the case in messages and in what is written about it: no spaces or slashes."""
    if not isinstance(value, str) or not _ID.fullmatch(value):
        raise OpgraphError(f"{where}: id is {_shown(value)}; give letters, digits, '.', '_' "
                           "and '-', starting with a letter or digit")
    return value


def _object(value, where: str, key: str) -> dict:
    if not isinstance(value, dict):
        raise OpgraphError(f"{where}: {key} is {_shown(value)}; give an object")
    return value


def _note(value, where: str, key: str) -> str:
    if not isinstance(value, str):
        raise OpgraphError(f"{where}: {key} is {_shown(value)}; give a string")
    return value


def _whole(value, where: str, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise OpgraphError(f"{where}: {key} is {_shown(value)}, not a whole number")
    return check_whole(value, f"{where}: {key}", MAX_DIM)


def _stage(value, where: str, key: str) -> int:
    """A pipeline stage's index, from 0 (the first); `_case` checks it against the degree."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_DIM:
        raise OpgraphError(f"{where}: {key} is {_shown(value)}; give a pipeline stage's index, a "
                           "whole number from 0 (the first stage)")
    return value


def _layer_list(value, where: str, key: str) -> list[int]:
    """Every pipeline stage's layers, first to last: whole numbers, 0 for a stage without."""
    if not isinstance(value, list) or not value or any(
            isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_DIM for n in value):
        raise OpgraphError(f"{where}: {key} is {_shown(value)}; give a list of each pipeline "
                           "stage's layers, whole numbers from 0 (e.g. [6, 5, 5, 0])")
    return value


def _flag(value, where: str, key: str) -> bool:
    if not isinstance(value, bool):
        raise OpgraphError(f"{where}: {key} is {_shown(value)}, not true or false")
    return value


def _zero(value, where: str, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value not in (0, 1, 2, 3):
        raise OpgraphError(f"{where}: {key} is {_shown(value)}; give the ZeRO stage 0, 1, 2 or 3")
    return value


def _positive(value, where: str, key: str) -> float:
    """A positive finite number; an integer too large for a float is refused, not overflowed."""
    number = None
    if not isinstance(value, bool) and isinstance(value, int | float):
        try:
            number = float(value)
        except OverflowError:
            number = None
    if number is None or not (math.isfinite(number) and number > 0):
        raise OpgraphError(f"{where}: {key} is {_shown(value)}, not a positive number")
    return number


def _within(low: float, high: float, unit: str):
    """A reader for a positive number from `low` to `high` (`_positive`, then the range): a
    measurement outside it is a typo or a unit slip, and would throw a fit off by 1e300."""
    def read(value, where: str, key: str) -> float:
        number = _positive(value, where, key)
        if not low <= number <= high:
            raise OpgraphError(f"{where}: {key} is {_shown(value)}, outside {low:g} to "
                               f"{high:g} {unit}; give the measured value in {unit}")
        return number
    return read


# What a measurement may be: a step from 1 us to 1e6 s (11.6 days; published steps take
# seconds), a GPU's rate from 1e-3 to 1e9 tokens/s, a GPU's memory up to 1e6 GiB.
STEP_TIME_S = (1e-6, 1e6)
_measured_step = _within(*STEP_TIME_S, "s")


def _choice(choices: Callable[[], tuple[str, ...]], what: str):
    """A reader for one of a list of names, saying the names when it is not one."""
    def read(value, where: str, key: str) -> str:
        names = choices()
        if not isinstance(value, str) or value not in names:
            raise OpgraphError(f"{where}: {key} is {_shown(value)}; choose {what}: "
                               f"{', '.join(names)}")
        return value
    read.__name__ = f"_read_{what.replace(' ', '_')}"
    return read


def _catalog_or_table(choices: Callable[[], tuple[str, ...]], what: str,
                      from_table: Callable):
    """A reader for a catalog id (`_choice`) or an inline table that `from_table` reads (a
    part, a cluster): checked here, kept as given."""
    by_name = _choice(choices, what)

    def read(value, where: str, key: str):
        if isinstance(value, dict):
            from_table(value, f"{where}: {key}")
            return value
        try:
            return by_name(value, where, key)
        except OpgraphError as e:
            raise OpgraphError(f"{e}; or give an object with the fields of a {key} file's "
                               "table and its id") from None
    read.__name__ = f"_read_{what.replace(' ', '_')}_or_table"
    return read


def _resolved(value, by_name: Callable, from_table: Callable, where: str):
    """A case's part or cluster: a catalog id's record, or an inline table's."""
    return by_name(value) if isinstance(value, str) else from_table(_thaw(value), where)


def _recompute(value, where: str, key: str) -> str:
    """A recompute policy (`choices.recompute_policy`): a name, or selective: and Megatron-Core's
    modules."""
    try:
        return recompute_policy(value)
    except OpgraphError as e:
        raise OpgraphError(f"{where}: {key}: {e}") from None


def _model(value, where: str, key: str):
    from opgraph.models import PRESETS

    if isinstance(value, str):
        if value not in PRESETS:
            raise OpgraphError(f"{where}: model {_shown(value)} is not a preset; choose one of: "
                               f"{', '.join(sorted(PRESETS))}, or give a Hugging Face config "
                               "object")
        return value
    if not isinstance(value, dict):
        raise OpgraphError(f"{where}: model is {_shown(value)}; give a preset name or a Hugging "
                           "Face config object")
    return value


# key -> reader(value, where, key); every key of a case, its parallel and its measured block
READERS: dict[str, Callable] = {
    "id": _case_id,
    "family": _case_id,
    "power_limit_w": _positive,
    "source": _text,
    "reason": _text,
    "notes": _note,
    "model": _model,
    "hardware": _catalog_or_table(lambda: tuple(parts.catalog()), "a catalog part",
                                  parts.from_table),
    "cluster": _catalog_or_table(lambda: tuple(clusters.catalog()), "a catalog cluster",
                                 clusters.from_table),
    "gpus": _whole,
    "seq_len": _whole,
    "recompute": _recompute,
    "precision": _choice(lambda: PRECISIONS, "a precision"),
    "fuse": _choice(lambda: FUSE_CHOICES, "a fusion policy"),
    "fused_attention": _flag,
    "parallel": _object, "measured": _object,  # read as blocks of their own
    # parallel
    "tp": _whole, "pp": _whole, "cp": _whole, "ep": _whole, "dp": _whole,
    "micro_batch": _whole, "global_batch": _whole, "virtual_stages": _whole,
    "zero": _zero, "replicate": _whole, "sequence_parallel": _flag, "async_tp": _flag,
    "overlap_grad_reduce": _flag,
    "overlap_param_gather": _flag,
    "first_stage_layers": _whole, "last_stage_layers": _whole, "stage_layers": _layer_list,
    "framework": _choice(lambda: FRAMEWORKS, "a framework"),
    "grad_reduce_dtype": _choice(lambda: GRAD_REDUCE_DTYPES, "a gradient-reduction dtype"),
    "attention_library": _choice(lambda: ATTENTION_LIBRARIES, "an attention library"),
    "cp_comm": _choice(lambda: CP_COMMS, "a context-parallel communication"),
    "expert_tp": _whole,
    # measured
    "step_time_s": _measured_step, "tokens_per_s_per_gpu": _within(1e-3, 1e9, "tokens/s"),
    "peak_memory_gib": _within(1e-6, 1e6, "GiB"), "peak_memory_gb": _within(1e-6, 1e6, "GB"),
    "peak_memory_stage": _stage,
}


def _block(table, keys: tuple[str, ...], where: str, name: str) -> dict:
    """A JSON object's values read by their READERS, after refusing unknown keys."""
    if not isinstance(table, dict):
        raise OpgraphError(f"{where}: {name} is {_shown(table)}; give an object with keys "
                           f"from {', '.join(keys)}")
    extra = [k for k in table if k not in keys]
    if extra:
        raise OpgraphError(f"{where}: unknown key {extra[0]!r} in {name}; the keys are "
                           f"{', '.join(keys)}")
    return {k: READERS[k](v, where, k if name == "the case" else f"{name}.{k}")
            for k, v in table.items()}


# --- reading one case ---------------------------------------------------------------------------
def _case(table, file: str, index: int) -> Case:
    """One case's table read and checked; messages name the case by its id once it is known."""
    where = f"{file}: cases[{index}]"
    if isinstance(table, dict) and "id" in table:
        where = f"{file}: case {_case_id(table['id'], where, 'id')}"
    fields = _block(table, CASE_KEYS, where, "the case")
    missing = [k for k in REQUIRED if k not in fields]
    if missing:
        raise OpgraphError(f"{where}: missing key {missing[0]!r}; a case needs "
                           f"{', '.join(REQUIRED)}")
    layout = _block(fields.pop("parallel", {}), PARALLEL_KEYS, where, "parallel")
    measured = _block(fields.pop("measured"), MEASURED_KEYS, where, "measured")
    timing = [k for k in TIMINGS if k in measured]
    if len(timing) != 1:
        raise OpgraphError(f"{where}: measured needs one of step_time_s and "
                           "tokens_per_s_per_gpu" + (", not both" if timing else ""))
    try:
        parallel = Parallel(gpus=fields["gpus"], **layout)
    except OpgraphError as e:
        raise OpgraphError(f"{where}: {e}") from None
    # dp and the global batch as numbers, not "what the others imply": one layout, one record
    parallel = attrs.evolve(parallel, dp=parallel.dp_degree, global_batch=parallel.batch)
    tps = measured.get("tokens_per_s_per_gpu")
    step = measured.get("step_time_s") or _measured_step(
        parallel.batch * fields["seq_len"] / (tps * fields["gpus"]), where,
        "the step time its tokens_per_s_per_gpu implies")
    if "peak_memory_gib" in measured and "peak_memory_gb" in measured:
        raise OpgraphError(f"{where}: measured gives peak_memory_gib and peak_memory_gb; give "
                           "the one unit the source used")
    stage = measured.get("peak_memory_stage")
    if stage is not None and stage >= parallel.pp:
        raise OpgraphError(f"{where}: measured.peak_memory_stage is {stage}, but the layout has "
                           f"{parallel.pp} pipeline stage{'s' if parallel.pp > 1 else ''}; give "
                           f"0 to {parallel.pp - 1}")
    case = Case(**{**DEFAULTS, **fields}, parallel=parallel, measured_step_time_s=step,
                measured_tokens_per_s_per_gpu=tps,
                measured_peak_memory_gib=measured.get("peak_memory_gib"),
                measured_peak_memory_gb=measured.get("peak_memory_gb"),
                measured_peak_memory_stage=stage)
    try:  # the part as the case runs it: an inline table, a power limit it can take
        part = case.part()
    except OpgraphError as e:
        raise OpgraphError(f"{where}: {e}") from None
    if case.cluster is None and not part.cluster:  # an inline part with no cluster
        raise OpgraphError(f"{where}: hardware {part.id} names no cluster; add "
                           "\"cluster\" to the case (a catalog id or an object) or to the part")
    if case.precision != "bf16" and part.fp8_flops is None:
        raise OpgraphError(f"{where}: precision {case.precision} on {part.id}, which has no FP8 "
                           "tensor cores; give precision bf16 or another part")
    return case


def read_case(table: dict, where: str = "case") -> Case:
    """One case from its case-file form (`Case.to_json`), checked as a file's cases are."""
    return _case(table, where, 0)


def _check_model(case: Case, file: str, built: dict) -> None:
    """The case's model builds, takes its seq_len, and its layers split over the pipeline
    stages. `built` keeps each distinct model's graph, so a file builds each model once."""
    key = json.dumps(_thaw(case.model), sort_keys=True)
    try:
        if key not in built:
            built[key] = _model_graph(case.model, case.id)
        graph = _at_seq_len(built[key], case)
        from ..parallel.distributed import check_pipeline  # the CLI's check: the same stack

        try:
            check_pipeline(graph, case.parallel)
        except OpgraphError as e:
            raise OpgraphError(f"case {case.id}: {e}") from None
    except OpgraphError as e:  # the messages name the case; add the file
        raise OpgraphError(f"{file}: {e}") from None


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    seen = set()
    for key, _ in pairs:
        if key in seen:
            raise OpgraphError(f"key {key!r} appears twice in one object; keep one")
        seen.add(key)
    return dict(pairs)


def _parse(text: str, path: Path) -> dict:
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as e:
        raise OpgraphError(f"case file {path} is not valid JSON: {e}") from None
    except OpgraphError as e:
        raise OpgraphError(f"case file {path}: {e}") from None
    except RecursionError:
        raise OpgraphError(f"case file {path} nests too deeply to be a case file") from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise OpgraphError(f"case file {path}: {str(e).split(':')[0]}") from None
    if not isinstance(data, dict) or not isinstance(data.get("cases"), list):
        raise OpgraphError(f"case file {path} must hold an object with a list \"cases\": "
                           '{"cases": [{"id": ..., "model": ..., ...}]}')
    extra = [k for k in data if k not in TOP_KEYS]
    if extra:
        raise OpgraphError(f"case file {path}: unknown key {extra[0]!r}; the keys are "
                           f"{', '.join(TOP_KEYS)}")
    if not data["cases"]:
        raise OpgraphError(f"case file {path} lists no cases; add one to \"cases\"")
    return data


def resolve(path: str | Path | None) -> Path:
    """A case file's path: None for the shipped development set, a name of NAMED ("dev",
    "playbook-sweep", "holdout") for a shipped file wherever the command runs, else the path
    given."""
    if path is None:
        return SHIPPED
    if isinstance(path, str) and path in NAMED:
        return NAMED[path]
    if not str(path).strip():
        raise OpgraphError("the case file name is empty; give the path of a .json case file or "
                           f"one of {', '.join(NAMED)}")
    if not Path(path).exists():  # a mistyped shipped name, or --select's text given as a file
        raise OpgraphError(f"case file {path} does not exist; give the path of a .json case "
                           f"file or a shipped one ({', '.join(NAMED)}); --select TEXT picks "
                           "a file's cases by id")
    return Path(path)


def load_cases(path: str | Path | None = None, *, most: tuple[int, str] | None = None,
               pattern: str | None = None) -> list[Case]:
    """The cases of a case file, in its order; None: the shipped validation set (see NAMED).
    `most`, (a bound, what it bounds), refuses a file with more cases than the bound (those
    whose id contains `pattern`, if given) before any is built.

        >>> cases = load_cases()
        >>> len(cases), cases[0].parallel.tp, cases[0].measured_step_time_s
        (80, 8, 1.42)
    """
    path = resolve(path)
    data = _parse(read_small(path, "case file", CASES_MAX_BYTES), path)
    if most is not None:
        bound, what = most
        count = sum(pattern is None or pattern in str(t.get("id", "")) if isinstance(t, dict)
                    else 1 for t in data["cases"])
        if count > bound:
            raise OpgraphError(f"case file {path}: {count:,} cases, more than opgraph's bound "
                               f"of {bound:,} for {what}; pick some with --select or split "
                               "the file")
    cases, ids, built = [], set(), {}
    for i, table in enumerate(data["cases"]):
        case = _case(table, str(path), i)
        if case.id in ids:
            raise OpgraphError(f"{path}: case {case.id}: the id is used twice; give each "
                               "case its own id")
        ids.add(case.id)
        _check_model(case, str(path), built)
        cases.append(case)
    for record in load_unmodelled(path, data):
        if record.id in ids:
            raise OpgraphError(f"{path}: case {record.id} is both a case and unmodelled; keep one")
    return cases


@attrs.frozen(kw_only=True)
class Unmodelled:
    """A published run the file records but opgraph cannot predict, and why (a layout the source
    does not give, a part or a feature opgraph does not model): listed and counted by
    `opgraph validate`, never silently dropped."""

    id: str
    source: str
    reason: str
    family: str = ""


def load_unmodelled(path: str | Path | None = None, data: dict | None = None) -> list[Unmodelled]:
    """The file's "unmodelled" records (none where it has no such list)."""
    path = resolve(path)
    if data is None:
        data = _parse(read_small(path, "case file", CASES_MAX_BYTES), path)
    records = data.get("unmodelled", [])
    if not isinstance(records, list):
        raise OpgraphError(f"case file {path}: \"unmodelled\" is {_shown(records)}; give a list "
                           'of {"id", "source", "reason"} objects')
    out, ids = [], set()
    for i, table in enumerate(records):
        where = f"{path}: unmodelled[{i}]"
        fields = _block(table, UNMODELLED_KEYS, where, "the case")
        missing = [k for k in ("id", "source", "reason") if k not in fields]
        if missing:
            raise OpgraphError(f"{where}: missing key {missing[0]!r}; an unmodelled run needs "
                               "id, source and reason")
        if fields["id"] in ids:
            raise OpgraphError(f"{where}: the id {fields['id']} is used twice; keep one")
        ids.add(fields["id"])
        out.append(Unmodelled(**fields))
    return out


__all__ = ["CASE_KEYS", "DEFAULTS", "HOLDOUT", "MEASURED_KEYS", "NAMED", "PARALLEL_KEYS",
           "SHIPPED", "SWEEP", "Case", "Unmodelled", "load_cases", "load_unmodelled", "resolve"]


def select(cases: list[Case], pattern: str | None) -> list[Case]:
    """The cases whose id contains `pattern` (all for None); none is an error naming the ids."""
    if pattern is None:
        return cases
    chosen = [c for c in cases if pattern in c.id]
    if not chosen:
        raise OpgraphError(f"no case id contains {pattern!r}; the ids are "
                           f"{', '.join(c.id for c in cases[:4])}, ...")
    return chosen
