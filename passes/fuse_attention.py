"""fuse_attention: replace each unfused attention core with one FlashAttention kernel.

Invariant established: no `attention_scores` op whose score matrix is read only by its P.V
matmul (and their backward kernels) remains; each such core is a `flash_attention` op reading
Q, K, V and writing O, and, where the backward was derived already, one
`flash_attention_backward` kernel reading dO, Q, K, V and O and writing dQ, dK, dV. FLOPs are
kept for every shape fusion accepts (values may have another head size than queries and keys,
as in DeepSeek's MLA: `flash_attention`'s FLOP rule counts QK^T and P.V each with its own);
the score matrix's traffic (and its gradient's) is what disappears. A core the
`flash_attention` shape rule does not accept is left unfused.

The pattern is a tiny attention block written with the builder, so it matches any graph with
that structure, whatever model it came from. Fusing before or after `derive_backward` gives the
same kernels: both paths build the backward through the same rule.
"""

from __future__ import annotations

import attrs

from opgraph import rules
from opgraph.builder import GraphBuilder
from opgraph.ir import Graph, Op, Phase
from opgraph.rewrite import Match, Replacement, rewrite
from opgraph.symbols import B, H, H_kv, S, d_h, dim


@attrs.frozen
class Fused:
    """What one rewrite replaced: the new kernels and the ops they stand for."""

    op: str
    backward: str | None
    replaced: tuple[str, ...]


def attention_pattern(window: bool = False, softcap: bool = False) -> Graph:
    """Scores then P.V, as a model writes them; with a sliding window and soft-capped logits
    when asked (a pattern op matches ops with its parameters' names)."""
    g = GraphBuilder("attention-core")
    q = g.activation("q", (B, S, H * d_h))
    k = g.activation("k", (B, S, H_kv * d_h))
    v = g.activation("v", (B, S, H_kv * d_h))
    g.attention(q, k, v, heads=H, kv_heads=H_kv, name="attn",
                window=dim("W") if window else None, softcap=1 if softcap else None)
    return g.build()


# Every form of the core: plain, windowed, soft-capped, both (Gemma 2's local layers).
FORMS = ((False, False), (True, False), (False, True), (True, True))


def _fused_name(graph: Graph, scores: Op, pv: Op) -> str:
    prefix = []
    for a, b in zip(scores.name.split("."), pv.name.split(".")):
        if a != b:
            break
        prefix.append(a)
    name = ".".join([*prefix, "flash"])
    return name if not graph.has_op(name) else f"{pv.name}.flash"


def _replace(graph: Graph, match: Match) -> Replacement | None:
    scores, pv = graph.op(match.op("attn.scores")), graph.op(match.op("attn.pv"))
    q, k, v, p, o = (match.tensor(n) for n in ("q", "k", "v", "attn.scores", "attn.pv"))
    if scores.count != pv.count or dict(scores.params) != dict(pv.params):
        return None
    params = dict(scores.params)
    ins = [graph.tensor(n) for n in (q, k, v)]
    try:
        (shape,) = rules.infer_shapes("flash_attention", ins, params)
    except rules.ShapeError:
        return None
    out = graph.tensor(o).shape
    if len(shape) != len(out) or not all(rules.same(a, b) for a, b in zip(shape, out)):
        return None
    fwd = Op(_fused_name(graph, scores, pv), "flash_attention", scores.category, [q, k, v], [o],
             count=scores.count, params=params, region=scores.region)
    backward = [op for op in graph.ops() if op.forward in (scores.name, pv.name)]
    dp = [t.name for t in graph.tensors() if t.grad_of == p]
    add_ops = [fwd]
    if backward:
        gone = {n for op in backward for n in op.outputs}
        reads = [n for op in backward for n in op.inputs]
        do = next(n for n in reads if graph.tensor(n).grad_of == o)
        partials = [n for primal in (q, k, v) for n in dict.fromkeys(reads)
                    if graph.tensor(n).grad_of == primal and n not in gone]
        grads = [n for primal in (q, k, v) for op in backward for n in op.outputs
                 if graph.tensor(n).grad_of == primal]
        wrt = tuple(i for i, primal in enumerate((q, k, v))
                    if any(graph.tensor(n).grad_of == primal for n in grads))
        layout = {"dys": 1, "saved_inputs": 3, "saved_outputs": 1, "wrt": wrt}
        if partials:
            layout["accumulate"] = len(partials)
        add_ops.append(Op(f"{fwd.name}.grad", "flash_attention_backward", fwd.category,
                          [do, q, k, v, o, *partials], grads, count=fwd.count,
                          phase=Phase.BACKWARD, params={**params, **layout}, forward=fwd.name,
                          region=fwd.region))
    return Replacement(
        remove_ops=(scores.name, pv.name, *(op.name for op in backward)),
        remove_tensors=(p, *dp),
        add_ops=tuple(add_ops),
    )


def rewrite_attention(graph: Graph) -> tuple[Graph, list[Fused]]:
    """The fused graph and a record of each rewrite: `step, fused = rewrite_attention(step)`."""
    out, applied = graph, []
    for window, softcap in FORMS:
        out, done = rewrite(out, attention_pattern(window, softcap), _replace)
        applied += done
    report = [Fused(plan.add_ops[0].name, plan.add_ops[1].name if len(plan.add_ops) > 1 else None,
                    plan.remove_ops) for _, plan in applied]
    return out, report


def fuse_attention(graph: Graph) -> Graph:
    """`graph` with every attention core fused: `fuse_attention(preset("llama3-8b"))`."""
    return rewrite_attention(graph)[0]
