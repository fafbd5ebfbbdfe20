"""Why this layout, and how sure: `opgraph plan --compare` and `--sensitivity`.

**Why** (`compare`): the plan's first and second layouts beside the layouts a user names,
written as `plan` prints one (`parallel.parse_layout`: `tp8,pp16,dp64,mb1,zero1`) or read from a
launch config (`opgraph.io.launch`), each with its step split as the schedule runs rank 0
(`ParallelResult.parts`: compute, the pipeline bubble, the wait for each group's collectives, a
later stage's longer tail and the overlap slowdown, which add up to the step) and its memory per
GPU beside the part's capacity. A named layout is profiled as `opgraph profile` profiles it
(`distributed.profile_parallel`); the search's layouts carry the same figures (relative 1e-9,
tests/test_search.py). A named layout that is no layout of the job (its degrees do not divide
the GPUs or the model, its batch is another) is a row with its reason; one that does not fit
has its figures and the reason.

**How sure** (`sensitivity`): the top K layouts scheduled again with the calibrated cost model
moved by its error (`validate.LEFT_OUT_ERROR`): the kernels' efficiencies (matmul, attention)
times 1 - e and 1 + e, then the collectives' bandwidths (node, network) so, each an
`attrs.evolve` of the model's efficiencies (`perturb`); each layout's compiled job is only
scheduled again (`distributed.step_figures`). For each moved model: where the first choice now
ranks among the K, and which comes first. A moved value may pass 1 (a kernel above the peak it
is measured against): it stands for the model's error, not for a faster part.

    found = searcher.search(space, 10)
    rows = compare(searcher, found.best, [named("tp2,pp2,zero1", space)])
    moved = sensitivity(searcher, found.best)
"""

from __future__ import annotations

from pathlib import Path

import attrs

from ..core.errors import OpgraphError
from ..cost.costmodel import CalibratedCostModel, CostModel
from ..parallel.distributed import ParallelResult, step_figures
from ..parallel.parallel import Parallel, parse_layout
from ..parallel.search import Candidate, Ranked, Searcher, Space


def _pairs(given) -> tuple:
    return tuple(dict(given).items())


@attrs.frozen
class Named:
    """A layout a user names for the job `space` describes: the fields and options its text
    or config gave (checked when it is evaluated, so that a layout no job has is a row with
    its reason), and what the table calls it."""

    label: str
    text: str  # as the user wrote it, or the config's path
    fields: tuple = attrs.field(converter=_pairs)  # `Parallel`'s keywords, (name, value)
    recompute: str = "none"
    precision: str = "bf16"
    fuse: str | None = None
    mismatch: str | None = None  # why a config is not this job's, if it is not


def named(text: str, space: Space) -> Named:
    """A layout written as `plan` prints one (`parallel.parse_layout`), on `space`'s GPUs and
    batch, with its framework and --async-tp; what it leaves out of the step's options is the
    plan's where the plan fixes one (--recompute full), else none and bf16. A text that is no
    layout is an OpgraphError now, before any search."""
    fields, options = parse_layout(text)
    tp = fields.get("tp", 1)
    given = {"gpus": space.gpus, "global_batch": space.batch,
             "async_tp": space.async_tp and tp > 1, **space.framework_settings()}
    return Named("named", text, given | fields,
                 options.get("recompute", _only(space.recompute, "none")),
                 options.get("precision", _only(space.precision, "bf16")))


def _only(choices, default: str) -> str:
    return choices[0] if choices and len(choices) == 1 else default


def from_config(path: str, space: Space, model: str, seq: int) -> tuple[Named, tuple[str, ...]]:
    """The layout a launch config gives (a torchtitan job TOML, or Megatron-LM's arguments in
    a file), as `profile --torchtitan` / `--megatron-args` reads it, and the keys it does not
    model (`Launch.unknown`). A config of another job (its model, GPUs, batch or sequence
    length) is kept with the reason; one that does not read is an OpgraphError now. The layout
    runs the plan's model: a torchtitan job names its preset, checked; Megatron-LM's arguments
    give dimensions (its vocabulary padded), taken as the plan's model's."""
    from ..io import launch

    if Path(path).suffix == ".toml":
        job = launch.read_torchtitan(path, gpus=space.gpus)
    else:
        job = launch.read_megatron(f"@{path}", gpus=space.gpus)
    lay = job.parallel
    mismatch = (f"it trains {job.model}, the plan {model}"
                if isinstance(job.model, str) and job.model != model
                else _other_job(lay, job.seq_len, space, seq))
    fields = attrs.asdict(lay, recurse=False)
    return (Named("config", path, fields, job.recompute, job.precision, job.fuse,
                  f"{path}: {mismatch}; plan the same job" if mismatch else None),
            tuple(f"{path}: {note}" for note in job.unknown))


def from_case(given: str, case, space: Space, seq: int) -> Named:
    """The layout a run of a case file ran (`plan --case FILE:ID`, `opgraph.io.cases.Case`),
    kept with the reason where a flag made the plan's job another one."""
    mismatch = _other_job(case.parallel, case.seq_len, space, seq)
    return Named("case", given, attrs.asdict(case.parallel, recurse=False), case.recompute,
                 case.precision, None if case.fuse == "none" else case.fuse,
                 f"{given}: {mismatch}; plan the same job" if mismatch else None)


def _other_job(lay, seq_len: int | None, space: Space, seq: int) -> str | None:
    """How a layout's job differs from the plan's (its GPUs, global batch or sequence length:
    None, the same job)."""
    if lay.world != space.gpus:
        return f"it runs on {lay.world:,} GPUs, the plan on {space.gpus:,}"
    if lay.batch != space.batch:
        return f"its global batch is {lay.batch:,} sequences, the plan's {space.batch:,}"
    if seq_len is not None and seq_len != seq:
        return f"its sequence length is {seq_len:,}, the plan's {seq:,}"
    return None


@attrs.frozen
class Compared:
    """One row of the comparison: a layout and its figures as `profile` gives them, or the
    reason it has none (no layout of the job, or one that does not fit)."""

    label: str  # "#1", "#2", "named", "config"
    text: str
    candidate: Candidate | None = None
    result: ParallelResult | None = None
    reason: str | None = None
    source: str | None = None  # a config's path

    def to_json(self) -> dict:
        out = {"label": self.label, "layout": self.text}
        if self.source is not None:
            out["source"] = self.source
        if self.candidate is not None:
            out |= self.candidate.to_json()
        if self.result is not None:
            r = self.result
            capacity = r.memory.capacity
            out |= {"step_time_s": r.step_time_s, "mfu": r.mfu,
                    "tokens_per_s_per_gpu": r.tokens_per_s_per_gpu,
                    "parts_s": r.parts(), "memory_bytes": r.memory.total,
                    "capacity_bytes": capacity,
                    "headroom_bytes": capacity - r.memory.total if capacity else None}
        if self.reason is not None:
            out["reason"] = self.reason
        return out


def compare(searcher: Searcher, best: tuple[Ranked, ...], names: list[Named]
            ) -> tuple[Compared, ...]:
    """The first and second of `best` (a search's, on `searcher`), then each named layout
    profiled as `opgraph profile` profiles it."""
    from ..io.outputs.report import layout_text

    rows = [Compared(f"#{i}", layout_text(r.layout, r.candidate.recompute,
                                          r.candidate.precision), r.candidate, r.result)
            for i, r in enumerate(best[:2], 1)]
    return tuple(rows) + tuple(_profiled(searcher, n) for n in names)


def _profiled(searcher: Searcher, n: Named) -> Compared:
    from ..io.outputs.report import layout_text
    from ..parallel.job import JobSpec

    source = n.text if n.label == "config" else None
    if n.mismatch is not None:
        return Compared(n.label, n.text, reason=n.mismatch, source=source)
    try:
        layout = Parallel(**dict(n.fields))
        profile = JobSpec(forward=searcher.forward, hardware=searcher.hardware, layout=layout,
                          seq_len=searcher.seq, recompute=n.recompute, precision=n.precision,
                          fuse=n.fuse, cluster=searcher.cluster, cost=searcher.cost).profile()
    except OpgraphError as e:
        return Compared(n.label, n.text, reason=f"{n.text}: {e}", source=source)
    r = profile.parallel
    text = layout_text(layout, n.recompute, n.precision)
    reason = None
    if r.memory.fits is False:
        reason = (f"does not fit: {r.memory.total / 1e9:,.1f} GB per GPU (pipeline stage "
                  f"{r.memory_stage}) of {r.memory.capacity / 1e9:,.1f} GB")
    return Compared(n.label, text, Candidate(layout, n.recompute, n.precision), r, reason,
                    source)


# --- how sure --------------------------------------------------------------------------------

# What `sensitivity` moves, by the model's error: (what, the efficiencies that scale it).
MOVED = (("kernels", ("matmul", "attention", "attention_fused")),
         ("collectives", ("node", "network")))


def perturb(cost: CostModel, names: tuple[str, ...], factor: float) -> CostModel:
    """`cost` with each generation's efficiencies `names` times `factor` (`attrs.evolve` of
    its table): a calibrated model moved, every rule as it was.

        perturb(cost, ("matmul", "attention"), 1 - LEFT_OUT_ERROR)   # kernels 9.1% slower
    """
    if not isinstance(cost, CalibratedCostModel):
        raise OpgraphError("--sensitivity moves the calibrated model's efficiencies by its "
                           "error; give --cost calibrated (plan's default)")
    table = {generation: attrs.evolve(e, **{name: getattr(e, name) * factor for name in names})
             for generation, e in cost.table.items()}
    return attrs.evolve(cost, table=table)


@attrs.frozen
class Perturbed:
    """The top layouts under one moved cost model: each one's step, in the plan's order."""

    what: str  # "kernels", "collectives"
    names: tuple[str, ...]  # the efficiencies moved
    factor: float
    steps: tuple[float, ...]

    @property
    def first_rank(self) -> int:
        """Where the plan's first choice ranks now (1: still first; ties keep the plan's
        order)."""
        return 1 + sum(step < self.steps[0] for step in self.steps[1:])

    @property
    def first(self) -> int:
        """The index, in the plan's order, of the layout first now."""
        return min(range(len(self.steps)), key=lambda i: (self.steps[i], i))

    def to_json(self, best: tuple[Ranked, ...]) -> dict:
        return {"moved": self.what, "efficiencies": list(self.names), "factor": self.factor,
                "first_rank": self.first_rank, "of": len(self.steps),
                "first_step_time_s": self.steps[0],
                "first_now": best[self.first].candidate.to_json() | {
                    "plan_rank": self.first + 1, "step_time_s": self.steps[self.first]},
                "step_times_s": list(self.steps)}


def sensitivity(searcher: Searcher, best: tuple[Ranked, ...], error: float | None = None
                ) -> tuple[Perturbed, ...]:
    """`best` (a search's top layouts on `searcher`) scheduled again under each moved model
    (see the module): the kernels, then the collectives, each times 1 - `error` and 1 +
    `error` (default `validate.LEFT_OUT_ERROR`)."""
    if error is None:
        from ..analysis.validate import LEFT_OUT_ERROR as error
    jobs = [searcher.job(r.candidate) for r in best]
    out = []
    for what, names in MOVED:
        for factor in (1 - error, 1 + error):
            cost = perturb(searcher.cost, names, factor)
            out.append(Perturbed(what, names, factor,
                                 tuple(step_figures(job, cost).step_time_s for job in jobs)))
    return tuple(out)


__all__ = ["MOVED", "Compared", "Named", "Perturbed", "compare", "from_config", "named",
           "perturb", "sensitivity"]
