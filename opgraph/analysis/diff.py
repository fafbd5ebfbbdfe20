"""Two training steps side by side: which ops a change removed, added or changed, and what
that did to the step's time, MFU ceiling and memory. It is how a user sees what a pass bought.

    fused = compile_step(preset("llama3-8b"))
    unfused = compile_step(preset("llama3-8b"), fused_attention=False)
    d = diff_steps(unfused, fused, hardware.get("h100-sxm"))
    [o.name for o in d.removed]          # the unfused attention core's kernels
    d.totals_formula("bytes")            # -12*B*H*L*S**2: the score matrix's traffic
    print(format_diff(d))

Ops are matched by name. One on side A only is *removed*, on side B only *added*; one on both
is *changed* when its kind, inputs, outputs, multiplicity, FLOPs or bytes differ (as formulas,
or as numbers at each side's dimensions, so two sizes of one model differ too). A change of
hardware alone changes times, not ops: the totals show it, and `format_diff(every_op=True)`
each op's time.

Numbers come from `evaluate` (each side at its own hardware and dimensions); formulas from the
graphs through `opgraph.cost.formula`, computed when asked for. An op's `memory` is the bytes of its
outputs that stay resident for the backward pass (the activations `opgraph.cost.memory` counts), so
the ops of a diff account for the change in the footprint's activations. A difference of two
formulas is given only when both sides are one model at the same values of its dimensions,
where `B - A` means something; across models, or at different dimensions (tokens per step), each
side's formulas stand alone.
"""

from __future__ import annotations

import attrs
import sympy

from ..core.ir import Graph, Op, Phase, Role
from ..cost import formula as fm
from ..cost.costmodel import DEFAULT, CostModel
from ..cost.hardware import Hardware
from ..cost.memory import peak
from ..cost.profile import OpCost, Profile

QUANTITIES = ("flops", "bytes", "time", "memory")
STATUSES = ("removed", "added", "changed")


def op_memory(graph: Graph, op: Op, cost: CostModel = DEFAULT) -> sympy.Expr:
    """Bytes of `op`'s outputs kept for the backward pass, times their multiplicity (the cost
    model does not enter: memory is tensors)."""
    if op.phase is not Phase.FORWARD:  # a re-run op's outputs live only until read
        return sympy.Integer(0)
    return sympy.Add(*(t.nbytes * t.count for t in map(graph.tensor, op.outputs)
                       if t.role is Role.ACTIVATION
                       and any(c.phase in (Phase.BACKWARD, Phase.RECOMPUTE)
                               for c in graph.consumers(t.name))))


# Each quantity's formula for one op: (graph, op, cost=) -> its share of the step.
OP_FORMULAS = {"flops": fm.op_flops, "bytes": fm.op_bytes, "time": fm.op_time,
               "memory": op_memory}


@attrs.frozen(eq=False)
class OpSide:
    """One op on one side: its evaluated row and, where the graph is known, the op itself."""

    cost: OpCost
    graph: Graph | None = None
    dims: dict = attrs.field(factory=dict)  # symbol -> value, this side's
    model: CostModel = DEFAULT  # the cost model this side was evaluated with
    _formulas: dict = attrs.field(factory=dict, init=False, repr=False)  # computed once each

    @property
    def op(self) -> Op | None:
        return self.graph.op(self.cost.name) if self.graph is not None else None

    def formula(self, quantity: str) -> sympy.Expr | None:
        """`quantity`'s formula for this op (time keeps `peak` and `bandwidth` as symbols)."""
        if self.graph is None:
            return None
        if quantity not in self._formulas:
            expr = OP_FORMULAS[quantity](self.graph, self.op, cost=self.model)
            if quantity != "time":  # op_time is tidy already: count * roofline
                expr = fm.tidy(expr, fm.depth_symbols(self.graph))
            self._formulas[quantity] = expr
        return self._formulas[quantity]

    @property
    def memory(self) -> int | None:
        """Bytes of its outputs resident for the backward pass, at this side's dimensions."""
        return None if self.graph is None else fm.value(self.formula("memory"), self.dims)

    def figure(self, quantity: str):
        return self.memory if quantity == "memory" else getattr(
            self.cost, "time_s" if quantity == "time" else quantity)


@attrs.frozen(eq=False)
class OpDiff:
    """One op removed (`b` is None), added (`a` is None), changed (and why) or unchanged."""

    name: str
    a: OpSide | None
    b: OpSide | None
    why: tuple[str, ...]  # what differs: kind, inputs, outputs, count, flops, bytes
    comparable: bool  # both sides at the same dimensions: a difference of formulas means something

    @property
    def status(self) -> str:
        if self.a is None or self.b is None:
            return "removed" if self.b is None else "added"
        return "changed" if self.why else "unchanged"

    @property
    def kind(self) -> str:
        return (self.b or self.a).cost.kind

    @property
    def phase(self) -> str:
        return (self.b or self.a).cost.phase

    def delta(self, quantity: str):
        """B's figure minus A's (a missing side counts zero); None where one is unknown."""
        a, b = (s.figure(quantity) if s is not None else 0 for s in (self.a, self.b))
        return None if a is None or b is None else b - a

    @property
    def time_saved(self) -> float:
        return -self.delta("time")

    def delta_formula(self, quantity: str) -> sympy.Expr | None:
        """B's formula minus A's, or None across models, dimensions or without graphs."""
        if not self.comparable:
            return None
        sides = [s.formula(quantity) if s is not None else sympy.Integer(0)
                 for s in (self.a, self.b)]
        graph = (self.b or self.a).graph
        return fm.tidy(sympy.expand(sides[1] - sides[0]), fm.depth_symbols(graph))


@attrs.frozen(eq=False)
class StepDiff:
    """Two steps' profiles and the ops that differ, most time saved first."""

    a: Profile
    b: Profile
    ops: tuple[OpDiff, ...]
    graphs: tuple[Graph | None, Graph | None] = (None, None)
    same: tuple[OpDiff, ...] = ()  # ops on both sides that did not change (times may have)
    models: tuple[CostModel, CostModel] = (DEFAULT, DEFAULT)  # each side's cost model

    @property
    def unchanged(self) -> int:
        return len(self.same)

    @property
    def removed(self) -> list[OpDiff]:
        return [o for o in self.ops if o.status == "removed"]

    @property
    def added(self) -> list[OpDiff]:
        return [o for o in self.ops if o.status == "added"]

    @property
    def changed(self) -> list[OpDiff]:
        return [o for o in self.ops if o.status == "changed"]

    @property
    def comparable(self) -> bool:
        return _comparable(self.a, self.b, *self.graphs)

    def totals(self) -> dict[str, dict]:
        """Each step figure as `{a, b, delta}`: step time, MFU ceiling, memory, FLOPs, bytes."""
        figures = {
            "step_time_s": (self.a.step_time_s, self.b.step_time_s),
            "mfu_ceiling": (self.a.mfu_ceiling, self.b.mfu_ceiling),
            "memory_bytes": (_memory(self.a), _memory(self.b)),
            "flops": (self.a.flops, self.b.flops),
            "bytes": (self.a.bytes, self.b.bytes),
        }
        return {k: {"a": a, "b": b, "delta": None if a is None or b is None else b - a}
                for k, (a, b) in figures.items()}

    def side_formula(self, side: str, quantity: str) -> sympy.Expr | None:
        """One side's total `quantity` ("flops", "bytes" or "memory") as a formula."""
        graph, model = self.graphs["ab".index(side)], self.models["ab".index(side)]
        if graph is None:
            return None
        if quantity == "memory":  # the peak's parts, at the moment this side peaks, and the
            # gather buffers `Memory.total` stacks on them where they fit
            profile = self.a if side == "a" else self.b
            moment = peak(graph, _dims(graph, profile.values))
            return fm.tidy(moment.total + moment.buffers, fm.depth_symbols(graph))
        return fm.formula(graph, quantity, cost=model)

    def totals_formula(self, quantity: str) -> sympy.Expr | None:
        """B's total minus A's as a formula (one model at the same dimensions on both sides),
        e.g. the bytes a pass removed; None otherwise."""
        if not self.comparable:
            return None
        a, b = (self.side_formula(s, quantity) for s in "ab")
        return fm.tidy(sympy.expand(b - a), fm.depth_symbols(self.graphs[1]))

    def to_json(self) -> dict:
        """The stable `--json` object: `a`, `b`, `removed`, `added`, `changed`, `totals`."""
        out = {"a": _side_json(self.a), "b": _side_json(self.b), "comparable": self.comparable}
        for status in STATUSES:
            out[status] = [_op_json(o) for o in self.ops if o.status == status]
        out["unchanged"] = self.unchanged
        totals = self.totals()
        for quantity in ("flops", "bytes", "memory"):
            key = "memory_bytes" if quantity == "memory" else quantity
            totals[key]["formula"] = {s: _str(self.side_formula(s, quantity)) for s in "ab"}
            totals[key]["formula"]["delta"] = _str(self.totals_formula(quantity))
        a_time, b_time = totals["step_time_s"]["a"], totals["step_time_s"]["b"]
        totals["step_time_s"]["speedup"] = a_time / b_time if b_time else None
        out["totals"] = totals
        return out


def _memory(p: Profile):
    return p.memory.total if p.memory is not None else None


def _str(expr) -> str | None:
    return None if expr is None else str(expr)


def _why(a: OpSide, b: OpSide) -> tuple[str, ...]:
    """What differs between one op's two sides; empty if nothing does."""
    why = [k for k in ("kind", "count", "flops", "bytes")
           if getattr(a.cost, k) != getattr(b.cost, k)]
    if a.graph is not None and b.graph is not None:
        oa, ob = a.op, b.op
        why += [k for k in ("inputs", "outputs") if getattr(oa, k) != getattr(ob, k)]
        if oa.count != ob.count and "count" not in why:
            why.append("count")
        for k, rule in (("flops", fm.op_flops), ("bytes", fm.op_bytes)):
            if k not in why and sympy.expand(rule(a.graph, oa, cost=a.model)
                                             - rule(b.graph, ob, cost=b.model)) != 0:
                why.append(k)
    order = ("kind", "inputs", "outputs", "count", "flops", "bytes")
    return tuple(k for k in order if k in why)


def _diff(pa: Profile, pb: Profile, ga: Graph | None, gb: Graph | None,
          models: tuple[CostModel, CostModel] = (DEFAULT, DEFAULT)) -> StepDiff:
    def sides(p: Profile, g: Graph | None, model: CostModel) -> dict[str, OpSide]:
        dims = _dims(g, p.values) if g is not None else {}
        return {r.name: OpSide(r, g, dims, model) for r in p.ops}

    a, b = sides(pa, ga, models[0]), sides(pb, gb, models[1])
    comparable = _comparable(pa, pb, ga, gb)
    ops, same = [], []
    for name in [*a, *(n for n in b if n not in a)]:
        if name in a and name in b:
            why = _why(a[name], b[name])
            (ops if why else same).append(OpDiff(name, a[name], b[name], why, comparable))
        else:
            ops.append(OpDiff(name, a.get(name), b.get(name), (), comparable))
    ops.sort(key=lambda o: -o.time_saved)  # stable: ties keep A's order, then B's
    same.sort(key=lambda o: -o.time_saved)
    return StepDiff(pa, pb, tuple(ops), (ga, gb), tuple(same), models)


def _comparable(pa: Profile, pb: Profile, ga: Graph | None, gb: Graph | None) -> bool:
    """Both graphs known, of one model's dimensions, evaluated at the same values."""
    return ga is not None and gb is not None and ga.dims == gb.dims and pa.values == pb.values


def _dims(graph: Graph, values: dict) -> dict:
    from opgraph.passes.evaluate import resolve

    return resolve(graph, values)


def diff_steps(a: Graph, b: Graph, hardware: Hardware, values: dict | None = None, *,
               b_hardware: Hardware | None = None, b_values: dict | None = None,
               cost: CostModel = DEFAULT, b_cost: CostModel | None = None) -> StepDiff:
    """Compiled steps `a` and `b` side by side, both on `hardware` at `values` with the cost
    model `cost` (B's own with `b_hardware`, `b_values`, `b_cost`):
    `diff_steps(unfused, fused, hardware.get("h100-sxm"))`."""
    from opgraph.passes.evaluate import evaluate

    b_hardware = b_hardware or hardware
    b_values = values if b_values is None else b_values
    b_cost = cost if b_cost is None else b_cost
    return _diff(evaluate(a, hardware, values, cost=cost),
                 evaluate(b, b_hardware, b_values, cost=b_cost), a, b, (cost, b_cost))


def diff_profiles(a: Profile, b: Profile) -> StepDiff:
    """Two evaluated profiles side by side: numbers only (no graphs, so no formulas, no
    inputs or outputs, no per-op memory)."""
    return _diff(a, b, None, None)


# --- text -------------------------------------------------------------------------------------
_MARK = {"removed": "-", "added": "+", "changed": "~", "unchanged": ""}


def _bytes(n) -> str:
    if n is None:
        return "?"
    sign, n = ("-" if n < 0 else ""), abs(n)
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{sign}{n / scale:.2f} {unit}"
    return f"{sign}{n:.0f} B"


def _pair(o: OpDiff, quantity: str, fmt) -> str:
    a, b = (fmt(s.figure(quantity)) if s is not None else "-" for s in (o.a, o.b))
    return f"{a} > {b}"


def _table(rows: list[list[str]], right) -> list[str]:
    """Columns as wide as their widest cell; those in `right` right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [" ".join(c.rjust(w) if i in right else c.ljust(w)
                     for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in rows]


def describe(p: Profile) -> str:
    """`llama3-8b on h100-sxm, 8,192 tokens (1 x 8,192), fused attention`."""
    return (f"{p.model} on {p.hardware.id}, {p.tokens:,} tokens "
            f"({p.tokens // p.seq_len} x {p.seq_len:,}), {p.attention}")


def format_diff(d: StepDiff, *, b_options: str = "", formulas: bool = False,
                every_op: bool = False) -> str:
    """The `opgraph diff` text: both sides, the ops that differ (most time saved first, `-`
    removed, `+` added, `~` changed, figures as A > B), then the step's totals. With
    `formulas=True` each op's change in FLOPs, bytes and memory follows as a formula; with
    `every_op=True` the unchanged ops are listed too (blank mark: their time can still change,
    on other hardware)."""
    b_head = describe(d.b) + (f"  (A with {b_options})" if b_options else "")
    lines = [f"A: {describe(d.a)}", f"B: {b_head}", ""]
    counts = ", ".join(f"{len([o for o in d.ops if o.status == s])} {s}" for s in STATUSES)
    lines.append(f"ops: {counts}, {d.unchanged} unchanged")
    listed = sorted([*d.ops, *d.same], key=lambda o: -o.time_saved) if every_op else d.ops
    if listed:
        header = ["", "op", "phase", "kind", "saved (ms)", "time A > B (ms)", "GFLOP A > B",
                  "bytes A > B", "memory A > B", ""]
        rows = [[_MARK[o.status], o.name, o.phase, o.kind, f"{o.time_saved * 1e3:.3f}",
                 _pair(o, "time", lambda t: f"{t * 1e3:.3f}"),
                 _pair(o, "flops", lambda f: f"{f / 1e9:.1f}"), _pair(o, "bytes", _bytes),
                 _pair(o, "memory", _bytes), f"({', '.join(o.why)})" if o.why else ""]
                for o in listed]
        lines += [""] + _table([header, *rows], right=range(4, 9))
        lines += _fused_lines(d)
        if formulas:
            lines += ["", "formulas (B - A)" if d.comparable else "formulas (A > B)"]
            for o in d.ops:
                lines.append(f"{_MARK[o.status]} {o.name}")
                for q in ("flops", "bytes", "memory"):
                    lines.append(f"    {q:<7} {_op_formula_text(o, q)}")
    t = d.totals()
    step, mfu, mem = t["step_time_s"], t["mfu_ceiling"], t["memory_bytes"]
    speed = step["a"] / step["b"] if step["b"] else float("nan")
    lines += [
        "",
        f"{'':<13}{'A':>12} {'B':>12} {'B - A':>12}",
        (f"{'step time':<13}{step['a'] * 1e3:>9.1f} ms {step['b'] * 1e3:>9.1f} ms "
         f"{step['delta'] * 1e3:>+9.1f} ms  (speed-up {speed:.3f}x)"),
        (f"{'MFU ceiling':<13}{mfu['a'] * 100:>11.1f}% {mfu['b'] * 100:>11.1f}% "
         f"{mfu['delta'] * 100:>+9.1f} pts"),
        f"{'memory':<13}{_bytes(mem['a']):>12} {_bytes(mem['b']):>12} {_signed(mem['delta']):>12}",
        (f"{'TFLOP':<13}{t['flops']['a'] / 1e12:>12.1f} {t['flops']['b'] / 1e12:>12.1f} "
         f"{t['flops']['delta'] / 1e12:>+12.1f}"),
        (f"{'HBM bytes':<13}{_bytes(t['bytes']['a']):>12} {_bytes(t['bytes']['b']):>12} "
         f"{_signed(t['bytes']['delta']):>12}"),
    ]
    if d.comparable:
        lines += ["", "B - A as formulas:"]
        lines += [f"  {q:<7} {d.totals_formula(q)}" for q in ("flops", "bytes", "memory")]
    return "\n".join(lines)


def fused_saving(graph: Graph, op: Op) -> sympy.Expr:
    """The HBM bytes a fused kernel (kind `fused`) saves in the step: its members' traffic, each
    run alone on its own tensors, less its own, times its multiplicity."""
    from ..cost.costmodel import fused_members

    alone = sympy.Add(*(c.bytes for c in fused_members(graph, op).values()))
    return sympy.expand((alone - graph.op_bytes(op)) * op.count)


def _fused_lines(d: StepDiff) -> list[str]:
    """One line per fused kernel a side gained: its members and the bytes it saves."""
    lines = []
    for o in d.added:
        op = o.b.op
        if op is None or op.kind != "fused":
            continue
        saved = fused_saving(o.b.graph, op)
        value = int(saved.xreplace(o.b.dims)) if not saved.free_symbols - set(o.b.dims) else None
        members = " + ".join(m.name for m in op.param("body"))
        lines.append(f"  {o.name} = {members}: saves {_bytes(value)} ({saved})")
    head = ("fused kernels (B): members, and the bytes each saves over its members run alone "
            "(the totals follow the cost model's backward convention)")
    return ["", head, *lines] if lines else []


def _signed(n) -> str:
    return "?" if n is None else ("+" if n >= 0 else "") + _bytes(n)


def _op_formula_text(o: OpDiff, quantity: str) -> str:
    if o.comparable:
        return str(o.delta_formula(quantity))
    a, b = (str(s.formula(quantity)) if s is not None else "0" for s in (o.a, o.b))
    return f"{a}  >  {b}"


# --- JSON -------------------------------------------------------------------------------------
def _side_json(p: Profile) -> dict:
    return {"model": p.model, "hardware": p.hardware.id, "tokens": p.tokens,
            "seq_len": p.seq_len, "batch": p.tokens // p.seq_len,
            "fused_attention": p.fused_attention, "dimensions": dict(p.values),
            "step_time_s": p.step_time_s, "mfu_ceiling": p.mfu_ceiling,
            "memory_bytes": _memory(p), "flops": p.flops, "bytes": p.bytes}


def _op_side_json(s: OpSide | None) -> dict | None:
    if s is None:
        return None
    c = s.cost
    op = s.op
    return {"kind": c.kind, "category": c.category, "phase": c.phase, "count": c.count,
            "flops": c.flops, "bytes": c.bytes, "time_s": c.time_s, "bound": c.bound,
            "memory_bytes": s.memory,
            "inputs": list(op.inputs) if op is not None else None,
            "outputs": list(op.outputs) if op is not None else None,
            "formulas": {q: _str(s.formula(q)) for q in QUANTITIES}}


def _op_json(o: OpDiff) -> dict:
    return {"name": o.name, "status": o.status, "kind": o.kind, "phase": o.phase,
            "why": list(o.why), "a": _op_side_json(o.a), "b": _op_side_json(o.b),
            "delta": {"flops": o.delta("flops"), "bytes": o.delta("bytes"),
                      "time_s": o.delta("time"), "memory_bytes": o.delta("memory"),
                      "formulas": {q: _str(o.delta_formula(q))
                                   for q in ("flops", "bytes", "memory")}}}


__all__ = ["OpDiff", "OpSide", "StepDiff", "describe", "diff_profiles", "diff_steps",
           "format_diff", "op_memory"]
