"""The rewrite driver: complete matching at input positions, convexity, predicates, fusion into
one kernel whose traffic is its boundary, overlap resolution and the guarded fixed-point loop."""

import pytest
import sympy
from opgraph.models import preset

from opgraph import GraphBuilder, verify
from opgraph.cost.costmodel import rule_flops
from opgraph.core.ir import Graph, Op, Tensor
from opgraph.core.rewrite import (Replacement, Rewrite, RewriteError, find, fixpoint, fused_flops,
                                  is_convex, matches, one_region, rewrite)
from opgraph.core.symbols import B, D, S

BSD = B * S * D  # elements of one [B, S, D] activation
BF16 = 2  # bytes per element


def _pattern_gelu_add_gelu() -> Graph:
    p = GraphBuilder("gelu-add-gelu")
    x, c = p.activation("x", (B, S, D)), p.activation("c", (B, S, D))
    p.gelu(p.add(p.gelu(x, name="g1"), c, name="a"), name="g2")
    return p.build()


def test_finds_what_the_first_fitting_consumer_hides():
    """`y` has two `add` consumers; the first fits the pattern's add but its output feeds no
    gelu. A walk that binds the first fitting consumer and never retries finds nothing; the
    complete matcher finds the second."""
    g = GraphBuilder("two-consumers")
    x = g.activation("x", (B, S, D))
    y = g.gelu(x, name="y")
    g.add(y, g.activation("c1", (B, S, D)), name="wrong")  # first consumer: a dead end
    z = g.add(y, g.activation("c2", (B, S, D)), name="right")
    g.gelu(z, name="out")
    graph = g.build()
    assert [c.name for c in graph.consumers("y")] == ["wrong", "right"]
    (m,) = find(_pattern_gelu_add_gelu(), graph)
    assert dict(m.ops) == {"g1": "y", "a": "right", "g2": "out"}
    assert m.tensor("c") == "c2" and m.tensor("x") == "x"


def test_input_positions_are_respected():
    """The pattern adds `c + gelu(x)`; a graph adding `gelu(x) + c` is another pattern."""
    p = GraphBuilder("c-plus-gelu")
    x, c = p.activation("x", (B, S, D)), p.activation("c", (B, S, D))
    p.add(c, p.gelu(x, name="g"), name="a")
    pattern = p.build()
    g = GraphBuilder("positions")
    x, c = g.activation("x", (B, S, D)), g.activation("c", (B, S, D))
    y = g.gelu(x, name="y")
    g.add(y, c, name="y_plus_c")
    g.add(c, y, name="c_plus_y")
    g.add(y, y, name="y_plus_y")  # one tensor at both positions: not two pattern tensors
    (m,) = find(pattern, g.build())
    assert m.op("a") == "c_plus_y"


def _chain(n: int) -> Graph:
    g = GraphBuilder(f"chain{n}")
    x = g.activation("x", (B, S, D))
    for i in range(n):
        x = g.gelu(x, name=f"g{i}")
    return g.build()


def _gelu_gelu() -> Graph:
    p = GraphBuilder("gelu-gelu")
    p.gelu(p.gelu(p.activation("x", (B, S, D)), name="first"), name="second")
    return p.build()


def test_every_match_is_found_and_overlaps_resolve_in_graph_order():
    graph = _chain(3)
    found = find(_gelu_gelu(), graph)
    assert [m.graph_ops for m in found] == [("g0", "g1"), ("g1", "g2")]  # overlapping, both
    out, applied = rewrite(graph, _gelu_gelu(), lambda g, m: Replacement.fuse(
        g, m.graph_ops, name=f"{m.op('first')}+"))
    assert [m.graph_ops for m, _ in applied] == [("g0", "g1")]  # the earlier one wins
    assert [op.name for op in out.ops()] == ["g0+", "g2"]
    assert [op.name for op in graph.ops()] == ["g0", "g1", "g2"]  # the input is left alone


def _nonconvex() -> Graph:
    g = GraphBuilder("detour")
    x, y = g.activation("x", (B, S, D)), g.activation("y", (B, S, D))
    a = g.add(x, y, name="a")
    g.add(a, g.gelu(a, name="detour"), name="b")  # a -> detour -> b leaves and re-enters
    return g.build()


def _add_add() -> Graph:
    p = GraphBuilder("add-add")
    a = p.add(p.activation("x", (B, S, D)), p.activation("y", (B, S, D)), name="first")
    p.add(a, p.activation("z", (B, S, D)), name="second")
    return p.build()


def test_a_non_convex_match_is_rejected():
    graph = _nonconvex()
    (m,) = matches(_add_add(), graph)  # the pattern's edges are all there ...
    assert m.graph_ops == ("a", "b") and m.tensor("z") == "detour"
    assert not is_convex(graph, m.graph_ops)  # ... but one kernel for a and b makes a cycle
    assert find(_add_add(), graph) == []
    assert is_convex(graph, ["a", "detour", "b"])
    with pytest.raises(RewriteError, match="re-enters"):
        Replacement.fuse(graph, ["a", "b"], kind="fused", name="ab")


def _residual_norm() -> Graph:
    """A residual add and the norm that reads it: the fusion a layer boundary hid."""
    p = GraphBuilder("add-rmsnorm")
    s = p.add(p.activation("x", (B, S, D)), p.activation("y", (B, S, D)), name="add")
    p.rmsnorm(s, p.weight("w", (D,)), name="norm")
    return p.build()


def _fuse_residual_norm(graph: Graph, m) -> Replacement:
    return Replacement.fuse(graph, m.graph_ops, name=f"{m.op('norm')}.fused")


def test_a_predicate_rejects_the_match_that_crosses_a_region():
    """In Llama the residual add feeds a norm twice: inside the layer (attn_residual ->
    mlp_norm) and across the stack's end (the last mlp_residual -> final_norm, L times against
    once). `one_region` keeps the first only."""
    graph = preset("llama3-8b")
    every = find(_residual_norm(), graph)
    assert [m.graph_ops for m in every] == [("layers.attn_residual", "layers.mlp_norm"),
                                           ("layers.mlp_residual", "final_norm")]
    kept = find(_residual_norm(), graph, where=one_region)
    assert kept == every[:1]
    assert find(_residual_norm(), graph, where=[one_region, lambda g, m: False]) == []


def test_fusing_keeps_flops_and_leaves_the_boundary_traffic():
    graph = preset("llama3-8b")
    out, applied = rewrite(graph, _residual_norm(), _fuse_residual_norm, where=one_region)
    (match, plan), = applied
    fused = out.op("layers.mlp_norm.fused")
    assert plan.add_ops == (fused,) and plan.remove_tensors == ()  # both outputs are read on
    assert fused.inputs == ("embed", "layers.o_proj", "layers.mlp_norm.weight")
    # the sum leaves the kernel: the MLP's residual add reads it; the norm feeds the MLP
    assert fused.outputs == ("layers.attn_residual", "layers.mlp_norm")
    assert (fused.count, fused.region, fused.category) == (graph.op("layers.attn_residual").count,
                                                           "layers", "elementwise")
    # an add (1 per element) and an RMSNorm (4 per element): FLOPs are kept
    assert sympy.expand(rule_flops(out, fused) - 5 * BSD) == 0
    assert sympy.expand(fused_flops(graph, match.graph_ops) - 5 * BSD) == 0
    # bytes: two [B, S, D] activations in, two out, and the norm's [D] weight
    assert sympy.expand(out.op_bytes(fused) - BF16 * (4 * BSD + D)) == 0
    unfused = sum(graph.op_bytes(graph.op(n)) for n in match.graph_ops)
    assert sympy.expand(unfused - out.op_bytes(fused) - BF16 * BSD) == 0  # the sum is read once
    assert not any(out.has_op(n) for n in match.graph_ops)
    assert out.regions() == graph.regions()


def test_inner_tensors_vanish():
    out, _ = rewrite(_chain(2), _gelu_gelu(), lambda g, m: Replacement.fuse(
        g, m.graph_ops, name="both"))
    assert [t.name for t in out.tensors()] == ["x", "g1"]
    assert out.op("both").inputs == ("x",) and out.op("both").outputs == ("g1",)


def test_fuse_refuses_ops_of_two_regions():
    graph = preset("llama3-8b")
    with pytest.raises(RewriteError, match="different regions"):
        Replacement.fuse(graph, ["layers.mlp_residual", "final_norm"], name="f")
    with pytest.raises(RewriteError, match="already"):
        Replacement.fuse(graph, ["layers.q_proj"], name="layers.k_proj")


def _fused_pair() -> Graph:
    """Two `fused` kernels in a row, written by hand: the kind has no builder method. A pattern
    op matches on its parameters' names, so these carry a fused kernel's (empty here)."""
    p = Graph("fused-fused")
    for name in ("x", "y", "z"):
        p.add_tensor(Tensor(name, (B, S, D)))
    for name, x, y in (("first", "x", "y"), ("second", "y", "z")):
        p.add_op(Op(name, "fused", "elementwise", [x], [y],
                    params={"body": (), "inner": (), "outputs": (y,)}))
    return p


def _fuse(graph: Graph, m) -> Replacement:
    return Replacement.fuse(graph, m.graph_ops, name="+".join(m.graph_ops))


def test_the_fixed_point_loop_fuses_a_chain():
    """Eight GELUs: the first round fuses them in pairs and the pairs in pairs, the second
    fuses what is left, the third finds nothing and stops."""
    rules = [Rewrite(_gelu_gelu(), _fuse, where=one_region), Rewrite(_fused_pair(), _fuse)]
    graph = _chain(8)
    out, applied = fixpoint(graph, rules)
    (op,) = out.ops()
    assert op.inputs == ("x",) and op.outputs == ("g7",)
    assert [t.name for t in out.tensors()] == ["x", "g7"]
    assert sympy.expand(rule_flops(out, op) - 8 * 8 * BSD) == 0  # eight GELUs, 8 FLOPs per element each
    assert sympy.expand(out.op_bytes(op) - 2 * BF16 * BSD) == 0  # x in, g7 out
    assert len(applied) == 4 + 2 + 1
    verify(graph)  # untouched
    with pytest.raises(RewriteError, match="no fixed point in 2 rounds"):
        fixpoint(graph, rules, max_rounds=2)


def test_the_guard_stops_a_rewrite_that_recreates_its_pattern():
    p = GraphBuilder("gelu")
    p.gelu(p.activation("x", (B, S, D)), name="g")
    again = Rewrite(p.build(), lambda g, m: Replacement.fuse(
        g, m.graph_ops, kind="gelu", name=m.op("g") + "'"))
    with pytest.raises(RewriteError, match=r"no fixed point in 5 rounds.*g0'''''"):
        fixpoint(_chain(1), [again], max_rounds=5)


def test_a_pattern_needs_an_op():
    p = Graph("empty")
    p.add_tensor(Tensor("x", (B, S, D)))
    with pytest.raises(RewriteError, match="no op"):
        find(p, _chain(1))


def test_fuse_expresses_the_flash_attention_kernel():
    """"These two ops become one kernel" gives `fuse_attention`'s forward kernel for Llama."""
    from opgraph.passes.fuse_attention import attention_pattern, fuse_attention

    forward = preset("llama3-8b")
    (m,) = find(attention_pattern(), forward)
    scores = forward.op(m.op("attn.scores"))
    (op,) = Replacement.fuse(forward, m.graph_ops, kind="flash_attention",
                             name="layers.attn.flash", params=scores.params).add_ops
    fused = fuse_attention(forward)
    want = fused.op("layers.attn.flash")
    assert sympy.expand(rule_flops(forward, op) - rule_flops(fused, want)) == 0
    assert op == want


def test_fusing_attention_with_another_value_width_keeps_its_flops():
    """DeepSeek-style MLA: Q.K over 192 dims per head, P.V over 128. The fused kernel's FLOPs
    are its members', QK^T and P.V each over the causal lower triangle."""
    from opgraph.passes.fuse_attention import attention_pattern

    H = sympy.Symbol("H", positive=True, integer=True)
    g = GraphBuilder("mla")
    q, k = g.activation("q", (B, S, H * 192)), g.activation("k", (B, S, H * 192))
    g.attention(q, k, g.activation("v", (B, S, H * 128)), heads=H, kv_heads=H, name="attn")
    graph = g.build()
    (m,) = find(attention_pattern(), graph)
    params = graph.op(m.op("attn.scores")).params  # heads, kv_heads, causal
    (op,) = Replacement.fuse(graph, m.graph_ops, kind="flash_attention", name="flash",
                             params=params).add_ops
    qk, pv = 2 * B * H * S * S * 192 / 2, 2 * B * H * S * S * 128 / 2
    assert sympy.expand(rule_flops(graph, op) - (qk + pv)) == 0
