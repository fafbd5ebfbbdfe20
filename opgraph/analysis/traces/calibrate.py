"""Efficiencies from one measured step: a trace's kernel times against the roofline's.

    c = compare(breakdown(iter_kernels("step.json.gz")), evaluate(step, h100), steps=1)
    fit = fit_trace(c, calibration.get("hopper"))
    print(format_trace_fit(fit))        # per category roofline / measured, then the fitted values

The roofline is a ceiling (`opgraph.cost.costmodel`); the calibrated model divides each term by an
efficiency (`opgraph.cost.calibration`). A kernel that the roofline bounds by its FLOPs takes
`FLOPs / (efficiency x peak)` there, so one step's efficiency is its roofline time over its
measured time, summed over the categories that efficiency scales (SCALED_BY):

    matmul     = sum roofline / sum measured over the kernel rows of matmul and output_head
    attention  = the same over the attention row
    bandwidth  = the same over the memory-bound rows: norm, elementwise, optimizer, embedding

A sum is exact when every op of those categories is bound by the term the efficiency scales
(matrix multiplies and FlashAttention by FLOPs, the rest by bytes), as they are at training
sizes, with one exception: the output head's category holds the loss (the plate's convention),
which is memory-bound and whose kernels a trace sorts as element-wise or other, not as GEMMs; it
is a few percent of the head, so `matmul` is a little high and `bandwidth` a little low for it.
A small matrix multiply bound by its bytes would make `matmul` a little low. The fit is only
against the ROOFLINE profile of the step (`fit_trace` checks): a calibrated profile's times are
already divided by efficiencies.

Invariants: a fitted efficiency is in (0, 1] (a trace faster than the roofline is an error, not a
fit); a row with no measured or no roofline time is left out of its sum, with a note; an
efficiency none of whose rows is left keeps `base`'s value, with a note; every other field
(matmul_half_flops, launch_s, host_s, node, network, overlap_slowdown) is `base`'s, because one
step's category totals cannot separate them: a per-kernel launch cost and a saturating small-matmul
term are both folded into the measured sums, and a single GPU's trace has no collectives to fit
`node`, `network` or `overlap_slowdown` against.
"""

from __future__ import annotations

import attrs

from ...core.errors import OpgraphError
from ...cost.calibration import FIELDS, Efficiencies
from ...cost.costmodel import DEFAULT, runs_per_charged, shape_factor
from .compare import Comparison, Row

# Roofline category -> the efficiency that scales its time (`opgraph.cost.costmodel`'s EFFICIENCY
# and its memory term); None for a category no single efficiency scales. Every roofline category has
# a row (a test checks it against `opgraph.core.categories.CATEGORIES`), so a new one must say which
# efficiency it follows.
SCALED_BY: dict[str, str | None] = {
    "matmul": "matmul",
    "output_head": "matmul",  # its matrix multiply dominates; the loss is a small share
    "attention": "attention",
    "scan": None,  # the SSD's small chunk matmuls beside its states' HBM round trip: neither alone
    "norm": "bandwidth",
    "elementwise": "bandwidth",
    "optimizer": "bandwidth",
    "embedding": "bandwidth",
    "routing": None,  # small router matmuls beside top-k selections: neither term alone
}

# The efficiencies a trace fits, in the order reports list them.
FITTED = ("matmul", "attention", "bandwidth")

# Rounding may put an exact efficiency of 1 a hair above it; more than this is a wrong run.
_SLACK = 1e-9


@attrs.frozen
class TraceFit:
    """`efficiencies`: `base` with FITTED's fields replaced where the trace measured them
    (`fitted` names those); `per_category`: (kernel category, roofline s, measured s) per step
    of each row a fit used; `notes`: why a row or an efficiency was left as it was."""

    efficiencies: Efficiencies
    per_category: tuple[tuple[str, float, float], ...] = attrs.field(converter=tuple)
    notes: tuple[str, ...] = attrs.field(converter=tuple)


def efficiency_of(row: Row) -> str | None:
    """The efficiency that scales `row`'s roofline categories, or None when they name none or
    more than one (a `--rules` category with no roofline counterpart; routing)."""
    names = {SCALED_BY.get(c) for c in row.roofline_categories}
    return names.pop() if len(names) == 1 else None


def _used(row: Row) -> str | None:
    """Why `row` is left out of its efficiency's sum, or None when it is used."""
    if not row.measured_s:
        return f"{row.name}: no measured time (no kernel of the trace is classified {row.name})"
    if not row.roofline_s:
        missing = " or ".join(row.roofline_categories)
        return f"{row.name}: no roofline time (the model has no {missing})"
    return None


def _check_roofline(comparison: Comparison) -> None:
    """An error unless every op of a fitted category is timed by the roofline: `max(FLOPs /
    peak, bytes / bandwidth)`, the peak the BF16 or the FP8 one (`opgraph.cost.costmodel`)."""
    p = comparison.profile
    peaks = [x for x in (p.hardware.peak_flops, p.hardware.fp8_flops) if x]
    for op in p.ops:
        if SCALED_BY.get(op.category) is None:
            continue
        times = [max(op.flops / peak, op.bytes / p.hardware.bandwidth) for peak in peaks]
        if not any(abs(op.time_s - t) <= 1e-9 * max(t, 1e-30) for t in times):
            raise OpgraphError(f"the profile of {p.model} is not the roofline's (op {op.name} "
                               "takes longer than its FLOPs and bytes at the peak): fit against "
                               "the roofline profile (--cost roofline), not a calibrated one")


def _with_shapes(comparison: Comparison, rows: list[Row], base: Efficiencies) -> float:
    """The rows' roofline time with each compute-bound kernel's shape factor
    (`costmodel.shape_factor`: a GEMM's waves, an attention kernel's exponentials, at `base`'s
    tiles and ratio) and the FLOPs it runs per FLOP the plate charges it
    (`costmodel.runs_per_charged`: FlashAttention's backward): the time `matmul` or `attention`
    divides in the calibrated model, so the fit inverts it (a memory-bound op kept as it is)."""
    p = comparison.profile
    categories = {c for r in rows for c in r.roofline_categories}
    return sum(op.time_s * (shape_factor(op.kind, p.grids.get(op.name, ()),
                                         op.flops / op.count, p.hardware, base)
                            * runs_per_charged(op.kind, DEFAULT)
                            if op.bound == "compute" and op.count else 1.0)
               for op in p.ops if op.category in categories)


def _ratio(name: str, rows: list[Row], trace: str, roofline: float | None = None) -> float:
    """Sum of roofline time (or `roofline`) over sum of measured time: `name`'s efficiency; an
    error above 1."""
    measured = sum(r.measured_s for r in rows)
    roofline = sum(r.roofline_s for r in rows) if roofline is None else roofline
    value = roofline / measured
    if value > 1 + _SLACK:
        which = " + ".join(r.name for r in rows)
        raise OpgraphError(f"{trace or 'the trace'}: the {which} kernels ran faster than the "
                           f"roofline allows ({name} efficiency {value:.3g} > 1); check that "
                           "--model, --tokens, --seq-len, --steps and --hardware are those of "
                           "the traced run")
    return min(value, 1.0)


def fit_trace(comparison: Comparison, base: Efficiencies) -> TraceFit:
    """`base` with matmul, attention and bandwidth fitted to `comparison` (a measured step beside
    its roofline profile, `opgraph.analysis.traces.compare.compare`): each is the roofline time over
    the measured time of the rows it scales (SCALED_BY). See the module for what is left as
    `base`'s.

        fit_trace(compare(b, evaluate(step, h100)), calibration.get("hopper")).efficiencies.matmul
    """
    _check_roofline(comparison)
    trace = comparison.trace
    groups: dict[str, list[Row]] = {name: [] for name in FITTED}
    notes = []
    for row in comparison.rows:
        name = efficiency_of(row)
        if not row.modelled or name is None:
            if row.modelled and row.measured_s:
                notes.append(f"{row.name}: no one efficiency scales "
                             f"{' + '.join(row.roofline_categories)}; left out")
            continue
        why = _used(row)
        if why:
            notes.append(f"{why}; left out of {name}")
        else:
            groups[name].append(row)
    values, sources = {}, dict(base.sources)
    for name, rows in groups.items():
        if not rows:
            notes.append(f"{name}: nothing measured to fit it; kept at {getattr(base, name):g} "
                         f"({base.generation})")
            continue
        shaped = _with_shapes(comparison, rows, base) if name != "bandwidth" else None
        values[name] = _ratio(name, rows, trace, shaped)
        sources[name] = (f"fitted on {trace or 'a trace'}: roofline / measured time of the "
                         f"{' + '.join(r.name for r in rows)} kernels"
                         + (" (each kernel's shape counted)" if name != "bandwidth" else ""))
    if "matmul" in values and comparison.profile.attention == "unfused attention":
        notes.append("the roofline's attention is unfused: its matrix multiplies run as GEMM "
                     "kernels, measured under matmul but not in its roofline time, so matmul is "
                     "low; fit against a run with fused attention")
    fitted = tuple(f for f in FIELDS if f in values)
    efficiencies = attrs.evolve(base, **values, fitted=fitted,
                                sources=tuple(sorted(sources.items())))
    # the roofline time each efficiency divides: with each GEMM's waves, each attention
    # kernel's exponentials
    per_category = [(r.name, _with_shapes(comparison, [r], base) if name != "bandwidth"
                     else r.roofline_s, r.measured_s)
                    for name, rows in groups.items() for r in rows]
    return TraceFit(efficiencies, per_category, notes)


def format_trace_fit(fit: TraceFit) -> str:
    """The `opgraph calibrate TRACE` table: per kernel category its roofline (with each GEMM's
    waves and each attention kernel's exponentials) and measured time per step and their
    ratio, then each efficiency (fitted, or kept with the base's value), then the notes."""
    lines = [f"{'kernels':<14} {'roofline ms':>11} {'measured ms':>11} {'efficiency':>10}"]
    for name, roofline, measured in fit.per_category:
        lines.append(f"{name:<14} {roofline * 1e3:>11.3f} {measured * 1e3:>11.3f} "
                     f"{roofline / measured:>10.3f}")
    e = fit.efficiencies
    lines += ["", f"efficiencies ({e.generation})"]
    for name in FITTED:
        how = "fitted" if name in e.fitted else "kept (not measured)"
        lines.append(f"  {name:<12} {getattr(e, name):.4f}  {how}")
    lines += [f"note: {n}" for n in fit.notes]
    return "\n".join(lines)


__all__ = ["FITTED", "SCALED_BY", "TraceFit", "efficiency_of", "fit_trace", "format_trace_fit"]
