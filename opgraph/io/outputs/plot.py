"""The plate's figure and the sweep's, drawn with matplotlib (optional: `pip install
'opgraph[plot]'`).

    plot_profile(evaluate(step, hardware.get("h100-sxm")), "plate.png")
    plot_sweep({"tokens": [8192, 65536], "step_time_s": [...], "mfu_ceiling": [...],
                "matmul_time_share": [...], ...}, "tokens", "sweep.png")

matplotlib is imported inside the functions, with the non-interactive Agg backend, so nothing
else in opgraph imports it and no display is needed. The format follows the file's suffix
(`.png` or `.svg`); the file is written to a temp file beside it and renamed, so a failure leaves
no half-written figure.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from ...core.errors import OpgraphError
from ...cost.profile import CATEGORIES, Profile
from .atomic import write_atomic

FORMATS = ("png", "svg")
SWEEP_DIMS = {"tokens": "tokens per step", "seq_len": "sequence length",
              "batch": "sequences per step (batch)"}
TIME_COLOR = "#d1495b"
FLOP_COLOR = "#00798c"
MFU_COLOR = "black"
DPI = 100


def _format(path: str | os.PathLike) -> str:
    fmt = Path(path).suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise OpgraphError(f"cannot draw {path}: give a file name ending in .png or .svg")
    return fmt


def _pyplot():
    """matplotlib's pyplot on the Agg backend, or a one-line error saying what to install."""
    try:
        import matplotlib
    except ImportError:
        raise OpgraphError("plotting needs matplotlib: pip install 'opgraph[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: str | os.PathLike, fmt: str) -> None:
    def draw(f) -> None:
        fig.savefig(f, format=fmt, dpi=DPI)

    try:
        write_atomic(path, draw, mode="wb")
    finally:
        plt.close(fig)


def _pct(x: float) -> str:
    return f"{x * 100:.3f}%" if 0 < x < 0.001 else f"{x * 100:.1f}%"


def profile_title(profile: Profile) -> str:
    """Two lines: model, hardware, tokens (batch x seq_len), fused or not; step time under
    the cost model the profile used (one GPU: its ops one after another; many: the schedule
    over the job's GPUs), MFU."""
    batch = profile.tokens // profile.seq_len
    attention = "fused" if profile.fused_attention else "unfused"
    job = profile.parallel
    how = ("no overlap" if job is None else
           f"scheduled over {job.layout.world:,} GPUs, communication overlapped")
    mfu = (f"MFU ceiling {profile.mfu_ceiling * 100:.1f}%" if job is None else
           f"MFU {job.mfu * 100:.1f}%")
    return (f"{profile.model} on {profile.hardware.name}: {profile.tokens:,} tokens per step "
            f"({batch} x {profile.seq_len:,}), {attention} attention\n"
            f"step time {profile.step_time_s * 1e3:.1f} ms ({profile.cost}, {how}), {mfu}")


def plot_profile(profile: Profile, path: str | os.PathLike) -> None:
    """Each category's share of the step's time beside its share of the FLOPs, as paired
    horizontal bars (the plate's figure), written to `path` (.png or .svg)."""
    fmt = _format(path)
    plt = _pyplot()
    cats = list(profile.categories)
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(cats) + 1.8))
    height = 0.38
    ys = range(len(cats))
    time = [c.time_share for c in cats]
    flops = [c.flop_share for c in cats]
    ax.barh([y - height / 2 for y in ys], time, height, color=TIME_COLOR, label="share of time")
    ax.barh([y + height / 2 for y in ys], flops, height, color=FLOP_COLOR,
            label="share of FLOPs")
    for y, t, f in zip(ys, time, flops, strict=True):
        ax.text(t + 0.01, y - height / 2, _pct(t), va="center", fontsize=8)
        ax.text(f + 0.01, y + height / 2, _pct(f), va="center", fontsize=8)
    ax.set_yticks(list(ys), [f"{c.name} ({c.bound})" for c in cats])
    ax.invert_yaxis()
    ax.set_xlim(0, min(1.0, max(time + flops) + 0.12))
    ax.xaxis.set_major_formatter(_axis_pct)
    ax.set_xlabel("share of the training step")
    ax.legend(loc="lower right", frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    ax.set_title(profile_title(profile), fontsize=10)
    fig.tight_layout()
    _save(plt, fig, path, fmt)


def _axis_pct(x: float, _pos) -> str:
    return f"{x * 100:.0f}%"


def sweep_categories(rows: Mapping[str, Sequence]) -> list[str]:
    """The categories a sweep table has `<category>_time_share` columns for, in report order."""
    found = [k[: -len("_time_share")] for k in rows if k.endswith("_time_share")]
    known = [c for c in CATEGORIES if c in found]
    return known + sorted(set(found) - set(known))


def plot_sweep(rows: Mapping[str, Sequence], dim: str, path: str | os.PathLike,
               title: str | None = None) -> None:
    """The category time shares, stacked, and the MFU ceiling against the swept dimension
    `dim` (a column: tokens, seq_len or batch) on a log axis, written to `path`.

    `rows` maps column name to a sequence, one entry per point: `dim`, `mfu_ceiling` and
    `<category>_time_share` columns (others, such as `step_time_s`, are ignored).
    """
    fmt = _format(path)
    for column in (dim, "mfu_ceiling"):
        if column not in rows:
            raise OpgraphError(f"the sweep has no {column!r} column; it has "
                               f"{', '.join(rows) or 'none'}")
    cats = sweep_categories(rows)
    if not cats:
        raise OpgraphError("the sweep has no <category>_time_share columns to draw")
    order = sorted(range(len(rows[dim])), key=lambda i: rows[dim][i])
    xs = [float(rows[dim][i]) for i in order]
    if not xs or xs[0] <= 0:
        raise OpgraphError(f"the sweep's {dim} values must be positive to draw on a log axis")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 5))
    shares = [[float(rows[f"{c}_time_share"][i]) for i in order] for c in cats]
    colors = plt.get_cmap("tab10").colors
    ax.stackplot(xs, shares, labels=cats, colors=colors[: len(cats)], alpha=0.85)
    mfu = [float(rows["mfu_ceiling"][i]) for i in order]
    ax.plot(xs, mfu, color=MFU_COLOR, marker="o", linewidth=2, label="MFU ceiling")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [f"{x:,.0f}" for x in xs], fontsize=8)
    ax.minorticks_off()
    if xs[-1] > xs[0]:
        ax.set_xlim(xs[0], xs[-1])
    ax.set_ylim(0, 1)
    ax.yaxis.set_major_formatter(_axis_pct)
    ax.set_xlabel(SWEEP_DIMS.get(dim, dim) + " (log scale)")
    ax.set_ylabel("share of step time; MFU ceiling")
    ax.set_title(title or f"category shares of the step and the MFU ceiling\nagainst {dim}",
                 fontsize=10)
    handles, labels = ax.get_legend_handles_labels()
    order = [*range(len(cats) - 1, -1, -1), len(cats)]  # the stack top-down, then the MFU line
    ax.legend([handles[i] for i in order], [labels[i] for i in order], loc="center left",
              bbox_to_anchor=(1.01, 0.5), frameon=False, fontsize=8)
    fig.tight_layout()
    _save(plt, fig, path, fmt)


def plot_scaling(points: Sequence, title: str, path: str | os.PathLike) -> None:
    """The scaling curve of `opgraph plan --gpus A:B:xF`: each size's best tokens/s per GPU
    and MFU against the number of GPUs (`points`: (GPUs, search.Ranked) pairs)."""
    fmt = _format(path)
    plt = _pyplot()
    gpus = [n for n, _ in points]
    fig, left = plt.subplots(figsize=(8, 4.5))
    left.plot(gpus, [r.result.tokens_per_s_per_gpu for _, r in points], "o-", color=TIME_COLOR)
    left.set_xscale("log", base=2)
    left.set_xlabel("GPUs")
    left.set_ylabel("tokens / s per GPU (best layout)", color=TIME_COLOR)
    left.set_ylim(bottom=0)
    right = left.twinx()
    right.plot(gpus, [r.result.mfu for _, r in points], "s--", color=MFU_COLOR)
    right.set_ylabel("MFU", color=MFU_COLOR)
    right.set_ylim(0, 1)
    right.yaxis.set_major_formatter(_axis_pct)
    left.set_title(title)
    fig.tight_layout()
    _save(plt, fig, path, fmt)
