"""fuse_attention: replace each unfused attention core with one FlashAttention kernel.

Invariant established: no `attention_scores` op whose score matrix is read only by its P.V
matmul (and their backward kernels) remains, nor one whose probabilities go to P.V through a
dropout (FlashAttention draws the mask in the kernel, from a counter-based RNG, and keeps no
mask: its cost is taken as the kernel's without dropout); each such core is a
`flash_attention` op reading Q, K, V and writing O, and, where the backward was derived already, one
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

import functools
import os

import attrs
import sympy

from opgraph.core import rules
from opgraph.core.builder import GraphBuilder
from opgraph.core.contracts import FORWARD, step_pass
from opgraph.core.ir import Graph, Op
from opgraph.core.rewrite import Match, Replacement, fused_flops, rewrite
from opgraph.core.symbols import B, H, H_kv, S, d_h, dim

from .derive_backward import backward_kernels


@attrs.frozen
class Fused:
    """What one rewrite replaced: the new kernels and the ops they stand for."""

    op: str
    backward: str | None
    replaced: tuple[str, ...]


def attention_pattern(window: bool = False, softcap: bool = False,
                      alibi: bool = False, dropout: bool = False) -> Graph:
    """Scores then P.V, as a model writes them; with a sliding window, soft-capped logits,
    ALiBi's bias and dropout on the probabilities when asked (a pattern op matches ops with its
    parameters' names)."""
    g = GraphBuilder("attention-core")
    q = g.activation("q", (B, S, H * d_h))
    k = g.activation("k", (B, S, H_kv * d_h))
    v = g.activation("v", (B, S, H_kv * d_h))
    g.attention(q, k, v, heads=H, kv_heads=H_kv, name="attn",
                window=dim("W") if window else None, softcap=1 if softcap else None,
                alibi=alibi, dropout=0.5 if dropout else None)
    return g.build()


# Every form of the core: plain, windowed, soft-capped, both (Gemma 2's local layers); then
# each of those with ALiBi's bias (BLOOM's plain one); then all of them with dropout (GPT-2's).
FORMS = tuple((window, softcap, alibi, dropout) for dropout in (False, True)
              for alibi in (False, True)
              for window, softcap in ((False, False), (True, False), (False, True), (True, True)))


@functools.cache
def _pattern(form: tuple[bool, bool, bool, bool]) -> Graph:
    """`attention_pattern` of one of `FORMS`, built once: the matcher only reads a pattern."""
    return attention_pattern(*form)


def _core(graph: Graph, match: Match) -> tuple[Op, ...]:
    """The core's forward ops: scores, the dropout where there is one, P.V."""
    names = [match.op(n) for n in ("attn.scores", "attn.dropout", "attn.pv")
             if n in dict(match.ops)]
    return tuple(graph.op(n) for n in names)


def _fused_name(graph: Graph, scores: Op, pv: Op) -> str:
    """The core's own name (`layers.attn` for `layers.attn.scores` and `layers.attn.pv`, as the
    builder's `attention` names them) with `.flash`; beside P.V's name if that is taken."""
    name = os.path.commonprefix([scores.name, pv.name]).rstrip(".") + ".flash"
    return name if not graph.has_op(name) else f"{pv.name}.flash"


def _keeps_flops(graph: Graph, match: Match) -> bool:
    """A predicate: the core's shapes fit one FlashAttention kernel of the same FLOPs (a shape
    the kernel's rules do not accept, or cost differently, stays unfused)."""
    core = _core(graph, match)
    scores, pv = core[0], core[-1]
    if scores.count != pv.count or dict(scores.params) != dict(pv.params):
        return False
    q, k, v, o = (graph.tensor(match.tensor(n)) for n in ("q", "k", "v", "attn.pv"))
    params = dict(scores.params)
    try:
        (shape,) = rules.infer_shapes("flash_attention", [q, k, v], params)
    except rules.ShapeError:
        return False
    if len(shape) != len(o.shape) or not all(rules.same(a, b) for a, b in zip(shape, o.shape)):
        return False
    flops = rules.count_flops("flash_attention", [q, k, v], [o], params)
    return sympy.expand(flops - fused_flops(graph, match.graph_ops)) == 0


def _replace(graph: Graph, match: Match) -> Replacement | None:
    """The core becomes one `flash_attention` kernel (None where something outside the core reads
    its score matrix); where the backward exists, its kernels
    become the one FlashAttention's backward rule (VJP_RULES) makes, writing the same gradient
    tensors the unfused kernels wrote."""
    core = _core(graph, match)
    scores, pv = core[0], core[-1]
    q, k, v, o = (match.tensor(n) for n in ("q", "k", "v", "attn.pv"))
    names = [op.name for op in core]
    backward = [op for op in graph.ops() if op.forward in names]
    plan = Replacement.fuse(graph, names, kind="flash_attention",
                            name=_fused_name(graph, scores, pv), params=scores.params,
                            dropping=[op.name for op in backward])
    if plan.add_ops[0].outputs != (o,):
        return None  # the score matrix is read outside the core: it cannot stay in SRAM
    if not backward:
        return plan
    (fwd,) = plan.add_ops
    made = {n for op in backward for n in op.outputs}
    read = dict.fromkeys(n for op in backward for n in op.inputs)
    grad_of = {n: graph.tensor(n).grad_of for n in (*read, *made)}
    final = {grad_of[n]: n for n in made if grad_of[n] in (q, k, v)
             and not any(n in op.inputs for op in backward)}
    partial = {grad_of[n]: n for n in read if grad_of[n] in (q, k, v) and n not in made}
    do = next(n for n in read if grad_of[n] == o)
    kernels = backward_kernels(graph, fwd, output_grads={o: do}, writes=final,
                               accumulate=partial)
    return attrs.evolve(plan, add_ops=(fwd, *kernels), remove_tensors=(
        *plan.remove_tensors, *(n for n in made if n not in final.values())))


def rewrite_attention(graph: Graph) -> tuple[Graph, list[Fused]]:
    """The fused graph and a record of each rewrite: `step, fused = rewrite_attention(step)`."""
    out, applied = graph, []
    for form in FORMS:
        out, done = rewrite(out, _pattern(form), _replace, where=_keeps_flops)
        applied += done
    report = [Fused(plan.add_ops[0].name, plan.add_ops[1].name if len(plan.add_ops) > 1 else None,
                    plan.remove_ops) for _, plan in applied]
    return out, report


@step_pass(at=FORWARD, bind=lambda o: o.fused_attention and {})
def fuse_attention(graph: Graph) -> Graph:
    """`graph` with every attention core fused: `fuse_attention(preset("llama3-8b"))`."""
    return rewrite_attention(graph)[0]
