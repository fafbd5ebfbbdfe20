"""Solve: the values of one dimension at which a condition on the step's costs holds.

    max_share(step, h100, "optimizer", 0.02)     # tokens per step, whole sequences
    ridge(step, h100, "layers.q_proj")           # tokens at which the op turns compute-bound

Both conditions are `g(x) <= 0` for a `g` made of the cost formulas (`opgraph.cost.formula`) with
every other dimension and the hardware put in as exact numbers. Each op's time is
`count * Max(compute, memory)`, both branches polynomials in `x` (linear in the batch at a fixed
sequence length, quadratic in the sequence length for attention), so `g` is piecewise
polynomial: between the breakpoints where some op's two branches cross, every Max is one
branch. `smallest` walks those pieces in increasing `x` and solves each exactly with sympy
(`Poly.real_roots`); no bisection, no tolerance. Answers are then checked numerically:
`max_share` with `evaluate` at the answer and one step outside each end of the stretch on which
the condition holds (a share can fall or rise with the dimension: `ShareAnswer.holds`), `ridge` with
the op's own formulas just above and below the crossing.
"""

from __future__ import annotations

import itertools
import math

import attrs
import sympy

from opgraph.passes.evaluate import evaluate, resolve

from ..core.errors import OpgraphError
from ..core.ir import Graph
from ..core.symbols import B, S
from ..cost import formula as fm
from ..cost.costmodel import DEFAULT, CostModel
from ..cost.hardware import Hardware
from ..cost.lowered import lower, lower_op

T = sympy.Symbol("T", positive=True)  # tokens per step, B*S, as a continuous quantity
DIMS = ("tokens", "seq_len")


def _number(value) -> float:
    return float(sympy.N(value, 30))


def _real_roots(expr, x, lo, hi) -> list:
    """The real roots of the polynomial numerator of `expr` in the open interval (lo, hi)."""
    numerator = sympy.fraction(sympy.together(expr))[0]
    poly = sympy.Poly(sympy.expand(numerator), x)
    if poly.degree() <= 0:
        return []
    roots = sorted(set(poly.real_roots()), key=_number)
    return [r for r in roots
            if _number(lo) < _number(r) and (hi is None or _number(r) < _number(hi))]


def _branches(g, x, at) -> sympy.Expr:
    """`g` with each Max replaced by its largest argument at the point `at` (and each Min, a
    sliding window's, by its smallest)."""
    choice = {}
    for m in g.atoms(sympy.Min):
        choice[m] = min(m.args, key=lambda a: _number(a.subs(x, at)))
    g = g.xreplace(choice)
    for m in g.atoms(sympy.Max):
        choice[m] = max(m.args, key=lambda a: _number(a.subs(x, at)))
    return g.xreplace(choice)


def _crossings(atoms, x, lo, hi=None) -> list:
    """Where two arguments of one of `atoms` (Max or Min of polynomials) cross, in (lo, hi)."""
    breaks = set()
    for m in atoms:
        for i, a in enumerate(m.args):
            for b in m.args[i + 1:]:
                breaks.update(_real_roots(a - b, x, lo, hi))
    return sorted(breaks, key=_number)


def smallest(g, x: sympy.Symbol, lo, closed: bool = True) -> sympy.Expr | None:
    """The least `x >= lo` (`> lo` unless `closed`) with `g(x) <= 0`, exactly: the start of the
    first such stretch, or None where there is none. `smallest(5 - Max(x, 3), x, 0)` is 5.

    `g` is a sum of polynomials in `x` and of Max of such polynomials, which may hold Min of
    polynomials (a sliding window's `Min(S, W)`): between the points where a Min's arguments
    cross, each Min is one of them, and the rest is as without."""
    g = sympy.sympify(g)
    lo = sympy.sympify(lo)
    mins = g.atoms(sympy.Min)
    if not mins:
        return _smallest(g, x, lo, None, closed)
    edges = [lo, *_crossings(mins, x, lo), None]
    for i, (left, right) in enumerate(itertools.pairwise(edges)):
        probe = left + 1 + left if right is None else (left + right) / 2
        choice = {m: min(m.args, key=lambda a: _number(a.subs(x, probe))) for m in mins}
        found = _smallest(g.xreplace(choice), x, left, right, closed or i > 0)
        if found is not None:
            return found
    return None


def _smallest(g, x: sympy.Symbol, lo, hi, closed: bool) -> sympy.Expr | None:
    """`smallest` for `g` without Min, on [lo, hi) (`hi` None: without end)."""
    edges = [lo, *_crossings(g.atoms(sympy.Max), x, lo, hi), hi]
    for left, right in itertools.pairwise(edges):
        probe = left + 1 + left if right is None else (left + right) / 2
        piece = _branches(g, x, probe)
        if sympy.expand(piece) == 0:
            return left
        if closed and left == lo and _number(piece.subs(x, left)) <= 0:
            return left
        cuts = [left, *_real_roots(piece, x, left, right), right]
        for a, b in itertools.pairwise(cuts):
            mid = a + 1 + a if b is None else (a + b) / 2
            if _number(piece.subs(x, mid)) <= 0:
                return a
    return None


def _fixed(graph: Graph, values: dict, free: sympy.Symbol) -> dict:
    """Every dimension's value but `free`'s."""
    return {sym: v for sym, v in resolve(graph, values).items() if sym != free}


def _time(graph: Graph, ops, hardware: Hardware, cost: CostModel, low=None) -> sympy.Expr:
    hw = fm.hardware_values(hardware)
    return fm.step_time(graph, ops, hw[fm.PEAK], hw[fm.BANDWIDTH], cost,
                        peaks={"fp8": hw.get(fm.PEAK_FP8)}, low=low)


@attrs.frozen
class ShareAnswer:
    """Where a part of the step is at most `max_share` of its time, in whole sequences per step
    (dim "tokens", at a fixed seq_len) or whole tokens of sequence length (dim "seq_len").

    A share can fall as the dimension grows (the optimizer's, against tokens) or rise
    (attention's, against seq_len), so the condition holds on a stretch of values. `holds` says
    which: "from" (from the answer up, without end), "up_to" (from the smallest value up to the
    answer) or "between" (from the answer up to `last`); None when it never holds. `tokens`,
    `seq_len` and `batch` are the answer's point: the stretch's first value, or for "up_to" its
    last. `crossing` is where the share equals `max_share` at that end, in `dim` units (tokens
    per step, or seq_len); `again_from` where it holds again after a closed stretch.
    """

    of: str  # the category's id or the op's name
    kind: str  # "category" or "op"
    max_share: float
    dim: str
    tokens: int | None
    seq_len: int
    batch: int
    share: float | None
    share_one_fewer: float | None  # one sequence fewer (or, for seq_len, one token shorter)
    crossing: float | None
    limit: float | None = None  # the share as the dimension grows without bound
    holds: str | None = None  # "from", "up_to", "between" or None (never)
    share_one_more: float | None = None  # just past the stretch's last value, where it closes
    last: int | None = None  # "between": the stretch's last value, in dim units
    again_from: int | None = None  # the first value of the next stretch, in dim units

    def to_json(self) -> dict:
        return attrs.asdict(self)


def _first_whole(g, x, lo: int) -> tuple[int, sympy.Expr] | None:
    """The least whole `n >= lo` with `g(n) <= 0`, and the real crossing before it."""
    lo = sympy.Integer(lo)
    for _ in range(100):  # each pass skips one stretch too short to hold a whole value
        root = smallest(g, x, lo)
        if root is None:
            return None
        n = max(int(sympy.ceiling(root)), int(lo))
        if _number(g.subs(x, n)) <= 0:
            return n, root
        lo = sympy.Integer(n)
    return None


def _last_whole(g, x, start: int) -> tuple[int, sympy.Expr] | None:
    """The greatest whole `m >= start` with `g <= 0` at every whole number from `start` to `m`
    (`g(start) <= 0`), and the real crossing after it; None when there is no such end."""
    lo = sympy.Integer(start)
    for _ in range(100):  # each pass skips one excursion too short to hold a whole value
        root = smallest(-g, x, lo, closed=False)  # the first x > lo at which g >= 0
        if root is None:
            return None
        m = int(sympy.floor(root)) + 1
        if _number(g.subs(x, m)) > 0:
            return m - 1, root
        lo = sympy.Integer(m)
    return None


def max_share(graph: Graph, hardware: Hardware, category: str | None = None, share: float = 0.02,
              *, op: str | None = None, dim: str = "tokens", values: dict | None = None,
              cost: CostModel = DEFAULT) -> ShareAnswer:
    """Where the selected ops take at most `share` of the step's time: the batch (dim "tokens",
    at the given seq_len) or the seq_len (at the given batch) from which it holds, or up to
    which it holds where the share rises (`ShareAnswer.holds`)."""
    fm.roofline_only(cost, "solve")
    if not 0 < share < 1:
        raise OpgraphError(f"--max-share {share}: give a fraction between 0 and 1, e.g. 0.02")
    if dim not in DIMS:
        raise OpgraphError(f"unknown dimension {dim!r} to solve for; choose one of {DIMS}")
    x = B if dim == "tokens" else S
    mine = fm.select(graph, op=op, category=category)
    fixed = _fixed(graph, values, x)
    low = lower(graph, cost)  # the part and the whole step read one lowering
    part = _time(graph, mine, hardware, cost, low).xreplace(fixed)
    step = _time(graph, graph.ops(), hardware, cost, low).xreplace(fixed)
    g = part - sympy.Rational(repr(share)) * step
    what, kind = (op, "op") if op else (category, "category")
    seq, batch = int(fixed.get(S, 0)), int(fixed.get(B, 0))
    first = _first_whole(g, x, 1)
    if first is None:
        tail = _branches(part / step, x, 10 ** 12)
        limit = _number(sympy.limit(tail, x, sympy.oo))
        return ShareAnswer(what, kind, share, dim, None, seq, batch, None, None, None, limit)
    start, low = first
    closes = _last_whole(g, x, start)
    again = _first_whole(g, x, closes[0] + 1) if closes is not None else None
    holds = "from" if closes is None else "up_to" if start == 1 else "between"
    names = {o.name for o in mine}

    def measured(value: int) -> float:
        p = evaluate(graph, hardware, {x.name: value, **{s.name: int(v) for s, v in fixed.items()}},
                     cost=cost)
        return sum(r.time_s for r in p.ops if r.name in names) / p.step_time_s

    def units(value) -> float:  # x as tokens per step (x is the batch) or as seq_len
        return value * seq if x == B else value

    n = closes[0] if holds == "up_to" else start
    at = measured(n)
    fewer = measured(start - 1) if holds != "up_to" and start > 1 else None
    more = measured(closes[0] + 1) if closes is not None else None
    if at > share or (fewer is not None and fewer <= share) or (more is not None
                                                                and more <= share):
        raise AssertionError(f"solve and evaluate disagree at {x} = {n}: {fewer}, {at}, {more}")
    crossing = _number(closes[1] if holds == "up_to" else low)
    return ShareAnswer(what, kind, share, dim, int(units(n)) * (batch if x == S else 1),
                       n if x == S else seq, n if x == B else batch, at, fewer,
                       units(crossing), None, holds, more,
                       int(units(closes[0])) if holds == "between" else None,
                       int(units(again[0])) if again is not None else None)


@attrs.frozen
class RidgeAnswer:
    """Where an op turns from memory- to compute-bound, in tokens per step or sequence length;
    `value` None with `bound` "memory" or "compute" when it is that at every size."""

    op: str
    dim: str
    value: float | None
    smallest_whole: int | None
    bound: str | None  # set when the op never turns: "memory" or "compute" throughout
    expression: str | None  # the crossing as a formula of the dimensions and the hardware
    latex: str | None
    intensity: str  # the op's FLOPs per byte, as a formula
    intensity_limit: float | None  # ... at the other dimensions' values, as `dim` grows
    ridge_intensity: float  # the part's peak / bandwidth
    depends_on: tuple[str, ...] = ()  # the intensity's other dimensions, e.g. ("S",) for attention

    def to_json(self) -> dict:
        """The record, with the crossing also under the dimension's name (`"tokens": 344.9`)."""
        out = attrs.asdict(self)
        return {**out, self.dim: self.value}


def ridge(graph: Graph, hardware: Hardware, op: str, *, dim: str = "tokens",
          values: dict | None = None, cost: CostModel = DEFAULT) -> RidgeAnswer:
    """The tokens per step (at the given seq_len; dim "tokens") or the seq_len (at the given
    batch) above which `op` is compute-bound: `ridge(step, h100, "layers.q_proj")`."""
    fm.roofline_only(cost, "solve")
    if dim not in DIMS:
        raise OpgraphError(f"unknown dimension {dim!r} to solve for; choose one of {DIMS}")
    (node,) = fm.select(graph, op=op)
    node_cost = lower_op(graph, node, cost).cost
    flops, nbytes = node_cost.flops, node_cost.bytes
    x, swap = (T, {B: T / S}) if dim == "tokens" else (S, {})
    flops, nbytes = sympy.expand(flops.xreplace(swap)), sympy.expand(nbytes.xreplace(swap))
    fixed = _fixed(graph, values, B if dim == "tokens" else S)
    hw = fm.hardware_values(hardware)
    peak = fm.PEAK_SYMBOLS.get(node_cost.compute, fm.PEAK)  # an FP8 matmul: the FP8 peak
    if peak not in hw:
        raise OpgraphError(f"op {op} runs in {node_cost.compute.upper()} and {hardware.id} has "
                           f"no dense {node_cost.compute.upper()} peak")
    g = _sides(cost, flops, nbytes, hw[peak], hw[fm.BANDWIDTH]).xreplace(fixed)
    ridge_intensity = float(hw[peak]) / hardware.bandwidth
    if nbytes == 0:
        raise OpgraphError(f"op {op} moves no bytes: it has no ridge point")
    ratio = sympy.factor(flops / nbytes)
    others = tuple(sorted(s.name for s in ratio.free_symbols if s in (B, S)))
    tends = sympy.limit(_branches(ratio.xreplace(fixed), x, 10 ** 12), x, sympy.oo)
    tends = _number(tends) if tends.is_finite else None
    found = smallest(g, x, 0, closed=False)
    if found is None or found == 0:
        return RidgeAnswer(op, dim, None, None, "memory" if found is None else "compute", None,
                           None, str(ratio), tends, ridge_intensity, others)
    value = _number(found)
    whole = int(sympy.ceiling(found))
    if _number(g.subs(x, whole)) > 0 or (whole > 1 and _number(g.subs(x, whole - 1)) <= 0):
        raise AssertionError(f"the ridge of {op} at {value} does not check out")
    closed = _closed_form(flops, nbytes, x, fixed, hw, value, cost, peak)
    return RidgeAnswer(op, dim, value, whole, None, str(closed) if closed is not None else None,
                       fm.latex(closed) if closed is not None else None, str(ratio), tends,
                       ridge_intensity, others)


def _sides(cost: CostModel, flops, nbytes, peak, bandwidth) -> sympy.Expr:
    """The cost model's memory term less its compute term: positive while memory-bound."""
    return (cost.time(0, nbytes, peak, bandwidth, sympy.Max)
            - cost.time(flops, 0, peak, bandwidth, sympy.Max))


def _closed_form(flops, nbytes, x, fixed, hw, value, cost, peak=fm.PEAK):
    """The crossing `flops / peak = bytes / bandwidth` solved for `x` with every dimension and the
    hardware kept as symbols (`peak`: the op's, `peak_fp8` for an FP8 matmul): the solution that
    is `value` at the preset."""
    try:
        solutions = sympy.solve(_sides(cost, flops, nbytes, peak, fm.BANDWIDTH), x)
    except NotImplementedError:
        return None
    subs = {**fixed, **hw}
    for sol in solutions:
        at = sol.xreplace(subs)
        if at.is_number and at.is_real and math.isclose(_number(at), value, rel_tol=1e-9):
            return sympy.factor(sol)
    return None


__all__ = ["DIMS", "RidgeAnswer", "ShareAnswer", "T", "max_share", "ridge", "smallest"]
