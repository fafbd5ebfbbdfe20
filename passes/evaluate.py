"""evaluate: substitute the dimensions and hardware into a graph's costs, giving a Profile.

Each op's FLOPs, bytes and time come from the cost model (`opgraph.cost.costmodel`, by default the
plate's conventions): time per op is `count x max(flops / peak, bytes / bandwidth)`, and ops do
not overlap, so the step time is their sum. The MFU ceiling follows the plate's convention,
`6 x N x tokens / (step time x peak)` (the cost model's `mfu`), N the parameters other than the
input embedding (a weight read only by embedding lookups); tokens per step are `B x S`. For a
mixture of experts N counts the parameters a token uses (`opgraph.core.parameters`: an expert's
weights times K/E), also reported as `active_parameters`.

Each op runs at the peak of its compute dtype (the cost model's `peak`: FP8 matmuls at the part's
FP8 peak). The MFU stays against the BF16 peak (torchtitan's convention); the HFU counts every
FLOP run, re-run ones (`passes.recompute`) included, each FP8 FLOP weighted by BF16 peak / FP8
peak, so that it stays the share of the step the arithmetic units are busy.

Beside the roofline, the profile carries the step's peak HBM need by liveness
(`opgraph.cost.memory`: where it happens and its parts) against the part's capacity.

Values are checked as the command line checks them (`resolve`): each a whole number above 0,
`tokens` (B x S) a whole number of sequences.
"""

from __future__ import annotations

import math
import numbers

import sympy

from opgraph.core.errors import OpgraphError
from opgraph.core.ir import Graph
from opgraph.core.limits import MAX_DIM, MAX_TOKENS, check_whole
from opgraph.core.parameters import mfu_parameters, mfu_weights  # noqa: F401 - re-exported
from opgraph.core.symbols import B, S
from opgraph.cost.costmodel import DEFAULT, CostModel
from opgraph.cost.hardware import Hardware
from opgraph.cost.lowered import Lowered, lower, number
from opgraph.cost.memory import figures
from opgraph.cost.memory import peak as peak_moment
from opgraph.cost.profile import CATEGORIES, CategoryCost, OpCost, Profile


def whole(name: str, value, maximum: int = MAX_DIM) -> int:
    """`value` as a whole number from 1 to `maximum` (the CLI's bounds, `opgraph.core.limits`), or
    an OpgraphError naming `name`: 8 and 8.0 are 8; 1.5, 0, inf, True and "8" are errors.

        >>> whole("B", 8.0)
        8
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real | sympy.Basic):
        raise OpgraphError(f"{name} = {value!r}: give a whole number, e.g. 8")
    if isinstance(value, sympy.Basic):
        whole_number = value.is_Integer
    elif isinstance(value, numbers.Integral):
        whole_number = True
    else:
        whole_number = math.isfinite(value) and float(value).is_integer()
    if not whole_number:
        raise OpgraphError(f"{name} = {value!r} is not a whole number; give one, e.g. 8")
    return check_whole(int(value), name, maximum)


def resolve(graph: Graph, values: dict | None = None) -> dict[sympy.Symbol, sympy.Integer]:
    """The graph's default dimensions updated with `values` (keys: symbols or their names; also
    "tokens", tokens per step, which sets the batch B = tokens / S), each checked by `whole`.
    A sequence longer than the model's positions is an error."""
    merged = {sym: sympy.Integer(v) for sym, v in graph.dims.items()}
    by_name = {sym.name: sym for sym in merged}
    tokens = None
    for key, value in (values or {}).items():
        if key == "tokens":
            tokens = whole("tokens", value, MAX_TOKENS)
            continue
        sym = by_name.get(key, key) if isinstance(key, str) else key
        if isinstance(sym, str):
            raise OpgraphError(f"unknown dimension {key!r} for {graph.name}; "
                               f"it has {', '.join(sorted(by_name))} (or tokens)")
        merged[sym] = sympy.Integer(whole(sym.name, value))
    longest = graph.max_seq_len
    if longest and S in merged and merged[S] > longest:
        raise OpgraphError(f"seq_len {int(merged[S]):,} is longer than {graph.name}'s "
                           f"{longest:,} positions; give at most {longest:,}")
    if tokens is not None:
        if values and any(k in ("B", B) for k in values):
            raise OpgraphError("give tokens or the batch B, not both")
        if S not in merged:
            raise OpgraphError(f"{graph.name} has no sequence length to split tokens by")
        seq = int(merged[S])
        if tokens % seq:
            raise OpgraphError(f"tokens {tokens:,} is not a multiple of the sequence length "
                               f"{seq:,}; try {max(seq, tokens // seq * seq):,}")
        merged[B] = sympy.Integer(tokens // seq)
    return merged


def evaluate(graph: Graph, hardware: Hardware, values: dict | None = None, *,
             cost: CostModel = DEFAULT) -> Profile:
    """The roofline profile of `graph` on `hardware`: `evaluate(step, hardware.get("h100-sxm"))`.

    `values` overrides the graph's dimensions, e.g. `{"B": 8}` or `{"tokens": 65536}`; `cost`
    is the cost model (the plate's conventions by default).
    """
    return interpret(lower(graph, cost), hardware, resolve(graph, values))


def interpret(low: Lowered, hardware: Hardware, subs: dict, ops=None) -> Profile:
    """The lowered step `low` at the point `subs` (`resolve`'s) on `hardware`, in Python
    floats: every op timed by its cost model at once (`CostModel.op_time_list`). `ops`:
    `low.at(subs)`, where the caller has it already."""
    cost, peak, bandwidth = low.cost, hardware.peak_flops, hardware.bandwidth
    ops = low.at(subs) if ops is None else ops
    peaks = [cost.peak(hardware, o.compute) for o in ops]  # each compute dtype's peak
    times = cost.op_time_list(hardware, [o.kind for o in ops], [o.flops for o in ops],
                              [o.bytes for o in ops], [o.count for o in ops], peaks,
                              [o.grid for o in ops], [o.launches for o in ops],
                              [o.efficiency for o in ops])
    rows, grids = [], {}
    at_peak = 0.0  # the FLOPs as the BF16 peak would see them: FP8 FLOPs scaled to its peak
    for o, at, time in zip(ops, peaks, times, strict=True):
        at_peak += cost.busy_flops(o.flops, at, peak)
        if o.grid:
            grids[o.name] = o.grid
        rows.append(OpCost(o.name, o.kind, o.category, o.phase.value, o.count, o.flops, o.bytes,
                           time, cost.bound(o.flops, o.bytes, at, bandwidth)))
    step = sum(r.time_s for r in rows)
    total_flops = sum(r.flops for r in rows)
    categories = category_costs(rows, step, total_flops)
    tokens = int(number(low.tokens, subs, "tokens per step"))
    parameters = int(number(low.parameters, subs, "the parameter count"))
    mfu_n = int(number(low.mfu_parameters, subs, "the parameter count"))
    active = (None if low.active_parameters is None
              else int(number(low.active_parameters, subs, "the active parameter count")))
    graph = low.graph
    return Profile(
        model=graph.name, hardware=hardware,
        values={str(k): int(v) for k, v in sorted(subs.items(), key=lambda kv: kv[0].name)},
        parameters=parameters, mfu_parameters=mfu_n, tokens=tokens,
        ops=tuple(rows), categories=categories, step_time_s=step, flops=total_flops,
        bytes=sum(r.bytes for r in rows),
        mfu_ceiling=cost.mfu(mfu_n, tokens, step, peak) if step else 0.0,
        hfu_ceiling=cost.hfu(at_peak, step, peak) if step else 0.0,
        fused_attention=any(o.kind == "flash_attention" for o in low.ops),
        memory=figures(peak_moment(graph, subs), subs, hardware.memory_bytes),
        active_parameters=active, cost=cost.name, grids=grids,
    )


def category_costs(rows: list[OpCost], step: float, total_flops: float) -> tuple:
    """Each category's time, FLOPs and bytes over `rows`, with its shares of `step` and of
    `total_flops`, in the reports' order."""
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
