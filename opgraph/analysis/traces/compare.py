"""A measured profile beside the roofline's: category by category, and the MFU against its ceiling.

    b = breakdown(iter_kernels("step.json.gz"))
    c = compare(b, evaluate(step, hardware.get("h100-sxm"), {"B": 8}))
    print(format_comparison(c))

Kernel categories and roofline categories are one vocabulary (`opgraph.core.categories`): a kernel
category stands for the roofline category of the same name, except where a kernel's name cannot
tell which it implements (ROOFLINE_OF, a table a user can extend): matmul kernels are the
projections (`matmul`) and the output head (`output_head`, which also holds the loss: the plate's
category, so its cross-entropy kernel, measured as element-wise or other, is predicted under
matmul). Kernel categories with no roofline counterpart (communication, memory, other, and any a
`--rules` file adds) are listed as not modelled, and a roofline category no kernel category maps
to is listed with no measurement.

Invariants: measured times are per step (the trace's totals over `steps`); every row's ratio is
measured over roofline; the rows' measured times sum to the trace's kernel time per step, and
their roofline times to the roofline step time.

The measured MFU is `6 x N x tokens / (t x peak)` with the ceiling's N, tokens and peak, and t
the measured step: the trace's span per step (first kernel start to last kernel end: what the GPU
took, launch gaps included, as MFU is normally quoted). The same over busy time (the union of the
kernels' intervals: the gaps closed) is given beside it.
"""

from __future__ import annotations

import attrs

from ...core.categories import KERNELS_COVER
from ...core.errors import OpgraphError
from ...cost.costmodel import DEFAULT
from ...cost.profile import Profile

# Kernel category -> the roofline categories it implements (see `opgraph.core.categories`).
ROOFLINE_OF: dict[str, tuple[str, ...]] = dict(KERNELS_COVER)


@attrs.frozen
class Row:
    """One kernel category beside its roofline categories; None where one side has nothing."""

    name: str
    roofline_categories: tuple[str, ...]
    measured_s: float | None  # per step
    measured_share: float | None  # of the measured kernel time
    kernels: int | None  # per trace, not per step
    roofline_s: float | None
    roofline_share: float | None  # of the roofline step time

    @property
    def modelled(self) -> bool:
        return bool(self.roofline_categories)

    @property
    def ratio(self) -> float | None:
        """Measured over roofline, where both exist and the roofline's is not zero."""
        if self.measured_s is None or not self.roofline_s:
            return None
        return self.measured_s / self.roofline_s


@attrs.frozen
class Comparison:
    trace: str
    steps: int
    profile: Profile
    rows: tuple[Row, ...]
    kernels: int
    kernel_time_s: float  # per step, as the rest
    busy_time_s: float
    idle_time_s: float
    span_s: float

    @property
    def roofline_step_s(self) -> float:
        return self.profile.step_time_s

    def _mfu(self, seconds: float) -> float:
        """The cost model's MFU (`CostModel.mfu`, written once) of a step taking `seconds`."""
        p = self.profile
        return DEFAULT.mfu(p.mfu_parameters, p.tokens, seconds, p.hardware.peak_flops)

    @property
    def mfu_span(self) -> float:
        """The measured MFU: the ceiling's model FLOPs over the measured span per step."""
        return self._mfu(self.span_s)

    @property
    def mfu_busy(self) -> float:
        """The MFU the run would have with its launch gaps closed (over busy time)."""
        return self._mfu(self.busy_time_s)

    @property
    def warnings(self) -> list[str]:
        """What says the trace and the roofline describe different runs."""
        out = []
        ceiling = self.profile.mfu_ceiling
        if self.profile.cost != "roofline":  # only the roofline's MFU is a ceiling
            return out
        if ceiling and max(self.mfu_span, self.mfu_busy) > ceiling:
            which = "the measured MFU" if self.mfu_span > ceiling else \
                "the measured MFU over busy time"
            out.append(f"{which} is above the ceiling: check that --model, --tokens, "
                       "--seq-len, --steps and --hardware are those of the traced run")
        return out

    @property
    def not_modelled_s(self) -> float:
        return sum(r.measured_s for r in self.rows if not r.modelled and r.measured_s)

    def to_json(self) -> dict:
        p = self.profile
        return {
            "trace": self.trace,
            "steps": self.steps,
            "model": p.model,
            "hardware": {"id": p.hardware.id, "name": p.hardware.name,
                         "peak_flops": p.hardware.peak_flops},
            "tokens": p.tokens, "seq_len": p.seq_len, "batch": p.tokens // p.seq_len,
            "fused_attention": p.fused_attention,
            "kernels": self.kernels,
            "kernel_time_s": self.kernel_time_s,
            "busy_time_s": self.busy_time_s,
            "idle_time_s": self.idle_time_s,
            "span_s": self.span_s,
            "not_modelled_s": self.not_modelled_s,
            "roofline_step_time_s": self.roofline_step_s,
            "span_over_roofline": self.span_s / self.roofline_step_s,
            "measured_mfu": self.mfu_span,
            "measured_mfu_busy": self.mfu_busy,
            "mfu_ceiling": p.mfu_ceiling,
            "mfu_over_ceiling": self.mfu_span / p.mfu_ceiling if p.mfu_ceiling else None,
            "categories": [attrs.asdict(r) | {"modelled": r.modelled, "ratio": r.ratio}
                           for r in self.rows],
            "warnings": self.warnings,
        }


def _count(kernels) -> int:
    return kernels if isinstance(kernels, int) else len(kernels)


def compare(breakdown, profile: Profile, steps: int = 1, trace: str = "",
            roofline_of: dict[str, tuple[str, ...]] = ROOFLINE_OF) -> Comparison:
    """The measured `breakdown` (from `opgraph.analysis.traces.breakdown`, over `steps` training
    steps) beside the roofline `profile` of one step."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, not {steps}")
    if _count(breakdown.kernels) == 0 or breakdown.span_s <= 0:
        raise OpgraphError(f"{trace or 'the trace'} has no GPU kernels to compare; "
                           "record the profile with CUDA activities on")
    if steps > _count(breakdown.kernels):  # every step runs at least one kernel
        raise OpgraphError(f"--steps {steps:,} is more than the {_count(breakdown.kernels):,} "
                           f"GPU kernels of {trace or 'the trace'}: give the number of training "
                           "steps the trace holds")
    roofline = {c.name: c for c in profile.categories}
    measured = {c.name: c for c in breakdown.categories}
    step = profile.step_time_s
    rows, mapped = [], set()
    for name in [*roofline_of, *(n for n in measured if n not in roofline_of)]:
        targets = tuple(roofline_of.get(name, ()))
        present = [roofline[t] for t in targets if t in roofline]
        if name not in measured and not present:
            continue
        mapped.update(targets)
        m = measured.get(name)
        time = sum(r.time_s for r in present) if targets else None
        rows.append(Row(name, targets, m.time_s / steps if m else 0.0, m.share if m else 0.0,
                        _count(m.kernels) if m else 0, time,
                        time / step if time is not None and step else None))
    for name, r in roofline.items():  # roofline categories no kernel category stands for
        if name not in mapped:
            rows.append(Row(name, (name,), None, None, None, r.time_s, r.time_share))
    return Comparison(trace, steps, profile, tuple(rows), _count(breakdown.kernels),
                      breakdown.kernel_time_s / steps, breakdown.busy_time_s / steps,
                      breakdown.idle_time_s / steps, breakdown.span_s / steps)


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return ""
    ms = seconds * 1e3
    return f"{ms:.2f}" if ms == 0 or ms >= 0.1 else f"{ms:.3g}"


def _pct(x: float | None) -> str:
    if x is None:
        return ""
    return f"{x * 100:.3f}%" if 0 < x < 0.001 else f"{x * 100:.1f}%"


def _ratio(x: float | None) -> str:
    return "" if x is None else f"{x:.3g}x"


def format_comparison(c: Comparison) -> str:
    """The `opgraph compare` table: one row per kernel category, then the step and the MFU."""
    p = c.profile
    batch = p.tokens // p.seq_len
    per = "per step" if c.steps == 1 else f"per step (the trace's totals / {c.steps} steps)"
    # The roofline's words where it is the model; a calibrated profile is a prediction, not a
    # ceiling, and says so.
    model, short = (("roofline", "roof") if p.cost == "roofline" else (p.cost, "pred"))
    w = max(11, len(model) + 3)  # the predicted column, wide enough for its heading
    lines = [
        f"measured  {c.trace}: {c.kernels:,} GPU kernels; times {per}",
        (f"{model:<9} {p.model} on {p.hardware.describe()}, {p.tokens:,} tokens per step "
        f"({batch} x {p.seq_len:,}), {p.attention}"),
        "",
        (f"{'kernels':<14} {'measured ms':>11} {'share':>7} {model + ' ms':>{w}} {'share':>7} "
        f"{'meas/' + short:>9}  {model} categories"),
    ]
    for r in c.rows:
        if r.measured_s is None:
            where = "(no kernel category measures it)"
        elif not r.modelled:
            where = "not modelled"
        else:
            where = " + ".join(r.roofline_categories)
        lines.append(f"{r.name:<14} {_ms(r.measured_s):>11} {_pct(r.measured_share):>7} "
                     f"{_ms(r.roofline_s):>{w}} {_pct(r.roofline_share):>7} "
                     f"{_ratio(r.ratio):>9}  {where}")
    if p.cost == "roofline":
        mfu = (f"MFU ceiling   {_pct(p.mfu_ceiling)} (roofline); measured / ceiling "
               f"{c.mfu_span / p.mfu_ceiling:.2f}" if p.mfu_ceiling else "MFU ceiling   0")
    else:
        mfu = (f"predicted MFU {_pct(p.mfu_ceiling)} ({model}); measured / predicted "
               f"{c.mfu_span / p.mfu_ceiling:.2f}" if p.mfu_ceiling else "predicted MFU 0")
    lines += [
        "",
        (f"{'kernel time':<14} {_ms(c.kernel_time_s):>11} {'':>7} {_ms(c.roofline_step_s):>{w}} "
        f"{'':>7} {_ratio(c.kernel_time_s / c.roofline_step_s):>9}  "
        f"(of it not modelled: {_ms(c.not_modelled_s)} ms)"),
        f"{'busy':<14} {_ms(c.busy_time_s):>11}  (union of the kernels' intervals)",
        f"{'idle (gaps)':<14} {_ms(c.idle_time_s):>11}  (launch gaps: "
        + ("the roofline has none)" if p.cost == "roofline" else
           f"the {model} model's are in its kernel times)"),
        (f"{'span':<14} {_ms(c.span_s):>11} {'':>7} {_ms(c.roofline_step_s):>{w}} {'':>7} "
        f"{_ratio(c.span_s / c.roofline_step_s):>9}  (first kernel start to last kernel end)"),
        "",
        (f"measured MFU  {_pct(c.mfu_span)} over the span "
        f"({_pct(c.mfu_busy)} over busy time, the gaps closed)"),
        mfu,
        (f"  MFU = 6 x {p.mfu_parameters:,} params x {p.tokens:,} tokens / (time x "
        f"{p.hardware.peak_flops / 1e12:g} TFLOP/s)"),
        *(f"warning: {w}" for w in c.warnings),
    ]
    return "\n".join(lines)
