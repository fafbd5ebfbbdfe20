"""Where the calibrated model's error lives: `python benchmarks/bench_shares.py [TEXT]`.

The calibrated model fits ONE number, the share of each part's best measured GEMM rate that a
training step's GEMMs reach (`opgraph/calibration.toml`, `matmul`). This scans that share with
everything else as shipped and prints

(a) per family of the shipped dev runs, the share (on a grid of 0.05) at which the family's mean
    squared log error is least, and its mean absolute error there: families that want very
    different shares are what no one shared number reconciles;
(b) per run whose id contains TEXT (default: every run), the share at which the prediction equals
    the measured step (bisection), beside the layout; and, with `--free-node`, the same with
    every collective inside a node costed at nothing (is it the tensor-parallel traffic?).

About 15 s for (a), 1-2 s a run for (b), on two cores.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import attrs  # noqa: E402

from opgraph.cost import calibration  # noqa: E402
from opgraph.io.cases import load_cases, select  # noqa: E402
from opgraph.cost.costmodel import CalibratedCostModel  # noqa: E402
from opgraph.parallel.distributed import step_figures  # noqa: E402
from opgraph.core.errors import OpgraphError  # noqa: E402
from opgraph.analysis.fit import compile_cases  # noqa: E402

GRID = [round(0.50 + 0.05 * i, 2) for i in range(11)]  # 0.50 ... 1.00


@attrs.frozen
class FreeNode(CalibratedCostModel):
    """The calibrated model with every collective that stays inside a node free."""

    def comm_time(self, kind, message, group, cluster, stride=1, *rest, **options):
        if group * stride <= cluster.gpus_per_node:
            return 0.0
        return super().comm_time(kind, message, group, cluster, stride, *rest, **options)


def table_at(shipped: dict, share: float) -> dict:
    """The shipped efficiencies with `matmul` at `share` of each generation's ceiling."""
    return {g: attrs.evolve(e, matmul=share * e.matmul_ceiling) if e.matmul_ceiling else e
            for g, e in shipped.items()}


def error(job, case, shipped, share, model=CalibratedCostModel) -> float:
    return step_figures(job, model(table=table_at(shipped, share))).step_time_s \
        / case.measured_step_time_s - 1


def family_shares(jobs, shipped) -> None:
    families: dict[str, list] = {}
    for case, job in jobs:
        families.setdefault(case.family or case.id, []).append((case, job))
    print("(a) the share each family wants, everything else as shipped")
    print(f"{'family':24s} {'cases':>5s} {'share':>6s} {'mean abs error':>15s}")
    for family, runs in families.items():
        best = min((sum(math.log1p(error(j, c, shipped, s)) ** 2 for c, j in runs), s)
                   for s in GRID)[1]
        mae = sum(abs(error(j, c, shipped, best)) for c, j in runs) / len(runs)
        print(f"{family:24s} {len(runs):5d} {best:6.2f} {mae:14.1%}")


def needed_share(job, case, shipped, model) -> str:
    low, high = 0.2, 1.6
    if error(job, case, shipped, high, model) > 0:
        return "> 1.6"
    if error(job, case, shipped, low, model) < 0:
        return "< 0.2"
    for _ in range(18):  # the error falls as the share rises
        mid = (low + high) / 2
        low, high = (mid, high) if error(job, case, shipped, mid, model) > 0 else (low, mid)
    return f"{low:.3f}"


def run_shares(jobs, shipped, free_node: bool) -> None:
    print("\n(b) the share at which each run's prediction equals its measured step"
          + ("; in brackets, with collectives inside a node free" if free_node else ""))
    for case, job in jobs:
        p = case.parallel
        extra = f"  ({needed_share(job, case, shipped, FreeNode)})" if free_node else ""
        print(f"{case.id:52s} {needed_share(job, case, shipped, CalibratedCostModel):>6s}"
              f"{extra}  tp{p.tp} pp{p.pp} dp{p.dp} mb{p.micro_batch}")


def main(argv: list[str]) -> int:
    free_node = "--free-node" in argv
    words = [a for a in argv if not a.startswith("--")]
    shipped = calibration.load(ROOT / "opgraph" / "calibration.toml")
    every = load_cases(None)
    try:
        chosen = select(every, words[0] if words else None)
    except OpgraphError as e:  # checked before the minutes of scanning
        print(f"bench_shares.py: {e}", file=sys.stderr)
        return 2
    family_shares(compile_cases(every), shipped)
    run_shares(compile_cases(chosen), shipped, free_node)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
