"""Predict published runs and compare: `validate(load_cases())`.

Each case (`opgraph.io.cases`) is compiled and scheduled as `opgraph profile` would with the same
flags (`opgraph.parallel.distributed.profile_parallel`), and its predicted step time set beside the
measured one: error = predicted / measured - 1. The roofline is a ceiling, so its errors are
negative: no real run beats it.

A case opgraph cannot model (the file's `unmodelled` list, or a case whose prediction fails with
an OpgraphError) is listed with its reason and counted, not dropped and not fatal.

Beyond the error of each run:

- `by_family`: the mean absolute error per source family (a paper's table, a framework's
  benchmark), the unit a prediction is judged in;
- `cross_validate`: leave one family out: fit the calibrated model's fitted parameters on every
  other family, predict the one left out; the left-out error beside the in-sample one (a fit on
  all), family by family;
- `rank`: choice quality: cases grouped by model and GPUs, each group's Spearman correlation of
  predicted and measured throughput, and the regret of opgraph's first choice: how much slower
  its measured run is than the measured best.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable

import attrs

from ..core.errors import OpgraphError
from ..cost.costmodel import DEFAULT, CostModel
from ..io.cases import Case, Unmodelled
from ..parallel.distributed import step_figures

# How far a prediction of a family the fit never saw is off: `opgraph validate --cv family`'s
# mean left-out step-time error (the README's and docs/calibration.md's leave-one-family-out
# table, 8.3% left out against 7.9% in-sample, on the 80 shipped runs). `plan --sensitivity`
# moves the calibrated model's efficiencies by it (`opgraph.analysis.explain`). Rerun --cv and
# update it when the calibration is refitted (tests/test_explain.py holds it to the README's).
LEFT_OUT_ERROR = 0.083


@attrs.frozen
class Prediction:
    case: Case
    predicted_step_time_s: float
    predicted_peak_memory_bytes: int  # the reserved peak (`Memory.total`)
    mfu: float
    # the allocated peak (`Memory.allocated`): the same but where the allocator keeps buffers
    predicted_allocated_bytes: int | None = None
    # what decides whether it fits: the fullest stage's allocated peak (`Memory.fits`), where the
    # figures above are another stage's (`Case.measured_peak_memory_stage`)
    predicted_fit_bytes: int | None = None
    # the predicted step split as the schedule runs rank 0 (`ParallelResult.parts`: compute,
    # bubble, each group's exposed communication, ...), in seconds: where a miss can come from
    parts: tuple[tuple[str, float], ...] = ()

    @property
    def error(self) -> float:
        """predicted / measured - 1."""
        return self.predicted_step_time_s / self.case.measured_step_time_s - 1

    @property
    def memory_error(self) -> float | None:
        """predicted / measured peak memory - 1, where the run's memory was published."""
        measured = self.case.measured_peak_memory_bytes
        return None if measured is None else self.predicted_peak_memory_bytes / measured - 1

    @property
    def tokens_per_s_per_gpu(self) -> float:
        """The predicted throughput: the step's tokens over its time, per GPU."""
        return self.case.tokens_per_step / (self.predicted_step_time_s * self.case.gpus)

    def to_json(self) -> dict:
        out = {"id": self.case.id, "family": self.case.family,
               "measured_step_time_s": self.case.measured_step_time_s,
               "predicted_step_time_s": self.predicted_step_time_s, "error": self.error,
               "predicted_mfu": self.mfu,
               "predicted_peak_memory_gb": self.predicted_peak_memory_bytes / 1e9}
        if self.parts:
            out["predicted_parts_s"] = dict(self.parts)
        if self.predicted_allocated_bytes is not None:
            out["predicted_allocated_memory_gb"] = self.predicted_allocated_bytes / 1e9
        measured = self.case.measured_peak_memory_bytes
        if measured is not None:
            out["measured_peak_memory_gb"] = measured / 1e9
            out["memory_error"] = self.memory_error
        return out


@attrs.frozen
class Skipped:
    """A run that was not predicted, and why."""

    id: str
    family: str
    reason: str

    def to_json(self) -> dict:
        return {"id": self.id, "family": self.family, "reason": self.reason}


def predict(case: Case, cost: CostModel = DEFAULT) -> Prediction:
    """One case's prediction, as `opgraph profile` gives it for the case's flags: the case
    compiled once a process (`opgraph.analysis.fit.compile_cases`, shared with the fit and with
    other cost models), then scheduled under `cost`."""
    from .fit import compile_cases

    ((_, job),) = compile_cases([case], cost)
    r = step_figures(job, cost)
    memory = r.memory  # the fullest stage's, unless the source says whose GPU it read
    if case.measured_peak_memory_stage is not None:
        memory = job.stages[job.kinds[case.measured_peak_memory_stage]].memory
    return Prediction(case, r.step_time_s, memory.total, r.mfu, memory.allocated,
                      r.memory.allocated, tuple(r.parts().items()))


@attrs.frozen
class Report:
    predictions: tuple[Prediction, ...]
    skipped: tuple[Skipped, ...] = ()

    @property
    def mape(self) -> float:
        """Mean absolute error of the step time, a fraction."""
        return mean_abs(p.error for p in self.predictions)

    @property
    def family_mape(self) -> float:
        """The families' mean absolute errors averaged, each family weighted equally (as the
        fit and `--cv family` weigh them), a fraction."""
        families = self.by_family().values()
        return sum(mean_abs(p.error for p in ps) for ps in families) / len(families)

    @property
    def worst(self) -> Prediction:
        return max(self.predictions, key=lambda p: abs(p.error))

    def by_family(self) -> dict[str, tuple[Prediction, ...]]:
        """The predictions grouped by their case's family, in the order families first appear."""
        out: dict[str, list] = {}
        for p in self.predictions:
            out.setdefault(p.case.family or p.case.id, []).append(p)
        return {k: tuple(v) for k, v in out.items()}

    def to_json(self) -> dict:
        if not self.predictions:
            return {"cases": [], "skipped": [s.to_json() for s in self.skipped]}
        return {"cases": [p.to_json() for p in self.predictions], "mape": self.mape,
                "family_mape": self.family_mape, "max_error": abs(self.worst.error), "worst_case": self.worst.case.id,
                "families": [{"family": f, "cases": len(ps), "mape": mean_abs(
                    p.error for p in ps)} for f, ps in self.by_family().items()],
                "skipped": [s.to_json() for s in self.skipped]}


def mean_abs(errors: Iterable[float]) -> float:
    """The mean of the absolute values (NaN for none)."""
    errors = [abs(e) for e in errors]
    return sum(errors) / len(errors) if errors else math.nan


def validate(cases: list[Case], cost: CostModel = DEFAULT,
             unmodelled: Iterable[Unmodelled] = (), progress=None) -> Report:
    """Every case predicted (see the module); one that cannot be is skipped with its reason.
    `progress`, if given, is called once per case."""
    predictions, skipped = [], [Skipped(u.id, u.family, u.reason) for u in unmodelled]
    for c in cases:
        try:
            predictions.append(predict(c, cost))
        except OpgraphError as e:
            skipped.append(Skipped(c.id, c.family, str(e)))
        if progress is not None:
            progress()
    return Report(tuple(predictions), tuple(skipped))


def format_report(report: Report, what: str, note: str = "") -> str:
    """The `opgraph validate` table, the families' errors and the skipped runs, `note` under
    it."""
    lines = [(f"{'case':<44} {'GPUs':>6} {'measured s':>11} {what + ' s':>13} {'error':>8}  "
             f"{'memory GB (measured)':>21}")]
    for p in report.predictions:
        c = p.case
        memory = f"{p.predicted_peak_memory_bytes / 1e9:.1f}"
        if c.measured_peak_memory_bytes is not None:
            memory += f" ({c.measured_peak_memory_bytes / 1e9:.1f})"
        lines.append(f"{c.id:<44} {c.gpus:>6,} {c.measured_step_time_s:>11.3f} "
                     f"{p.predicted_step_time_s:>13.3f} {p.error * 100:>+7.1f}%  {memory:>21}")
    if report.predictions:
        families = report.by_family()
        if len(families) > 1:
            lines += ["", f"{'family':<28} {'cases':>5} {'mean abs error':>15} "
                          f"{'mean error':>11}"]
            for f, ps in families.items():
                signed = sum(p.error for p in ps) / len(ps)
                lines.append(f"{f:<28} {len(ps):>5} {mean_abs(p.error for p in ps) * 100:>14.1f}% "
                             f"{signed * 100:>+10.1f}%")
        worst = report.worst
        lines += ["", (f"mean absolute error {report.mape * 100:.1f}% over "
                       f"{len(report.predictions)} cases; worst {worst.error * 100:+.1f}% "
                       f"({worst.case.id})")]
        if len(families) > 1:
            lines.append(f"mean over {len(families)} families, each weighted equally: "
                         f"{report.family_mape * 100:.1f}%")
        if not math.isfinite(report.mape):
            lines.append("(an error is not finite)")
    if report.skipped:
        lines += ["", f"not modelled: {len(report.skipped)} run"
                      f"{'s' if len(report.skipped) != 1 else ''}"]
        lines += [f"  {s.id}: {s.reason}" for s in report.skipped]
    if note:
        lines.append(note)
    return "\n".join(lines)


# --- leave one family out -------------------------------------------------------------------
@attrs.frozen
class FamilyScore:
    family: str
    cases: int
    in_sample_mape: float  # the fit on every family, judged on this one
    left_out_mape: float  # the fit on every other family, judged on this one

    def to_json(self) -> dict:
        return {"family": self.family, "cases": self.cases,
                "in_sample_mape": self.in_sample_mape, "left_out_mape": self.left_out_mape}


def cross_validate(cases: list[Case], table: dict, *, steps: int | None = None,
                   progress=None) -> tuple[FamilyScore, ...]:
    """Leave one family out (see the module): for each family, the calibrated model's fitted
    parameters refitted on the other families' cases, from the same start, and this family's
    cases predicted with them. Each case is compiled once for all the fits."""
    from .fit import STEPS, compile_cases, fit_jobs

    jobs = compile_cases(cases)
    families: dict[str, list[int]] = {}
    for i, c in enumerate(cases):
        families.setdefault(c.family or c.id, []).append(i)
    if len(families) < 2:
        raise OpgraphError("leaving one family out needs cases of two families or more; "
                           f"these are all {next(iter(families))}")
    steps = STEPS if steps is None else steps
    everything = fit_jobs(jobs, table, steps=steps)
    if progress is not None:
        progress()
    scores = []
    for family, members in families.items():
        kept = [j for i, j in enumerate(jobs) if i not in set(members)]
        fitted = fit_jobs(kept, table, steps=steps, judged=[jobs[i] for i in members])
        scores.append(FamilyScore(
            family, len(members), mean_abs(everything.errors[i][2] for i in members),
            mean_abs(e for _, _, e in fitted.errors)))
        if progress is not None:
            progress()
    return tuple(scores)


def cross_validation_summary(scores: tuple[FamilyScore, ...]) -> dict:
    """`--cv family --json`: each family's scores and their means over families."""
    return {"families": [s.to_json() for s in scores],
            "left_out_mape": statistics.fmean(s.left_out_mape for s in scores),
            "in_sample_mape": statistics.fmean(s.in_sample_mape for s in scores)}


def format_cross_validation(scores: tuple[FamilyScore, ...]) -> str:
    lines = [f"{'family left out':<28} {'cases':>5} {'in-sample':>10} {'left out':>9}"]
    for s in scores:
        lines.append(f"{s.family:<28} {s.cases:>5} {s.in_sample_mape * 100:>9.1f}% "
                     f"{s.left_out_mape * 100:>8.1f}%")
    summary = cross_validation_summary(scores)
    lines += ["", f"mean over {len(scores)} families: left out "
                  f"{summary['left_out_mape'] * 100:.1f}%, in-sample "
                  f"{summary['in_sample_mape'] * 100:.1f}% (mean absolute error of the step time)"]
    return "\n".join(lines)


# --- choice quality -------------------------------------------------------------------------
@attrs.frozen
class RankScore:
    group: str  # the model and the GPUs
    layouts: int
    spearman: float  # predicted against measured tokens/s per GPU
    regret: float  # measured best / measured of the first choice - 1
    choice: str  # the case opgraph puts first
    best: str  # the case measured fastest

    def to_json(self) -> dict:
        return {"group": self.group, "layouts": self.layouts, "spearman": self.spearman,
                "regret": self.regret, "choice": self.choice, "best": self.best}


def _ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank (Spearman's convention)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation: Pearson's of the ranks (NaN where a side is constant).

        >>> spearman([1, 2, 3, 4], [10, 20, 30, 40]), spearman([1, 2, 3], [3, 2, 1])
        (1.0, -1.0)
    """
    ra, rb = _ranks(a), _ranks(b)
    n = len(ra)
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    va = sum((x - ma) ** 2 for x in ra)
    vb = sum((y - mb) ** 2 for y in rb)
    return cov / math.sqrt(va * vb) if va and vb else math.nan


def group_key(case: Case) -> str:
    """The group a case is ranked in: its model (the preset, or the config's dimensions) and its
    GPUs."""
    import json

    from ..io.cases import _thaw

    model = case.model if isinstance(case.model, str) else json.dumps(_thaw(case.model),
                                                                      sort_keys=True)
    return f"{model}@{case.gpus}"


def rank(report: Report, capacity: dict[str, float] | None = None) -> tuple[RankScore, ...]:
    """Choice quality per group of two layouts or more (see the module). opgraph's first choice
    is its fastest predicted layout among those it predicts fit in the part's memory
    (`capacity`: hardware id -> bytes), or among all where it predicts none fit."""
    groups: dict[str, list[Prediction]] = {}
    for p in report.predictions:
        groups.setdefault(group_key(p.case), []).append(p)
    scores = []
    for key, ps in groups.items():
        if len(ps) < 2:
            continue
        measured_tps = [p.case.tokens_per_step / (p.case.measured_step_time_s * p.case.gpus)
                        for p in ps]
        predicted_tps = [p.tokens_per_s_per_gpu for p in ps]
        fits = [p for p in ps if capacity is None or (
            p.predicted_peak_memory_bytes if p.predicted_fit_bytes is None
            else p.predicted_fit_bytes) <= capacity.get(p.case.part_id, math.inf)] or ps
        choice = max(fits, key=lambda p: p.tokens_per_s_per_gpu)
        best = max(range(len(ps)), key=lambda i: measured_tps[i])
        chosen = measured_tps[ps.index(choice)]
        first = ps[0].case
        name = first.family + ": " + (first.model if isinstance(first.model, str) else
                                      _model_label(first)) + f" on {first.gpus} GPUs"
        scores.append(RankScore(name, len(ps), spearman(predicted_tps, measured_tps),
                                measured_tps[best] / chosen - 1, choice.case.id,
                                ps[best].case.id))
    return tuple(scores)


def _model_label(case: Case) -> str:
    m = case.model
    hidden = m.get("hidden_size") or m.get("n_embd") or m.get("n_embed")  # BLOOM's spelling
    layers = m.get("num_hidden_layers") or m.get("n_layer")
    return f"{m.get('model_type')} d{hidden} L{layers}"


def format_rank(scores: tuple[RankScore, ...]) -> str:
    lines = [f"{'group':<48} {'layouts':>7} {'Spearman':>8} {'regret':>7}  first choice"]
    for s in scores:
        lines.append(f"{s.group:<48} {s.layouts:>7} {s.spearman:>8.2f} {s.regret * 100:>6.1f}%  "
                     f"{s.choice}")
    if scores:
        summary = rank_summary(scores)
        lines += ["", f"over {len(scores)} groups: median Spearman "
                      f"{summary['median_spearman']:.2f}, mean regret "
                      f"{summary['mean_regret'] * 100:.1f}%"]
    else:
        lines.append("no group has two layouts or more of one model on one GPU count")
    return "\n".join(lines)


def rank_summary(scores: tuple[RankScore, ...]) -> dict:
    """`--rank --json`: each group's scores, the median Spearman and the mean regret."""
    rhos = [s.spearman for s in scores if not math.isnan(s.spearman)]
    return {"groups": [s.to_json() for s in scores],
            "median_spearman": statistics.median(rhos) if rhos else math.nan,
            "mean_regret": statistics.fmean(s.regret for s in scores) if scores else math.nan}
