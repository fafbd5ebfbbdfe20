"""Cost formulas: the FLOPs, bytes and roofline time of an op, a category or the whole step, as
sympy expressions of the model's dimensions.

    step = compile_step(preset("llama3-8b"))
    formula(step, "flops", category="matmul")   # 6*B*D*L*S*(3*F + 2*H*d_h + 2*H_kv*d_h)
    formula(step, "time", op="layers.q_proj")   # L*Max(2*(...)/bandwidth, 2*B*D*H*S*d_h/peak)

Invariant: a formula is exactly what `evaluate` adds up: both read the step lowered under the
same cost model (`opgraph.cost.lowered`, the `cost` argument), each op's per-instance cost times
its multiplicity `count`, which stays symbolic (`L` for a layer stack), so nothing is unrolled
and substituting a configuration's values gives `evaluate`'s figure. Time is per op the cost
model's `time` with `sympy.Max`, `count * Max(flops / peak, bytes / bandwidth)`, summed over ops.
The hardware enters as two symbols, `peak` (dense FLOP/s) and `bandwidth` (HBM bytes/s), or,
given a `Hardware`, as its exact numbers.

Under the calibrated cost model (`CalibratedCostModel`) a kernel's time is its formula, `count
* Max(host_s, launch_s + Max((flops + matmul_half_flops) / (efficiency * peak), bytes /
(bandwidth_share * bandwidth)))`, with the efficiencies of the part's generation
(`opgraph.cost.calibration`) as exact numbers; so a calibrated time formula needs the part
(`hardware`), and without one it is an error, never the roofline's formula in its place.
`time_rates` is the one place that decides which cost models have formulas: `formula`,
`lowered_time`, `opgraph.analysis.solve` and the CLI ask it.

Tidying only regroups, it never approximates: terms are collected on the layer counts and each
coefficient is factored; a roofline's common factor is pulled out of its Max
(`2*B*D*S*Max(6/bandwidth, 1/peak)`), which shows the two intensities side by side.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable

import sympy

from ..core.errors import OpgraphError
from ..core.ir import Graph, Op
from .costmodel import (
    ALIGN,
    ATTENTION_KINDS,
    DEFAULT,
    CalibratedCostModel,
    Cost,
    CostModel,
    attention_role,
    exp_factor,
    host_floor,
    k_overhead,
    row_factor,
    split_k,
    unaligned,
    wave_quantum,
)
from .hardware import Hardware
from .lowered import Lowered, LoweredOp, lower, lower_op
from .profile import CATEGORIES

PEAK = sympy.Symbol("peak", positive=True)  # dense FLOP/s
PEAK_FP8 = sympy.Symbol("peak_fp8", positive=True)  # dense FP8 FLOP/s (FP8 matmuls only)
BANDWIDTH = sympy.Symbol("bandwidth", positive=True)  # HBM bytes/s
HARDWARE_SYMBOLS = {"peak": "peak dense FLOP/s", "bandwidth": "HBM bandwidth, bytes/s",
                    "peak_fp8": "peak dense FP8 FLOP/s"}
PEAK_SYMBOLS = {"fp8": PEAK_FP8}  # a Cost's compute dtype -> the symbol of its peak


@functools.lru_cache(maxsize=65536)  # bounded; a pure function of an immutable expression
def _factor(expr: sympy.Expr) -> sympy.Expr:
    """`sympy.factor(expr)`, once per distinct expression: a model's formulas repeat its ops'
    few shapes, and factoring is most of what writing them costs."""
    return sympy.factor(expr)


def roofline(flops, nbytes, peak=PEAK, bandwidth=BANDWIDTH, cost: CostModel = DEFAULT
             ) -> sympy.Expr:
    """The cost model's time, `Max(flops / peak, bytes / bandwidth)`, with the factor both terms
    share pulled out: `roofline(2*B*S*D, 12*B*S*D)` is `2*B*D*S*Max(6/bandwidth, 1/peak)`."""
    flops, nbytes = sympy.sympify(flops), sympy.sympify(nbytes)
    compute = _factor(flops / peak)
    memory = _factor(nbytes / bandwidth)
    common = sympy.Integer(1)
    if compute != 0 and memory != 0:
        common = sympy.gcd(sympy.fraction(compute)[0], sympy.fraction(memory)[0])
        common = common.as_content_primitive()[1]  # symbols only: the numbers stay per intensity
        if common.is_positive is not True:
            common = sympy.Integer(1)
    if common == 1:
        return cost.time(flops, nbytes, peak, bandwidth, _factored_max(1))
    return common * cost.time(flops, nbytes, peak, bandwidth, _factored_max(common))


def _factored_max(common):
    def maximum(compute, memory):
        if common == 1:
            return sympy.Max(_factor(compute), _factor(memory))
        return sympy.Max(_factor(compute / common), _factor(memory / common))
    return maximum


def time_rates(cost: CostModel, hardware: Hardware | None = None):
    """The efficiencies a time formula under `cost` is written with: None for the roofline
    (none); for the calibrated model those of `hardware`'s generation (`Efficiencies`), an
    error without a part. The one place that decides which cost models have time formulas."""
    if not isinstance(cost, CalibratedCostModel):
        return None
    if hardware is None:
        raise OpgraphError("a calibrated time formula takes its part's efficiencies: give the "
                           "part (formula(..., hardware=part); opgraph formula "
                           "--numeric-hardware), or use the roofline")
    return cost.figures(hardware)  # its efficiencies, clock ratio and SMs, by name


def roofline_only(cost: CostModel, what: str) -> None:
    """An error where `what` (an engine written on the roofline's formulas alone: solve's
    crossings and ridges) is asked for under another cost model."""
    if isinstance(cost, CalibratedCostModel):
        raise OpgraphError(f"{what} works on the roofline's formulas; --cost calibrated is for "
                           "profile, sweep, diff, compare, validate and formula")


def _exact(number: float) -> sympy.Rational:
    return sympy.Rational(repr(float(number)))


def calibrated_time(kind: str, c: Cost, peak, bandwidth, rates) -> sympy.Expr:
    """One kernel's time under the calibrated cost model with figures `rates` (`time_rates`):
    `CalibratedCostModel.scaled_time`, the one rule every number system runs, on formulas
    (`sympy.Max`, a count's zero tested structurally): `Max(host_s x launches, launch_s +
    Max((flops x shape + matmul_half_flops) / (efficiency x clock x peak), bytes /
    (bandwidth_share x bandwidth)))`. `shape` is its waves or exponentials (`_shape`), over
    `matmul_unaligned` where its N is `_unaligned` (a `Piecewise` where N is a symbol)."""
    shape = _shape(kind, c, rates)
    off = _unaligned(kind, c, rates)  # True, False, or a condition on a symbolic N
    slow = 1 / _exact(rates["matmul_unaligned"])
    quantum = (shape * slow if off is True else shape if off is False
               else sympy.Piecewise((shape * slow, off), (shape, True)))
    return CalibratedCostModel.scaled_time(
        c.flops, c.bytes, 1, peak * _exact(rates["clock"]), bandwidth,
        rate=_exact(rates[c.efficiency]), half=_exact(rates["matmul_half_flops"]),
        bandwidth_share=_exact(rates["bandwidth"]), launch=_exact(rates["launch_s"]),
        quantum=quantum, host=host_floor(kind, _exact(rates["host_s"]), c.launches),
        maximum=sympy.Max, nonzero=_nonzero)


def _nonzero(count) -> sympy.Integer:
    """1 where a formula of FLOPs or bytes is not identically zero, else 0: `scaled_time`'s
    test of a kernel doing arithmetic, or any work, written structurally for formulas."""
    return sympy.Integer(0) if sympy.sympify(count) == 0 else sympy.Integer(1)


def _shape(kind: str, c: Cost, rates: dict) -> sympy.Expr:
    """`costmodel.shape_factor` as a formula: an attention kernel's `exp_factor`, a matrix
    multiply's `wave_quantum` with `sympy.ceiling` times its `k_overhead`; 1 where the op, the
    part or the generation has none."""
    if not c.grid or c.flops == 0:
        return sympy.Integer(1)
    if kind in ATTENTION_KINDS:
        overhead = rates["attention_backward_kv_overhead" if attention_role(kind) == 2
                         else "attention_kv_overhead"]
        rows = row_factor(c.grid[0], c.grid[2], _exact(overhead)) if overhead else 1
        return exp_factor(c.flops, c.grid[0], c.grid[1],
                          _exact(rates["attention_exp_ratio"])) * rows
    k0 = rates["matmul_k_overhead"]
    count, m, n = c.grid
    tiles = [rates["sms"], rates["matmul_tile_m"], rates["matmul_tile_n"]]
    if not all(tiles):
        return k_overhead(c.flops, count, m, n, _exact(k0)) if k0 else sympy.Integer(1)
    tiles = [sympy.Integer(int(t)) for t in tiles]
    split = split_k(count, m, n, *tiles, ceil=sympy.ceiling, floor=sympy.floor,
                    sign=sympy.sign)
    k = k_overhead(c.flops, count * split, m, n, _exact(k0)) if k0 else sympy.Integer(1)
    return k * wave_quantum(count, m, n, *tiles, ceil=sympy.ceiling, split=split)


def _unaligned(kind: str, c: Cost, rates: dict):
    """`costmodel.unaligned` as a formula: whether the GEMM's N is not a multiple of
    `costmodel.ALIGN` (True or False where N is a number, the condition N mod ALIGN != 0 over a
    symbolic N), where the generation's `matmul_unaligned` slows such a GEMM; False else."""
    if (rates["matmul_unaligned"] == 1 or not c.grid or c.flops == 0
            or kind in ATTENTION_KINDS or not all(c.grid)):
        return False
    n = c.grid[2]
    if n.is_Number:
        return bool(unaligned(n))
    return sympy.Ne(sympy.Mod(n, ALIGN), 0)


def _lowered_op(graph: Graph, op: Op, cost: CostModel, low: Lowered | None) -> LoweredOp:
    return low.op(op.name) if low is not None else lower_op(graph, op, cost)


def op_flops(graph: Graph, op: Op, cost: CostModel = DEFAULT, low: Lowered | None = None
             ) -> sympy.Expr:
    return _lowered_op(graph, op, cost, low).flops


def op_bytes(graph: Graph, op: Op, cost: CostModel = DEFAULT, low: Lowered | None = None
             ) -> sympy.Expr:
    return _lowered_op(graph, op, cost, low).bytes


def op_time(graph: Graph, op: Op, peak=PEAK, bandwidth=BANDWIDTH, cost: CostModel = DEFAULT,
            low: Lowered | None = None, peaks: dict | None = None, rates=None) -> sympy.Expr:
    """`op`'s time over its count (`lowered_time`); `low`, the graph lowered under `cost`
    (`lower`), when many ops are asked for."""
    return lowered_time(_lowered_op(graph, op, cost, low), peak, bandwidth, cost, peaks, rates)


def lowered_time(o: LoweredOp, peak=PEAK, bandwidth=BANDWIDTH, cost: CostModel = DEFAULT,
                 peaks: dict | None = None, rates=None) -> sympy.Expr:
    """A lowered op's time over its count, as a formula. The count is positive, so `count *
    Max(a, b) == Max(count*a, count*b)`. An op whose arithmetic runs in FP8 takes `peak_fp8`
    (with numbers: `peaks["fp8"]`). Under the calibrated cost model `rates` are its part's
    efficiencies (`time_rates`), each kernel `calibrated_time`."""
    if rates is None:
        rates = time_rates(cost)  # the roofline: None; calibrated without a part: an error
    c = o.cost
    if c.compute is not None:  # an FP8 matmul: its own peak (a number given with `peak`)
        if isinstance(peak, sympy.Symbol):
            peak = PEAK_SYMBOLS[c.compute]
        elif (peaks or {}).get(c.compute) is None:
            raise OpgraphError(f"op {o.name} runs in {c.compute.upper()} and the part has no "
                               f"dense {c.compute.upper()} peak; give one that has")
        else:
            peak = peaks[c.compute]
    if rates is None:
        return o.count * roofline(c.flops, c.bytes, peak, bandwidth, cost)
    return o.count * calibrated_time(o.kind, c, peak, bandwidth, rates)


def step_time(graph: Graph, ops, peak=PEAK, bandwidth=BANDWIDTH, cost: CostModel = DEFAULT,
              peaks: dict | None = None, rates=None, low: Lowered | None = None) -> sympy.Expr:
    """The summed time of `ops` (a list of the graph's ops); `peaks` and `rates` as
    `lowered_time`'s; `low`, the graph lowered under `cost`, where the caller has it."""
    low = low or lower(graph, cost)
    return sympy.Add(*(lowered_time(low.op(op.name), peak, bandwidth, cost, peaks, rates)
                       for op in ops))


# The quantities a formula can be of: (graph, op, cost, low) -> that op's share of the step.
QUANTITIES: dict[str, Callable] = {"flops": op_flops, "bytes": op_bytes, "time": op_time}


def select(graph: Graph, *, op: str | None = None, category: str | None = None) -> list[Op]:
    """The ops a formula covers: one op by name, a category's, or (neither) the whole step."""
    ops = graph.ops()
    if op is not None:
        if not graph.has_op(op):
            close = difflib.get_close_matches(op, [o.name for o in ops], n=3, cutoff=0.5)
            hint = f"did you mean {', '.join(close)}?" if close else \
                "see `opgraph profile --ops` for the names"
            raise OpgraphError(f"no op {op!r} in {graph.name}'s step; {hint}")
        return [graph.op(op)]
    if category is not None:
        mine = [o for o in ops if o.category == category]
        if not mine:
            found = {o.category for o in ops}
            have = ", ".join([c for c in CATEGORIES if c in found] + sorted(found - {*CATEGORIES}))
            raise OpgraphError(f"no category {category!r} in {graph.name}; choose one of: {have}")
        return mine
    return ops


def hardware_values(hardware: Hardware) -> dict[sympy.Symbol, sympy.Rational]:
    """The part's peak and bandwidth (and FP8 peak, where it has one) as exact numbers: 989e12
    is `989000000000000`."""
    out = {PEAK: sympy.Rational(repr(hardware.peak_flops)),
           BANDWIDTH: sympy.Rational(repr(hardware.bandwidth))}
    if hardware.fp8_flops is not None:
        out[PEAK_FP8] = sympy.Rational(repr(hardware.fp8_flops))
    return out


def depth_symbols(graph: Graph) -> list[sympy.Symbol]:
    """The symbols ops' multiplicities are made of (`L`), in name order."""
    found = set().union(*(sympy.sympify(op.count).free_symbols for op in graph.ops()))
    return sorted(found, key=lambda s: s.name)


def formula(graph: Graph, quantity: str, *, op: str | None = None, category: str | None = None,
            hardware: Hardware | None = None, cost: CostModel = DEFAULT) -> sympy.Expr:
    """The tidied sum of `quantity` ("flops", "bytes" or "time") over the selected ops, under
    the cost model `cost`. For time, `hardware` puts in that part's numbers; without it `peak`
    and `bandwidth` stay symbols. A calibrated time needs `hardware` (`time_rates`):

        formula(step, "time", hardware=h100, cost=CalibratedCostModel())  # = evaluate's
    """
    if quantity not in QUANTITIES:
        raise OpgraphError(f"unknown quantity {quantity!r}; choose one of {', '.join(QUANTITIES)}")
    ops = select(graph, op=op, category=category)
    low = lower(graph, cost)
    mine = [low.op(o.name) for o in ops]
    if quantity != "time":
        total = sympy.Add(*(getattr(o, quantity) for o in mine))
    else:
        rates = time_rates(cost, hardware)
        hw = {} if hardware is None else hardware_values(hardware)
        total = sympy.Add(*(lowered_time(o, hw.get(PEAK, PEAK), hw.get(BANDWIDTH, BANDWIDTH),
                                         cost, {"fp8": hw.get(PEAK_FP8)}, rates) for o in mine))
    return tidy(total, depth_symbols(graph))


def tidy(expr: sympy.Expr, depth=()) -> sympy.Expr:
    """`expr` regrouped to read well: terms that share a roofline (`Max`) are summed under it, and
    each coefficient is collected on the `depth` symbols (the layer counts) and factored.

        >>> from opgraph.core.symbols import B, D, F, L, S, V
        >>> tidy(L*B*S*D + L*B*S*F + D*V, [L])
        B*L*S*(D + F) + D*V
    """
    groups: dict[sympy.Expr, list[sympy.Expr]] = {}
    for term in sympy.Add.make_args(sympy.sympify(expr)):
        key = sympy.Mul(*(f for f in sympy.Mul.make_args(term) if isinstance(f, sympy.Max)))
        groups.setdefault(key, []).append(term / key)
    return sympy.Add(*(key * _tidy_polynomial(sympy.Add(*terms), list(depth))
                       for key, terms in groups.items()))


def _tidy_polynomial(expr: sympy.Expr, depth: list) -> sympy.Expr:
    expanded = sympy.expand(expr)
    if not depth:
        return _factor(expanded)
    groups = sympy.collect(expanded, depth, evaluate=False)
    return sympy.Add(*(k * _factor(v) for k, v in groups.items()))


def latex(expr: sympy.Expr) -> str:
    """LaTeX of a formula, the hardware symbols set upright: `\\mathrm{peak}`."""
    return sympy.latex(expr, symbol_names={PEAK: r"\mathrm{peak}",
                                           BANDWIDTH: r"\mathrm{bandwidth}"})


def symbol_values(expr: sympy.Expr, dims: dict[sympy.Symbol, int],
                  hardware: Hardware | None = None) -> dict[str, int | float]:
    """Each free symbol of `expr` with its value: dimensions from `dims`, `peak` and `bandwidth`
    from `hardware`. A symbol with no value is an error naming it."""
    known = {sym: _plain(v) for sym, v in dims.items()}
    if hardware is not None:
        known |= {PEAK: hardware.peak_flops, BANDWIDTH: hardware.bandwidth}
        if hardware.fp8_flops is not None:
            known[PEAK_FP8] = hardware.fp8_flops
    out = {}
    for sym in sorted(expr.free_symbols, key=lambda s: s.name):
        if sym not in known:
            raise OpgraphError(f"the formula depends on {sym}, which has no value; give it one")
        out[sym.name] = known[sym]
    return out


def value(expr: sympy.Expr, dims: dict[sympy.Symbol, int], hardware: Hardware | None = None):
    """The formula's number at `dims` (and `hardware`): an int where it is whole, else a float."""
    known = {**dims, **(hardware_values(hardware) if hardware is not None else {})}
    number = expr.xreplace({k: sympy.sympify(v) for k, v in known.items()})
    if not number.is_number:
        missing = ", ".join(sorted(map(str, number.free_symbols)))
        raise OpgraphError(f"the formula depends on {missing}, which has no value; give it one")
    return _plain(number)


def _plain(number) -> int | float:
    number = sympy.sympify(number)
    return int(number) if number.is_integer else float(number)


__all__ = [
    "BANDWIDTH",
    "HARDWARE_SYMBOLS",
    "PEAK",
    "PEAK_FP8",
    "PEAK_SYMBOLS",
    "QUANTITIES",
    "calibrated_time",
    "depth_symbols",
    "formula",
    "hardware_values",
    "latex",
    "lowered_time",
    "op_bytes",
    "op_flops",
    "op_time",
    "roofline",
    "roofline_only",
    "select",
    "step_time",
    "symbol_values",
    "tidy",
    "time_rates",
    "value",
]
