"""Predict published runs and compare: `validate(load_cases())`.

Each case (`opgraph.cases`) is compiled and scheduled as `opgraph profile` would with the same
flags (`opgraph.distributed.profile_parallel`), and its predicted step time set beside the
measured one: error = predicted / measured - 1. The roofline is a ceiling, so its errors are
negative: no real run beats it.
"""

from __future__ import annotations

import math

import attrs

from . import cluster as clusters
from . import hardware as hw
from .cases import Case
from .costmodel import DEFAULT, CostModel
from .distributed import profile_parallel
from .pipeline import fusion_passes


@attrs.frozen
class Prediction:
    case: Case
    predicted_step_time_s: float
    predicted_peak_memory_bytes: int
    mfu: float

    @property
    def error(self) -> float:
        """predicted / measured - 1."""
        return self.predicted_step_time_s / self.case.measured_step_time_s - 1

    def to_json(self) -> dict:
        out = {"id": self.case.id, "measured_step_time_s": self.case.measured_step_time_s,
               "predicted_step_time_s": self.predicted_step_time_s, "error": self.error,
               "predicted_mfu": self.mfu,
               "predicted_peak_memory_gib": self.predicted_peak_memory_bytes / 2**30}
        if self.case.measured_peak_memory_gib is not None:
            out["measured_peak_memory_gib"] = self.case.measured_peak_memory_gib
        return out


def case_options(case: Case) -> dict:
    """`compile_step`'s options for a case: recomputation, precision, element-wise fusion."""
    return {"recompute": case.recompute, "precision": case.precision,
            "fused_attention": case.fused_attention, "extra_passes": fusion_passes(case.fuse)}


def predict(case: Case, cost: CostModel = DEFAULT) -> Prediction:
    """One case's prediction, as `opgraph profile` gives it for the case's flags."""
    part = hw.get(case.hardware)
    cluster = clusters.get(case.cluster) if case.cluster else clusters.for_hardware(part)
    profile = profile_parallel(case.forward(), part, case.parallel, cluster=cluster,
                               values={"S": case.seq_len}, cost=cost, **case_options(case))
    r = profile.parallel
    return Prediction(case, r.step_time_s, r.memory.total, r.mfu)


@attrs.frozen
class Report:
    predictions: tuple[Prediction, ...]

    @property
    def mape(self) -> float:
        """Mean absolute error of the step time, a fraction."""
        return sum(abs(p.error) for p in self.predictions) / len(self.predictions)

    @property
    def worst(self) -> Prediction:
        return max(self.predictions, key=lambda p: abs(p.error))

    def to_json(self) -> dict:
        return {"cases": [p.to_json() for p in self.predictions], "mape": self.mape,
                "max_error": abs(self.worst.error), "worst_case": self.worst.case.id}


def validate(cases: list[Case], cost: CostModel = DEFAULT) -> Report:
    """Every case predicted (see the module)."""
    return Report(tuple(predict(c, cost) for c in cases))


def format_report(report: Report, what: str, note: str = "") -> str:
    """The `opgraph validate` table, `note` under it."""
    lines = [(f"{'case':<40} {'GPUs':>5} {'measured s':>11} {what + ' s':>13} {'error':>8}  "
             f"{'memory GiB (measured)':>22}")]
    for p in report.predictions:
        c = p.case
        memory = f"{p.predicted_peak_memory_bytes / 2**30:.1f}"
        if c.measured_peak_memory_gib is not None:
            memory += f" ({c.measured_peak_memory_gib:g})"
        lines.append(f"{c.id:<40} {c.gpus:>5,} {c.measured_step_time_s:>11.3f} "
                     f"{p.predicted_step_time_s:>13.3f} {p.error * 100:>+7.1f}%  {memory:>22}")
    worst = report.worst
    lines += ["", (f"mean absolute error {report.mape * 100:.1f}% over {len(report.predictions)} "
                  f"cases; worst {worst.error * 100:+.1f}% ({worst.case.id})")]
    if not math.isfinite(report.mape):
        lines.append("(an error is not finite)")
    if note:
        lines.append(note)
    return "\n".join(lines)
