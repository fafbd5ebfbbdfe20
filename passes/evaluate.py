"""evaluate: substitute the dimensions and hardware into a graph's costs, giving a Profile.

Per op, time is the roofline `max(flops / peak, bytes / bandwidth)` (XLA's HloCostAnalysis);
ops do not overlap, so the step time is their sum. The MFU ceiling follows the plate's convention:
`6 x N x tokens / (step time x peak)`, N the parameters other than the input embedding (a weight
read only by embedding lookups); tokens per step are `B x S`. For a mixture of experts N counts
the parameters a token uses (`opgraph.parameters`: an expert's weights times K/E).

Beside the roofline, `extra` carries the step's HBM footprint (`opgraph.memory`) against the
part's capacity, and for a mixture of experts its `active_parameters`.
"""

from __future__ import annotations

import sympy

from opgraph.errors import OpgraphError
from opgraph.hardware import Hardware
from opgraph.ir import Graph, Phase
from opgraph.memory import figures, footprint
from opgraph.parameters import active_parameters, is_routed
from opgraph.profile import CATEGORIES, CategoryCost, OpCost, Profile
from opgraph.symbols import B, S


def resolve(graph: Graph, values: dict | None = None) -> dict[sympy.Symbol, sympy.Integer]:
    """The graph's default dimensions updated with `values` (keys: symbols or their names)."""
    merged = {sym: sympy.Integer(v) for sym, v in graph.dims.items()}
    by_name = {sym.name: sym for sym in merged}
    for key, value in (values or {}).items():
        sym = by_name.get(key, key) if isinstance(key, str) else key
        if isinstance(sym, str):
            raise OpgraphError(f"unknown dimension {key!r} for {graph.name}; "
                               f"it has {', '.join(sorted(by_name))}")
        merged[sym] = sympy.Integer(value)
    return merged


def mfu_weights(graph: Graph) -> list:
    """The weights the MFU convention counts: every weight some non-embedding op reads."""
    return [w for w in graph.weights()
            if any(op.kind != "embedding" and op.phase is Phase.FORWARD
                   for op in graph.consumers(w.name))]


def mfu_parameters(graph: Graph) -> sympy.Expr:
    """N of the MFU convention: the `mfu_weights`, each times the share a token uses."""
    return active_parameters(graph, mfu_weights(graph))


def _number(expr, subs: dict, what: str):
    value = sympy.sympify(expr).xreplace(subs)
    if not value.is_number:
        missing = ", ".join(sorted(map(str, value.free_symbols)))
        raise OpgraphError(f"{what} depends on {missing}, which has no value; give it one")
    return value


def evaluate(graph: Graph, hardware: Hardware, values: dict | None = None) -> Profile:
    """The roofline profile of `graph` on `hardware`: `evaluate(step, hardware.get("h100-sxm"))`.

    `values` overrides the graph's dimensions, e.g. `{"B": 8}`.
    """
    subs = resolve(graph, values)
    peak, bandwidth = hardware.peak_flops, hardware.bandwidth
    rows = []
    for op in graph.ops():
        count = int(_number(op.count, subs, f"op {op.name}'s count"))
        flops = float(_number(op.flops * op.count, subs, f"op {op.name}'s FLOPs"))
        nbytes = float(_number(graph.op_bytes(op) * op.count, subs, f"op {op.name}'s bytes"))
        compute, memory = flops / peak, nbytes / bandwidth
        rows.append(OpCost(op.name, op.kind, op.category, op.phase.value, count, flops, nbytes,
                           max(compute, memory), "compute" if compute >= memory else "memory"))
    step = sum(r.time_s for r in rows)
    total_flops = sum(r.flops for r in rows)
    categories = _categories(rows, step, total_flops)
    tokens = int(_number(B * S, subs, "tokens per step"))
    parameters = int(_number(graph.parameters(), subs, "the parameter count"))
    mfu_n = int(_number(mfu_parameters(graph), subs, "the parameter count"))
    return Profile(
        model=graph.name, hardware=hardware,
        values={str(k): int(v) for k, v in sorted(subs.items(), key=lambda kv: kv[0].name)},
        parameters=parameters, mfu_parameters=mfu_n, tokens=tokens,
        ops=tuple(rows), categories=categories, step_time_s=step, flops=total_flops,
        bytes=sum(r.bytes for r in rows),
        mfu_ceiling=6 * mfu_n * tokens / (step * peak) if step else 0.0,
        hfu_ceiling=total_flops / (step * peak) if step else 0.0,
        fused_attention=any(op.kind == "flash_attention" for op in graph.ops()),
        extra=_extra(graph, subs, hardware),
    )


def _extra(graph: Graph, subs: dict, hardware: Hardware) -> dict:
    """`active_parameters` (a mixture of experts only) and the `memory` footprint, in bytes."""
    extra = {}
    if is_routed(graph):
        extra["active_parameters"] = int(_number(active_parameters(graph), subs,
                                                 "the active parameter count"))
    parts = {name: int(_number(expr, subs, f"the {name}' memory"))
             for name, expr in footprint(graph).parts().items()}
    extra["memory"] = figures(parts, hardware.memory_bytes)
    return extra


def _categories(rows: list[OpCost], step: float, total_flops: float) -> tuple:
    names = [c for c in CATEGORIES if any(r.category == c for r in rows)]
    names += sorted({r.category for r in rows} - set(CATEGORIES))
    out = []
    for name in names:
        mine = [r for r in rows if r.category == name]
        time = sum(r.time_s for r in mine)
        memory_time = sum(r.time_s for r in mine if r.bound == "memory")
        flops = sum(r.flops for r in mine)
        out.append(CategoryCost(name, time, time / step if step else 0.0, flops,
                                flops / total_flops if total_flops else 0.0,
                                sum(r.bytes for r in mine),
                                "memory" if memory_time > time / 2 else "compute"))
    return tuple(out)
