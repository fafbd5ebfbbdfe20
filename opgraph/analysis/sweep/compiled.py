"""A step's costs compiled once, with `sympy.lambdify`, into one numpy function of the swept
dimensions (`compile_sweep`), and run over arrays of points (`Sweep.run`). FLOPs and bytes are
the lowered step's (`opgraph.cost.lowered`); the cost model's `time`, `mfu` and `hfu` run on the
arrays."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import numpy as np
import sympy

from opgraph.passes.evaluate import resolve

from ...core.errors import OpgraphError
from ...core.ir import Graph
from ...cost.costmodel import DEFAULT, CostModel, attention_role, host_floor
from ...cost.lowered import lower
from ...cost.profile import CATEGORIES

CHUNK = 8192  # points per call: a chunk's arrays stay in cache


@attrs.frozen
class Sweep:
    """A step's costs as one numpy function of the free dimensions (`compile_sweep`)."""

    model: str
    free: tuple[str, ...]  # the function's arguments, dimension names
    categories: tuple[str, ...]
    function: Callable  # (*free) -> [flops of each term, bytes of each term, N_mfu, tokens]
    multiplicity: np.ndarray  # per term: how many ops it stands for
    membership: np.ndarray  # (categories, terms): term i's category is j
    cost: CostModel = DEFAULT
    fp8: np.ndarray | None = None  # per term: whether it runs at the FP8 peak; None: none does
    rates: tuple[str, ...] = ()  # per term: the efficiency its arithmetic runs at (calibrated)
    attention: tuple[int, ...] = ()  # per term: its `attention_role` (its grid: its scores)

    @property
    def terms(self) -> int:
        return len(self.multiplicity)

    def columns(self) -> list[str]:
        return ["step_time_s", "flops", "bytes", "mfu_ceiling", "hfu_ceiling",
                *(f"{c}_time_share" for c in self.categories)]

    def run(self, dims: dict[str, np.ndarray], peak, bandwidth, peak_fp8=None,
            efficiencies: dict | None = None) -> dict[str, np.ndarray]:
        """Each column of `columns()` at every point: `dims` maps each free name to an array;
        `peak` and `bandwidth` (and `peak_fp8`, the FP8 terms' peak) are arrays of the same
        length or numbers; so are, for a calibrated cost model, `efficiencies` (each point's
        part's `CalibratedCostModel.figures`: its efficiencies, clock ratio and SMs)."""
        if self.cost.shapes and efficiencies is None:
            raise OpgraphError(f"a {self.cost.name} sweep needs each point's efficiencies")
        n = len(next(iter(dims.values()))) if dims else 1
        if self.fp8 is not None and (peak_fp8 is None or np.isnan(peak_fp8).any()):
            raise OpgraphError(f"{self.model}'s step runs matmuls in FP8: give parts with a "
                               "dense FP8 peak")
        fp8 = np.broadcast_to(np.asarray(peak if peak_fp8 is None else peak_fp8, dtype=float),
                              (n,))
        peak = np.broadcast_to(np.asarray(peak, dtype=float), (n,))
        bandwidth = np.broadcast_to(np.asarray(bandwidth, dtype=float), (n,))
        out = {name: np.empty(n) for name in self.columns()}
        for lo in range(0, n, CHUNK):
            hi = min(n, lo + CHUNK)
            args = [np.asarray(dims[name][lo:hi], dtype=float) for name in self.free]
            eff = None if efficiencies is None else {
                k: np.broadcast_to(np.asarray(v, dtype=float), (n,))[lo:hi]
                for k, v in efficiencies.items()}
            for name, col in self._chunk(args, hi - lo, peak[lo:hi], bandwidth[lo:hi],
                                         fp8[lo:hi], eff).items():
                out[name][lo:hi] = col
        return out

    def _chunk(self, args, m, peak, bandwidth, peak_fp8, eff) -> dict[str, np.ndarray]:
        k = self.terms
        rows = 7 * k if eff is not None else 2 * k  # flops, bytes (and counts, grids, hosts)
        values = np.empty((rows + 2, m))
        for i, v in enumerate(self.function(*args)):
            values[i] = v  # constants broadcast
        flops, nbytes, counts = values[:k], values[k:2 * k], values[2 * k:3 * k]
        n_mfu, tokens = values[rows], values[rows + 1]
        peaks = peak if self.fp8 is None else np.where(self.fp8[:, None], peak_fp8, peak)
        shapes = eff is not None  # each term's kernel counts, grids and host launches
        time = self.cost.kernel_times(
            eff or {}, self.attention, flops, nbytes, counts if shapes else 1.0, peaks,
            bandwidth, values[3 * k:6 * k].reshape(3, k, m) if shapes else None,
            values[6 * k:rows] if shapes else None, self.rates)
        step = self.multiplicity @ time
        shares = (self.membership * self.multiplicity) @ time / step
        total_flops = self.multiplicity @ flops
        at_peak = (total_flops if self.fp8 is None
                   else self.multiplicity @ self.cost.busy_flops(flops, peaks, peak))
        cols = {"step_time_s": step, "flops": total_flops, "bytes": self.multiplicity @ nbytes,
                "mfu_ceiling": self.cost.mfu(n_mfu, tokens, step, peak),
                "hfu_ceiling": self.cost.hfu(at_peak, step, peak, np.minimum)}
        cols |= {f"{c}_time_share": shares[j] for j, c in enumerate(self.categories)}
        return cols


def compile_sweep(step: Graph, free=("B", "S"), *, cost: CostModel = DEFAULT) -> Sweep:
    """The step's costs under `cost` compiled over the dimensions named in `free`; every other
    dimension takes the graph's value: `compile_sweep(step, free=("B", "S", "L"))`."""
    dims = resolve(step)
    by_name = {sym.name: sym for sym in dims}
    unknown = [name for name in free if name not in by_name]
    if unknown:
        raise OpgraphError(f"unknown dimension {unknown[0]!r} for {step.name}; "
                           f"it has {', '.join(sorted(by_name))}")
    symbols = [by_name[name] for name in free]
    fixed = {sym: v for sym, v in dims.items() if sym not in symbols}
    terms: dict[tuple, int] = {}
    low = lower(step, cost)
    for o in low.ops:
        c = o.cost
        # the roofline needs only each term's totals; the calibrated model also its kernel
        # count (a launch each), the efficiency its arithmetic runs at, its GEMM grid and its
        # instances' share of host_s (`host_floor`: 0, or the kernels one launches)
        grid = tuple(sympy.sympify(g).xreplace(fixed) for g in c.grid) or (0,) * 3
        per_kernel = ((o.count.xreplace(fixed), c.efficiency, grid, attention_role(o.kind),
                       sympy.sympify(host_floor(o.kind, sympy.Integer(1),
                                                c.launches)).xreplace(fixed))
                      if cost.shapes
                      else (sympy.Integer(1), "matmul", (), 0, sympy.Integer(1)))
        key = (o.category, o.flops.xreplace(fixed), o.bytes.xreplace(fixed), c.compute,
               *per_kernel)
        terms[key] = terms.get(key, 0) + 1
    found = {key[0] for key in terms}
    categories = tuple([c for c in CATEGORIES if c in found] + sorted(found - {*CATEGORIES}))
    n_mfu = sympy.sympify(low.mfu_parameters).xreplace(fixed)  # a MoE's active share
    exprs = [key[1] for key in terms] + [key[2] for key in terms]
    if cost.shapes:  # kernel counts, for the launches; GEMM grids, for waves;
        exprs += [key[4] for key in terms]  # and each instance's share of host_s
        exprs += [key[6][i] for i in range(3) for key in terms]
        exprs += [key[8] for key in terms]
    exprs += [n_mfu, low.tokens.xreplace(fixed)]
    leftover = set().union(*(sympy.sympify(e).free_symbols for e in exprs)) - set(symbols)
    if leftover:
        raise OpgraphError(f"{step.name}'s costs depend on {', '.join(sorted(map(str, leftover)))}"
                           ", which has no value; give it one")
    # Plain arithmetic needs no numpy namespace (that costs ~0.1 s to set up): `*`, `+` and
    # `**` of numpy arrays are numpy's own.
    modules = [{}] if all(map(_arithmetic, exprs)) else "numpy"
    function = sympy.lambdify(symbols, exprs, modules, cse=True)
    membership = np.array([[1.0 if key[0] == c else 0.0 for key in terms] for c in categories])
    fp8 = np.array([key[3] is not None for key in terms])
    return Sweep(step.name, tuple(free), categories, function,
                 np.array(list(terms.values()), dtype=float), membership, cost,
                 fp8 if fp8.any() else None, tuple(key[5] for key in terms),
                 tuple(key[7] for key in terms))


def _arithmetic(expr) -> bool:
    """Only numbers, symbols, sums, products and whole powers."""
    for node in sympy.preorder_traversal(sympy.sympify(expr)):
        if isinstance(node, sympy.Pow):
            if not node.exp.is_Integer:
                return False
        elif not isinstance(node, sympy.Add | sympy.Mul | sympy.Symbol | sympy.Rational):
            return False
    return True
