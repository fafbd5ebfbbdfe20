"""Draw the figures of docs/profile.md: `python docs/make_figures.py` writes docs/plate.png and
docs/sweep.png (Llama 3 8B on one H100 SXM, the plate's conventions).

plate.png is what `opgraph profile --plot docs/plate.png` draws. sweep.png is `plot_sweep` over
1 to 32 sequences of 8192 tokens, its rows computed here with `evaluate`, one call per point.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the checkout's opgraph, not an installed one

from opgraph.models import preset

from opgraph import compile_step, evaluate, hardware
from opgraph.io.outputs.plot import plot_profile, plot_sweep

BATCHES = (1, 2, 4, 8, 16, 32)


def sweep_rows(step, part, batches=BATCHES) -> dict[str, list]:
    """Columns as `opgraph sweep` gives them: tokens, batch, seq_len, step time, MFU ceiling
    and each category's share of the time."""
    rows: dict[str, list] = {"tokens": [], "batch": [], "seq_len": [], "step_time_s": [],
                             "mfu_ceiling": []}
    for batch in batches:
        p = evaluate(step, part, {"B": batch})
        for key, value in (("tokens", p.tokens), ("batch", batch), ("seq_len", p.seq_len),
                           ("step_time_s", p.step_time_s), ("mfu_ceiling", p.mfu_ceiling)):
            rows[key].append(value)
        for c in p.categories:
            rows.setdefault(f"{c.name}_time_share", []).append(c.time_share)
    return rows


def main() -> None:
    part = hardware.get("h100-sxm")
    step = compile_step(preset("llama3-8b"))
    plot_profile(evaluate(step, part), HERE / "plate.png")
    rows = sweep_rows(step, part)
    plot_sweep(rows, "tokens", HERE / "sweep.png",
               title=f"llama3-8b on {part.name}, fused attention, sequences of 8,192 tokens\n"
                     "each category's share of the step time, and the MFU ceiling")
    for tokens, mfu, opt in zip(rows["tokens"], rows["mfu_ceiling"],
                                rows["optimizer_time_share"], strict=True):
        print(f"{tokens:>8,} tokens  MFU ceiling {mfu * 100:.1f}%  optimizer {opt * 100:.1f}%")


if __name__ == "__main__":
    main()
