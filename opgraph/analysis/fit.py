"""Fit the calibrated model's efficiencies to measured runs: `opgraph calibrate --fit CASES.json`.

The efficiencies the generations' tables name as `fitted` are set, ONE value per name shared by
every generation that fits it (`matmul` as a share of each generation's measured
`matmul_ceiling`, where it has one), to minimise the mean squared log error of the predicted step
time, `mean(log(predicted / measured)^2)`, averaged per family of runs and then over families;
the others keep their values. The search is
Nelder and Mead's simplex (1965) in unbounded coordinates (a fraction f as log(f / (1 - f)), a
FLOP count as log(1 + F / 1e9)), from the fixed starting values `START` (not from the file's
current values), with a fixed number of steps: the same cases give the same result on any
machine. Each case is compiled once (`opgraph.parallel.distributed.prepare`); a step of the search
only re-costs and re-schedules it (`schedule`).

The error the fit reports is IN-SAMPLE: measured on the runs it was fitted to.
"""

from __future__ import annotations

import functools
import json
import math
import re

import attrs
import numpy as np

from ..core.errors import OpgraphError
from ..cost.calibration import FRACTIONS, Efficiencies
from ..cost.costmodel import DEFAULT, CalibratedCostModel, CostModel
from ..io.cases import Case
from ..io.outputs.progress import progressed
from ..parallel.distributed import Job, step_figures

# Where every fit starts (so that a fit does not depend on the file it rewrites).
START = {"matmul": 0.7, "matmul_half_flops": 1e10, "attention": 0.5, "bandwidth": 0.85,
         "launch_s": 2e-6, "node": 0.8, "network": 0.9, "overlap_slowdown": 0.1}
STEPS = 60  # simplex iterations: one or two shared parameters converge well before
_GFLOP = 1e9


def _to_free(name: str, value: float) -> float:
    if name in FRACTIONS:
        value = min(max(value, 1e-6), 1 - 1e-9)
        return math.log(value / (1 - value))
    if name == "matmul_half_flops":
        return math.log1p(value / _GFLOP)
    return math.log(max(value, 1e-12))


def _from_free(name: str, x: float) -> float:
    if name in FRACTIONS:
        return 1 / (1 + math.exp(-x))
    if name == "matmul_half_flops":
        return math.expm1(max(x, 0.0)) * _GFLOP
    return math.exp(x)


def nelder_mead(f, x0: np.ndarray, steps: int, scale: float = 0.3,
                tolerance: float = 1e-10, desc: str = "fit") -> np.ndarray:
    """The minimum of `f` near `x0` by Nelder and Mead's simplex (reflection 1, expansion 2,
    contraction 0.5, shrink 0.5), at most `steps` steps, fewer once the simplex's values agree
    to `tolerance` (relative); the steps are counted on a progress bar named `desc` where
    stderr is a terminal.

        >>> x = nelder_mead(lambda v: float(((v - 3) ** 2).sum()), np.zeros(2), 200)
        >>> bool(np.allclose(x, 3, atol=1e-4))
        True
    """
    n = len(x0)
    simplex = [x0] + [x0 + scale * np.eye(n)[i] for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in progressed(range(steps), desc, unit="step"):
        order = np.argsort(values, kind="stable")
        simplex = [simplex[i] for i in order]
        values = [values[i] for i in order]
        if values[-1] - values[0] <= tolerance * (abs(values[0]) + tolerance):
            break  # the simplex has converged
        centre = np.mean(simplex[:-1], axis=0)
        worst = simplex[-1]
        reflected = centre + (centre - worst)
        fr = f(reflected)
        if fr < values[0]:
            expanded = centre + 2 * (centre - worst)
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = centre + 0.5 * (worst - centre)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:  # shrink toward the best
                simplex = [simplex[0]] + [simplex[0] + 0.5 * (x - simplex[0])
                                          for x in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    return simplex[int(np.argmin(values))]


@attrs.frozen
class Fitted:
    """A fit's result: the new table and, per case, (id, generation, error) in-sample."""

    table: dict  # generation -> Efficiencies
    errors: tuple[tuple[str, str, float], ...]


def compile_cases(cases: list[Case], cost: CostModel = DEFAULT) -> list[tuple[Case, Job]]:
    """Each case compiled once, as `opgraph validate` predicts it under `cost`. A Job holds no
    efficiency (the fit re-costs it at each step); only the backward convention shapes it
    (`CostModel.backward` and `factor`). So a case compiled once serves every later fit, subset
    or prediction of it in the process under any cost model of that convention: `_compiled`
    keeps the last few hundred, keyed by the case's whole case-file form and the convention."""
    convention = CostModel(backward=cost.backward, factor=cost.factor)
    return [(c, _compiled(json.dumps(c.to_json(), sort_keys=True), convention)) for c in cases]


@functools.lru_cache(maxsize=1024)
def _compiled(key: str, convention: CostModel) -> Job:
    from ..io.cases import read_case

    return read_case(json.loads(key)).job(convention).prepare()


def fit(cases: list[Case], table: dict[str, Efficiencies], *,
        steps: int = STEPS) -> Fitted:
    """Fit the generations' `fitted` efficiencies to the cases (see the module)."""
    return fit_jobs(compile_cases(cases), table, steps=steps)


def loss(jobs: list[tuple[Case, Job]], table: dict[str, Efficiencies]) -> float:
    """What the fit minimises: the mean squared log error of the predicted step time, averaged
    within each family of runs (`Case.family`), then over the families."""
    model = CalibratedCostModel(table=table)
    families: dict[str, list] = {}
    for case, job in jobs:
        families.setdefault(case.family or case.id, []).append(
            math.log(step_figures(job, model).step_time_s / case.measured_step_time_s) ** 2)
    return float(np.mean([np.mean(errors) for errors in families.values()]))


def fit_jobs(jobs: list[tuple[Case, Job]], table: dict[str, Efficiencies], *,
             steps: int = STEPS, judged: list[tuple[Case, Job]] | None = None) -> Fitted:
    """`fit` of cases compiled once (`compile_cases`), its errors those of `judged` (default:
    the fitted cases themselves, in-sample).

    A fitted efficiency is ONE value shared by every generation that names it in `fitted` (for
    `matmul`, a share of each generation's measured `matmul_ceiling` where it has one): it
    describes kernels or software (how close cuBLAS comes to the peak, how much of a link NCCL
    reaches), not a site, so the runs of one generation inform the others, and a generation
    with no run of its own is predicted from the rest. The loss weighs each family (a paper's
    table, a framework's benchmark: `Case.family`) equally, so a sweep of many runs of one
    source does not outvote the others. Generations that fit nothing keep their values."""
    for case, job in jobs:
        if job.hardware.generation not in table:
            raise OpgraphError(f"case {case.id}: its hardware {job.hardware.id} has no "
                               "calibrated generation to fit")
    names = sorted({n for e in table.values() for n in e.fitted})

    def tables(x) -> dict[str, Efficiencies]:
        values = {n: _from_free(n, v) for n, v in zip(names, x, strict=True)}
        return {g: attrs.evolve(e, **{n: _scaled(n, values[n], e) for n in e.fitted})
                for g, e in table.items()}

    x0 = np.array([_to_free(n, START[n]) for n in names])
    out = tables(nelder_mead(lambda x: loss(jobs, tables(x)), x0, steps, tolerance=1e-6,
                             desc="fitting efficiencies") if names and jobs else x0)
    model = CalibratedCostModel(table=out)
    errors = tuple((case.id, job.hardware.generation,
                    step_figures(job, model).step_time_s / case.measured_step_time_s - 1)
                   for case, job in (jobs if judged is None else judged))
    return Fitted(out, errors)


def _scaled(name: str, value: float, e: Efficiencies) -> float:
    """A shared fitted value as generation `e` reads it: `matmul` as that share of the
    generation's measured `matmul_ceiling` where it has one, any other value as it is."""
    return value * e.matmul_ceiling if name == "matmul" and e.matmul_ceiling else value


def to_toml(table: dict[str, Efficiencies], header: str) -> str:
    """A calibration file with `table`'s values (12 significant digits), sources and fits."""
    lines = [header.rstrip(), ""]
    for generation, e in table.items():
        lines.append(f"[{_key(generation)}]")
        for name, value in e.values().items():
            lines.append(f"{name} = {value:.12g}")
        lines.append("fitted = [" + ", ".join(f'"{n}"' for n in e.fitted) + "]")
        if e.sources:
            lines += ["", f"[{_key(generation)}.sources]"]
            lines += [f"{_key(name)} = {_quoted(text)}" for name, text in e.sources]
        lines.append("")
    return "\n".join(lines)


def _quoted(text: str) -> str:
    """A TOML basic string: backslash and quote escaped, and every control character (a
    newline in a source) as \\uXXXX, which TOML 1.0 reads back (it allows no raw ones)."""
    body = "".join(
        "\\\\" if c == "\\" else '\\"' if c == '"'
        else f"\\u{ord(c):04X}" if ord(c) < 0x20 or ord(c) == 0x7F else c
        for c in text)
    return f'"{body}"'


def _key(name: str) -> str:
    """A TOML key: bare where TOML allows it (letters, digits, - and _), else quoted."""
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else _quoted(name)
